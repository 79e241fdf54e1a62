"""The world's video plumbing: the VideoSample and VideoFamily records and how a clip is built.

A video sample is made exactly as an image sample is (:mod:`mmspec.world.core`): its own RNG from
``(seed, family, split, index)``, a spec drawn until it belongs to the split, then rendered. The
one difference is deliberate: a video family's spec is the **clip alone** (what moves or
appears, and when) and the question is drawn while rendering, so a clip and its key fact belong
to exactly one split, whatever question is asked about it. (An image spec includes its question,
so an image scene can recur in another split under another question.)

This module owns the records and the build; the families themselves are in
:mod:`mmspec.world.clips` and the registry in :mod:`mmspec.world`. It knows nothing about
events, tokenizers or models.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmspec.prompt import VIDEO_QA, fill_template
from mmspec.world.core import draw_in_split, fix_articles

N_FRAMES = 8  # frames per clip, each IMAGE_SIZE x IMAGE_SIZE like the image families' images
VIDEO_FPS = 8.0  # the rate a clip is played at: 8 frames span 7 frame intervals, 0.875 s


@dataclass
class VideoSample:
    """One video question: a short clip, the filled prompt, a verbose answer and its facts."""

    uid: str  # f"{family}-{split}-{index}"
    family: str
    split: str
    frames: list[Image.Image]  # RGB, IMAGE_SIZE x IMAGE_SIZE, len == VIDEO_FAMILIES[family].n_frames
    fps: float  # frames per second (VIDEO_FPS): frame k is shown at k / fps seconds
    question: str
    prompt: str  # mmspec.prompt.VIDEO_QA, filled: one <video> marker, where the clip goes
    answer: str  # verbose, varied phrasing; states every value of `facts` and `key_fact` verbatim
    facts: dict[str, str]  # closed-vocabulary facts the answer states; the asked one first, and
    # the answer's last sentence gives it (as for the single-image families)
    key_fact: str  # THE clip's key temporal fact ("red circle moved right"; the order things
    # appeared in), a phrase the answer states verbatim whatever the question
    caption: str  # one short ground-truth description of the whole clip


@dataclass
class VideoDraft:
    """What a video family's renderer returns; the build adds the uid, split, fps and prompt."""

    frames: list[Image.Image]
    question: str
    answer: str
    facts: dict[str, str]
    key_fact: str
    caption: str


@dataclass(frozen=True)
class VideoFamily:
    """A video task family: how to draw a clip's spec from an RNG and render it into a VideoDraft."""

    name: str
    n_frames: int
    draw_spec: Callable[[random.Random], Any]  # -> frozen dataclass of the clip; repr() is its identity
    render: Callable[[Any, random.Random], VideoDraft]  # also draws the question
    description: str = field(default="", compare=False)


def build_video_sample(fam: VideoFamily, split: str, index: int, seed: int) -> VideoSample:
    """Draw clip specs until one belongs to ``split``, render it and fill :data:`VIDEO_QA`."""
    spec, rng = draw_in_split(fam.name, fam.draw_spec, split, index, seed)
    draft = fam.render(spec, rng)
    if len(draft.frames) != fam.n_frames:
        raise AssertionError(f"{fam.name} rendered {len(draft.frames)} frames, wants {fam.n_frames}")
    question = fix_articles(draft.question)
    return VideoSample(
        uid=f"{fam.name}-{split}-{index}",
        family=fam.name,
        split=split,
        frames=draft.frames,
        fps=VIDEO_FPS,
        question=question,
        prompt=fill_template(VIDEO_QA, question=question),
        answer=fix_articles(draft.answer),
        facts=draft.facts,
        key_fact=draft.key_fact,
        caption=fix_articles(draft.caption),
    )
