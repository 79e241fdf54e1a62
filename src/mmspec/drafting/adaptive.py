"""Ensemble weights that adapt at test time: after each block, each view's weight is updated from
how well its OWN draft distribution predicted the tokens the target has just confirmed.

Speculative decoding learns for free, every block, which tokens the target confirmed (the
accepted draft tokens and the target's next token) and, at those positions, the target's whole
distribution p. Every view's distribution q_v at the same positions was computed by the block's
batched draft forward (one row per view). A view whose q_v was closer to the target gets more
weight in the next block's mixture. The mixture drafted from is exactly the q verification
uses, so any weighting is lossless (greedy and sampling alike).

Rules (:class:`AdaptiveWeights`, ``rule=``):

* ``"tabed"``: TABED (Lee, Kang, Ahn, Classen, Galim, Oh, Yan, Koo, Lee: "TABED: Test-Time
  Adaptive Ensemble Drafting for Robust Speculative Decoding in LVLMs", Findings of EACL 2026,
  arXiv 2601.20357), its history-dependent weights with the KL measure: the deviation of view v
  is the summed KL(p_t || q_v,t) over the past confirmed positions t (the positions whose draft
  distribution exists: the accepted ones and the first rejected one; not the bonus position
  after a fully accepted chain, which no draft forward reached), over all of the request's
  history or its last ``window`` positions; the weight is its inverse, normalised, then
  sharpened by a temperature: ``w_v ∝ (1 / Σ_t KL_v,t) ** (1 / temperature)``.
* ``"loglik"``: exponential weights (Hedge with the log loss; with ``decay=1`` and
  ``temperature=1``, the Bayesian posterior of "which view generates the target's tokens"):
  ``w_v ∝ w0_v · exp(S_v / temperature)``, where ``S_v = Σ_t decay^(age_t) log q_v(c_t)`` sums
  the log-probability view v gave each confirmed token c_t, older tokens discounted by ``decay``
  per token.

Both start from the initial weights (equal, or a conversation's earlier turn's final weights,
``initial``), which multiply whatever the evidence says.

Everything here is a pure tensor function or a small state object whose tensors stay on the
draft's device: no host sync per block; the trajectory is read once, at the end of a request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmspec.errors import MMSpecError

RULES = ("tabed", "loglik")
LOG_FLOOR = math.log(1e-6)  # log q is floored here: a filtered-out (top-k / top-p) token costs a bounded amount
KL_FLOOR = 1e-11  # TABED's stand-in for 1/0 (a view with no deviation yet)


@dataclass(frozen=True)
class AdaptiveWeights:
    """How ensemble weights adapt within a request (``SpecDecoder(weights=AdaptiveWeights(...))``;
    ``weights="adaptive"`` is ``AdaptiveWeights()``).

    rule: "tabed" (inverse summed KL, TABED) or "loglik" (exponential weights on the confirmed
        tokens' log-likelihood); module docstring.
    temperature: > 0; below 1 sharpens the weights towards the best view, above 1 flattens them.
    decay: "loglik": per-token discount of older evidence, in (0, 1] (1: none).
    window: "tabed": confirmed positions of history read (0: all of the request's, TABED's default).
    initial: starting weights, one per view (None: equal); e.g. an earlier turn's final weights.
    """

    rule: str = "tabed"
    temperature: float = 1.0
    decay: float = 1.0
    window: int = 0
    initial: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise MMSpecError(f"unknown adaptive rule {self.rule!r}; use one of {', '.join(RULES)}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (math.isfinite(self.temperature) and self.temperature > 0):
            raise MMSpecError(f"adaptive temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise MMSpecError(f"adaptive decay must be in (0, 1] (1: no decay), got {self.decay!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise MMSpecError(f"adaptive window must be a whole number >= 0 (0: all history), got {self.window!r}")
        if self.initial is not None:
            object.__setattr__(self, "initial", check_initial(self.initial))

    @property
    def label(self) -> str:
        """As the bench's method suffix says it: "adaptive" (TABED, temperature 1), else
        "adaptive:RULE" or "adaptive:RULE:TEMPERATURE"."""
        if self.temperature != 1.0:
            return f"adaptive:{self.rule}:{self.temperature:g}"
        return "adaptive" if self.rule == "tabed" else f"adaptive:{self.rule}"

    @classmethod
    def parse(cls, spec) -> AdaptiveWeights | None:
        """``"adaptive"``, ``"adaptive:loglik"``, ``"adaptive:tabed:0.2"`` (rule, temperature) or an
        AdaptiveWeights -> an AdaptiveWeights; a list of numbers or None -> None (fixed weights)."""
        if isinstance(spec, AdaptiveWeights):
            return spec
        if isinstance(spec, str) and spec.lower().split(":")[0] == "adaptive":
            parts = spec.lower().split(":")
            if len(parts) > 3:
                raise MMSpecError(f"weights={spec!r}: write adaptive, adaptive:RULE or adaptive:RULE:TEMPERATURE")
            temperature = 1.0
            if len(parts) == 3:
                try:
                    temperature = float(parts[2])
                except ValueError:
                    raise MMSpecError(f"weights={spec!r}: the temperature {parts[2]!r} is not a number; "
                                      "write e.g. adaptive:tabed:0.2") from None
            return cls(rule=(parts[1] if len(parts) > 1 else "") or "tabed", temperature=temperature)
        if isinstance(spec, str):
            raise MMSpecError(f"weights={spec!r}: give a list of numbers (one per view), 'adaptive' (or "
                              "'adaptive:loglik', 'adaptive:tabed:0.2'), or an AdaptiveWeights")
        return None


def check_initial(initial) -> tuple[float, ...]:
    """Starting weights: a non-empty sequence of finite numbers >= 0 with a positive sum."""
    if isinstance(initial, (str, bytes)) or not hasattr(initial, "__iter__"):
        raise MMSpecError(f"initial weights must be a list of numbers, one per view, got {initial!r}")
    try:
        vals = tuple(float(w) for w in initial)
    except (TypeError, ValueError):
        raise MMSpecError(f"initial weights must be a list of numbers, one per view, got {initial!r}") from None
    if not vals or not all(math.isfinite(w) and w >= 0 for w in vals) or sum(vals) <= 0:
        raise MMSpecError(f"initial weights must be finite numbers >= 0 with a positive sum, got {list(vals)}")
    return vals


# ---------------------------------------------------------------------- pure maths
def confirmed_evidence(q: torch.Tensor, p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per view and position, how well its distribution predicted what the target confirmed.

    q: [B, m, V_draft] each view's distribution at the m path positions (V_draft <= V);
    p: [m, V] the target's at the same positions; tokens: [m] the confirmed tokens (long);
    valid: [m] bool, positions a draft forward reached.
    -> kl [B, m]: KL(p || q_v) (0 where not valid); logq [B, m]: log q_v(token) floored at
    ``LOG_FLOOR`` (0 where not valid).
    """
    V = p.shape[-1]
    q = q.double()
    if q.shape[-1] < V:  # the draft's vocabulary is a prefix of the target's
        q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
    p = p.double()
    logq = q.clamp_min(1e-300).log().clamp_min(LOG_FLOOR)  # [B, m, V]
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))  # [m, V]
    kl = (plogp[None] - p[None] * logq).sum(-1).clamp_min(0.0)  # [B, m]
    lq = logq.gather(-1, tokens.view(1, -1, 1).expand(q.shape[0], -1, 1))[..., 0]  # [B, m]
    return kl * valid, lq * valid


