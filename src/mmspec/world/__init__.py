"""mmspec.world: a deterministic, seeded synthetic multimodal world with the IbED paper's eight task families.

Families mirror the paper's benchmarks (ChartQA, TextVQA, VQAv2, HallusionBench; Spot-the-Diff,
IEdit; PororoSV, VIST) at a scale tiny CPU-trained models can learn: 96 px flat renders, eight
colours, six shapes, a 3x3 grid of positions, counts 1-5, values 0-20, ~40 sign words. Answers
are verbose and varied in wording; their key facts are closed-vocabulary and recorded in
``Sample.facts``. A sample is a pure function of ``(family, split, index, seed)``; splits share
no content (see :mod:`mmspec.world.core`).

Video families (:data:`VIDEO_FAMILIES`, :func:`make_video_sample`) are kept apart from the
eight image families: :data:`FAMILIES`, :func:`iter_all` and the tokenizer's corpus hold only
the image families, so the shipped models' recipes see exactly the samples they always did.

- ``motion``: a shape moves left, right, up or down by one or two cells, or keeps still (beside
  an optional still shape); questions: which way it moves, where it is at first and at the end;
- ``order``: the first frame is empty, then 2-4 shapes appear one at a time; questions: which
  appeared first, second or last, how many appeared.

A clip is 8 frames of 96 px (:data:`~mmspec.world.video.N_FRAMES`, played at
:data:`~mmspec.world.video.VIDEO_FPS`), its prompt the single-image template with one ``<video>``
marker (:data:`mmspec.prompt.VIDEO_QA`); ``VideoSample.key_fact`` is the clip's key temporal fact
(the motion; the order of appearance), stated verbatim by the reference answer. The same
determinism and split guarantees hold, and a clip belongs to one split whatever its question
(:mod:`.video`). Their event-camera stand-ins are made by :mod:`mmspec.events` and
:mod:`mmspec.substitutes`.

The multi-turn family ``conversation`` (:mod:`.conversation`, :func:`make_conversation`) is kept
apart too (:data:`MULTI_TURN`): turn 1 is a single-image question, turn 2 another question about
the same image, its prompt built from turn 1's prompt and whatever answer turn 1 got.

This package owns the data, its tokenizer (:mod:`.tokenizer`) and its HF processor
(:mod:`.processor`). It knows nothing about models, drafting or training loops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from mmspec.errors import MMSpecError
from mmspec.world import clips
from mmspec.world.conversation import Conversation, generate_conversations, make_conversation
from mmspec.world.core import IMAGE_SIZE, SPLITS, Family, Sample, build_sample
from mmspec.world.families import FAMILIES, N_IMAGES
from mmspec.world.video import N_FRAMES, VIDEO_FPS, VideoFamily, VideoSample, build_video_sample

# Kept out of FAMILIES on purpose (see the module docstring).
VIDEO_FAMILIES: dict[str, VideoFamily] = {
    f.name: f
    for f in (
        VideoFamily("motion", N_FRAMES, clips.draw_motion, clips.render_motion,
                    "a shape moves left/right/up/down or keeps still: which way, where at first / at the end"),
        VideoFamily("order", N_FRAMES, clips.draw_order, clips.render_order,
                    "shapes appear one by one: which first / second / last, how many"),
    )
}

# Multi-turn families (name -> images per conversation), kept out of FAMILIES as the video ones.
MULTI_TURN: dict[str, int] = {"conversation": 1}

__all__ = [
    "Conversation", "FAMILIES", "MULTI_TURN", "generate_conversations", "make_conversation", "IMAGE_SIZE", "N_FRAMES", "N_IMAGES", "SPLITS", "VIDEO_FAMILIES", "VIDEO_FPS",
    "Family", "Sample", "VideoFamily", "VideoSample",
    "bundled_examples", "generate_samples", "generate_video_samples", "iter_all", "iter_video",
    "make_sample", "make_video_sample",
]  # fmt: skip


def _family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise MMSpecError(f"unknown family {name!r}; use one of {', '.join(FAMILIES)}") from None


def _video_family(name: str) -> VideoFamily:
    try:
        return VIDEO_FAMILIES[name]
    except KeyError:
        hint = f"{name!r} is an image family: use make_sample for it, or a video family: " if name in FAMILIES else ""
        raise MMSpecError(f"unknown video family {name!r}; {hint}use one of {', '.join(VIDEO_FAMILIES)}") from None


def make_sample(family: str, split: str, index: int, seed: int = 0) -> Sample:
    """The sample at ``index`` of ``family``'s ``split``; a pure function of its arguments."""
    return build_sample(_family(family), split, index, seed)


def generate_samples(family: str, split: str, n: int, seed: int = 0, start: int = 0) -> list[Sample]:
    """Samples ``start .. start+n-1`` of one family and split."""
    return [make_sample(family, split, i, seed) for i in range(start, start + n)]


def iter_all(split: str, n_per_family: int | Mapping[str, int], seed: int = 0) -> Iterator[Sample]:
    """Samples of every family, interleaved (index-major) so any prefix is balanced.

    ``n_per_family``: one count for all families, or a count per family name (families not
    named get none); a family drops out of the interleaving once its count is reached.
    """
    counts = {name: n_per_family for name in FAMILIES} if isinstance(n_per_family, int) else dict(n_per_family)
    for name in counts:
        _family(name)  # a clear error for an unknown name
    for i in range(max(counts.values(), default=0)):
        for name, n in counts.items():
            if i < n:
                yield make_sample(name, split, i, seed)


def make_video_sample(family: str, split: str, index: int, seed: int = 0) -> VideoSample:
    """The clip at ``index`` of video ``family``'s ``split``; a pure function of its arguments."""
    return build_video_sample(_video_family(family), split, index, seed)


def generate_video_samples(family: str, split: str, n: int, seed: int = 0, start: int = 0) -> list[VideoSample]:
    """Video samples ``start .. start+n-1`` of one video family and split."""
    return [make_video_sample(family, split, i, seed) for i in range(start, start + n)]


def iter_video(split: str, n_per_family: int | Mapping[str, int], seed: int = 0) -> Iterator[VideoSample]:
    """Samples of every video family, interleaved as :func:`iter_all` interleaves the image ones."""
    counts = {name: n_per_family for name in VIDEO_FAMILIES} if isinstance(n_per_family, int) else dict(n_per_family)
    for name in counts:
        _video_family(name)
    for i in range(max(counts.values(), default=0)):
        for name, n in counts.items():
            if i < n:
                yield make_video_sample(name, split, i, seed)


def bundled_examples(out_dir: str | Path) -> list[Path]:
    """Write test-split sample 0 of each family as PNGs (``{family}_{k}.png``); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name in FAMILIES:
        sample = make_sample(name, "test", 0)
        for k, img in enumerate(sample.images):
            path = out / f"{name}_{k}.png"
            img.save(path)
            paths.append(path)
    return paths
