"""The embedded video pair: a tiny Video-LLaVA target (and draft) made from the image pack and
fine-tuned on the world's video families (``mmspec train video``).

Owns: building a ``VideoLlavaForConditionalGeneration`` from a trained image LLaVA (its tower
serves images and frames, its projector and LM carry over; the vocabulary gains ``<video>``),
teacher-forced fine-tuning of the projector and the LM on the clips' reference
answers (the towers stay frozen; the step function of :func:`mmspec.train.loop.fit`), the pair's
saved processor (Video-LLaVA's, :func:`video_processor`), and the quality bar the embedded video target must clear:
its greedy answers state the clip's key motion fact (``VideoSample.key_fact``). A clip's inputs
are :func:`mmspec.world.processor.clip_inputs`' (the bench reads them too).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.errors import MMSpecError
from mmspec.train.loop import FitConfig, StepInfo, fit
from mmspec.world.processor import clip_inputs


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
    role: str = "target"  # target or draft: its progress bar's label and checkpoint file
    resume: bool = True  # continue from out/checkpoints/{role}.pt when it is there
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from mmspec.world import N_FRAMES, VIDEO_FAMILIES

        for name in ("samples", "steps", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MMSpecError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {v!r}")
        if isinstance(self.n_frames, bool) or not isinstance(self.n_frames, int) or not 1 <= self.n_frames <= N_FRAMES:
            raise MMSpecError(f"--n-frames must be from 1 to {N_FRAMES} (the world's clips have {N_FRAMES} frames), "
                              f"got {self.n_frames!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MMSpecError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):
            raise MMSpecError(f"--{'draft-' if self.role == 'draft' else ''}minutes must be a finite number > 0, "
                              f"got {self.minutes}")
        unknown = [f for f in self.families if f not in VIDEO_FAMILIES]
        if unknown or not self.families:
            raise MMSpecError(f"unknown video family {unknown[0] if unknown else '(none)'!r}; use some of "
                              f"{', '.join(VIDEO_FAMILIES)}")
        if self.role not in ("target", "draft"):
            raise MMSpecError(f"role must be target or draft, got {self.role!r}")


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


def video_settings(cfg: VideoTrainConfig) -> dict:
    """What a resumed fine-tune must share with its checkpoint, by the `train video` flags."""
    return {"n_frames": cfg.n_frames, "families": list(cfg.families), "samples": cfg.samples,
            "batch_size": cfg.batch_size, "lr": cfg.lr, "seed": cfg.seed,
            **{k: v for k, v in cfg.notes.items() if k != "command"}}


def train_video(model, data: Sequence[dict], cfg: VideoTrainConfig, pad_id: int,
                log: Callable[[str], None] = print) -> list[float]:
    """Teacher-forced fine-tuning of the projector and LM (towers frozen) on ``data`` (items of
    :func:`~mmspec.world.processor.clip_inputs` with labels), on the one loop
    (:func:`mmspec.train.loop.fit`): Ctrl-C
    keeps the finished steps in ``cfg.out/checkpoints/{role}.pt`` and a rerun resumes them.
    Returns the loss history."""
    model.train()
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(not ("image_tower" in name or "video_tower" in name))
        if p.requires_grad:
            trainable.append(p)

    def step_loss(m, info: StepInfo) -> tuple[torch.Tensor, dict]:
        rng = random.Random(cfg.seed * 1_000_003 + info.step)  # the batch is a function of the step: resumable
        batch = _batch([data[rng.randrange(len(data))] for _ in range(cfg.batch_size)], pad_id)
        batch["pixel_values_videos"] = batch["pixel_values_videos"].to(m.dtype)  # [B, T, 3, H, W]
        return m(**batch).loss, {}

    fit_cfg = FitConfig(label=f"train video {cfg.role}", steps=cfg.steps, minutes=cfg.minutes, lr=cfg.lr,
                        warmup_steps=20, grad_clip=1.0,
                        checkpoint=Path(cfg.out) / "checkpoints" / f"{cfg.role}.pt",
                        resume=cfg.resume, settings=video_settings(cfg), progress=cfg.progress)
    try:
        res = fit(model, step_loss, fit_cfg, params=trainable, log=log)
    finally:
        model.eval()
    return res.losses


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


def torchvision_works() -> bool:
    """Whether torchvision imports (Video-LLaVA's video processor in transformers needs it; a
    torchvision built for another torch fails on import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another torch
        return False
    return True


def video_processor(tokenizer, image_processor, patch_size: int):
    """Video-LLaVA's processor for the pair: ``processor(text=prompt, videos=[frames],
    return_tensors="pt")`` gives ``input_ids`` (``<video>`` expanded to ``frames x (grid^2 + 1)``
    slots) and ``pixel_values_videos [1, T, 3, H, W]``, what :func:`~mmspec.world.processor.clip_inputs` makes of the
    same frames. Needs torchvision (transformers' video processors use it)."""
    if not torchvision_works():
        raise MMSpecError("Video-LLaVA's video processor needs a torchvision that matches this torch; install it "
                          "(pip install torchvision), or make the inputs with mmspec.world.processor.clip_inputs")
    from transformers import VideoLlavaProcessor, VideoLlavaVideoProcessor

    d = image_processor.to_dict()
    frames = VideoLlavaVideoProcessor(size=d["size"], crop_size=d["crop_size"], do_center_crop=d["do_center_crop"],
                                      do_resize=d["do_resize"], do_rescale=d["do_rescale"],
                                      do_normalize=d["do_normalize"], image_mean=list(d["image_mean"]),
                                      image_std=list(d["image_std"]), resample=d["resample"],
                                      rescale_factor=d["rescale_factor"], do_sample_frames=False)
    return VideoLlavaProcessor(image_processor=image_processor, video_processor=frames, tokenizer=tokenizer,
                               patch_size=patch_size, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)


def save_video_pair(model, tokenizer, image_processor, out: str | Path,
                    log: Callable[[str], None] = print) -> Path:
    """A loadable directory: weights (fp16), config, tokenizer and processor. With torchvision the
    processor is Video-LLaVA's (:func:`video_processor`): ``AutoProcessor.from_pretrained(out)``
    then handles ``videos=``. Without it, the tokenizer and image processor only, and one line
    says so (the inputs then come from :func:`~mmspec.world.processor.clip_inputs`)."""
    out = Path(out)
    model.save_pretrained(out)
    vc = model.config.vision_config
    if torchvision_works():
        video_processor(tokenizer, image_processor, vc.patch_size).save_pretrained(out)
        return out
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    log(f"{out}: saved without Video-LLaVA's video processor (it needs torchvision, which does not import here); "
        "make a clip's inputs with mmspec.world.processor.clip_inputs")
    return out
