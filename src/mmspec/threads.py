"""CPU threads per process: the ``--threads`` default and setting it before any model runs.

Two processes that each take every core (torch's default) fight over them: on a 2-core machine
two ``mmspec bench run`` take 21 s where one thread each takes 5.6 s. The default here is torch's
own choice shared among the processes a launcher started on this machine (``LOCAL_WORLD_SIZE``,
set by ``torchrun``); separate runs started by hand are told ``--threads`` by their user.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mmspec.errors import MMSpecError


def default_threads(env: Mapping[str, str] | None = None, available: int | None = None) -> int:
    """Torch's thread count (``available``, default ``torch.get_num_threads()``) divided by the
    number of local ranks, at least 1."""
    import torch

    env = os.environ if env is None else env
    available = torch.get_num_threads() if available is None else available
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or "1")
    except ValueError:
        local = 1
    return max(1, available // max(1, local))


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: :func:`default_threads`); return it."""
    import torch

    n = default_threads() if threads is None else threads
    if n < 1:
        raise MMSpecError(f"--threads must be >= 1, got {n}; or leave it out for one share of the cores per process")
    torch.set_num_threads(n)
    return n
