"""``mmspec train align``: flags onto :class:`~mmspec.align.AlignConfig`; the work is
:func:`mmspec.align.train_align` on :func:`mmspec.align.world_pairs`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.align import AlignConfig, train_align, world_pairs
from mmspec.cli.common import fail, set_threads
from mmspec.errors import MMSpecError


def align_command(
    draft: Path = typer.Option(..., help="The draft model directory the encoder feeds (its processor is read from it)."),
    out: Path = typer.Option(..., help="Where the encoder is saved."),
    kind: str = typer.Option("events", help="Substitute: events, low_fps or low_res."),
    families: str = typer.Option("motion,order", help="World video families to align on."),
    samples: int = typer.Option(200, help="Train-split clips per family."),
    n_tokens: int = typer.Option(16, help="Tokens per video the encoder gives the draft."),
    steps: int = typer.Option(500, help="Optimiser steps."),
    minutes: float = typer.Option(None, help="Time budget: stop and save when it is spent."),
    batch_size: int = typer.Option(16, help="Clips per step."),
    lr: float = typer.Option(2e-3, help="Peak learning rate (cosine decay)."),
    world_seed: int = typer.Option(0, help="World seed of the clips."),
    threads: int = typer.Option(None, help="CPU threads."),
) -> None:
    """Train the draft's substitute encoder + alignment layer (events -> the draft's video features)."""
    from transformers import AutoImageProcessor, AutoProcessor

    from mmspec.models.loading import load_model
    from mmspec.provenance import command_line

    try:
        set_threads(threads)
        cfg = AlignConfig(kind=kind, out=str(out), n_tokens=n_tokens, steps=steps, minutes=minutes,
                          batch_size=batch_size, lr=lr,
                          notes={"command": command_line(), "families": families, "samples": samples,
                                 "draft": str(draft), "world_seed": world_seed})
        model = load_model(str(draft), dtype="float32")
        try:
            processor = AutoProcessor.from_pretrained(str(draft))
        except (OSError, ValueError, TypeError):  # a directory with an image processor only
            processor = AutoImageProcessor.from_pretrained(str(draft))
        subs, targets = world_pairs(model, processor, cfg, [f for f in families.split(",") if f], samples, world_seed)
        train_align(subs, targets, cfg)
    except MMSpecError as e:
        fail(e)
