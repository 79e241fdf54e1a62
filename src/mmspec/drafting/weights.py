"""Adaptive ensemble weights (TABED, or exponential weights) for every request of a step at once.

The rules are :mod:`mmspec.drafting.adaptive`'s (its docstring has the maths and the references); this
module keeps their state for all rows in device tensors and updates every row in one set of
tensor operations per step: each request's evidence is its views' distributions at its accepted
path (the draft's logits each fed depth produced, kept for the step) against the target's
distribution and confirmed token there. Rows accept different numbers of tokens, so a TABED
window is a ring buffer per row, and the exponential decay an exponent per row.

The weights every block drafted with are kept per step (one copy of all rows' weights) and read
for a request once, when it finishes (:meth:`BatchAdaptive.trajectory`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmspec.drafting.adaptive import AdaptiveWeights, evidence_rows, loglik_weights
from mmspec.errors import MMSpecError


def _tabed_batched(kl_sum: torch.Tensor, prior: torch.Tensor, temperature: float) -> torch.Tensor:
    """:func:`mmspec.drafting.adaptive.tabed_weights` per row: kl_sum, prior [R, V] -> weights [R, V]."""
    inv = 1.0 / kl_sum.clamp_min(1e-11)
    w = inv / inv.sum(-1, keepdim=True)
    w = (w.clamp_min(1e-300).log() / temperature).softmax(-1)
    w = w * prior
    return w / w.sum(-1, keepdim=True)


class BatchAdaptive:
    """The adaptive weights of every request's views (module docstring): ``weights`` [rows, V]."""

    def __init__(self, config: AdaptiveWeights, n_views: int, device: torch.device):
        self.config = config
        self.V = n_views
        self.device = device
        self._alloc(1)
        self.trail: list[torch.Tensor] = []  # per step: the weights [R, V] the step drafted with
        self.trail_rows: list[list[int]] = []  # per step: the request ids (owners) of its rows
        self.owner: list[int] = []  # per active row: an id that follows the request across row moves
        self._next_owner = 0

    def _alloc(self, rows: int) -> None:
        z = lambda: torch.zeros(rows, self.V, dtype=torch.float64, device=self.device)  # noqa: E731
        old = getattr(self, "prior", None)
        new = dict(prior=z(), weights=z(), kl_sum=z(), score=z())
        W = max(self.config.window, 1)
        new["hist"] = torch.zeros(rows, self.V, W, dtype=torch.float64, device=self.device)
        new["ptr"] = torch.zeros(rows, dtype=torch.long, device=self.device)
        if old is not None:
            n = old.shape[0]
            for k, t in new.items():
                t[:n] = getattr(self, k)
        for k, t in new.items():
            setattr(self, k, t)

    def ensure(self, rows: int) -> None:
        if rows > self.prior.shape[0]:
            self._alloc(max(rows, 2 * self.prior.shape[0]))

    def admit(self, first: int, initial: Sequence[Sequence[float] | None]) -> None:
        self.ensure(first + len(initial))
        for i, start in enumerate(initial):
            start = start if start is not None else self.config.initial
            if start is not None and len(start) != self.V:
                raise MMSpecError(f"{len(start)} initial weights for {self.V} views; give one per view")
            w = torch.tensor(list(start) if start is not None else [1.0] * self.V, dtype=torch.float64)
            r = first + i
            self.prior[r] = (w / w.sum()).to(self.device)
            self.weights[r] = self.prior[r]
            self.kl_sum[r] = 0
            self.score[r] = 0
            self.hist[r] = 0
            self.ptr[r] = 0
            self.owner.append(self._next_owner)
            self._next_owner += 1

    def remove(self, b: int, last: int) -> None:
        for t in (self.prior, self.weights, self.kl_sum, self.score, self.hist, self.ptr):
            if b != last:
                t[b] = t[last]
        self.owner[b] = self.owner[last]
        self.owner.pop()
        alive = set(self.owner)
        while self.trail_rows and not alive.intersection(self.trail_rows[0]):  # steps no active request drafted in
            self.trail.pop(0)
            self.trail_rows.pop(0)

    def record(self, rows: int) -> None:
        """The weights this step drafts with (one copy for all rows)."""
        self.trail.append(self.weights[:rows].clone())
        self.trail_rows.append(list(self.owner[:rows]))

    def update(self, q: torch.Tensor, p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
               count: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """One step's evidence for every row: q [R, V, m, V_draft] each view's distribution at the
        row's path positions, p [R, m, V] the target's, tokens [R, m] the confirmed ones, valid
        [R, m] the positions a draft forward reached, count [R] the row's path positions (the
        accepted nodes and the root; entries past it are padding). -> the next weights [R, V]."""
        R, V, m = q.shape[0], self.V, tokens.shape[1]
        cfg = self.config
        kl, lq = evidence_rows(q.reshape(R * V, m, -1), p.repeat_interleave(V, 0), tokens.repeat_interleave(V, 0),
                               valid.repeat_interleave(V, 0))  # [R V, m]
        kl, lq = kl.view(R, V, m), lq.view(R, V, m)
        j = torch.arange(m, device=q.device)
        on = (j[None] < count[:, None])[:, None, :]  # [R, 1, m]
        kl, lq = kl * on, lq * on
        if cfg.rule == "tabed":
            if cfg.window:
                W = self.hist.shape[-1]
                at = (self.ptr[:R, None] + j[None]) % W  # [R, m]
                keep = on.expand(R, V, m)
                old = self.hist[:R].gather(-1, at[:, None, :].expand(R, V, m))
                self.hist[:R].scatter_(-1, at[:, None, :].expand(R, V, m), torch.where(keep, kl, old))
                self.ptr[:R] = torch.where(live, (self.ptr[:R] + count) % W, self.ptr[:R])
                total = self.hist[:R].sum(-1)
            else:
                self.kl_sum[:R] = torch.where(live[:, None], self.kl_sum[:R] + kl.sum(-1), self.kl_sum[:R])
                total = self.kl_sum[:R]
            new = _tabed_batched(total, self.prior[:R], cfg.temperature)
        else:
            ages = (count[:, None] - 1 - j[None]).clamp_min(0).to(torch.float64)  # [R, m]
            decay = float(cfg.decay)
            s = self.score[:R] * torch.pow(decay, count[:, None].to(torch.float64)) \
                + (lq * torch.pow(decay, ages[:, None, :])).sum(-1)
            self.score[:R] = torch.where(live[:, None], s, self.score[:R])
            new = loglik_weights(self.score[:R], self.prior[:R], cfg.temperature)
        self.weights[:R] = torch.where(live[:, None], new, self.weights[:R])
        return self.weights[:R]

    def trajectory(self, b: int, drafted: list[bool]) -> tuple[list[list[float]], list[float]]:
        """Row b's (the weights of every block it drafted, its final weights), read once;
        ``drafted``: per step the drafter ran while the row was active, whether it drafted a node."""
        who = self.owner[b]
        steps = [t[rows.index(who)] for t, rows in zip(self.trail, self.trail_rows) if who in rows]
        picks = [w for w, d in zip(steps, drafted) if d]
        # a step launched after the row's last (overlap) recorded its final weights before changing them
        final = steps[len(drafted)] if len(steps) > len(drafted) else self.weights[b]
        rows = torch.stack(picks + [final]).tolist()
        return rows[:-1], rows[-1]

