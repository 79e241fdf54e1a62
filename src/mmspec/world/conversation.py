"""The multi-turn family ``conversation``: a second question about the same image after the first answer.

Turn 1 is a single-image world question (chartqa, textvqa or vqav2, by index); turn 2 asks a
*different* question about the same image. The turn-2 prompt is built from whatever answer turn 1
got (:func:`turn2_prompt`): a benchmark feeds it the target's own turn-1 output, so the
conversation is the one a user would have, and a decoder that keeps its cache between turns
prefills only the new suffix (turn 1's prompt + answer are its prefix).

Determinism and splits, as the other families (:mod:`mmspec.world.core`): a conversation is a
pure function of ``(split, index, seed)``; it is drawn from its own RNG, and both of its
questions' specs belong to ``split`` by the base family's own split hash (specs of another split
are redrawn), so no question of a test conversation is a train sample of its family.

It is kept out of :data:`mmspec.world.FAMILIES` (the tokenizer corpus and the shipped models'
recipes iterate those): its text is made of the single-image families' own sentences and the
chat markers ``USER:`` / ``ASSISTANT:``, all in the world tokenizer's vocabulary.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from mmspec.errors import MMSpecError
from mmspec.world.core import Family, build_sample, check_split, derive_rng, split_of
from mmspec.world.families import FAMILIES

BASE_FAMILIES = ("chartqa", "textvqa", "vqav2")  # conversation i builds on BASE_FAMILIES[i % 3]
NAME = "conversation"
_MAX_REDRAWS = 10_000


@dataclass
class Conversation:
    """Two turns about the same image(s). ``turn2_prompt(answer1)`` is turn 2's whole prompt."""

    uid: str  # f"conversation-{split}-{index}"
    split: str
    base_family: str
    images: list[Image.Image]
    prompt1: str  # turn 1's prompt (the base family's template, filled)
    question1: str
    answer1: str  # the world's reference answer to turn 1
    question2: str
    answer2: str  # the world's reference answer to turn 2
    facts2: dict[str, str]
    captions: list[str]  # the image's ground-truth caption (its content, as the base family words it)

    def turn2_prompt(self, answer1: str | None = None) -> str:
        """Turn 1's prompt + ``answer1`` (default: the reference) + the new user turn."""
        return turn2_prompt(self.prompt1, self.answer1 if answer1 is None else answer1, self.question2)


def turn2_prompt(prompt1: str, answer1: str, question2: str) -> str:
    """``prompt1 + " " + answer1 + " USER: " + question2 + " ASSISTANT:"`` (the byte-level
    pre-tokenizer splits before every space, so its tokens extend turn 1's prompt + answer)."""
    answer1 = answer1.strip()
    return f"{prompt1} {answer1} USER: {question2} ASSISTANT:" if answer1 else f"{prompt1} USER: {question2} ASSISTANT:"


def _second_spec(family: str, spec: Any, rng: random.Random) -> Any | None:
    """A spec with the same image content as ``spec`` and another question (None: none fits)."""
    kinds = {"chartqa": ("max", "min", "value", "colour", "diff"),
             "textvqa": ("word", "colour", "all") + (("number",) if getattr(spec, "number", None) is not None else ()),
             "vqav2": ("count_all",)}[family]
    others = [k for k in kinds if k != spec.kind]
    if not others:
        return None
    kind = rng.choice(others)
    return replace(spec, kind=kind, target="") if family == "vqav2" else replace(spec, kind=kind)


def make_conversation(split: str, index: int, seed: int = 0) -> Conversation:
    """The conversation at ``index`` of ``split``; a pure function of its arguments."""
    check_split(split)
    if index < 0:
        raise MMSpecError(f"index must be >= 0, got {index}")
    fam: Family = FAMILIES[BASE_FAMILIES[index % len(BASE_FAMILIES)]]
    rng = derive_rng(seed, NAME, split, index)
    for _ in range(_MAX_REDRAWS):
        spec1 = fam.draw_spec(rng)
        if split_of(fam.name, spec1) != split:
            continue
        spec2 = _second_spec(fam.name, spec1, rng)
        if spec2 is not None and split_of(fam.name, spec2) == split:
            break
    else:  # pragma: no cover - 10k misses of a 1% event
        raise AssertionError(f"no {split} conversation found for {fam.name}")
    r1, r2 = (random.Random(rng.getrandbits(64)) for _ in range(2))
    one = _render(fam, spec1, split, r1)
    two = _render(fam, spec2, split, r2)  # its pixels are dropped: the question is about turn 1's image
    return Conversation(uid=f"{NAME}-{split}-{index}", split=split, base_family=fam.name, images=one.images,
                        prompt1=one.prompt, question1=one.question or "", answer1=one.answer,
                        question2=two.question or "", answer2=two.answer, facts2=two.facts,
                        captions=one.captions)


def _render(fam: Family, spec: Any, split: str, rng: random.Random):
    """A Sample of ``fam`` for a given in-split ``spec``, its wording drawn from ``rng``
    (:func:`~mmspec.world.core.build_sample` does the template filling and article fixing)."""
    fixed = Family(fam.name, fam.n_images, lambda _r: spec, lambda s, _r: fam.render(s, rng), fam.description)
    return build_sample(fixed, split, 0, 0)


def generate_conversations(split: str, n: int, seed: int = 0, start: int = 0) -> list[Conversation]:
    """Conversations ``start .. start+n-1`` of ``split``."""
    return [make_conversation(split, i, seed) for i in range(start, start + n)]
