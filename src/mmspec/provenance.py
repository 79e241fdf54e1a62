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
    """Platform, CPU count, torch version and the device (GPU name when CUDA is used)."""
    info = {"platform": platform.platform(), "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "device": device or "cpu"}
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def command_line(group: str) -> str:
    """The command as a user types it: ``mmspec GROUP ...`` when run through the ``mmspec`` CLI
    (whatever its path or ``python -m mmspec``), else ``sys.argv`` as given."""
    if group in sys.argv[1:2]:
        return shlex.join(["mmspec", group, *sys.argv[2:]])
    return shlex.join(sys.argv)


def now() -> str:
    """The local time with its UTC offset, to the second (ISO 8601)."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def stamp(group: str, device: str | None = None) -> dict:
    """``{"command", "date", "machine"}`` for a file of figures written by ``mmspec GROUP ...``."""
    return {"command": command_line(group), "date": now(), "machine": machine_info(device)}
