"""The persistent batch: every active request's decoding state as device tensors, a row each.

vLLM v1's ``InputBatch`` is the model. The tensors are allocated once for a number of rows
(grown, rarely, by doubling) and updated IN PLACE: a step reads and writes them with tensor
operations only (its forwards, verification and commits), so it costs the same host work for
one row or many and a CUDA graph can capture it. What the host changes, a request admitted or
one leaving, it stages here (:meth:`BatchState.admit`: one copy per dtype for all newcomers;
:meth:`BatchState.remove`: the last row moved into the leaver's place, a handful of copies).

Per row b (the engine's row b is the target cache's row b, :class:`~mmspec.models.rows.RowCache`):

* ``length``: target slots committed (every committed token but the newest, which is pending);
* ``pos_offset``: a token's position minus its slot after the prompt (multimodal RoPE; else 0);
* ``pending`` [P], ``pending_len``: committed tokens the drafter has not seen yet, oldest first;
  the newest, ``pending[pending_len - 1]``, is the root of the row's next tree; ``pending_feats``
  [P, F]: for a feature-level head, the target's feature before each;
* ``remaining``: tokens the request may still emit;
* ``seed``, ``step``: the row's random stream (:mod:`mmspec.runtime.rng`); ``origin``: its
  ``length`` at admission (``length - origin + d - 1`` is the output position of a depth-d
  node: the key of its seeded noise); ``coupled``: it samples by the Gumbel-max coupling
  (:func:`~mmspec.runtime.verify.verify_steps`);
* ``temperature``, ``top_k``, ``top_p``, ``greedy``: its sampling parameters
  (:class:`~mmspec.runtime.verify.RowSampling`);
* ``last_image``: its prompt's last image slot (relaxed acceptance, LOSSY; a large negative number
  when it has none);
* ``live``: the row holds a request (a free row of a shape bucket takes part in a step's
  forwards as padding, but nothing of it advances).

The host keeps what it needs to plan a step without reading the device: each row's committed
length (from the step's one packed read), its parameters, and the rows in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.runtime.pinned import STAGING
from mmspec.runtime.verify import RowSampling, SamplingParams, flags

NO_IMAGE = -(1 << 40)


def stage(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor the host made, onto ``device`` in one non-blocking copy: on a GPU from a pinned
    staging slot written in place (:data:`~mmspec.runtime.pinned.STAGING`: no pinning per call;
    the copy does not wait for the device, so it never stalls a step in flight), as it is on the CPU."""
    if device.type == "cuda":
        return STAGING.stage(host, device)
    return host.to(device, non_blocking=True)


@dataclass
class RowStart:
    """A newcomer's first state (host values), as admission leaves it."""

    length: int  # target slots the prefill committed (the prompt less its last token)
    root: int  # the prompt's last token: the first pending one
    pos_offset: int
    remaining: int
    seed: int
    params: SamplingParams
    last_image: int | None
    feats: torch.Tensor | None = None  # [1, F] a head's target feature before the root (device)
    coupled: bool = False  # samples by the Gumbel-max coupling (a seed fixes the answer)


