"""The training loop of one stage of the LLaVA recipe, and the quick evaluations.

Owns: which parameters a stage trains (:func:`set_trainable`), the learning-rate schedule
(:func:`lr_at`: linear warm-up over ``warmup_ratio`` then cosine to 0), the loss of a batch
(:func:`batch_loss` on :func:`batch_forward`, images through :mod:`pooling` so pooled and full
grids share one code path), :func:`optimise` (a stage on the one loop, :func:`mmspec.train.loop.fit`:
AdamW, the schedule on steps or the clock, grad clipping, progress bar, checkpoints and resume),
:func:`train_stage` and held-out metrics
(:func:`eval_loss`; the fact recall is :func:`mmspec.train.evaluate.fact_recall`) and
:func:`greedy_answer`.

Stages (IbED Appendix A, after LLaVA-1.5): stage 1 = projector only (LM and vision frozen),
stage 2 = projector + LM (vision frozen). Our deviation: the vision tower is not a pretrained
CLIP, so the target first runs a "stage 0" training everything end-to-end; drafts and the
captioner then reuse the trained target's tower, frozen.

Does not know about files or the pack's order of stages: see ``pack.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.errors import MMSpecError
from mmspec.train.config import StageConfig, Trainable, check_schedule
from mmspec.train.data import Batch, Encoder, Example, View
from mmspec.train.loop import FitConfig, fit, fmt_loss
from mmspec.train.pooling import embed_multimodal, pooled_image_features


def set_trainable(model, trainable: Trainable) -> list[torch.nn.Parameter]:
    """Freeze/unfreeze the model's parts for a stage; returns the trainable parameters."""
    inner = model.model
    parts = {
        "all": [model],
        "projector": [inner.multi_modal_projector],
        "projector+lm": [inner.multi_modal_projector, inner.language_model, model.lm_head],
    }
    if trainable not in parts:
        raise MMSpecError(f"unknown trainable set {trainable!r}; use one of {sorted(parts)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for part in parts[trainable]:
        for p in part.parameters():
            p.requires_grad_(True)
    seen: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():
        if p.requires_grad:
            seen[id(p)] = p
    return list(seen.values())


def lr_at(progress: float, base_lr: float, warmup_ratio: float) -> float:
    """Learning rate at ``progress`` in [0, 1]: linear warm-up, then cosine decay to 0."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_ratio > 0 and progress < warmup_ratio:
        return base_lr * progress / warmup_ratio
    rest = (progress - warmup_ratio) / max(1e-12, 1.0 - warmup_ratio)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * rest))


def batch_forward(model, batch: Batch, train_vision: bool = False, labels: torch.Tensor | None = None):
    """``model``'s output on ``batch``: the images' (pooled) features spliced into the token
    embeddings at the image tokens, one forward, no cache; with ``labels``, HF's mean loss too."""
    feats = None
    if batch.pixel_values is not None:
        feats = pooled_image_features(model, batch.pixel_values, batch.tokens_per_image, train_vision)
    embeds = embed_multimodal(model, batch.input_ids, feats)  # [B, T, H]
    return model(inputs_embeds=embeds, attention_mask=batch.attention_mask, labels=labels, use_cache=False)


def batch_loss(model, batch: Batch, train_vision: bool = True, weighted: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (answer + eos) tokens of ``batch``;
    with ``batch.loss_weights`` (and ``weighted``), the weighted mean sum(w * ce) / sum(w)."""
    if batch.loss_weights is None or not weighted:
        return batch_forward(model, batch, train_vision, labels=batch.labels).loss
    logits = batch_forward(model, batch, train_vision).logits  # [B, T, V]
    targets = batch.labels[:, 1:]  # [B, T-1]: position t predicts token t+1
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets,
                                           ignore_index=-100, reduction="none")  # [B, T-1]
    w = batch.loss_weights[:, 1:] * (targets != -100)  # [B, T-1]
    return (ce * w).sum() / w.sum().clamp_min(1e-12)


@dataclass
class StageResult:
    """What a stage did: losses per step (train), steps run, seconds, samples seen."""

    name: str
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    samples: int = 0

    @property
    def final_loss(self) -> float:
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail) if tail else float("nan")

    def line(self) -> str:
        """One line for people: steps, seconds, samples and the loss to 4 significant digits."""
        first = self.losses[0] if self.losses else None
        return (f"{self.name}: {self.steps} steps, {self.seconds:.1f} s, {self.samples} samples, loss "
                f"{fmt_loss(first)} -> {fmt_loss(self.final_loss if self.losses else None)}")

    def summary(self) -> dict:
        return {"name": self.name, "steps": self.steps, "seconds": round(self.seconds, 1),
                "samples": self.samples, "first_loss": self.losses[0] if self.losses else None,
                "final_loss": self.final_loss,
                "samples_per_s": round(self.samples / max(self.seconds, 1e-9), 2)}


def bf16_autocast(device: str, enabled: bool):
    """bf16 autocast on ``device``'s type when ``enabled``, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def optimise(name: str, params: list[torch.nn.Parameter], step_loss: Callable[[], tuple[torch.Tensor, int]],
             lr: float, steps: int | None, max_seconds: float | None, warmup_ratio: float,
             weight_decay: float, grad_clip: float, progress: bool = True, *, model: torch.nn.Module | None = None,
             checkpoint: str | Path | None = None, settings: dict | None = None, resume: bool = True,
             log: Callable[[str], None] = print) -> StageResult:
    """A stage's optimisation on the one loop (:func:`mmspec.train.loop.fit`): AdamW on ``params``,
    the learning rate from :func:`lr_at` at ``max(step / steps, elapsed / max_seconds)`` (either
    may be None, not both), gradient clipping, a progress bar, and, with ``checkpoint``, the
    finished steps kept on Ctrl-C and resumed. ``step_loss(step)`` computes one batch's loss and
    returns it with the number of samples in the batch. Fills ``steps``, ``seconds``, ``samples``
    and ``losses``."""
    check_schedule(steps, max_seconds, name)
    cfg = FitConfig(label=name, steps=steps, minutes=None if max_seconds is None else max_seconds / 60.0, lr=lr,
                    warmup_ratio=warmup_ratio, weight_decay=weight_decay, grad_clip=grad_clip,
                    checkpoint=checkpoint, resume=resume, settings=dict(settings or {}), progress=progress)

    def step(_model, info) -> tuple[torch.Tensor, dict]:
        loss, n = step_loss(info.step) if _takes_step(step_loss) else step_loss()
        return loss, {"samples": n}

    holder = model if model is not None else torch.nn.ParameterList(params)
    res = fit(holder, step, cfg, params=params, log=log)
    return StageResult(name, res.losses, res.steps, res.seconds, sum(h.get("samples", 0) for h in res.history))


def _takes_step(fn: Callable) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False


def stage_settings(stage: StageConfig) -> dict:
    """What a resumed stage must share with its checkpoint (the step count and budget may grow)."""
    return {f"stage {k}": getattr(stage, k) for k in ("trainable", "lr", "batch_size", "warmup_ratio",
                                                      "weight_decay", "grad_clip", "pooled_tokens",
                                                      "text_view_prob", "caption_view_prob")}


def train_stage(model, stage: StageConfig, batches: Iterator[Batch], device: str = "cpu",
                autocast_bf16: bool = False, progress: bool = True, *, checkpoint: str | Path | None = None,
                settings: dict | None = None, resume: bool = True,
                log: Callable[[str], None] = print) -> StageResult:
    """Run one stage on ``model`` (in place). ``batches`` must already match ``stage``'s view.
    With ``checkpoint`` (a file), Ctrl-C keeps the finished steps and a rerun resumes them (the
    stream is fast-forwarded to the step it stopped at)."""
    params = set_trainable(model, stage.trainable)
    train_vision = stage.trainable == "all"
    model.to(device).train()
    drawn = [0]

    def step_loss(step: int) -> tuple[torch.Tensor, int]:
        while drawn[0] < step:  # a resumed run: skip the batches the finished steps saw
            next(batches)
            drawn[0] += 1
        batch = next(batches).to(device)
        drawn[0] += 1
        with bf16_autocast(device, autocast_bf16):
            return batch_loss(model, batch, train_vision), batch.input_ids.shape[0]

    try:
        result = optimise(stage.name, params, step_loss, stage.lr, stage.steps, stage.max_seconds,
                          stage.warmup_ratio, stage.weight_decay, stage.grad_clip, progress, model=model,
                          checkpoint=checkpoint, settings={**stage_settings(stage), **(settings or {})},
                          resume=resume, log=log)
    finally:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
    return result


@torch.no_grad()
def eval_loss(model, batches: Sequence[Batch], device: str = "cpu") -> float:
    """Mean loss per labelled token over fixed held-out ``batches`` (loss weights ignored, so
    runs with and without ``--fact-weight`` compare)."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        n = int((batch.labels[:, 1:] != -100).sum())
        total += float(batch_loss(model, batch, train_vision=False, weighted=False)) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def greedy_answer(model, encoder: Encoder, image_processor, ex: Example, tokens_per_image: int = 64,
                  max_new_tokens: int = 64, device: str = "cpu", view: View = "multimodal") -> list[int]:
    """Greedy continuation of ``ex``'s prompt seen through ``view``; returns the new token ids."""
    from mmspec.train.data import collate

    enc = encoder.encode(Example(ex.prompt, "", ex.images, ex.captions, ex.family), view, tokens_per_image)
    n_prompt = len(enc.labels) - sum(1 for label in enc.labels if label != -100)
    batch = collate([type(enc)(enc.input_ids[:n_prompt], enc.labels[:n_prompt], enc.images)],
                    encoder.tokenizer.pad_token_id, image_processor, tokens_per_image).to(device)
    feats = None
    if batch.pixel_values is not None:
        feats = pooled_image_features(model, batch.pixel_values, tokens_per_image, train_vision=False)
    embeds = embed_multimodal(model, batch.input_ids, feats)
    out = model.generate(inputs_embeds=embeds, attention_mask=batch.attention_mask,
                         max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=encoder.tokenizer.pad_token_id,
                         eos_token_id=encoder.tokenizer.eos_token_id)
    return out[0].tolist()
