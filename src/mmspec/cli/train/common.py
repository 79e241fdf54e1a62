"""What the ``mmspec train`` commands share: options, step defaults and checks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

# options that several commands share, declared once
_STEPS = typer.Option(None, help="optimiser steps (default: 1000, or as many as --minutes allow when it is given)")
_MINUTES = typer.Option(None, help="wall-clock cap; the schedule then follows time")
_BF16 = typer.Option(True, help="bf16 autocast")


def _default_steps(steps: Optional[int], minutes: Optional[float]) -> Optional[int]:
    """--steps as given; unset, 1000 without --minutes and None (the clock decides) with it."""
    return steps if steps is not None or minutes is not None else 1000


def _require_model_dir(path: Path, option: str) -> None:
    if not (path / "config.json").exists():
        raise typer.BadParameter(f"{path} is not an HF LLaVA model directory (no config.json)", param_hint=option)


def _parse_family_samples(specs: list[str], default: int) -> dict[str, int]:
    """``["chartqa=4000", ...]`` -> training samples per family (every family; ``default`` unless named)."""
    from mmspec.world import FAMILIES

    counts = {name: default for name in FAMILIES}
    for spec in specs:
        name, sep, n = spec.partition("=")
        if not sep or name not in FAMILIES or not n.isdigit():
            raise typer.BadParameter(f"{spec!r} is not FAMILY=N with FAMILY one of {', '.join(FAMILIES)} and N >= 0",
                                     param_hint="--family-samples")
        counts[name] = int(n)
    if not any(counts.values()):
        raise typer.BadParameter("every family has 0 samples; nothing to train on", param_hint="--family-samples")
    return counts
