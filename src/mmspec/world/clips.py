"""The video families: motion (one shape moves, or keeps still) and order (shapes appear one by one).

Each family is a ``draw_*`` (the clip's spec: what is there, what moves or appears and when; the
question is drawn at render time, see :mod:`mmspec.world.video`) and a ``render_*`` (8 frames of
96 px flat shapes on white, drawn like the image families', and a verbose answer whose wording
varies while its facts stay fixed). Every word of their text is a whole word of the world
tokenizer's vocabulary (tested), so the shipped tokenizer reads it without new merges.

- motion: a shape slides one or two grid cells left, right, up or down over the clip (linearly,
  from frame 0 to the last), or keeps still; half the clips add a second shape that keeps still.
  Key fact: ``"{colour} {shape} moved {direction}"`` or ``"{colour} {shape} kept still"``.
- order: the first frame is empty; then 2-4 shapes of distinct colours appear one at a time, each
  in its own cell, at distinct frames, and stay. Key fact: the order, ``"red circle, blue star
  and green square"``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from mmspec.world.core import pick, sentence
from mmspec.world.render import (
    COLOUR_NAMES,
    COLOURS,
    GRID,
    POSITIONS,
    SHAPES,
    WHITE,
    Obj,
    canvas,
    cell_centre,
    draw_shape,
    where,
)
from mmspec.world.single import describe_scene
from mmspec.world.video import N_FRAMES, VideoDraft

DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
STILL = "still"
_STEP = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (row, col) per cell


def _listing(names: list[str]) -> str:
    """'red circle, blue star and green square'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclass(frozen=True)
class _Look:
    """How one object is drawn in every frame of a clip: a fixed pixel offset and radius."""

    dx: int
    dy: int
    r: int


def _look(rng: random.Random, jitter: int = 2) -> _Look:
    return _Look(rng.randint(-jitter, jitter), rng.randint(-jitter, jitter), rng.choice((11, 12)))


def _draw(draw: ImageDraw.ImageDraw, obj: Obj, look: _Look, cx: float, cy: float) -> None:
    draw_shape(draw, obj.shape, COLOURS[obj.colour], cx + look.dx, cy + look.dy, look.r)


# ----------------------------------------------------------------------------- motion


@dataclass(frozen=True)
class MotionSpec:
    mover: Obj  # the shape that moves (or keeps still), in its start cell
    direction: str  # one of DIRECTIONS, or STILL
    steps: int  # grid cells travelled: 1 or 2 (0 when still)
    other: Obj | None  # a shape of another colour that keeps still, off the mover's path

    @property
    def cells(self) -> tuple[int, ...]:
        """The cells the mover passes through, start first, end last."""
        row, col = divmod(self.mover.cell, GRID)
        dr, dc = _STEP.get(self.direction, (0, 0))
        return tuple((row + dr * k) * GRID + col + dc * k for k in range(self.steps + 1))

    @property
    def end(self) -> str:
        return POSITIONS[self.cells[-1]]


def _room(cell: int, direction: str) -> int:
    """How many cells a shape in ``cell`` can move in ``direction`` without leaving the grid."""
    row, col = divmod(cell, GRID)
    return {"left": col, "right": GRID - 1 - col, "up": row, "down": GRID - 1 - row}[direction]


def draw_motion(rng: random.Random) -> MotionSpec:
    """The direction first (uniform over the four and still), then a start cell with room for it."""
    direction = rng.choice(DIRECTIONS + (STILL,))
    if direction == STILL:
        cell, steps = rng.randrange(GRID * GRID), 0
    else:
        cell = rng.choice([c for c in range(GRID * GRID) if _room(c, direction) > 0])
        steps = rng.randint(1, _room(cell, direction))
    colour, shape = rng.choice(COLOUR_NAMES), rng.choice(SHAPES)
    spec = MotionSpec(Obj(colour, shape, cell), direction, steps, None)
    if rng.random() < 0.5:
        free = [c for c in range(GRID * GRID) if c not in spec.cells]
        other = Obj(rng.choice([c for c in COLOUR_NAMES if c != colour]), rng.choice(SHAPES), rng.choice(free))
        spec = MotionSpec(spec.mover, direction, steps, other)
    return spec


def _motion_frames(spec: MotionSpec, rng: random.Random) -> list[Image.Image]:
    look = _look(rng)
    other_look = _look(rng) if spec.other is not None else None
    (x0, y0), (x1, y1) = cell_centre(spec.cells[0]), cell_centre(spec.cells[-1])
    frames = []
    for k in range(N_FRAMES):
        img, draw = canvas(WHITE)
        if spec.other is not None:
            _draw(draw, spec.other, other_look, *cell_centre(spec.other.cell))
        a = k / (N_FRAMES - 1)  # linear from the start cell's centre (frame 0) to the end's (last)
        _draw(draw, spec.mover, look, x0 + a * (x1 - x0), y0 + a * (y1 - y0))
        frames.append(img)
    return frames


