"""The world's HF processor (LLaVA layout) and the training text split of a sample.

Owns how a world sample becomes model inputs: a ``LlavaProcessor`` that expands each
``<image>`` into ``(image_size / patch_size)^2`` image tokens (the CLS token is dropped by the
"default" feature strategy, which ``num_additional_image_tokens=1`` accounts for) and a
``CLIPImageProcessorPil`` that normalises 96 px RGB images. Knows nothing about models.
"""

from __future__ import annotations

import torch
from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerBase

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
