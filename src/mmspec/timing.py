"""Wall-clock timing that is honest on accelerators: wait for queued device work before
reading the clock. Shared by the engine's stats and the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Block until ``device`` has finished its queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 0) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class BlockClock:
    """Per-block phase times without a host sync at each mark: CUDA events on a GPU (read once,
    at :meth:`durations`), ``perf_counter`` on the CPU. ``start()`` opens a block, each
    ``mark()`` closes a phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[list] = []

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append([self._now()])

    def mark(self) -> None:
        self.marks[-1].append(self._now())

    def durations(self) -> list[tuple[float, ...]]:
        """Seconds of each phase, per block."""
        if self.cuda:  # the last mark's event, not the device: a step launched since may still run (overlap)
            last = next((m[-1] for m in reversed(self.marks) if m), None)
            if last is not None:
                last.synchronize()
            return [tuple(a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])) for m in self.marks]
        return [tuple(b - a for a, b in zip(m, m[1:])) for m in self.marks]
