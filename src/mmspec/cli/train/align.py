"""``mmspec train align``: flags onto :class:`~mmspec.train.align.AlignConfig`, checked by
:func:`check_align_options` before anything loads or is written; the work is
:func:`mmspec.train.align.train_align` on :func:`mmspec.train.align.world_pairs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mmspec.cli import options
from mmspec.cli.common import set_threads
from mmspec.cli.train.common import check_model_dir, check_out, check_processor, check_threads, training_errors
from mmspec.errors import MMSpecError

if TYPE_CHECKING:
    from mmspec.train.align import AlignConfig


def align_command(
    draft: Path = typer.Option(..., help="The draft model directory the encoder feeds (its processor is read from it)."),
    out: Path = typer.Option(..., help="Where the encoder is saved (and its checkpoint: a rerun resumes)."),
    kind: str = typer.Option("events", help="Substitute: events, low_fps or low_res."),
    families: str = typer.Option("motion,order", help="World video families to align on."),
    samples: int = typer.Option(200, help="Train-split clips per family."),
    n_tokens: int = typer.Option(16, help="Tokens per video the encoder gives the draft."),
    steps: int = typer.Option(500, help="Optimiser steps."),
    minutes: float | None = typer.Option(None, help="Time budget: stop and save when it is spent."),
    batch_size: int = typer.Option(16, help="Clips per step."),
    lr: float = typer.Option(2e-3, help="Peak learning rate (cosine decay)."),
    world_seed: int = typer.Option(0, help="World seed of the clips."),
    threads: int | None = options.THREADS,
    fresh: bool = options.FRESH,
) -> None:
    """Train the draft's substitute encoder + alignment layer (events -> the draft's video features).

    Ctrl-C keeps the finished steps (OUT/checkpoints/align.pt); the same command resumes them."""
    from mmspec.provenance import command_line
    from mmspec.train.align import AlignConfig, train_align, world_pairs

    with training_errors():
        cfg = AlignConfig(kind=kind, out=str(out), n_tokens=n_tokens, steps=steps, minutes=minutes,
                          batch_size=batch_size, lr=lr, resume=not fresh,
                          notes={"command": command_line(), "families": families, "samples": samples,
                                 "draft": str(draft), "world_seed": world_seed})
        check_align_options(cfg, draft, families, samples, threads)
        set_threads(threads)
        from transformers import AutoImageProcessor, AutoProcessor

        from mmspec.models.loading import load_model

        model = load_model(str(draft), dtype="float32")
        try:
            processor = AutoProcessor.from_pretrained(str(draft))
        except (OSError, ValueError, TypeError):  # a directory with an image processor only
            processor = AutoImageProcessor.from_pretrained(str(draft))
        subs, targets = world_pairs(model, processor, cfg, _names(families), samples, world_seed)
        train_align(subs, targets, cfg)


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_align_options(cfg: AlignConfig, draft: Path, families: str, samples: int, threads: int | None) -> None:
    """Every `train align` option, before anything is loaded or written (the config's own numbers
    are checked by :class:`AlignConfig`)."""
    from mmspec.train.align import CHECKPOINT, align_settings
    from mmspec.train.loop import read_checkpoint
    from mmspec.world import VIDEO_FAMILIES

    check_threads(threads)
    if isinstance(samples, bool) or samples < 1:
        raise MMSpecError(f"--samples must be >= 1 train clip per family, got {samples}")
    unknown = [f for f in _names(families) if f not in VIDEO_FAMILIES]
    if unknown or not _names(families):
        raise MMSpecError(f"--families {families!r}: unknown video family {unknown[0] if unknown else '(none)'!r}; "
                          f"use some of {', '.join(VIDEO_FAMILIES)}")
    check_model_dir(draft, "--draft", "a draft model")
    check_processor(draft, "--draft", tokenizer=False)
    check_n_tokens(cfg.n_tokens, draft)
    check_out(Path(cfg.out))
    if cfg.resume:
        read_checkpoint(Path(cfg.out) / CHECKPOINT, align_settings(cfg), cfg.steps, cfg.minutes,
                        f"a {cfg.kind} encoder")


def check_n_tokens(n_tokens: int, draft: Path) -> None:
    """``--n-tokens``: the draft's features of each frame are pooled to that many tokens, a square
    that divides its patch grid (read from its config.json, before it loads)."""
    import json

    from mmspec.models.pooling import valid_pool_sizes

    try:
        vision = json.loads((draft / "config.json").read_text())["vision_config"]
        grid = int(vision["image_size"]) // int(vision["patch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # loading the draft says what is wrong with it
    sizes = valid_pool_sizes(grid)
    if n_tokens not in sizes:
        raise MMSpecError(f"--n-tokens {n_tokens}: the draft's video features are each frame's {grid}x{grid} patch "
                          f"grid pooled to a square that divides it, so one of {', '.join(map(str, sizes))}; "
                          "give one of them (default 16)")
