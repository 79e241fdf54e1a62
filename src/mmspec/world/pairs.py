"""The two-image families: spot_the_diff (describe what changed) and iedit (say how to edit).

spot_the_diff shows a busy scene of small shapes on a pale background, changed in one or two
places; iedit shows one big object (plus at most one small one) on a coloured background and a
single edit, stated as an instruction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from mmspec.world.core import Draft, pick, sentence
from mmspec.world.render import (
    BACKGROUNDS,
    COLOUR_NAMES,
    COLOURS,
    SHAPES,
    Obj,
    canvas,
    cell_centre,
    draw_shape,
    render_objects,
    where,
)
from mmspec.world.single import describe_scene

# ----------------------------------------------------------------------------- spot_the_diff


@dataclass(frozen=True)
class Change:
    kind: str  # "recolour" | "move" | "add" | "remove"
    before: Obj | None
    after: Obj | None


@dataclass(frozen=True)
class DiffSpec:
    background: str
    objs: tuple[Obj, ...]
    changes: tuple[Change, ...]


def _one_change(rng: random.Random, objs: list[Obj], touched: set[int]) -> Change:
    free = [c for c in range(9) if c not in {o.cell for o in objs} and c not in touched]
    movable = [o for o in objs if o.cell not in touched]
    kinds = ["add"] if free else []
    if movable:
        kinds += ["recolour", "remove"] + (["move"] if free else [])
    kind = rng.choice(kinds)
    if kind == "add":
        return Change(kind, None, Obj(rng.choice(COLOUR_NAMES), rng.choice(SHAPES), rng.choice(free)))
    o = rng.choice(movable)
    if kind == "recolour":
        return Change(kind, o, replace(o, colour=rng.choice([c for c in COLOUR_NAMES if c != o.colour])))
    if kind == "move":
        return Change(kind, o, replace(o, cell=rng.choice(free)))
    return Change(kind, o, None)


def draw_diff(rng: random.Random) -> DiffSpec:
    objs = [Obj(rng.choice(COLOUR_NAMES), rng.choice(SHAPES), c) for c in sorted(rng.sample(range(9), rng.randint(2, 5)))]
    # the changed objects must be unambiguous by name
    changes: list[Change] = []
    touched: set[int] = set()
    current = list(objs)
    for _ in range(rng.choice((1, 1, 2))):
        ch = _one_change(rng, current, touched)
        for o in (ch.before, ch.after):
            if o is not None:
                touched.add(o.cell)
        if ch.before is not None:
            current.remove(ch.before)
        if ch.after is not None:
            current.append(ch.after)
        changes.append(ch)
    return DiffSpec(rng.choice(("white", "grey", "cream")), tuple(objs), tuple(changes))


def apply_changes(objs: tuple[Obj, ...], changes: tuple[Change, ...]) -> tuple[Obj, ...]:
    out = list(objs)
    for ch in changes:
        if ch.before is not None:
            out.remove(ch.before)
        if ch.after is not None:
            out.append(ch.after)
    return tuple(sorted(out, key=lambda o: o.cell))


def _say_change(ch: Change, rng: random.Random) -> tuple[str, str, str]:
    """(sentence, subject fact, detail fact)."""
    b, a = ch.before, ch.after
    if ch.kind == "recolour":
        s = pick(rng, (f"the {b.name} {where(b.position)} has turned {a.colour}",
                       f"the {b.name} {where(b.position)} is {a.colour} in the second image",
                       f"the colour of the {b.name} {where(b.position)} changed to {a.colour}"))
        return s, b.name, a.colour
    if ch.kind == "move":
        s = pick(rng, (f"the {b.name} has moved from the {b.position} to the {a.position}",
                       f"the {b.name} is now {where(a.position)} instead of {where(b.position)}"))
        return s, b.name, a.position
    if ch.kind == "add":
        s = pick(rng, (f"a {a.name} has appeared {where(a.position)}",
                       f"a new {a.name} was added {where(a.position)}",
                       f"the second image has an extra {a.name} {where(a.position)}"))
        return s, a.name, a.position
    s = pick(rng, (f"the {b.name} {where(b.position)} is gone",
                   f"the {b.name} that was {where(b.position)} has been removed",
                   f"the second image is missing the {b.name} {where(b.position)}"))
    return s, b.name, b.position


def render_diff(spec: DiffSpec, rng: random.Random) -> Draft:
    bg = BACKGROUNDS[spec.background]
    after = apply_changes(spec.objs, spec.changes)
    # the same jitter for unchanged objects in both images: draw both from one seed
    jseed = rng.getrandbits(32)
    img1 = render_objects(list(spec.objs), random.Random(jseed), bg)
    img2 = render_objects(list(after), random.Random(jseed), bg)
    facts: dict[str, str] = {}
    said = []
    for k, ch in enumerate(spec.changes, 1):
        s, subject, detail = _say_change(ch, rng)
        facts[f"object_{k}"], facts[f"detail_{k}"] = subject, detail
        said.append(s)
    if len(said) == 1:
        head = pick(rng, ("There is one difference: ", "The two images differ in one place: ",
                          "Only one thing changed: "))
        body = head + said[0] + "."
    else:
        head = pick(rng, ("There are two differences. ", "The images differ in two ways. ",
                          "I notice two changes. "))
        body = head + f"First, {said[0]}. " + pick(rng, ("Second, ", "Also, ", "In addition, ")) + said[1] + "."
    rest = pick(rng, ("Everything else is the same.", "The rest of the scene is unchanged.",
                      "All other shapes stay where they were.", ""))
    answer = (body + " " + rest).strip()
    captions = [describe_scene(spec.objs), describe_scene(after)]
    return Draft([img1, img2], answer, facts, captions)


# ----------------------------------------------------------------------------- iedit

SIZES = {"small": 10, "big": 20}
EDIT_KINDS = ("recolour", "background", "move", "resize", "reshape", "add", "remove")


@dataclass(frozen=True)
class Scene:
    background: str
    main: Obj
    size: str  # "small" | "big"
    extra: Obj | None  # a small second object


@dataclass(frozen=True)
class EditSpec:
    source: Scene
    kind: str
    target: Scene


def draw_edit(rng: random.Random) -> EditSpec:
    bg = rng.choice(tuple(BACKGROUNDS))
    main = Obj(rng.choice(COLOUR_NAMES), rng.choice(SHAPES), rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 8)))
    size = rng.choice(tuple(SIZES))
    extra = None
    if rng.random() < 0.5:
        cells = [c for c in range(9) if abs(c // 3 - main.cell // 3) + abs(c % 3 - main.cell % 3) >= 2]
        extra = Obj(rng.choice([c for c in COLOUR_NAMES if c != main.colour]), rng.choice(SHAPES), rng.choice(cells))
    src = Scene(bg, main, size, extra)
    kinds = [k for k in EDIT_KINDS if (k != "remove" or extra) and (k != "add" or not extra)]
    kind = rng.choice(kinds)
    if kind == "recolour":
        tgt = replace(src, main=replace(main, colour=rng.choice([c for c in COLOUR_NAMES if c != main.colour])))
    elif kind == "background":
        tgt = replace(src, background=rng.choice([b for b in BACKGROUNDS if b != bg]))
    elif kind == "move":
        taken = {main.cell} | ({extra.cell} if extra else set())
        tgt = replace(src, main=replace(main, cell=rng.choice([c for c in range(9) if c not in taken])))
    elif kind == "resize":
        tgt = replace(src, size="big" if size == "small" else "small")
    elif kind == "reshape":
        tgt = replace(src, main=replace(main, shape=rng.choice([s for s in SHAPES if s != main.shape])))
    elif kind == "add":
        cells = [c for c in range(9) if abs(c // 3 - main.cell // 3) + abs(c % 3 - main.cell % 3) >= 2]
        new = Obj(rng.choice([c for c in COLOUR_NAMES if c != main.colour]), rng.choice(SHAPES), rng.choice(cells))
        tgt = replace(src, extra=new)
    else:
        tgt = replace(src, extra=None)
    return EditSpec(src, kind, tgt)


def _centre(obj: Obj) -> tuple[int, int]:
    """Big objects need room: pull edge cells 6 px toward the middle."""
    cx, cy = cell_centre(obj.cell)
    return cx + (cx < 48) * 6 - (cx > 48) * 6, cy + (cy < 48) * 6 - (cy > 48) * 6


def render_scene(scene: Scene, jx: int, jy: int):
    img, draw = canvas(BACKGROUNDS[scene.background])
    cx, cy = _centre(scene.main)
    draw_shape(draw, scene.main.shape, COLOURS[scene.main.colour], cx + jx, cy + jy, SIZES[scene.size])
    if scene.extra is not None:
        ex, ey = cell_centre(scene.extra.cell)
        draw_shape(draw, scene.extra.shape, COLOURS[scene.extra.colour], ex, ey, 8)
    return img


def describe_edit_scene(scene: Scene) -> str:
    s = f"a {scene.size} {scene.main.name} {where(scene.main.position)} on a {scene.background} background"
    if scene.extra is not None:
        s += f", with a small {scene.extra.name} {where(scene.extra.position)}"
    return s


def _instruction(spec: EditSpec, rng: random.Random) -> tuple[str, dict[str, str]]:
    s, t, m = spec.source, spec.target, spec.source.main
    if spec.kind == "recolour":
        c = t.main.colour
        text = pick(rng, (f"Change the colour of the {m.name} to {c}.", f"Recolour the {m.shape} from {m.colour} to {c}.",
                          f"Make the {m.name} {c} instead."))
        return text, {"object": m.shape, "colour": c}
    if spec.kind == "background":
        b = t.background
        text = pick(rng, (f"Change the background from {s.background} to {b}.", f"Paint the background {b}.",
                          f"Replace the {s.background} background with a {b} one."))
        return text, {"background": b}
    if spec.kind == "move":
        p = t.main.position
        text = pick(rng, (f"Move the {m.name} to the {p}.", f"Shift the {m.shape} from the {m.position} to the {p}.",
                          f"Drag the {m.name} so that it sits {where(p)}."))
        return text, {"object": m.shape, "position": p}
    if spec.kind == "resize":
        z = t.size
        verb = "Enlarge" if z == "big" else "Shrink"
        text = pick(rng, (f"{verb} the {m.name} so it is {z}.", f"Make the {m.name} {z}.",
                          f"Resize the {m.shape}: it should be {z} in the target."))
        return text, {"object": m.shape, "size": z}
    if spec.kind == "reshape":
        sh = t.main.shape
        text = pick(rng, (f"Replace the {m.name} with a {m.colour} {sh}.",
                          f"Turn the {m.shape} into a {sh}, keeping it {m.colour}.",
                          f"Change the shape of the {m.name} to a {sh}."))
        return text, {"shape": sh}
    if spec.kind == "add":
        e = t.extra
        text = pick(rng, (f"Add a small {e.name} {where(e.position)}.", f"Draw a {e.name} {where(e.position)}.",
                          f"Insert a small {e.name} {where(e.position)} of the image."))
        return text, {"object": e.name, "position": e.position}
    e = s.extra
    text = pick(rng, (f"Remove the small {e.name} {where(e.position)}.", f"Delete the {e.name}.",
                      f"Erase the {e.name} from the {e.position}."))
    return text, {"object": e.name}


def render_edit(spec: EditSpec, rng: random.Random) -> Draft:
    jx, jy = rng.randint(-2, 2), rng.randint(-2, 2)
    images = [render_scene(spec.source, jx, jy), render_scene(spec.target, jx, jy)]
    text, facts = _instruction(spec, rng)
    tail = pick(rng, ("", " Keep everything else as it is.", " Leave the rest of the image unchanged.",
                      " Nothing else needs to change."))
    return Draft(images, sentence(text) + tail, facts, [describe_edit_scene(spec.source), describe_edit_scene(spec.target)])
