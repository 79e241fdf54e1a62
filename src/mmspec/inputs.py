"""Turning what a user gives (prompt text, image files, videos) into the target's processor inputs.

Owns image and video loading (with clear errors for unreadable files: a video is a directory of
frame images, or a video file where a reader is installed), the prompt conventions of the CLI
and the call of the processor:

* ``<image>`` / ``<video>`` in the prompt mark where each image / video goes; without markers,
  one per image and per video goes in front of the text;
* a checkpoint whose processor has a chat template gets its own frame
  (``processor.apply_chat_template`` with image / video content parts in marker order); any
  other gets LLaVA-1.5's ``USER: ... ASSISTANT:``; a prompt already starting with ``USER:`` is
  used as written;
* :func:`processor_inputs` keeps the processor's WHOLE output (``image_sizes``,
  ``image_grid_thw``, ``pixel_values_videos``, ...), which ``SpecDecoder.generate`` and
  ``target.generate`` both take.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from mmspec.errors import MMSpecError
from mmspec.prompt import IMAGE_MARKER, VIDEO_MARKER, check_image_count

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


def _open_image(path: Path, flag: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise MMSpecError(
            f"cannot read {str(path)!r} as an image ({e.__class__.__name__}); pass a PNG or "
            f"JPEG file to {flag} (Pillow must be able to open it)"
        ) from None


def load_images(paths: Sequence[str | Path]) -> list:
    images = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise MMSpecError(f"image file not found: {str(path)!r}; check the path given to --image")
        images.append(_open_image(path, "--image"))
    return images


def check_video_path(path: str | Path) -> None:
    """A video is a directory holding frame images, or a file (read by :func:`load_video`)."""
    path = Path(path)
    if path.is_dir():
        if not any(f.suffix.lower() in FRAME_SUFFIXES for f in path.iterdir() if f.is_file()):
            raise MMSpecError(f"--video {str(path)!r} is a directory without frame images ({', '.join(FRAME_SUFFIXES)}); "
                              "pass a directory of a video's frames (read in name order) or a video file")
    elif not path.is_file():
        raise MMSpecError(f"video not found: {str(path)!r}; check the path given to --video (a video file or a "
                          "directory of its frames)")


def _even(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (all of them when there are no more than ``n``)."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:1]


def load_video(path: str | Path, n_frames: int = 8) -> list:
    """One video -> ``n_frames`` evenly spaced RGB frames (PIL), from a directory of frame images
    (name order) or a video file (PyAV, else OpenCV; without either: a clear error)."""
    from PIL import Image

    path = Path(path)
    check_video_path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in FRAME_SUFFIXES)
        return [_open_image(f, "--video") for f in _even(files, n_frames)]
    try:
        import av
    except ImportError:
        av = None
    if av is not None:
        try:
            with av.open(str(path)) as container:
                frames = [f.to_image().convert("RGB") for f in container.decode(video=0)]
        except Exception as e:  # noqa: BLE001 - any decoder failure: not a video PyAV reads
            raise MMSpecError(f"cannot read {str(path)!r} as a video ({e.__class__.__name__}); pass a video file "
                              "PyAV reads, or a directory of its frames") from None
    else:
        try:
            import cv2
        except ImportError:
            raise MMSpecError(f"reading the video file {str(path)!r} needs a video reader (pip install av); or "
                              "pass --video a directory of its frames (PNG/JPEG, read in name order)") from None
        cap, frames = cv2.VideoCapture(str(path)), []
        ok, frame = cap.read()
        while ok:
            frames.append(Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)))
            ok, frame = cap.read()
        cap.release()
    if not frames:
        raise MMSpecError(f"{str(path)!r} has no video frames; pass a video file or a directory of its frames")
    return _even(frames, n_frames)


def _count(text: str, marker: str) -> int:
    return text.count(marker)


def _check_counts(text: str, n_images: int, n_videos: int) -> None:
    """The prompt's ``<image>`` and ``<video>`` slots against the images and videos given; a
    mismatch names both counts on both sides and the fix (a ``<video>`` slot given an image:
    the clip goes with ``--video``)."""
    n_img, n_vid = _count(text, IMAGE_MARKER), _count(text, VIDEO_MARKER)
    if (n_img, n_vid) == (n_images, n_videos):
        return
    if n_vid == 0 and n_videos == 0:
        check_image_count(text, n_images)  # images only: the one-kind message
    if n_img == n_images and (n_img == 0 or n_vid == 0):  # videos only, or images that match and no <video>
        raise MMSpecError(f"the prompt has {n_vid} {VIDEO_MARKER} slot(s) but {n_videos} video(s) were given; put one "
                          f"{VIDEO_MARKER} in the prompt for each --video (in order), or pass {n_vid} video(s)")
    fix = (f"a {VIDEO_MARKER} slot takes a video: pass the clip with --video (a directory of its frames or a video "
           f"file; videos= in Python), or write {IMAGE_MARKER} where each image goes"
           if n_vid > n_videos and n_images > n_img else
           f"put one {IMAGE_MARKER} in the prompt for each image and one {VIDEO_MARKER} for each video (in order), or "
           f"pass {n_img} image(s) and {n_vid} video(s)")
    raise MMSpecError(f"the prompt has {n_img} {IMAGE_MARKER} and {n_vid} {VIDEO_MARKER} slot(s) but {n_images} "
                      f"image(s) and {n_videos} video(s) were given; {fix}")


def with_markers(text: str, n_images: int, n_videos: int = 0) -> str:
    """The user's text with its markers, or one per image and video in front when it has none;
    markers that do not match the images and videos given are refused."""
    text = text.strip()
    if IMAGE_MARKER not in text and VIDEO_MARKER not in text and (n_images or n_videos):
        text = " ".join([IMAGE_MARKER] * n_images + [VIDEO_MARKER] * n_videos) + " " + text
    _check_counts(text, n_images, n_videos)
    return text


def frame_prompt(text: str, n_images: int, n_videos: int = 0) -> str:
    """LLaVA-1.5's frame: markers added when the user left them out, then ``USER: ... ASSISTANT:``."""
    text = with_markers(text, n_images, n_videos)
    if not text.startswith("USER:"):
        text = f"USER: {text} ASSISTANT:"
    return text


