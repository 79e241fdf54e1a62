"""Turning what a user gives (prompt text, image files) into the target's processor inputs.

Owns image loading (with clear errors for unreadable files) and the prompt conventions of the
CLI: a prompt without ``<image>`` markers gets one marker per image in front, and a prompt
without a chat frame is wrapped as ``USER: ... ASSISTANT:`` (the LLaVA-1.5 format).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mmspec.errors import MMSpecError
from mmspec.prompt import IMAGE_MARKER, check_image_count


def load_images(paths: Sequence[str | Path]) -> list:
    from PIL import Image, UnidentifiedImageError

    images = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise MMSpecError(f"image file not found: {str(path)!r}; check the path given to --image")
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise MMSpecError(
                f"cannot read {str(path)!r} as an image ({e.__class__.__name__}); pass a PNG or "
                "JPEG file (Pillow must be able to open it)"
            ) from None
    return images


def frame_prompt(text: str, n_images: int) -> str:
    """Add image markers and the USER/ASSISTANT frame when the user left them out."""
    text = text.strip()
    if IMAGE_MARKER not in text and n_images:
        text = " ".join([IMAGE_MARKER] * n_images) + " " + text
    if not text.startswith("USER:"):
        text = f"USER: {text} ASSISTANT:"
    check_image_count(text, n_images)
    return text


def processor_inputs(processor, prompt: str, images: Sequence) -> dict:
    """Run the target's processor; returns input_ids, attention_mask and pixel_values."""
    check_image_count(prompt, len(images))
    try:
        enc = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    except (ValueError, TypeError) as e:
        raise MMSpecError(f"the target's processor rejected the prompt/images: {e}") from None
    return dict(enc)
