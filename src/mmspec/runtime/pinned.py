"""Pinned host memory allocated once and reused: the step's outcome ring and the staging buffers.

Pinning memory (``cudaHostAlloc``) is a driver call that can take as long as a small step, and
it serialises with the device; a fresh pinned tensor per step or per staged copy costs that every
time. Two owners here, both grown by power-of-two buckets and otherwise reused:

* :class:`PinnedRing`: where each launched step's packed outcomes land (a non-blocking copy from
  the device), two slots, because a step may be launched while the one before it is still being
  read (:meth:`~mmspec.engine.step.Engine.launch`: at most one step ahead), so a slot is written
  again only once the step that used it has been read;
* :class:`PinnedStaging`: host values on their way to the device (:func:`~mmspec.runtime.state.stage`):
  each copy is written in place into a free pinned slot, copied from it without blocking, and the
  slot is free again once the device has done that copy (a CUDA event), so the host never waits
  for a step in flight to stage the next admission.

On the CPU none of this is used (a step is read where it ran).
"""

from __future__ import annotations

import threading

import torch

from mmspec.runtime.graphs import bucket

MIN_BYTES = 1 << 12  # the smallest staging slot
STAGING_SLOTS = 16  # staging slots kept (a copy finds a free one unless this many are in flight)


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class PinnedRing:
    """``slots`` flat pinned buffers taken in turn (module docstring)."""

    def __init__(self, slots: int = 2):
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.turn = 0
        self.allocations = 0  # pinned buffers allocated so far (a test's count)

    def reserve(self, numel: int, dtype: torch.dtype = torch.long) -> None:
        """Every slot holds at least ``numel`` elements of ``dtype`` (a warm-up's: no growth later)."""
        for i in range(len(self.buffers)):
            self._fit(i, numel, dtype)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next slot as a contiguous tensor of ``shape`` (its old contents: the step two
        launches ago, read already)."""
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        numel = 1
        for n in shape:
            numel *= n
        return self._fit(i, numel, dtype)[:numel].view(shape)

    def _fit(self, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers[i]
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self.buffers[i] = _pinned(bucket(max(numel, 1)), dtype)
            self.allocations += 1
        return buf


class PinnedStaging:
    """Pinned slots that host values are staged in on their way to a device (module docstring)."""

    def __init__(self):
        self.slots: list[list] = []  # [pinned uint8 buffer, its last copy's CUDA event or None]
        self.lock = threading.Lock()  # prefills of two engines may stage from two threads
        self.allocations = 0

    def reserve(self, slots: int = STAGING_SLOTS, nbytes: int = 1 << 16) -> None:
        """At least ``slots`` slots of ``nbytes`` bytes each (a warm-up's)."""
        with self.lock:
            for s in self.slots:
                if s[0].numel() < nbytes and (s[1] is None or s[1].query()):
                    s[0] = self._new(nbytes)
            while len(self.slots) < slots:
                self.slots.append([self._new(nbytes), None])

    def stage(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (a CPU tensor) on ``device``: written into a free pinned slot, copied from it
        without blocking."""
        host = host.contiguous()
        nbytes = host.numel() * host.element_size()
        with self.lock:
            slot = self._free(nbytes)
            self.slots.pop(next(i for i, s in enumerate(self.slots) if s is slot))  # by identity: slots hold tensors
            self.slots.append(slot)  # least recently used first
            src = slot[0][:nbytes].view(host.dtype).view(host.shape)
            src.copy_(host)
            out = src.to(device, non_blocking=True)
            if slot[1] is None:
                slot[1] = torch.cuda.Event()
            slot[1].record(torch.cuda.current_stream(device))
        return out

    def _free(self, nbytes: int) -> list:
        """A slot whose last copy is done, of at least ``nbytes`` bytes (grown, or a new one, only
        when none fits; past :data:`STAGING_SLOTS` busy ones, the oldest is waited for)."""
        free = [s for s in self.slots if s[1] is None or s[1].query()]
        fits = [s for s in free if s[0].numel() >= nbytes]
        if fits:
            return fits[0]
        if free:
            free[0][0] = self._new(nbytes)
            return free[0]
        if len(self.slots) < STAGING_SLOTS:
            self.slots.append([self._new(nbytes), None])
            return self.slots[-1]
        slot = self.slots.pop(0)  # every slot busy: wait for the oldest copy
        slot[1].synchronize()
        if slot[0].numel() < nbytes:
            slot[0] = self._new(nbytes)
        self.slots.append(slot)
        return slot

    def _new(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return _pinned(bucket(max(nbytes, MIN_BYTES)), torch.uint8)


STAGING = PinnedStaging()  # the process's staging slots (pinned memory is the host's, shared by every device)
