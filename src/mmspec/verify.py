"""Verification maths for speculative decoding: pure tensor functions, no model calls.

Notation (DESIGN.md): ``p`` is the target distribution, ``q`` the draft distribution.
A block proposes ``k`` draft tokens ``d_1..d_k`` (k <= gamma). The target scores them in one
forward pass, giving ``p`` at ``k + 1`` positions: ``p[i]`` is the target's next-token
distribution before ``d_{i+1}``, and ``p[k]`` follows the last draft token.

* **accepted** tokens: the longest prefix of drafts that passes verification;
* **recovered** token: on the first rejection at position ``i``, a token drawn from the
  residual ``norm(max(0, p[i] - q[i]))`` (greedy: ``argmax p[i]``);
* **bonus** token: when all ``k`` drafts pass, a token drawn from ``p[k]`` (greedy: argmax).

Every block therefore emits ``n_accepted + 1`` tokens (before any EOS / length cut).

The per-node step :func:`accept_or_residual` is written for one candidate against one
(p, q) pair, so token-tree verification (several candidate children per node, SpecInfer-style
recursive rejection sampling) reuses it node by node: a chain is a tree with one branch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmspec.errors import MMSpecError


@dataclass(frozen=True)
class SamplingParams:
    """How logits become probabilities. Applied identically to p and to every view's q."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # refused rather than reinterpreted: transformers raises for these, or treats them otherwise
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise MMSpecError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise MMSpecError(f"top_k must be a whole number >= 0 (0 or None: no top-k), got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise MMSpecError(f"top_p must be in (0, 1] (1 or None: no nucleus filter), got {self.top_p!r}; "
                              "for the single likeliest token use temperature=0")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class BlockOutcome:
    """What one verification produced."""

    n_accepted: int  # accepted draft tokens (0..k)
    next_token: int  # the recovered token (on rejection) or the bonus token (all accepted)
    bonus: bool  # True when all k drafts were accepted and next_token came from p[k]


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, then softmax.

    logits: [..., V] -> probs [..., V] (float32 or wider). With ``params.greedy`` the
    temperature is 1 (the distribution is only used to pick / mix, never sampled).
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not params.greedy:
        x = x / params.temperature
    if params.top_k is not None and 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and 0.0 < params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. p, q: [..., V] -> [..., V].

    Where p <= q everywhere (p == q), the residual is undefined; any rejection there has
    probability zero, so we fall back to p.
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution with an explicit (CPU) generator.

    Draws happen on the CPU so one generator serves target and draft on any device."""
    return int(torch.multinomial(probs.detach().double().cpu(), 1, generator=generator).item())


def accept_or_residual(
    token: int, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[bool, torch.Tensor]:
    """One speculative-sampling test of ``token`` (drawn from q) against p. p, q: [V].

    Accept with probability min(1, p(x) / q(x)). Returns (accepted, residual) where the
    residual is the distribution to continue with after a rejection (for a tree node with
    further candidate children, it becomes the new p).
    """
    px, qx = float(p[token]), float(q[token])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if qx > 0 and u * qx < px:  # u < p/q without dividing by a tiny q
        return True, p
    return False, residual(p, q)


def verify_greedy(draft_tokens: torch.Tensor, p_logits: torch.Tensor) -> BlockOutcome:
    """Greedy verification: accept while the draft equals argmax p.

    draft_tokens: [k] long; p_logits: [k + 1, V] target logits at the k + 1 positions.
    """
    k = draft_tokens.shape[0]
    target_choice = p_logits.argmax(dim=-1)  # [k + 1]
    mismatch = (draft_tokens != target_choice[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return BlockOutcome(n_accepted=n, next_token=int(target_choice[n]), bonus=n == k)


def verify_sampling(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> BlockOutcome:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over a chain.

    draft_tokens: [k] long, each drawn from the matching row of q_probs.
    q_probs: [k, V] the draft distributions the tokens were drawn from (the ensemble mixture).
    p_probs: [k + 1, V] target distributions, processed with the same SamplingParams.
    """
    k = draft_tokens.shape[0]
    for i in range(k):
        ok, resid = accept_or_residual(int(draft_tokens[i]), p_probs[i], q_probs[i], generator)
        if not ok:
            return BlockOutcome(n_accepted=i, next_token=sample(resid, generator), bonus=False)
    return BlockOutcome(n_accepted=k, next_token=sample(p_probs[k], generator), bonus=True)
