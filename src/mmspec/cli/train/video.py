"""``mmspec train video``: flags onto :class:`~mmspec.train.video.VideoTrainConfig` (one per
role, checked with the paths by :func:`check_video_options` before anything loads or is
written); builds the embedded video pair with :mod:`mmspec.train.video`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mmspec.cli import options
from mmspec.cli.common import set_threads
from mmspec.cli.train.common import (
    check_model_dir,
    check_model_type,
    check_out,
    check_processor,
    check_threads,
    training_errors,
)
from mmspec.errors import MMSpecError

if TYPE_CHECKING:
    from mmspec.train.video import VideoTrainConfig


def video_command(
    out: Path = typer.Option(..., help="Where the video target/ and draft/ are saved, with video_report.json "
                             "(and checkpoints/: a rerun resumes)."),
    target: Path | None = typer.Option(None, help="The image LLaVA the target is made from (default: the "
                                          "embedded target)."),
    draft: Path | None = typer.Option(None, help="The image LLaVA the draft is made from (default: the embedded "
                                         "draft)."),
    n_frames: int = typer.Option(4, help="Frames per clip the models read (1 to the clips' 8)."),
    samples: int = typer.Option(600, help="Train clips per video family."),
    minutes: float = typer.Option(30.0, help="The target's training time budget (the learning rate's "
                                 "cosine runs over it when it ends the run before --steps)."),
    draft_minutes: float = typer.Option(10.0, help="The draft's training time budget (likewise)."),
    steps: int = typer.Option(600, help="Optimiser steps (the schedule's length; the budget may stop earlier)."),
    batch_size: int = typer.Option(8, help="Clips per step."),
    lr: float = typer.Option(3e-4, help="Peak learning rate."),
    eval_samples: int = typer.Option(50, help="Test clips per family for the key-fact check."),
    threads: int | None = options.THREADS,
    fresh: bool = options.FRESH,
) -> None:
    """Build the embedded video pair from an image pack and fine-tune it on the world's clips.

    Ctrl-C keeps the finished steps (OUT/checkpoints/); the same command resumes them."""
    import json

    import torch

    from mmspec.provenance import command_line, stamp
    from mmspec.train.video import (
        VideoTrainConfig,
        build_video_llava,
        key_fact_rate,
        save_video_pair,
        train_video,
    )
    from mmspec.world import make_video_sample
    from mmspec.world.processor import clip_inputs

    with training_errors():
        from mmspec.embedded import default_path

        tdir = Path(target) if target else default_path() / "target"
        ddir = Path(draft) if draft else default_path() / "draft"
        cfg = VideoTrainConfig(out=str(out), n_frames=n_frames, samples=samples, steps=steps, minutes=minutes,
                               batch_size=batch_size, lr=lr, resume=not fresh, role="target",
                               notes={"command": command_line(), "target": str(tdir), "draft": str(ddir)})
        dcfg = replace(cfg, minutes=draft_minutes, role="draft")
        check_video_options(cfg, dcfg, tdir if target else None, ddir if draft else None, eval_samples, threads)
        set_threads(threads)
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        processor = AutoProcessor.from_pretrained(tdir)
        tok, ip = processor.tokenizer, processor.image_processor
        img_t = LlavaForConditionalGeneration.from_pretrained(tdir, dtype=torch.float32)
        img_d = LlavaForConditionalGeneration.from_pretrained(ddir, dtype=torch.float32)
        vt, vid = build_video_llava(img_t, tok, n_frames)
        vd, _ = build_video_llava(img_d, tok, n_frames)
        grid = img_t.config.vision_config.image_size // img_t.config.vision_config.patch_size
        per_frame = grid * grid + 1
        train = [make_video_sample(f, "train", i) for i in range(samples) for f in cfg.families]
        test = [make_video_sample(f, "test", i) for i in range(eval_samples) for f in cfg.families]
        data = [clip_inputs(s, tok, ip, vid, n_frames, per_frame, answer=s.answer) for s in train]
        report = {"provenance": stamp(), "n_frames": n_frames, "train_clips": len(train)}
        report["target_before"] = key_fact_rate(vt, test, tok, ip, vid, n_frames, per_frame)
        report["target_loss"] = train_video(vt, data, cfg, tok.pad_token_id, log=typer.echo)
        report["target_after"] = key_fact_rate(vt, test, tok, ip, vid, n_frames, per_frame)
        report["draft_loss"] = train_video(vd, data, dcfg, tok.pad_token_id, log=typer.echo)
        report["draft_after"] = key_fact_rate(vd, test, tok, ip, vid, n_frames, per_frame)
        for name, m in (("target", vt), ("draft", vd)):
            save_video_pair(m.half(), tok, ip, Path(out) / name, log=typer.echo)
        (Path(out) / "video_report.json").write_text(json.dumps(report, indent=1))
        typer.echo(f"key motion fact stated: target {report['target_before']['rate']:.0%} -> "
                   f"{report['target_after']['rate']:.0%}, draft {report['draft_after']['rate']:.0%} "
                   f"({len(test)} test clips); saved to {out}")


def check_video_options(cfg: VideoTrainConfig, dcfg: VideoTrainConfig, target: Path | None,
                        draft: Path | None, eval_samples: int, threads: int | None) -> None:
    """Every `train video` option, before anything is loaded or written (the numbers of each
    role's config are checked by :class:`VideoTrainConfig`)."""
    from mmspec.embedded import default_path
    from mmspec.train.loop import read_checkpoint
    from mmspec.train.video import video_settings

    check_threads(threads)
    if isinstance(eval_samples, bool) or eval_samples < 1:
        raise MMSpecError(f"--eval-samples must be >= 1 test clip per family, got {eval_samples}")
    for path, flag in ((target, "--target"), (draft, "--draft")):
        check_model_dir(path, flag, "an image LLaVA model")
        if path is None and not (default_path() / flag[2:] / "config.json").is_file():
            raise MMSpecError(f"the embedded {flag[2:]} is missing ({default_path() / flag[2:]}); give {flag} DIR or "
                              "make the pack with `mmspec train embedded`")
        if flag == "--target":  # the pair's tokenizer and image processor come from the target
            check_processor(path or default_path() / "target", flag)
        check_model_type(path or default_path() / flag[2:], flag, "llava",
                         "the video pair is built from an image LLaVA-1.5 (its tower, projector and LM)")
    check_out(Path(cfg.out))
    if cfg.resume:
        for c in (cfg, dcfg):
            read_checkpoint(Path(c.out) / "checkpoints" / f"{c.role}.pt", video_settings(c), c.steps, c.minutes,
                            f"the video {c.role}")