def evidence_rows(q: torch.Tensor, p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`confirmed_evidence` with every row its own target: q [N, m, V_draft], p [N, m, V],
    tokens [N, m] long, valid [N, m] bool -> kl, logq [N, m] (the same maths, row by row)."""
    V = p.shape[-1]
    q = q.double()
    if q.shape[-1] < V:
        q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
    p = p.double()
    logq = q.clamp_min(1e-300).log().clamp_min(LOG_FLOOR)  # [N, m, V]
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    kl = (plogp - p * logq).sum(-1).clamp_min(0.0)  # [N, m]
    lq = logq.gather(-1, tokens[..., None])[..., 0]
    return kl * valid, lq * valid


def tabed_weights(kl_sum: torch.Tensor, prior: torch.Tensor, temperature: float) -> torch.Tensor:
    """TABED: kl_sum [B] (summed KL over the history), prior [B] -> weights [B] summing to 1:
    ``prior · norm(1 / kl_sum) ** (1 / temperature)``, renormalised."""
    inv = 1.0 / kl_sum.clamp_min(KL_FLOOR)
    w = inv / inv.sum()
    w = (w.clamp_min(1e-300).log() / temperature).softmax(-1)
    w = w * prior
    return w / w.sum()


def loglik_weights(score: torch.Tensor, prior: torch.Tensor, temperature: float) -> torch.Tensor:
    """Exponential weights: score [B] (decayed summed log q_v of the confirmed tokens), prior [B]
    -> ``softmax(log prior + score / temperature)`` [B]."""
    return (prior.clamp_min(1e-300).log() + score / temperature).softmax(-1)


# ---------------------------------------------------------------------- one request's state
class AdaptiveState:
    """One request's adaptive weights, on the draft's device. ``weights`` [B] is what the next
    block mixes with; :meth:`update` takes one block's evidence; :meth:`trajectory` reads the
    weights every block drafted with (one host read, at the end)."""

    def __init__(self, config: AdaptiveWeights, n_views: int, device: torch.device,
                 initial: Sequence[float] | None = None):
        self.config = config
        start = initial if initial is not None else config.initial
        if start is not None and len(start) != n_views:
            raise MMSpecError(f"{len(start)} initial weights for {n_views} views; give one per view")
        w = torch.tensor(list(start) if start is not None else [1.0] * n_views, dtype=torch.float64)
        self.prior = (w / w.sum()).to(device)  # [B]
        self.weights = self.prior.clone()  # [B]
        self.kl_sum = torch.zeros(n_views, dtype=torch.float64, device=device)  # [B]: tabed, all history
        self.kl_hist: list[torch.Tensor] = []  # [B, m] per block: tabed with a window
        self.score = torch.zeros(n_views, dtype=torch.float64, device=device)  # [B]: loglik
        self.trail: list[torch.Tensor] = []  # [B] per drafted block: the weights it drafted with

    def update(self, q: torch.Tensor, p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One block's evidence (shapes as :func:`confirmed_evidence`) -> the next weights [B]."""
        cfg = self.config
        self.trail.append(self.weights)
        kl, lq = confirmed_evidence(q, p, tokens, valid)  # [B, m]
        m = tokens.shape[0]
        if cfg.rule == "tabed":
            if cfg.window:
                self.kl_hist.append(kl)
                hist = torch.cat(self.kl_hist, 1)[:, -cfg.window:]  # [B, <= window]
                self.kl_hist = [hist]
                total = hist.sum(1)
            else:
                total = self.kl_sum = self.kl_sum + kl.sum(1)
            self.weights = tabed_weights(total, self.prior, cfg.temperature)
        else:
            ages = torch.arange(m - 1, -1, -1, dtype=torch.float64, device=lq.device)  # [m]
            self.score = self.score * cfg.decay ** m + (lq * cfg.decay ** ages).sum(1)
            self.weights = loglik_weights(self.score, self.prior, cfg.temperature)
        return self.weights

    def trajectory(self) -> tuple[list[list[float]], list[float]]:
        """(the weights of every drafted block, the final weights), read from the device once."""
        rows = torch.stack(self.trail + [self.weights]).tolist() if self.trail else [self.weights.tolist()]
        return rows[:-1], rows[-1]
