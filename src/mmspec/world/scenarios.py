"""Scenario variants of the world's families, made to tell the draft views apart (TABED's and
the IbED paper's scenario-dependence): the eight families favour the multimodal view everywhere,
so an ensemble whose weights adapt has nothing to adapt to there.

- ``vqav2_inverted``, ``chartqa_inverted``: the family's images with their colours inverted, a
  palette neither model was trained on (out of distribution for the draft's vision and the
  target's alike; the text views never see it);
- ``vqav2_scrambled``: the image's halves swapped (rolled by half its width and height): the
  layout the models learned, broken;
- ``followup``: a text turn after an image turn: turn 1's prompt (vqav2), its reference answer,
  then the same question asked again (``USER: {question} ASSISTANT:``); what the answer needs is
  already in the text;
- ``vist_long``: ten images: one VIST story with its ending told, then another story to end, so
  the draft's context holds twice the images it was trained on.

Determinism and splits, as the families' (:mod:`mmspec.world.core`): a scenario sample is a pure
function of ``(name, split, index, seed)``, built from its base family's samples of the same
split only (``vist_long`` uses story ``index`` and story ``index + SECOND_STORY``), so no test
scenario holds a train sample's content. The scenarios are kept out of
:data:`mmspec.world.FAMILIES` (the tokenizer corpus and the shipped models' recipes iterate
those); their text is the families' own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from PIL import Image, ImageChops, ImageOps

from mmspec.errors import MMSpecError
from mmspec.world.core import Sample

SECOND_STORY = 100_000  # vist_long's second story: index + this, in the same split


@dataclass(frozen=True)
class Scenario:
    """A variant of a base family: ``make(split, index, seed) -> Sample``."""

    name: str
    base: str
    n_images: int
    make: Callable[[str, int, int], Sample]
    description: str = ""


def _base(family: str, split: str, index: int, seed: int) -> Sample:
    from mmspec.world import make_sample

    return make_sample(family, split, index, seed)


def invert(img: Image.Image) -> Image.Image:
    """Colours inverted (RGB)."""
    return ImageOps.invert(img.convert("RGB"))


def scramble(img: Image.Image) -> Image.Image:
    """Rolled by half the width and half the height: the quadrants swap diagonally."""
    w, h = img.size
    return ImageChops.offset(img.convert("RGB"), w // 2, h // 2)


def _transformed(family: str, fn: Callable[[Image.Image], Image.Image], tag: str):
    def make(split: str, index: int, seed: int) -> Sample:
        s = _base(family, split, index, seed)
        return replace(s, uid=f"{family}_{tag}-{split}-{index}", family=f"{family}_{tag}",
                       images=[fn(im) for im in s.images])
    return make


def _followup(split: str, index: int, seed: int) -> Sample:
    s = _base("vqav2", split, index, seed)
    prompt = f"{s.prompt} {s.answer} USER: {s.question} ASSISTANT:"
    return replace(s, uid=f"followup-{split}-{index}", family="followup", prompt=prompt)


def _vist_long(split: str, index: int, seed: int) -> Sample:
    a, b = _base("vist", split, index, seed), _base("vist", split, index + SECOND_STORY, seed)
    end = " ASSISTANT:"
    if not (a.prompt.endswith(end) and b.prompt.startswith("USER: ")):
        raise MMSpecError("the vist template changed: vist_long needs prompts 'USER: ... ASSISTANT:'")
    prompt = f"{a.prompt[:-len(end)]} {a.answer} {b.prompt[len('USER: '):]}"
    return replace(b, uid=f"vist_long-{split}-{index}", family="vist_long", prompt=prompt,
                   images=a.images + b.images, captions=a.captions + b.captions)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("vqav2_inverted", "vqav2", 1, _transformed("vqav2", invert, "inverted"),
                 "vqav2 with inverted colours (out of distribution)"),
        Scenario("chartqa_inverted", "chartqa", 1, _transformed("chartqa", invert, "inverted"),
                 "chartqa with inverted colours (out of distribution)"),
        Scenario("vqav2_scrambled", "vqav2", 1, _transformed("vqav2", scramble, "scrambled"),
                 "vqav2 with the image's halves swapped (layout out of distribution)"),
        Scenario("followup", "vqav2", 1, _followup, "a text turn after an image turn: the question asked again"),
        Scenario("vist_long", "vist", 10, _vist_long, "ten images: a told story, then another to end"),
    )
}


def make_scenario_sample(name: str, split: str, index: int, seed: int = 0) -> Sample:
    """The sample at ``index`` of scenario ``name``'s ``split``; a pure function of its arguments."""
    try:
        sc = SCENARIOS[name]
    except KeyError:
        raise MMSpecError(f"unknown scenario {name!r}; use one of {', '.join(SCENARIOS)}") from None
    return sc.make(split, index, seed)


def generate_scenario_samples(name: str, split: str, n: int, seed: int = 0, start: int = 0) -> list[Sample]:
    """Samples ``start .. start+n-1`` of one scenario and split."""
    return [make_scenario_sample(name, split, i, seed) for i in range(start, start + n)]
