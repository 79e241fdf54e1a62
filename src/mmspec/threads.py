"""CPU threads per process: the ``--threads`` default and setting it before any model runs.

Threads that fight for cores wait on each other at every operation: two ``mmspec bench run``
each taking both cores of a 2-core machine take 21 s where one thread each takes 5.6 s, and on
a 2-core machine loaded by other work two threads made the embedded pack's answer 14x slower
than one (perf/threads.py; docs/perf.md, "Threads"). So the default is the cores the machine
leaves idle (this process's cores minus the 1-minute load average, rounded, at most torch's own
count), shared among the processes a launcher started here (``LOCAL_WORLD_SIZE``, set by
``torchrun``), at least 1; ``OMP_NUM_THREADS`` or ``--threads`` given by the user are taken as given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from mmspec.errors import MMSpecError


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's, ``taskset``'s share),
    else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def machine_load() -> float:
    """The 1-minute load average (processes running or waiting to run); 0.0 where unknown."""
    try:
        return max(0.0, os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def default_threads(env: Mapping[str, str] | None = None, available: int | None = None,
                    cores: int | None = None, load: float | None = None) -> int:
    """The cores nobody else is using, shared among the processes a launcher started here, at
    least 1: torch's own count (``available``, default ``torch.get_num_threads()``: the physical
    cores, or ``OMP_NUM_THREADS``), capped by the cores this process may use (``cores``) and by
    the ones the rest of the machine leaves idle (``cores`` minus the 1-minute ``load``, rounded);
    divided by ``LOCAL_WORLD_SIZE``. An ``OMP_NUM_THREADS`` the user set is taken as given."""
    import torch

    env = os.environ if env is None else env
    available = torch.get_num_threads() if available is None else available
    cores = usable_cores() if cores is None else cores
    n = min(available, cores)
    if not env.get("OMP_NUM_THREADS"):  # torch's guess, not the user's: leave busy cores alone
        idle = math.floor(cores - (machine_load() if load is None else load) + 0.5)
        n = min(n, idle)
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or "1")
    except ValueError:
        local = 1
    return max(1, n // max(1, local))


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: :func:`default_threads`); return it."""
    import torch

    n = default_threads() if threads is None else threads
    if n < 1:
        raise MMSpecError(f"--threads must be >= 1, got {n}; or leave it out for one share of the cores per process")
    torch.set_num_threads(n)
    return n


def threads_note(threads: int | None, n: int) -> str:
    """One line saying how many threads run and why, for the output beside a speed-up."""
    if threads is not None:
        return f"CPU threads: {n} (--threads)"
    return (f"CPU threads: {n} of {usable_cores()} core(s) (the default: the cores the machine leaves idle, "
            f"load {machine_load():.1f}; speed-ups are measured with it; --threads N sets it)")