def chat_prompt(processor, text: str, n_images: int = 0, n_videos: int = 0) -> str:
    """The prompt as the target expects it: the processor's chat template where it has one (image
    and video content parts where the markers are), else :func:`frame_prompt`. A prompt already
    framed (``USER: ...``) is kept as written."""
    marked = with_markers(text, n_images, n_videos)
    template = getattr(processor, "chat_template", None)
    if marked.startswith("USER:") or not template:
        text = frame_prompt(marked, n_images, n_videos)
        return processor_markers(processor, text)
    content = []
    for piece in _MARKERS.split(marked):
        if piece == IMAGE_MARKER:
            content.append({"type": "image"})
        elif piece == VIDEO_MARKER:
            content.append({"type": "video"})
        elif piece.strip():
            content.append({"type": "text", "text": piece.strip()})
    try:
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that cannot render this message
        raise MMSpecError(f"the target's chat template cannot render this prompt ({e.__class__.__name__}: {e}); "
                          "write the whole prompt in the checkpoint's own format, starting with USER:") from None


def processor_markers(processor, text: str) -> str:
    """``<image>`` / ``<video>`` -> the processor's own markers where they differ (Qwen's pads)."""
    for marker, attr in ((IMAGE_MARKER, "image_token"), (VIDEO_MARKER, "video_token")):
        own = getattr(processor, attr, None)
        if isinstance(own, str) and own and own != marker:
            text = text.replace(marker, own)
    return text


def processor_inputs(processor, prompt: str, images: Sequence, videos: Sequence | None = None) -> dict:
    """Run the target's processor; returns its WHOLE output (input_ids, attention_mask,
    pixel_values and whatever the family adds: image_sizes, image_grid_thw, pixel_values_videos,
    video_grid_thw, ...) as a dict of tensors."""
    kw = {"images": list(images) or None}
    if videos:
        kw["videos"] = [list(v) for v in videos]
    try:
        enc = processor(text=prompt, return_tensors="pt", **kw)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise MMSpecError(f"the target's processor rejected the prompt/images: {e}") from None
    return dict(enc)


def to_target(inputs: dict, device, dtype) -> dict:
    """The processor's tensors on ``device``; floating ones (pixels) in the target's ``dtype``."""
    import torch

    return {k: (v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
