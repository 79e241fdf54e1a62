"""What made a figure: the command line that ran, when, and on which machine.

Owns the records that the benchmark runs (``run.rank{R}.json``), reports and the training
CLI's figure files carry, so that every number written to disk names its command, machine and
date (the project's rule for figures).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys

import torch


def machine_info(device: str | None = None) -> dict:
    """Platform, CPU count, torch (and its thread count) and transformers versions, the device,
    and for a CUDA device its GPU name and the CUDA version."""
    import transformers

    info = {"platform": platform.platform(), "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "device": device or "cpu"}
    if info["device"].startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(info["device"]))
        info["cuda"] = torch.version.cuda
    return info


def command_line() -> str:
    """The command as a user types it: ``mmspec ...`` when run through the ``mmspec`` CLI (its
    console script or ``python -m mmspec``), else ``sys.argv`` as given."""
    prog = sys.argv[0].replace("\\", "/") if sys.argv else ""
    if prog.rsplit("/", 1)[-1] == "mmspec" or prog.endswith("mmspec/__main__.py"):
        return shlex.join(["mmspec", *sys.argv[1:]])
    return shlex.join(sys.argv)


def now() -> str:
    """The local time with its UTC offset, to the second (ISO 8601)."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def stamp(device: str | None = None) -> dict:
    """``{"command", "date", "machine"}`` for a file of figures."""
    return {"command": command_line(), "date": now(), "machine": machine_info(device)}
