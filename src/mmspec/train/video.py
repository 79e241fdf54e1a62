"""The embedded video pair: a tiny Video-LLaVA target (and draft) made from the image pack and
fine-tuned on the world's video families (``mmspec train video``).

Owns: building a ``VideoLlavaForConditionalGeneration`` from a trained image LLaVA (its tower
serves images and frames, its projector and LM carry over; the vocabulary gains ``<video>``),
turning a world clip into the model's inputs (``n_frames`` evenly spaced frames; each frame
keeps its CLS token, as Video-LLaVA's video path does: ``n_frames x (grid^2 + 1)`` placeholder
tokens), teacher-forced fine-tuning of the projector and the LM on the clips' reference
answers (the towers stay frozen), and the quality bar the embedded video target must clear:
its greedy answers state the clip's key motion fact (``VideoSample.key_fact``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from mmspec.errors import MMSpecError


@dataclass
class VideoTrainConfig:
    out: str = "runs/video"
    n_frames: int = 4
    families: tuple[str, ...] = ("motion", "order")
    samples: int = 600  # train clips per family
    steps: int = 300
    minutes: float | None = None
    batch_size: int = 8
    lr: float = 3e-4
    seed: int = 0
    progress: bool = True
    notes: dict = field(default_factory=dict)


def build_video_llava(image_llava, tokenizer, n_frames: int):
    """A Video-LLaVA with ``image_llava``'s tower (for images and frames), projector and LM.
    ``tokenizer`` gains ``<video>`` (appended: no existing id changes); the LM's embeddings grow
    by that one row. Returns (model, video token id)."""
    from transformers import VideoLlavaConfig, VideoLlavaForConditionalGeneration

    from mmspec.world.tokenizer import add_video_token

    video_id = add_video_token(tokenizer)
    src = image_llava.config
    grid = src.vision_config.image_size // src.vision_config.patch_size
    cfg = VideoLlavaConfig(vision_config=src.vision_config.to_dict(), text_config=src.text_config.to_dict(),
                           image_token_index=src.image_token_id, video_token_index=video_id,
                           projector_hidden_act=src.projector_hidden_act,
                           vision_feature_select_strategy=src.vision_feature_select_strategy,
                           vision_feature_layer=src.vision_feature_layer, image_seq_length=grid * grid,
                           video_seq_length=n_frames * (grid * grid + 1))
    model = VideoLlavaForConditionalGeneration(cfg)
    core, old = model.model, image_llava.model
    core.image_tower.load_state_dict(old.vision_tower.state_dict())
    core.video_tower.load_state_dict(old.vision_tower.state_dict())
    core.multi_modal_projector.load_state_dict(old.multi_modal_projector.state_dict())
    model.resize_token_embeddings(len(tokenizer))
    lm_state = {k: v for k, v in old.language_model.state_dict().items() if "embed_tokens" not in k}
    core.language_model.load_state_dict(lm_state, strict=False)
    with torch.no_grad():
        emb_old, head_old = old.language_model.embed_tokens.weight, image_llava.lm_head.weight
        n = emb_old.shape[0]
        core.language_model.embed_tokens.weight[:n] = emb_old
        core.language_model.embed_tokens.weight[n:] = emb_old.mean(0)
        model.lm_head.weight[:n] = head_old
        model.lm_head.weight[n:] = head_old.mean(0)
    model.generation_config.eos_token_id = image_llava.generation_config.eos_token_id
    model.generation_config.pad_token_id = image_llava.generation_config.pad_token_id
    return model.to(image_llava.dtype).eval(), video_id


def clip_inputs(sample, tokenizer, image_processor, video_id: int, n_frames: int, tokens_per_frame: int,
                answer: str | None = None) -> dict:
    """A world clip -> input_ids [L] (``<video>`` expanded), pixel_values_videos [1, T, 3, H, W],
    and, with ``answer``, labels [L] (-100 on the prompt)."""
    frames = sample.frames
    idx = [round(i * (len(frames) - 1) / max(1, n_frames - 1)) for i in range(n_frames)]
    pv = image_processor(images=[frames[i] for i in idx], return_tensors="pt")["pixel_values"][None]
    ids = tokenizer(sample.prompt, add_special_tokens=True)["input_ids"]
    if ids.count(video_id) != 1:
        raise MMSpecError(f"{sample.uid}: its prompt must hold one <video> marker, found {ids.count(video_id)}")
    k = ids.index(video_id)
    ids = ids[:k] + [video_id] * (n_frames * tokens_per_frame) + ids[k + 1:]
    out = {"pixel_values_videos": pv}
    if answer is None:
        out["input_ids"] = torch.tensor(ids)
        return out
    ans = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    out["input_ids"] = torch.tensor(ids + ans)
    out["labels"] = torch.tensor([-100] * len(ids) + ans)
    return out


def _batch(items: Sequence[dict], pad: int) -> dict:
    L = max(x["input_ids"].shape[0] for x in items)
    ids = torch.full((len(items), L), pad, dtype=torch.long)
    labels = torch.full((len(items), L), -100, dtype=torch.long)
    mask = torch.zeros(len(items), L, dtype=torch.long)
    for b, x in enumerate(items):
        n = x["input_ids"].shape[0]
        ids[b, :n], labels[b, :n], mask[b, :n] = x["input_ids"], x["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values_videos": torch.cat([x["pixel_values_videos"] for x in items])}


def train_video(model, data: Sequence[dict], cfg: VideoTrainConfig, pad_id: int,
                log: Callable[[str], None] = print) -> list[float]:
    """Teacher-forced fine-tuning of the projector and LM (towers frozen) on ``data`` (items of
    :func:`clip_inputs` with labels). Returns the loss history."""
    from tqdm.auto import tqdm

    model.train()
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(not ("image_tower" in name or "video_tower" in name))
        if p.requires_grad:
            trainable.append(p)
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    hist, t0 = [], time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train video target", disable=not cfg.progress, mininterval=2.0)
    for step in bar:
        if cfg.minutes is not None and time.perf_counter() - t0 > 60 * cfg.minutes:
            log(f"time budget of {cfg.minutes:g} min spent at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        batch = _batch([data[rng.randrange(len(data))] for _ in range(cfg.batch_size)], pad_id)
        batch["pixel_values_videos"] = batch["pixel_values_videos"].to(model.dtype)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        hist.append(float(loss.detach()))
        bar.set_postfix(loss=f"{hist[-1]:.3f}")
    model.eval()
    return hist


@torch.inference_mode()
def key_fact_rate(model, samples: Sequence, tokenizer, image_processor, video_id: int, n_frames: int,
                  tokens_per_frame: int, max_new_tokens: int = 64) -> dict:
    """Share of clips whose greedy answer states the clip's key motion fact."""
    from mmspec.train.evaluate import states

    hits, by_family = 0, {}
    for s in samples:
        x = clip_inputs(s, tokenizer, image_processor, video_id, n_frames, tokens_per_frame)
        ids = x["input_ids"][None]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values_videos=x["pixel_values_videos"].to(model.dtype),
                             do_sample=False, max_new_tokens=max_new_tokens)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        ok = states(text, s.key_fact)
        hits += ok
        f = by_family.setdefault(s.family, [0, 0])
        f[0] += ok
        f[1] += 1
    return {"rate": hits / max(1, len(samples)), "n": len(samples),
            "by_family": {k: v[0] / v[1] for k, v in by_family.items()}}


def save_video_pair(model, tokenizer, image_processor, out: str | Path) -> Path:
    """A loadable directory: weights (fp16), config, tokenizer, image processor."""
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out
