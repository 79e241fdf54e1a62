"""``mmspec train video``: flags onto :class:`~mmspec.train.video.VideoTrainConfig`; builds the
embedded video pair with :mod:`mmspec.train.video`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import typer

from mmspec.cli.common import fail, set_threads
from mmspec.errors import MMSpecError
from mmspec.train.video import (VideoTrainConfig, build_video_llava, clip_inputs, key_fact_rate, save_video_pair,
                                train_video)


def video_command(
    out: Path = typer.Option(..., help="Where the video target/ and draft/ are saved, with video_report.json."),
    target: Path = typer.Option(None, help="The image LLaVA the target is made from (default: the embedded target)."),
    draft: Path = typer.Option(None, help="The image LLaVA the draft is made from (default: the embedded draft)."),
    n_frames: int = typer.Option(4, help="Frames per clip the models read."),
    samples: int = typer.Option(600, help="Train clips per video family."),
    minutes: float = typer.Option(30.0, help="The target's training time budget."),
    draft_minutes: float = typer.Option(10.0, help="The draft's training time budget."),
    steps: int = typer.Option(600, help="Optimiser steps (the schedule's length; the budget may stop earlier)."),
    batch_size: int = typer.Option(8, help="Clips per step."),
    lr: float = typer.Option(3e-4, help="Peak learning rate."),
    eval_samples: int = typer.Option(50, help="Test clips per family for the key-fact check."),
    threads: int = typer.Option(None, help="CPU threads."),
) -> None:
    """Build the embedded video pair from an image pack and fine-tune it on the world's clips."""
    import json

    from mmspec.provenance import command_line, stamp
    from mmspec.world import make_video_sample

    try:
        set_threads(threads)
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        from mmspec.embedded import default_path

        tdir = Path(target) if target else default_path() / "target"
        ddir = Path(draft) if draft else default_path() / "draft"
        processor = AutoProcessor.from_pretrained(tdir)
        tok, ip = processor.tokenizer, processor.image_processor
        img_t = LlavaForConditionalGeneration.from_pretrained(tdir, dtype=torch.float32)
        img_d = LlavaForConditionalGeneration.from_pretrained(ddir, dtype=torch.float32)
        vt, vid = build_video_llava(img_t, tok, n_frames)
        vd, _ = build_video_llava(img_d, tok, n_frames)
        grid = img_t.config.vision_config.image_size // img_t.config.vision_config.patch_size
        per_frame = grid * grid + 1
        cfg = VideoTrainConfig(out=str(out), n_frames=n_frames, samples=samples, steps=steps, minutes=minutes,
                               batch_size=batch_size, lr=lr, notes={"command": command_line()})
        train = [make_video_sample(f, "train", i) for i in range(samples) for f in cfg.families]
        test = [make_video_sample(f, "test", i) for i in range(eval_samples) for f in cfg.families]
        data = [clip_inputs(s, tok, ip, vid, n_frames, per_frame, answer=s.answer) for s in train]
        report = {"provenance": stamp(), "n_frames": n_frames, "train_clips": len(train)}
        report["target_before"] = key_fact_rate(vt, test, tok, ip, vid, n_frames, per_frame)
        report["target_loss"] = train_video(vt, data, cfg, tok.pad_token_id)
        report["target_after"] = key_fact_rate(vt, test, tok, ip, vid, n_frames, per_frame)
        dcfg = VideoTrainConfig(**{**cfg.__dict__, "minutes": draft_minutes})
        report["draft_loss"] = train_video(vd, data, dcfg, tok.pad_token_id)
        report["draft_after"] = key_fact_rate(vd, test, tok, ip, vid, n_frames, per_frame)
        for name, m in (("target", vt), ("draft", vd)):
            save_video_pair(m.half(), tok, ip, Path(out) / name)
        (Path(out) / "video_report.json").write_text(json.dumps(report, indent=1))
        print(f"key motion fact stated: target {report['target_before']['rate']:.0%} -> "
              f"{report['target_after']['rate']:.0%}, draft {report['draft_after']['rate']:.0%} "
              f"({len(test)} test clips); saved to {out}")
    except MMSpecError as e:
        fail(e)
