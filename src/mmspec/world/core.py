"""The world's plumbing: the Sample record, the Family record, seeded RNGs and split assignment.

This module owns *how* a sample is made from its arguments, not *what* is drawn:

- every sample has its own ``random.Random`` derived by hashing ``(seed, family, split, index)``,
  so a sample is a pure function of its arguments and no global RNG is touched;
- a family first draws a **spec** (a frozen dataclass of the semantic content: which objects,
  which question) and only then renders it (pixel jitter, answer phrasing). A spec is assigned to
  exactly one split by a hash of its ``repr`` (80/10/10), and specs of the wrong split are
  redrawn, so train/val/test share no content, whatever the seed.

It knows nothing about Pillow drawing, tokenizers or models.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmspec.errors import MMSpecError
from mmspec.prompt import TEMPLATES, fill_template

IMAGE_SIZE = 96
SPLITS = ("train", "val", "test")
# Share of the spec space owned by each split, in hash buckets of 100.
_SPLIT_BUCKETS = {"train": range(0, 80), "val": range(80, 90), "test": range(90, 100)}
_MAX_REDRAWS = 10_000


@dataclass
class Sample:
    """One multimodal example: images, the filled paper prompt, a verbose answer and its facts."""

    uid: str  # f"{family}-{split}-{index}"
    family: str
    split: str
    images: list[Image.Image]  # RGB, IMAGE_SIZE x IMAGE_SIZE, len == N_IMAGES[family]
    question: str | None  # single-image families only
    prompt: str  # mmspec.prompt.TEMPLATES[family], filled
    answer: str  # verbose, varied phrasing; states every value of `facts` verbatim
    facts: dict[str, str]  # image-dependent key facts the answer states; single-image families list
    # the fact the question asks first (the answer's last sentence gives it; evaluation scores by it)
    captions: list[str]  # one short ground-truth caption per image
    cues: tuple[str, ...] = ()  # answer phrases that commit it to its verdict (training weighs them; not scored)


@dataclass
class Draft:
    """What a family's renderer returns; ``make_sample`` adds the uid, split and prompt."""

    images: list[Image.Image]
    answer: str
    facts: dict[str, str]
    captions: list[str]
    question: str | None = None
    cues: tuple[str, ...] = ()  # phrases of ``answer`` that decide its verdict (see Sample.cues)


@dataclass(frozen=True)
class Family:
    """A task family: how to draw a spec from an RNG and how to render a spec into a Draft."""

    name: str
    n_images: int
    draw_spec: Callable[[random.Random], Any]  # -> frozen dataclass; repr() is its identity
    render: Callable[[Any, random.Random], Draft]
    description: str = field(default="", compare=False)

    @property
    def template(self) -> str:
        return TEMPLATES[self.name]


def derive_rng(seed: int, family: str, split: str, index: int) -> random.Random:
    """A private RNG for one sample; streams of different arguments are independent."""
    digest = hashlib.sha256(f"mmspec-world|{seed}|{family}|{split}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def split_of(family: str, spec: Any) -> str:
    """The split that owns a spec: a seed-independent hash of its content."""
    digest = hashlib.sha256(f"{family}|{spec!r}".encode()).digest()
    bucket = int.from_bytes(digest[:4], "little") % 100
    for split, buckets in _SPLIT_BUCKETS.items():
        if bucket in buckets:
            return split
    raise AssertionError("unreachable: buckets cover 0..99")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise MMSpecError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")


def draw_in_split(
    family: str, draw_spec: Callable[[random.Random], Any], split: str, index: int, seed: int
) -> tuple[Any, random.Random]:
    """The spec of sample ``index`` of ``family``'s ``split`` and its RNG, advanced past the draws
    (the renderer goes on with it): specs are drawn from the sample's own RNG until one belongs
    to ``split``. Image and video families share this, so both keep the same guarantees."""
    check_split(split)
    if index < 0:
        raise MMSpecError(f"index must be >= 0, got {index}")
    rng = derive_rng(seed, family, split, index)
    for _ in range(_MAX_REDRAWS):
        spec = draw_spec(rng)
        if split_of(family, spec) == split:
            return spec, rng
    raise AssertionError(f"no {split} spec found for {family}")  # pragma: no cover - 10k misses of a 10% split


def build_sample(fam: Family, split: str, index: int, seed: int) -> Sample:
    """Draw specs until one belongs to ``split``, render it and fill the paper template."""
    spec, rng = draw_in_split(fam.name, fam.draw_spec, split, index, seed)
    draft = fam.render(spec, rng)
    draft.answer, draft.captions = fix_articles(draft.answer), [fix_articles(c) for c in draft.captions]
    draft.question = None if draft.question is None else fix_articles(draft.question)
    if len(draft.images) != fam.n_images or len(draft.captions) != fam.n_images:
        raise AssertionError(f"{fam.name} rendered {len(draft.images)} images, wants {fam.n_images}")
    story = "[CAPTION]" in fam.template
    prompt = fill_template(
        fam.template,
        question=draft.question,
        captions=draft.captions[: fam.template.count("[CAPTION]")] if story else (),
    )
    return Sample(
        uid=f"{fam.name}-{split}-{index}",
        family=fam.name,
        split=split,
        images=draft.images,
        question=draft.question,
        prompt=prompt,
        answer=draft.answer,
        facts=draft.facts,
        captions=draft.captions,
        cues=tuple(fix_articles(c) for c in draft.cues),
    )


def pick(rng: random.Random, options: Sequence[str]) -> str:
    """One phrasing out of several; the answer text varies while the facts stay fixed."""
    return options[rng.randrange(len(options))]


# Where a sentence ends: end punctuation before whitespace or the end of the text ("3.5" and
# "e.g." inside a word do not end one). The one rule for every reader of the world's answers.
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def sentences(text: str) -> list[str]:
    """``text`` split into its sentences (:data:`SENTENCE_END`), each stripped; a last piece with
    no end punctuation (an answer cut off) is a sentence too. ``[""]`` for a blank text."""
    text = text.strip()
    out, start = [], 0
    for m in SENTENCE_END.finditer(text):
        out.append(text[start:m.end()].strip())
        start = m.end()
    rest = text[start:].strip()
    return out + [rest] if rest or not out else out


def sentence(text: str) -> str:
    """Capitalise the first letter only (keeps proper nouns and upper-case words as they are)."""
    return text[:1].upper() + text[1:] if text else text


_A_BEFORE_VOWEL = re.compile(r"\b([aA]) (?=[aeiou])")


def fix_articles(text: str) -> str:
    """'a orange star' -> 'an orange star' (renderers write 'a {colour} ...' throughout)."""
    return _A_BEFORE_VOWEL.sub(r"\1n ", text)
