"""Captioners for the caption view: image -> short text, run once per image at prefill.

The interface is one method, ``caption(images) -> list[str]``. :class:`HFCaptioner` wraps any
Hugging Face image-to-text model with its processor: encoder-decoder captioners such as BLIP
and Florence-2 (pass ``prompt="<CAPTION>"`` or ``"<MORE_DETAILED_CAPTION>"`` for Florence-2),
and decoder-only VLMs prompted to describe the image (the embedded tiny captioner).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from mmspec.errors import MMSpecError

# The embedded LLaVA captioner's prompt (recorded in its mmspec.json; mmspec.embedded falls back to it).
DEFAULT_CAPTIONER_PROMPT = "USER: <image> Describe the image briefly. ASSISTANT:"


class Captioner(Protocol):
    def caption(self, images: Sequence) -> list[str]: ...


def recorded_prompt(name_or_path: str | Path) -> str | None:
    """The captioner prompt a checkpoint directory from ``mmspec train`` records in its
    ``mmspec.json`` (None for any other checkpoint or a hub name)."""
    from mmspec.models.loading import read_sidecar

    return read_sidecar(name_or_path).get("captioner_prompt") if Path(name_or_path).is_dir() else None


class HFCaptioner:
    """Greedy captions from an HF image-to-text model (deterministic)."""

    def __init__(self, model, processor, *, prompt: str | None = None, max_new_tokens: int = 40):
        self.model = model.eval()
        self.processor = processor
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self._check_prompt()

    def _check_prompt(self) -> None:
        """A decoder-only VLM sees the image only through image tokens in its prompt. Without
        them transformers fails deep inside the processor or ``generate`` at the first caption;
        fail here instead, with the fix. The processor runs once on a blank image (no model
        forward), with the prompt or, with none, an empty text, so processors that insert the
        tokens themselves (BLIP-2, InstructBLIP) pass, prompt given or not."""
        token_id = getattr(self.model.config, "image_token_id", None)
        if self.model.config.is_encoder_decoder or token_id is None:
            return  # BLIP, Florence-2: the image goes to the encoder, not into the prompt
        from PIL import Image

        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        token = tokenizer.convert_ids_to_tokens(int(token_id)) if hasattr(tokenizer, "convert_ids_to_tokens") else None
        token = repr(str(token)) if token is not None else f"token id {int(token_id)}"
        fix = (f"Pass a prompt that holds {token} (--captioner-prompt, or prompt=); the embedded LLaVA "
               f"captioner's is {DEFAULT_CAPTIONER_PROMPT!r}.")
        given = "no prompt was given" if self.prompt is None else f"its prompt {self.prompt!r} has no {token}"
        try:
            ids = self.processor(images=Image.new("RGB", (64, 64)), text=self.prompt or "",
                                 return_tensors="pt").get("input_ids")
        except ValueError as e:  # e.g. LlavaProcessor: image tokens and images do not match
            raise MMSpecError(f"the captioner is a decoder-only VLM and {given}; its processor says: {e} {fix}") from e
        if ids is None or not bool((ids == token_id).any()):
            raise MMSpecError(f"the captioner is a decoder-only VLM and {given}, so it cannot see the image. {fix}")

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, prompt: str | None = None, dtype="auto", **kw):
        """``prompt=None`` takes the prompt a checkpoint from ``mmspec train`` records in its
        ``mmspec.json`` (the embedded captioner's), if any."""
        from mmspec.models.loading import load_model, load_processor

        prompt = recorded_prompt(name_or_path) if prompt is None else prompt
        return cls(load_model(name_or_path, dtype=dtype), load_processor(name_or_path), prompt=prompt, **kw)

    @torch.inference_mode()
    def caption(self, images: Sequence) -> list[str]:
        out = []
        device = next(self.model.parameters()).device
        for img in images:
            kwargs = {"images": img, "return_tensors": "pt"}
            if self.prompt is not None:
                kwargs["text"] = self.prompt
            inputs = self.processor(**kwargs).to(device)
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
            ids = self.model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
            if not self.model.config.is_encoder_decoder and "input_ids" in inputs:
                ids = ids[:, inputs["input_ids"].shape[1]:]  # decoder-only: drop the prompt
            text = self.processor.batch_decode(ids, skip_special_tokens=True)[0]
            out.append(" ".join(text.split()))
        return out


class FixedCaptioner:
    """Captions given up front (tests, benchmarks with reference captions)."""

    def __init__(self, captions: Sequence[str]):
        self._captions = list(captions)

    def caption(self, images: Sequence) -> list[str]:
        if len(images) != len(self._captions):
            raise MMSpecError(
                f"FixedCaptioner holds {len(self._captions)} captions but {len(images)} images were given"
            )
        return list(self._captions)
