"""The training loop of one stage of the LLaVA recipe, and the quick evaluations.

Owns: which parameters a stage trains (:func:`set_trainable`), the learning-rate schedule
(:func:`lr_at`: linear warm-up over ``warmup_ratio`` then cosine to 0), the loss of a batch
(:func:`batch_loss` on :func:`batch_forward`, images through :mod:`pooling` so pooled and full
grids share one code path), :func:`optimise` (the loop every stage shares: AdamW, the schedule
on steps or the clock, grad clipping, progress bar), :func:`train_stage` and held-out metrics
(:func:`eval_loss`, :func:`fact_recall`) and :func:`greedy_answer`.

Stages (IbED Appendix A, after LLaVA-1.5): stage 1 = projector only (LM and vision frozen),
stage 2 = projector + LM (vision frozen). Our deviation: the vision tower is not a pretrained
CLIP, so the target first runs a "stage 0" training everything end-to-end; drafts and the
captioner then reuse the trained target's tower, frozen.

Does not know about files or the pack's order of stages: see ``pack.py``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from mmspec.errors import MMSpecError
from mmspec.train.config import StageConfig, Trainable, check_schedule
from mmspec.train.data import Batch, Encoder, Example, View
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
             weight_decay: float, grad_clip: float, progress: bool = True) -> StageResult:
    """The loop every stage shares: AdamW on ``params``, the learning rate from :func:`lr_at` at
    ``max(step / steps, elapsed / max_seconds)`` (either may be None, not both), gradient
    clipping, a progress bar. ``step_loss()`` computes one batch's loss and returns it with the
    number of samples in the batch. Fills ``steps``, ``seconds``, ``samples`` and ``losses``."""
    check_schedule(steps, max_seconds, name)
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=weight_decay)
    result = StageResult(name)
    start = time.perf_counter()
    total = steps if max_seconds is None else None  # time-budgeted: count only
    bar = tqdm(total=total, desc=name, disable=not progress, dynamic_ncols=True, mininterval=2.0)
    step = 0
    while True:
        frac = 0.0 if steps is None else step / steps
        if max_seconds is not None:
            frac = max(frac, (time.perf_counter() - start) / max_seconds)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, lr, warmup_ratio)
        loss, n = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        step += 1
        result.losses.append(float(loss.detach()))
        result.samples += n
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
    bar.close()
    result.steps = step
    result.seconds = time.perf_counter() - start
    return result


def train_stage(model, stage: StageConfig, batches: Iterator[Batch], device: str = "cpu",
                autocast_bf16: bool = False, progress: bool = True) -> StageResult:
    """Run one stage on ``model`` (in place). ``batches`` must already match ``stage``'s view."""
    params = set_trainable(model, stage.trainable)
    train_vision = stage.trainable == "all"
    model.to(device).train()

    def step_loss() -> tuple[torch.Tensor, int]:
        batch = next(batches).to(device)
        with bf16_autocast(device, autocast_bf16):
            return batch_loss(model, batch, train_vision), batch.input_ids.shape[0]

    result = optimise(stage.name, params, step_loss, stage.lr, stage.steps, stage.max_seconds,
                      stage.warmup_ratio, stage.weight_decay, stage.grad_clip, progress)
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


def fact_recall(model, encoder: Encoder, image_processor, samples: Sequence, max_new_tokens: int = 64,
                device: str = "cpu", tokens_per_image: int = 64) -> dict:
    """Share of world facts the greedy answer states (held-out samples), with the same whole-word
    rule as the test-split figures (:func:`mmspec.train.evaluate.tally_facts`)."""
    from mmspec.train.evaluate import model_answers, tally_facts

    table = tally_facts(model_answers(model, encoder, image_processor, samples, "multimodal", max_new_tokens,
                                      device, tokens_per_image))
    hit = sum(r["hits"] for r in table.values())
    total = sum(r["facts"] for r in table.values())
    return {"recall": hit / max(total, 1), "per_family": {f: round(r["recall"], 3) for f, r in table.items()}}
