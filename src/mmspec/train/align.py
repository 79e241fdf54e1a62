"""``mmspec train align``: fit a substitute encoder (:mod:`mmspec.models.substitute`) so that what it
makes of a video's stand-in (events, fewer frames, lower resolution) looks, to the draft, like
what the draft makes of the real frames.

Owns the alignment targets and the loss; the loop is :func:`mmspec.train.loop.fit`. Target of
clip c: the draft's own features of its frames, pooled to ``n_tokens`` (its P-view pooling of the video when the draft reads videos;
for a draft that reads images, each frame's pooled features averaged over the frames). Loss:
mean squared error plus (1 - cosine similarity), per token. Data: the world's video clips
(train split; :func:`mmspec.world.make_video_sample`), or any frames the caller passes.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.errors import MMSpecError
from mmspec.train.loop import FitConfig, StepInfo, fit, fmt_loss, write_atomically


@dataclass
class AlignConfig:
    kind: str = "events"
    out: str = "runs/align"
    n_tokens: int = 16
    steps: int = 500
    minutes: float | None = None
    batch_size: int = 16
    lr: float = 2e-3
    hidden: int = 64
    seed: int = 0
    progress: bool = True
    resume: bool = True  # continue from out/checkpoints/align.pt when it is there
    opts: dict = field(default_factory=dict)  # make_substitute options
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from mmspec.substitutes import MAKERS

        if self.kind not in MAKERS:
            raise MMSpecError(f"unknown substitute kind {self.kind!r}; use one of {', '.join(MAKERS)}")
        for name in ("n_tokens", "steps", "batch_size", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MMSpecError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MMSpecError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):
            raise MMSpecError(f"--minutes must be a finite number > 0, got {self.minutes}")


@torch.no_grad()
def draft_video_target(draft, frames: Sequence, n_tokens: int, processor=None) -> torch.Tensor:
    """The draft's own features of a clip's frames, pooled to [n_tokens, H]."""
    from mmspec.models.base import ModelAdapter, adapter_for

    adapter = draft if isinstance(draft, ModelAdapter) else adapter_for(draft)
    if processor is None:
        raise MMSpecError("aligning to a draft needs its processor (to read the frames as it does)")
    ip = getattr(processor, "image_processor", processor)
    pv = ip(images=list(frames), return_tensors="pt")["pixel_values"].to(adapter.device, adapter.dtype)
    if adapter.video_token_id is not None and "pixel_values_videos" in adapter.mm_keys:
        # a draft that reads videos: its own pooled video features (its P view of the clip)
        return adapter.pooled({"pixel_values_videos": pv[None]}, n_tokens)["video"][0].float().cpu()
    per_frame = adapter.pooled({"pixel_values": pv}, n_tokens)["image"]  # each [n, H]
    return torch.stack(per_frame).mean(0).float().cpu()  # [n, H]: averaged over time


def align_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """pred, target [B, n, H] -> MSE + (1 - cosine) averaged over tokens."""
    return F.mse_loss(pred, target) + (1 - F.cosine_similarity(pred, target, dim=-1)).mean()


CHECKPOINT = Path("checkpoints") / "align.pt"  # under cfg.out: what a rerun resumes


def align_settings(cfg: AlignConfig) -> dict:
    """What a resumed fit must share with its checkpoint, by the `train align` flags."""
    return {"kind": cfg.kind, "n_tokens": cfg.n_tokens, "batch_size": cfg.batch_size, "lr": cfg.lr,
            "hidden": cfg.hidden, "seed": cfg.seed, **{k: v for k, v in cfg.notes.items() if k != "command"}}


def train_align(subs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], cfg: AlignConfig,
                log: Callable[[str], None] = print):
    """Fit an encoder on (substitute [S, C, H, W], target [n, H]) pairs; saves it under ``cfg.out``.
    Runs on the one loop (:func:`mmspec.train.loop.fit`): Ctrl-C keeps the finished steps in
    ``cfg.out/checkpoints/align.pt`` and a rerun resumes them."""
    from mmspec.models.substitute import build_substitute_encoder

    if not subs:
        raise MMSpecError("no training clips for the substitute encoder")
    out_size = targets[0].shape[-1]
    enc = build_substitute_encoder(cfg.kind, subs[0], cfg.n_tokens, out_size, hidden=cfg.hidden, opts=cfg.opts,
                                   seed=cfg.seed).train()
    x_all, y_all = torch.stack(list(subs)).float(), torch.stack(list(targets)).float()  # [N, S, C, H, W], [N, n, H]

    def step_loss(model, info: StepInfo) -> tuple[torch.Tensor, dict]:
        rng = random.Random(cfg.seed * 1_000_003 + info.step)  # the batch is a function of the step: resumable
        idx = [rng.randrange(len(subs)) for _ in range(cfg.batch_size)]
        return align_loss(model(x_all[idx]), y_all[idx]), {}

    fit_cfg = FitConfig(label=f"align {cfg.kind}", steps=cfg.steps, minutes=cfg.minutes, lr=cfg.lr, grad_clip=None,
                        checkpoint=Path(cfg.out) / CHECKPOINT, resume=cfg.resume, settings=align_settings(cfg),
                        progress=cfg.progress)
    res = fit(enc, step_loss, fit_cfg, log=log)
    if res.steps == 0:
        raise MMSpecError(f"the time budget of {cfg.minutes:g} min ended before the first step; raise --minutes")
    history = res.losses
    enc.eval()
    enc.config.trained = {**cfg.notes, "steps": res.steps, "final_loss": history[-1], "first_loss": history[0],
                          "seconds": res.seconds}
    enc.save(cfg.out)
    write_atomically(Path(cfg.out) / "train_log.json", lambda tmp: tmp.write_text(json.dumps(history)))
    log(f"saved the {cfg.kind} substitute encoder to {cfg.out} ({res.steps} steps, loss "
        f"{fmt_loss(history[0])} -> {fmt_loss(history[-1])})")
    return enc


def world_pairs(draft, processor, cfg: AlignConfig, families: Sequence[str], n: int, world_seed: int = 0):
    """(substitutes, targets) for the world's train-split clips of ``families``."""
    from mmspec.substitutes import make_substitute
    from mmspec.world import make_video_sample

    subs, targets = [], []
    for fam in families:
        for i in range(n):
            s = make_video_sample(fam, "train", i, world_seed)
            subs.append(make_substitute(s.frames, cfg.kind, **cfg.opts).tensor)
            targets.append(draft_video_target(draft, s.frames, cfg.n_tokens, processor))
    return subs, targets
