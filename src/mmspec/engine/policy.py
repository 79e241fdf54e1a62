"""Each step's speculation, decided by one policy: how deep to draft and which block shape, plain
decoding included, for the most expected tokens per second (goodput).

:class:`SpeculationPolicy` owns three estimates, each learnt from every step the scheduler reads:

- **what a step costs** (:class:`StepCost`): the seconds of a step over B rows that drafts to depth
  d and verifies n nodes a row, one model for every batch size and shape,
  ``T = θ · [1, B, d, B·d, B·n, hinges of B·n]`` (recursive least squares with forgetting, so ragged batches whose
  size changes every few steps share what each step measured), corrected per action and batch
  bucket by the mean of what the model missed there (a device whose cost is flat until it turns
  compute-bound is not a line);
- **what a row accepts**: per row, the probability α that a drafted token is accepted (a
  truncated-geometric estimate, exponentially averaged over that row's blocks), weighed against the
  pooled α of every row's blocks, which each decision draws from its Beta posterior (Thompson
  sampling: a draft that looked bad after a few unlucky blocks is tried again now and then, a bad
  one almost never once the evidence is in); kept on the row itself (:class:`~mmspec.engine.step.RowHost`), so a
  row whose drafts keep failing adds nothing to the case for drafting while its neighbours' do;
- **what a shape yields beyond a chain**: per candidate shape, the measured tokens of its steps
  over what the rows' α predicts for a chain as deep (1 for the chain itself).

The expected tokens of a step drafting shape s to depth d are ``gain_s · Σ_rows E(α_r, d_r)``, with
``E(α, k) = 1 + α + … + α^k`` and ``d_r`` the depth cut to what row r may still emit, and its
goodput that over the predicted T. Exploration is bounded: each shape runs whole ``explore`` times
and plain decoding once when the policy starts (a constant, not per batch size); after that at most
``probe_share`` of the steps re-measure the alternative run longest ago among those the model
still gives a chance (plain steps, each shape whole; while plain steps win, a depth-1 draft that
refreshes the rows' α), and the choice switches only for a gain above ``margin`` (no thrashing at
a threshold). Every choice is lossless: a
shallower tree, another shape or the root alone is verified exactly as any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mmspec.drafting.tree import TreeSpec
from mmspec.errors import MMSpecError
from mmspec.options import SPECULATE


@dataclass(frozen=True)
class Action:
    """What one step drafts: ``shape`` (an index into the policy's shapes) cut to ``depth``
    (0: plain decoding, the root alone), verifying ``nodes`` nodes a row (root included)."""

    shape: int
    depth: int
    nodes: int


def bucket(n: int) -> int:
    """Power-of-two bucket of a batch size (the cost model's local corrections are kept per bucket)."""
    return 1 << max(0, int(n) - 1).bit_length()


class StepCost:
    """Milliseconds of one step as a function of the rows B, the draft depth d and the nodes a row
    verifies n: ``θ · φ(B, d, n)``, φ = [1, B/32, d/8, B·d/256, B·n/256], fitted by recursive
    least squares with forgetting factor ``forget`` over every step, plus a per-(action, bucket)
    exponential average of the model's error there; where an action ran at exactly B, the average
    of what it measured there (the model is for what has not run: a new batch size, a depth not
    tried, and it carries what every step measured to them)."""

    KNOTS = (32, 128, 512, 2048)  # verified tokens where the cost's slope may change
    N_FEATURES = 5 + len(KNOTS)

    def __init__(self, forget: float = 0.995, ridge: float = 1e-2, smoothing: float = 0.2):
        self.forget, self.smoothing = forget, smoothing
        self.theta = np.zeros(self.N_FEATURES)
        self.P = np.eye(self.N_FEATURES) / ridge
        self.residual: dict[tuple[Action, int], float] = {}
        self.measured: dict[tuple[Action, int], float] = {}  # (action, B) -> averaged ms where it ran
        self.n = 0
        self.floor = float("inf")  # the cheapest step measured (predictions never go below a share of it)

    @staticmethod
    def features(B: int, depth: int, nodes: int) -> np.ndarray:
        tokens = B * nodes
        hinges = [max(0.0, tokens - k) / 256 for k in StepCost.KNOTS]
        return np.array([1.0, B / 32, depth / 8, B * depth / 256, tokens / 256, *hinges])

    def predict(self, B: int, a: Action) -> float | None:
        """Predicted seconds of a step of ``a`` over ``B`` rows (None: nothing measured yet)."""
        if self.n == 0:
            return None
        if (a, B) in self.measured:  # where it ran: what it measured there
            return self.measured[(a, B)] / 1e3
        ms = float(self.theta @ self.features(B, a.depth, a.nodes)) + self.residual.get((a, bucket(B)), 0.0)
        return max(ms, 0.25 * self.floor) / 1e3

    def predict_all(self, B: int, actions: list[Action]) -> np.ndarray:
        """:meth:`predict` of each action over ``B`` rows at once -> [A] seconds (NaN: unknown)."""
        if self.n == 0:
            return np.full(len(actions), np.nan)
        phi = np.stack([self.features(B, a.depth, a.nodes) for a in actions])  # [A, F]
        ms = phi @ self.theta + np.array([self.residual.get((a, bucket(B)), 0.0) for a in actions])
        ms = np.maximum(ms, 0.25 * self.floor)
        known = [self.measured.get((a, B)) for a in actions]
        return np.array([ms[j] if m is None else m for j, m in enumerate(known)]) / 1e3

    def update(self, B: int, a: Action, seconds: float) -> None:
        y, phi = seconds * 1e3, self.features(B, a.depth, a.nodes)
        Pphi = self.P @ phi
        k = Pphi / (self.forget + phi @ Pphi)
        self.theta = self.theta + k * (y - phi @ self.theta)
        self.P = (self.P - np.outer(k, Pphi)) / self.forget
        if np.trace(self.P) > 1e6:  # no excitation for long: keep the covariance bounded (no wind-up)
            self.P *= 1e6 / np.trace(self.P)
        self.n += 1
        self.floor = min(self.floor, y)
        old = self.measured.get((a, B))
        self.measured[(a, B)] = y if old is None else (1 - self.smoothing) * old + self.smoothing * y
        key, miss = (a, bucket(B)), y - float(phi @ self.theta)
        old = self.residual.get(key)
        self.residual[key] = miss if old is None else (1 - self.smoothing) * old + self.smoothing * miss


def expected_tokens(alpha: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """E(α, k) = 1 + α + … + α^k elementwise (α in [0, 1], k >= 0 drafted positions)."""
    a = np.clip(alpha, 0.0, 1.0 - 1e-9)
    return (1.0 - a ** (depth + 1)) / (1.0 - a)


@dataclass
class SpeculationPolicy:
    """The step's speculation (module docstring). ``mode``: "always" (every step drafts whole: the
    decoder's shape, or with ``tree="auto"`` the shape with the most tokens per second), "never"
    (plain batched target steps), "auto" (the goodput policy: depth and shape, plain decoding
    included). ``shapes``: the candidate block shapes (``tree="auto"``'s, chain first); None: the
    decoder's one shape, given at each :meth:`decide`."""

    mode: str = "always"
    shapes: tuple[TreeSpec, ...] | None = None
    explore: int = 1  # whole-shape steps each shape runs when the policy starts
    probe_share: float = 1 / 32  # at most this share of the steps re-measures an alternative
    probe_floor: float = 0.5  # ... only an alternative predicted at this share of the best or more
    margin: float = 0.03  # a new choice must beat the last one by this much (no thrashing)
    smoothing: float = 0.15  # weight of the newest block in the rows' and shapes' averages
    forget: float = 0.99  # each block's weight in the rows' pooled counts decays by this per later block
    prior_blocks: float = 3.0  # a row's own α outweighs the rows' pooled α after this many blocks
    prior_n: int = 0  # blocks the pooled counts rest on
    seed: int = 0  # the policy's own draws (Thompson sampling of the pooled α): decisions are reproducible
    _pooled: float | None = field(default=None, repr=False)  # this step's draw of the pooled α
    cost: StepCost = field(default_factory=StepCost)
    alpha_prior: tuple[float, float] = (0.0, 0.0)  # accepted / rejected drafts over every row's blocks (discounted)
    gains: dict = field(default_factory=dict)  # shape index -> measured tokens ÷ the chain's prediction
    runs: dict = field(default_factory=dict)  # Action -> steps run
    last_run: dict = field(default_factory=dict)  # Action -> the step it last ran at
    steps: int = 0
    probes: int = 0
    choice: Action | None = None  # the last step's exploiting choice
    batches: set = field(default_factory=set)  # the batch sizes it decided for (its report's rows)
    _actions: dict = field(default_factory=dict, repr=False)  # spec -> its candidate actions

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        if self.mode not in SPECULATE:
            raise MMSpecError(f"speculate must be one of {SPECULATE}, got {self.mode!r}")
        if self.shapes is not None and len(self.shapes) < 1:
            raise MMSpecError("a speculation policy's shapes= needs one block shape or more")

    # ---------------------------------------------------------------- estimates
    @property
    def acceptance(self) -> float | None:
        """The pooled α's posterior mean (None: nothing drafted yet): a Beta(1 + accepted, 1 +
        rejected) over every row's blocks, discounted."""
        acc, rej = self.alpha_prior
        return None if self.prior_n == 0 else (acc + 1) / (acc + rej + 2)

    def pooled_alpha(self) -> float:
        """This step's pooled α: a draw from its Beta posterior (Thompson sampling), so a draft
        that looked bad after a few unlucky blocks is tried again now and then, and one that is
        bad (a tight posterior near 0) almost never: exploration that shrinks as the evidence
        grows, whatever the batch size. Drawn once per decision (:meth:`decide`)."""
        if self._pooled is None:
            acc, rej = self.alpha_prior
            self._pooled = float(self._rng.beta(1 + acc, 1 + rej))
        return self._pooled

    def row_alpha(self, row) -> float:
        """Row ``row``'s α: its own average, weighed against the pooled α (:meth:`pooled_alpha`) by
        how many blocks it has drafted (``n / (n + prior_blocks)``), so a new row starts from what
        its neighbours showed and a row that drafts badly stops counting for drafting alone."""
        prior = self.pooled_alpha()
        if row.accept_avg is None:
            return prior
        acc, rej, n = row.accept_avg
        own = acc / (acc + rej) if acc + rej > 0 else prior
        w = n / (n + self.prior_blocks)
        return w * own + (1 - w) * prior

    def actions(self, spec: TreeSpec) -> list[Action]:
        """Every candidate of a step: plain decoding, then each shape cut to each depth."""
        if spec in self._actions:
            return self._actions[spec]
        self._actions[spec] = out = self._list_actions(spec)
        return out

    def _list_actions(self, spec: TreeSpec) -> list[Action]:
        shapes = self.shapes or (spec,)
        out = [Action(0, 0, 1)]
        for i, s in enumerate(shapes):
            for d in range(1, s.max_depth + 1):
                cut = s.for_remaining(d + 1)
                out.append(Action(i, d, cut.n_nodes))
        return out

    def whole(self, spec: TreeSpec) -> list[Action]:
        """Each shape at its full depth."""
        key = ("whole", spec)
        if key not in self._actions:
            shapes = self.shapes or (spec,)
            self._actions[key] = [a for a in self.actions(spec) if a.depth and a.depth == shapes[a.shape].max_depth]
        return self._actions[key]

    def spec_of(self, a: Action, spec: TreeSpec) -> TreeSpec | None:
        """The TreeSpec a step of ``a`` drafts (None: plain decoding)."""
        if a.depth == 0:
            return None
        return (self.shapes or (spec,))[a.shape].for_remaining(a.depth + 1)

    def goodputs(self, B: int, rows: Sequence, actions: list[Action]) -> np.ndarray:
        """Predicted tokens per second of each action over ``rows`` (NaN: its cost is unknown):
        a few array operations whatever the number of rows and actions."""
        alpha = np.array([self.row_alpha(r) for r in rows]) if rows else np.full(B, 0.5)  # [B]
        room = np.array([max(r.remaining - 1, 0) for r in rows]) if rows else np.full(B, 1 << 20)  # [B]
        depth = np.array([a.depth for a in actions])  # [A]
        gain = np.array([self.gains.get(a.shape, 1.0) if a.depth else 1.0 for a in actions])  # [A]
        tokens = gain * expected_tokens(alpha[None], np.minimum(depth[:, None], room[None])).sum(1)  # [A]
        t = self.cost.predict_all(B, actions)  # [A], NaN where unknown
        return tokens / np.maximum(t, 1e-9)

    # ---------------------------------------------------------------- the decision
    def decide(self, B: int, spec: TreeSpec, rows: Sequence = ()) -> Action:
        """The next step's action over ``B`` rows (``rows``: their host records, for each one's
        acceptance and remaining tokens); ``spec`` the decoder's shape (with no ``shapes``)."""
        self.steps += 1
        self.batches.add(B)
        self._pooled = None  # a fresh draw of the pooled α for this decision
        whole = self.whole(spec)
        if self.mode == "never":
            return Action(0, 0, 1)
        if self.mode == "always" and len(whole) == 1:
            return whole[0]
        for a in whole:  # starting: each shape measured whole, then (auto) plain decoding once
            if self.runs.get(a, 0) < self.explore:
                return self._ran(a)
        plain = Action(0, 0, 1)
        if self.mode == "auto" and not self.runs.get(plain):
            return self._ran(plain)
        actions = whole if self.mode == "always" else self.actions(spec)
        rates = self.goodputs(B, rows, actions)
        if np.isnan(rates).all():
            return self._ran(whole[-1])
        best = actions[int(np.nanargmax(rates))]
        if self.choice in actions and best != self.choice:  # keep the last choice unless beaten by the margin
            last = rates[actions.index(self.choice)]
            if not np.isnan(last) and last * (1 + self.margin) >= np.nanmax(rates):
                best = self.choice
        self.choice = best
        if self.probes + 1 <= self.probe_share * self.steps:  # re-measure the alternative run longest ago
            alts = [a for a in self._probes(whole, spec, best, rates, actions) if a != best]
            if alts:
                self.probes += 1
                return self._ran(min(alts, key=lambda a: self.last_run.get(a, -1)))
        return self._ran(best)

    def _probes(self, whole: list[Action], spec: TreeSpec, best: Action, rates: np.ndarray,
                actions: list[Action]) -> list[Action]:
        """What a probe step may re-measure: each shape whole and (auto) plain decoding, where the
        model predicts at least ``probe_floor`` of the best's goodput (a hopeless one is not paid
        for again: its cost is the shared model's, its tokens the rows' α); while plain steps
        win, a depth-1 draft, the cheapest that keeps the rows' α fresh."""
        top = float(np.nanmax(rates))
        alts = [a for a in whole + ([Action(0, 0, 1)] if self.mode == "auto" else [])
                if a in actions and rates[actions.index(a)] >= self.probe_floor * top]
        if self.mode == "auto" and best.depth == 0:
            alts += [a for a in actions if a.depth == 1][:1]
        return alts

    def _ran(self, a: Action) -> Action:
        self.runs[a] = self.runs.get(a, 0) + 1
        self.last_run[a] = self.steps
        return a

    # ---------------------------------------------------------------- learning
    def record(self, B: int, a: Action, seconds: float | None, blocks: Sequence[tuple] = ()) -> None:
        """One step read: its action over ``B`` rows, its seconds (None: not timed, e.g. it captured
        a graph), and per row that ran it ``(row, accepted, drafted_depth, rejected, emitted)``."""
        if seconds is not None:
            self.cost.update(B, a, seconds)
        if a.depth == 0 or not blocks:
            return
        w = self.smoothing
        acc_sum = rej_sum = 0.0
        predicted = emitted = 0.0
        prior, pb = None, self.prior_blocks
        for row, acc, depth, rejected, n_out in blocks:  # plain floats: no array per row
            if depth <= 0:
                continue
            if prior is None:
                prior = self.pooled_alpha()
            avg = row.accept_avg  # row_alpha(row), inline: a row's work a step is a few float operations
            if avg is None:
                al = prior
            else:
                own = avg[0] / (avg[0] + avg[1]) if avg[0] + avg[1] > 0 else prior
                own_w = avg[2] / (avg[2] + pb)
                al = own_w * own + (1 - own_w) * prior
            al = min(al, 1.0 - 1e-9)
            predicted += (1.0 - al ** (min(depth, a.depth) + 1)) / (1.0 - al)
            emitted += n_out
            if row.accept_avg is None:
                row.accept_avg = (float(acc), float(rejected), 1)
            else:
                a0, r0, n0 = row.accept_avg
                row.accept_avg = ((1 - w) * a0 + w * acc, (1 - w) * r0 + w * rejected, n0 + 1)
            acc_sum += acc
            rej_sum += rejected
        n = sum(1 for b in blocks if b[2] > 0)
        if n:
            pa, pr = self.alpha_prior
            keep = self.forget ** n  # the older blocks' weight after these n (per block, not per step)
            self.alpha_prior = (keep * pa + acc_sum, keep * pr + rej_sum)
            self.prior_n += n
        if predicted > 0 and (self.shapes is not None):
            g = emitted / predicted
            old_g = self.gains.get(a.shape)
            self.gains[a.shape] = g if old_g is None else (1 - w) * old_g + w * g

    # ---------------------------------------------------------------- reporting
    def report(self) -> dict:
        """Per batch size decided for: the shape chosen now and each whole shape's predicted
        figures (the cost model's step time, the tokens the rows' average α and the shape's gain
        predict; JSON-ready)."""
        if not self.shapes:
            return {}
        out = {}
        for b in sorted(self.batches):
            whole = self.whole(self.shapes[0])
            shapes = {}
            for a in whole:
                t = self.cost.predict(b, a)
                if t is None:
                    continue
                alpha = np.full(b, self.acceptance or 0.5)
                tokens = self.gains.get(a.shape, 1.0) * expected_tokens(alpha, np.full(b, a.depth)).sum()
                shapes[self.shapes[a.shape].label] = {"tokens_per_step": float(tokens), "step_ms": t * 1e3,
                                                      "tokens_per_s": float(tokens / t), "timed": self.runs.get(a, 0)}
            if shapes:
                out[str(b)] = {"choice": max(shapes, key=lambda k: shapes[k]["tokens_per_s"]), "shapes": shapes}
        return out