def render_motion(spec: MotionSpec, rng: random.Random) -> VideoDraft:
    frames = _motion_frames(spec, rng)
    n, d = spec.mover.name, spec.direction
    start, end = spec.mover.position, spec.end
    scene = describe_scene(tuple(sorted((spec.mover,) + ((spec.other,) if spec.other else ()), key=lambda o: o.cell)))
    seen = pick(rng, (f"The first image shows {scene}.", f"In the first image there is {scene}.",
                      f"Looking at the first image, I see {scene}."))
    if d == STILL:
        key = f"{n} kept still"
        motion = pick(rng, (f"The {key} {where(start)} in all the images.",
                            f"Nothing moved: the {key} {where(start)}.",
                            f"Then the {key} and was {where(start)} in all the images."))
    else:
        key = f"{n} moved {d}"
        motion = pick(rng, (f"Then the {key}, from the {start} to the {end}.",
                            f"In the next images the {key} until it was {where(end)}.",
                            f"Image by image the {key} and stopped {where(end)}."))
    rest = ""
    if spec.other is not None:
        o = spec.other
        rest = pick(rng, (f"The {o.name} kept still {where(o.position)}.",
                          f"The {o.name} was {where(o.position)} in all the images."))
    kind = rng.choice(("direction", "direction", "end", "start"))
    if kind == "direction":
        question = pick(rng, (f"Does the {n} move left, right, up or down, or does it stay still?",
                              f"How does the {n} move?", f"Where does the {n} move to?"))
        if d == STILL:
            end_sentence = pick(rng, (f"So the {n} kept still.", "The answer is that it kept still.",
                                      "So it kept still."))
        else:
            end_sentence = pick(rng, (f"So the {n} moved {d}.", f"The answer is {d}.", f"So it moved {d}."))
        facts = {"direction": d, "start": start, "end": end}
    elif kind == "end":
        question = pick(rng, (f"Where is the {n} at the end?", f"Where is the {n} in the last image?"))
        end_sentence = pick(rng, (f"So in the last image the {n} is {where(end)}.", f"The answer is {end}.",
                                  f"So at the end the {n} is {where(end)}."))
        facts = {"end": end, "direction": d, "start": start}
    else:
        question = pick(rng, (f"Where was the {n} at first?", f"Where was the {n} in the first image?"))
        end_sentence = pick(rng, (f"So in the first image the {n} was {where(start)}.", f"The answer is {start}.",
                                  f"So at first the {n} was {where(start)}."))
        facts = {"start": start, "direction": d, "end": end}
    answer = " ".join(t for t in (seen, motion, rest, end_sentence) if t)
    caption = f"a {key} from the {start} to the {end}" if d != STILL else f"a {key} {where(start)}"
    if spec.other is not None:
        caption += f" and a {spec.other.name} kept still {where(spec.other.position)}"
    return VideoDraft(frames, question, answer, facts, key, caption)


# ----------------------------------------------------------------------------- order


@dataclass(frozen=True)
class OrderSpec:
    objs: tuple[Obj, ...]  # in the order they appear; distinct colours, distinct cells
    frames: tuple[int, ...]  # the frame each appears in (and stays): strictly increasing, >= 1


def draw_order(rng: random.Random) -> OrderSpec:
    n = rng.randint(2, 4)
    colours = rng.sample(COLOUR_NAMES, n)
    cells = rng.sample(range(GRID * GRID), n)
    objs = tuple(Obj(c, rng.choice(SHAPES), cell) for c, cell in zip(colours, cells))
    return OrderSpec(objs, tuple(sorted(rng.sample(range(1, N_FRAMES), n))))


def _order_frames(spec: OrderSpec, rng: random.Random) -> list[Image.Image]:
    looks = [_look(rng) for _ in spec.objs]
    frames = []
    for k in range(N_FRAMES):
        img, draw = canvas(WHITE)
        for obj, look, at in zip(spec.objs, looks, spec.frames):
            if k >= at:
                _draw(draw, obj, look, *cell_centre(obj.cell))
        frames.append(img)
    return frames


def render_order(spec: OrderSpec, rng: random.Random) -> VideoDraft:
    frames = _order_frames(spec, rng)
    names = [o.name for o in spec.objs]
    order, count = _listing(names), len(names)
    scene = describe_scene(tuple(sorted(spec.objs, key=lambda o: o.cell)))
    empty = pick(rng, ("The first image shows an empty background.", "The first image is empty.",
                       "The scene is empty in the first image."))
    appear = pick(rng, (f"Then shapes appeared one by one: {order}.", f"Then new shapes appeared one by one: {order}.",
                        f"One by one, shapes appeared: {order}."))
    last_image = pick(rng, (f"In the last image there are {count} shapes: {scene}.",
                            f"The last image shows {count} shapes: {scene}.",
                            f"In the end the scene has {count} shapes: {scene}."))
    kind = rng.choice(("first", "second", "last", "count"))
    if kind in ("first", "second", "last"):
        name = names[{"first": 0, "second": 1, "last": -1}[kind]]
        question = pick(rng, (f"Which shape appeared {kind}?", f"What appeared {kind} in the images?"))
        end = pick(rng, (f"So the {name} appeared {kind}.", f"The answer is the {name}.",
                         f"So the {kind} shape was the {name}."))
        facts = {kind: name}
    else:
        question = pick(rng, ("How many shapes appeared?", "How many shapes came into the scene?"))
        end = pick(rng, (f"So {count} shapes appeared.", f"Counting them, {count} shapes appeared in total.",
                         f"The answer is {count}."))
        facts = {"count": str(count)}
    for key, value in (("first", names[0]), ("last", names[-1]), ("count", str(count))):
        facts.setdefault(key, value)
    answer = " ".join((empty, sentence(appear), last_image, end))
    caption = f"shapes appeared one by one: {describe_scene(spec.objs)}"  # in order of appearance
    return VideoDraft(frames, question, answer, facts, order, caption)