class BatchState:
    """The rows' device tensors and the host's view of them (module docstring)."""

    def __init__(self, device: torch.device, width: int, feat_dim: int | None = None, rows: int = 1,
                 feat_dtype: torch.dtype = torch.float32):
        self.device = device
        self.width = width  # P: the most pending tokens a row holds
        self.feat_dim, self.feat_dtype = feat_dim, feat_dtype
        self.active = 0
        self.lengths: list[int] = []  # host: each active row's committed target slots
        self.params: list[SamplingParams] = []
        self.coupled: list[bool] = []  # host: each active row's coupling
        self._flags = flags([SamplingParams()])  # what the host knows of the rows' parameters
        self._alloc(max(1, rows))

    def _alloc(self, rows: int) -> None:
        dev, P = self.device, self.width
        long = dict(dtype=torch.long, device=dev)
        old = getattr(self, "length", None)
        new = dict(
            length=torch.zeros(rows, **long), pos_offset=torch.zeros(rows, **long),
            pending=torch.zeros(rows, P, **long), pending_len=torch.ones(rows, **long),
            remaining=torch.zeros(rows, **long), seed=torch.zeros(rows, **long), step=torch.zeros(rows, **long),
            origin=torch.zeros(rows, **long), coupling=torch.zeros(rows, dtype=torch.bool, device=dev),
            temperature=torch.ones(rows, dtype=torch.float64, device=dev), top_k=torch.zeros(rows, **long),
            top_p=torch.ones(rows, dtype=torch.float64, device=dev), greedy=torch.ones(rows, dtype=torch.bool, device=dev),
            last_image=torch.full((rows,), NO_IMAGE, **long), live=torch.zeros(rows, dtype=torch.bool, device=dev))
        if self.feat_dim is not None:
            new["pending_feats"] = torch.zeros(rows, P, self.feat_dim, dtype=self.feat_dtype, device=dev)
        if old is not None:
            n = self.active
            for name, t in new.items():
                t[:n] = getattr(self, name)[:n]
        for name, t in new.items():
            setattr(self, name, t)
        self.rows = rows

    def ensure(self, rows: int) -> bool:
        """Room for ``rows`` rows. -> whether the tensors were reallocated (captured graphs stale)."""
        if rows <= self.rows:
            return False
        self._alloc(max(rows, 2 * self.rows))
        return True

    # ------------------------------------------------------------------ host changes
    def admit(self, starts: list[RowStart]) -> list[int]:
        """Newcomers take rows ``active ..``: their values staged and copied once per dtype."""
        first = self.active
        self.ensure(first + len(starts))
        k = len(starts)
        rows = slice(first, first + k)
        ints = torch.tensor([[s.length, s.root, s.pos_offset, s.remaining, s.seed, (s.params.top_k or 0),
                              NO_IMAGE if s.last_image is None else s.last_image, int(s.coupled)] for s in starts], dtype=torch.long)
        floats = torch.tensor([[1.0 if s.params.greedy else s.params.temperature,
                                1.0 if s.params.top_p is None else s.params.top_p, float(s.params.greedy)]
                               for s in starts], dtype=torch.float64)
        ints, floats = stage(ints, self.device), stage(floats, self.device)
        self.length[rows], self.pos_offset[rows], self.remaining[rows] = ints[:, 0], ints[:, 2], ints[:, 3]
        self.pending[rows] = 0
        self.pending[rows, 0] = ints[:, 1]
        self.pending_len[rows] = 1
        self.seed[rows], self.top_k[rows], self.last_image[rows] = ints[:, 4], ints[:, 5], ints[:, 6]
        self.step[rows] = 0
        self.origin[rows], self.coupling[rows] = ints[:, 0], ints[:, 7] > 0
        self.live[rows] = True
        self.temperature[rows], self.top_p[rows], self.greedy[rows] = floats[:, 0], floats[:, 1], floats[:, 2] > 0
        if self.feat_dim is not None:
            self.pending_feats[rows] = 0
            feats = [s.feats for s in starts]
            if all(f is not None for f in feats):
                self.pending_feats[rows, 0] = torch.cat(feats).to(self.feat_dtype)
        self.active += k
        self.lengths += [s.length for s in starts]
        self.params += [s.params for s in starts]
        self.coupled += [s.coupled for s in starts]
        self._flags = flags(self.params, self.coupled)
        return list(range(first, first + k))

    def remove(self, b: int) -> int | None:
        """Row b leaves: the last active row moves into it. -> the index that moved (None: b was last)."""
        last = self.active - 1
        moved = None
        tensors = self._tensors()
        if b != last:
            for t in tensors:
                t[b] = t[last]
            self.lengths[b], self.params[b], self.coupled[b] = self.lengths[last], self.params[last], self.coupled[last]
            moved = last
        for t in tensors:  # a free row is inert: it writes at slot 0 and emits nothing
            t[last] = 0
        self.pending_len[last] = 1
        self.greedy[last] = True
        self.temperature[last] = 1.0
        self.top_p[last] = 1.0
        self.lengths.pop()
        self.params.pop()
        self.coupled.pop()
        self.active -= 1
        self._flags = flags(self.params or [SamplingParams()], self.coupled)
        return moved

    def _tensors(self) -> list[torch.Tensor]:
        names = ["length", "pos_offset", "pending", "pending_len", "remaining", "seed", "step", "origin", "coupling",
                 "temperature", "top_k", "top_p", "greedy", "last_image", "live"]
        if self.feat_dim is not None:
            names.append("pending_feats")
        return [getattr(self, n) for n in names]

    # ------------------------------------------------------------------ a step's view
    @property
    def flags(self) -> dict:
        """What the host knows of the active rows' parameters (:func:`~mmspec.runtime.verify.flags`)."""
        return dict(self._flags)

    def sampling(self, rows: int, flags: dict | None = None) -> RowSampling:
        """The first ``rows`` rows' parameters (free rows beyond the active ones: greedy), with
        ``flags`` (a step plan's, which may turn on more paths than the rows use) or the rows' own."""
        f = self._flags if flags is None else flags
        return RowSampling(self.temperature[:rows], self.top_k[:rows], self.top_p[:rows], self.greedy[:rows],
                           coupled=self.coupling[:rows] if f.get("any_coupled") else None, **f)
