"""The world's HF processor (LLaVA layout) and the training text split of a sample.

Owns how a world sample becomes model inputs: a ``LlavaProcessor`` that expands each
``<image>`` into ``(image_size / patch_size)^2`` image tokens (the CLS token is dropped by the
"default" feature strategy, which ``num_additional_image_tokens=1`` accounts for) and a
``CLIPImageProcessorPil`` that normalises 96 px RGB images; and a world clip as a Video-LLaVA
pair (``mmspec train video``'s) reads it: :func:`clip_inputs` (evenly spaced frames, ``<video>``
expanded to ``frames x (grid^2 + 1)`` slots, each frame keeping its CLS token) with the layout
:func:`clip_layout` reads off the target's config. Loads no model.
"""

from __future__ import annotations

import torch
from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerBase

from mmspec.errors import MMSpecError
from mmspec.world.core import IMAGE_SIZE, Sample
from mmspec.world.tokenizer import IMAGE


def build_image_processor(image_size: int = IMAGE_SIZE) -> CLIPImageProcessorPil:
    """CLIP normalisation at ``image_size`` (world images are already square: resize is a no-op)."""
    return CLIPImageProcessorPil(
        size={"height": image_size, "width": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=True,
        do_resize=True,
    )


def build_processor(
    tokenizer: PreTrainedTokenizerBase, image_size: int = IMAGE_SIZE, patch_size: int = 12
) -> LlavaProcessor:
    """``processor(text=s.prompt, images=s.images, return_tensors="pt")`` -> input_ids, attention_mask,
    pixel_values ``[n_images, 3, image_size, image_size]``; each ``<image>`` becomes
    ``(image_size // patch_size) ** 2`` image tokens (64 for 96 / 12)."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    return LlavaProcessor(
        image_processor=build_image_processor(image_size),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE,
    )


def image_tokens_per_image(image_size: int = IMAGE_SIZE, patch_size: int = 12) -> int:
    return (image_size // patch_size) ** 2


def training_text(sample: Sample) -> tuple[str, str]:
    """(prompt_text, answer_text); the full training sequence is ``prompt + " " + answer + eos``.

    The byte-level pre-tokenizer splits before every space, so the tokens of the joined text are
    the prompt's tokens followed by the tokens of ``" " + answer``: masking the loss to the answer
    is a matter of counting the prompt's tokens.
    """
    return sample.prompt, sample.answer


def encode_for_training(processor: LlavaProcessor, sample: Sample) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / labels ``[1, seq]`` and pixel_values ``[n_images, 3, H, W]``.

    ``labels`` are -100 over the prompt (image tokens included) and the answer's ids + eos after it.
    """
    prompt, answer = training_text(sample)
    enc = processor(text=prompt, images=sample.images, return_tensors="pt")
    tok = processor.tokenizer
    answer_ids = tok.encode(" " + answer, add_special_tokens=False) + [tok.eos_token_id]
    ans = torch.tensor([answer_ids], dtype=enc["input_ids"].dtype)  # [1, n_answer]
    input_ids = torch.cat([enc["input_ids"], ans], dim=1)  # [1, n_prompt + n_answer]
    labels = torch.cat([torch.full_like(enc["input_ids"], -100), ans], dim=1)  # [1, seq]
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "pixel_values": enc["pixel_values"],
    }


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


def clip_layout(target) -> tuple[int, int, int]:
    """A Video-LLaVA target's (video token id, frames, slots per frame) for the world's clips: its
    ``video_seq_length`` read as frames x (grid^2 + 1) slots (each frame keeps its CLS token)."""
    cfg = target.config
    vid = getattr(cfg, "video_token_index", None)
    vc = getattr(cfg, "vision_config", None)
    per_frame = (vc.image_size // vc.patch_size) ** 2 + 1 if vc is not None else 0
    if vid is None or not per_frame or getattr(cfg, "video_seq_length", 0) % per_frame:
        raise MMSpecError("the world's clips are made for a Video-LLaVA target whose video_seq_length is its frames "
                          "x (grid^2 + 1) slots (mmspec train video's); for another "
                          "model give your own clips (--data sharegpt:FILE --media-dir DIR)")
    return vid, cfg.video_seq_length // per_frame, per_frame
