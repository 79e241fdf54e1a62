"""The four single-image families: chartqa, textvqa, vqav2, hallusionbench.

Each family is a ``draw_*`` (spec: the semantic content and the question) and a ``render_*``
(pixels + a verbose answer whose wording varies while its facts stay fixed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mmspec.world.core import IMAGE_SIZE, Draft, pick, sentence
from mmspec.world.render import (
    COLOUR_NAMES,
    COLOURS,
    PLURAL,
    SHAPES,
    Obj,
    canvas,
    draw_centred_text,
    fit_font_size,
    render_bar_chart,
    render_objects,
    text_colour_on,
    where,
)

CHART_LABELS = ("cat", "dog", "sun", "car", "box", "hat", "pen", "cup", "tea", "map", "bus", "egg")
SIGN_WORDS = (
    "STOP", "OPEN", "EXIT", "SALE", "CAFE", "BUS", "TAXI", "PARK", "BANK", "HOTEL",
    "SHOP", "BOOK", "FOOD", "MILK", "TEA", "GAS", "INN", "ZOO", "FARM", "GOLF",
    "PIZZA", "BAR", "WAY", "LEFT", "RIGHT", "SLOW", "PUSH", "PULL", "HELP", "WIFI",
    "LAB", "GYM", "SPA", "ART", "FIRE", "POST", "BAKE", "FISH", "MAP", "TOYS",
)  # fmt: skip
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")

# ----------------------------------------------------------------------------- chartqa


@dataclass(frozen=True)
class ChartSpec:
    labels: tuple[str, ...]
    values: tuple[int, ...]  # distinct, 1..10
    colours: tuple[str, ...]
    kind: str  # "max" | "min" | "value" | "colour" | "diff"
    a: int  # bar the question is about (value / colour / diff)
    b: int  # second bar (diff)


def draw_chart(rng: random.Random) -> ChartSpec:
    n = rng.choice((3, 4))
    a, b = rng.sample(range(n), 2)
    return ChartSpec(
        labels=tuple(rng.sample(CHART_LABELS, n)),
        values=tuple(rng.sample(range(1, 11), n)),
        colours=tuple(rng.sample(COLOUR_NAMES, n)),
        kind=rng.choice(("max", "min", "value", "value", "colour", "diff")),
        a=a,
        b=b,
    )


def _chart_listing(spec: ChartSpec, rng: random.Random) -> str:
    # Each value right after its label ("egg 4"): a later lookup ends on the label and the value
    # follows it. In text alone a small LM learned that form within 150 steps and not the "egg is
    # 4 ... value of egg is" one, whose last token stands before every value of the reading
    # (docs/results/lookup-form-2026-11-23/; in the world it was not learned within 50 CPU minutes).
    parts = [f"{lab} {val}" for lab, val in zip(spec.labels, spec.values)]
    body = ", ".join(parts[:-1]) + f" and {parts[-1]}"
    head = pick(rng, ("The chart has {n} bars: ", "There are {n} bars in the chart: ",
                      "Reading the bar chart, I see {n} bars: ", "The bar chart shows {n} values: "))
    return head.format(n=len(spec.values)) + body + "."


def render_chart(spec: ChartSpec, rng: random.Random) -> Draft:
    img = render_bar_chart(list(spec.labels), list(spec.values), list(spec.colours))
    listing = _chart_listing(spec, rng)
    la, va, ca = spec.labels[spec.a], spec.values[spec.a], spec.colours[spec.a]
    if spec.kind in ("max", "min"):
        k = max if spec.kind == "max" else min
        i = spec.values.index(k(spec.values))
        lab, val, col = spec.labels[i], str(spec.values[i]), spec.colours[i]
        word = "highest" if spec.kind == "max" else "lowest"
        question = pick(rng, (f"Which bar has the {word} value?", f"Which label has the {word} value in the chart?",
                              f"Which category is the {word}?"))
        tall = "tallest" if spec.kind == "max" else "shortest"
        body = pick(rng, (f"The {tall} bar is the {col} one: {lab} {val}.",
                          f"Comparing the heights, the {col} bar {lab} {val} is the {tall}.",
                          f"Of these, {lab} {val} has the {word} value, drawn as the {col} bar."))
        end = pick(rng, (f"So the answer is {lab}.", f"Therefore the answer is {lab}.", f"The answer is {lab}."))
        facts = {"label": lab, "value": val, "colour": col}
    elif spec.kind == "value":
        question = pick(rng, (f"What is the value of {la}?", f"What value does the bar for {la} show?",
                              f"How high is the {la} bar?"))
        # the lookup comes right after the reading, the asked label right before its value, as in
        # the scene lookups. (A sentence naming the bar's colour stood between them before d7a7352;
        # taking it out did not change what the practice learned: docs/results/lookup-target-2026-11-24/.)
        body = ""
        end = pick(rng, (f"So the asked bar is {la} {va}.", f"The answer is {la} {va}.",
                         f"For the asked bar that gives {la} {va}."))
        facts = {"value": str(va)}
    elif spec.kind == "colour":
        question = pick(rng, (f"What colour is the bar for {la}?", f"Which colour is used for {la}?"))
        body = pick(rng, (f"The bar {la} {va} is drawn in {ca}.",
                          f"Looking under the x axis, {la} {va} has a {ca} bar."))
        end = pick(rng, (f"So the bar is {ca}.", f"The answer is {ca}.", f"Therefore the colour is {ca}."))
        facts = {"colour": ca, "value": str(va)}
    else:  # diff
        lb, vb = spec.labels[spec.b], spec.values[spec.b]
        d = abs(va - vb)
        question = pick(rng, (f"What is the difference between {la} and {lb}?",
                              f"How much larger is the bigger of {la} and {lb}?"))
        body = pick(rng, (f"Of the two, {la} {va} and {lb} {vb}, so the difference is {max(va, vb)} minus {min(va, vb)}, which is {d}.",
                          f"The values are {la} {va} and {lb} {vb}. Subtracting the smaller from the larger gives {d}."))
        end = pick(rng, (f"The answer is {d}.", f"So the difference is {d}."))
        facts = {"difference": str(d)}
    answer = " ".join((listing, sentence(body), end) if body else (listing, end))
    caption = "a bar chart: " + ", ".join(f"{c} {lab} {v}" for lab, v, c in zip(spec.labels, spec.values, spec.colours))
    return Draft([img], answer, facts, [caption], question)


# ----------------------------------------------------------------------------- textvqa


@dataclass(frozen=True)
class SignSpec:
    word: str
    number: int | None  # 0..20 on a second line, or none
    colour: str
    kind: str  # "word" | "number" | "colour" | "all"


def draw_sign(rng: random.Random) -> SignSpec:
    number = rng.randint(0, 20) if rng.random() < 0.5 else None
    kinds = ("word", "colour", "all") + (("number", "number") if number is not None else ())
    return SignSpec(rng.choice(SIGN_WORDS), number, rng.choice(COLOUR_NAMES), rng.choice(kinds))


def _sign_image(spec: SignSpec, rng: random.Random):
    img, draw = canvas((225, 225, 225))
    rgb = COLOURS[spec.colour]
    ink = text_colour_on(rgb)
    h = 34 if spec.number is None else 58
    x0, y0 = 8 + rng.randint(-3, 3), (IMAGE_SIZE - h) // 2 + rng.randint(-6, 6)
    draw.rectangle((x0 - 2, y0 + h, x0 + 2, 95), fill=(90, 90, 90))  # the pole
    draw.rectangle((x0 + 34, y0 + h, x0 + 38, 95), fill=(90, 90, 90))
    draw.rounded_rectangle((x0, y0, x0 + 80, y0 + h), radius=6, fill=rgb)
    size = fit_font_size(spec.word, 72, 24)
    draw_centred_text(draw, spec.word, x0 + 40, y0 + 17, size, ink)
    if spec.number is not None:
        draw_centred_text(draw, str(spec.number), x0 + 40, y0 + 42, 20, ink)
    return img


def render_sign(spec: SignSpec, rng: random.Random) -> Draft:
    img = _sign_image(spec, rng)
    w, c, n = spec.word, spec.colour, spec.number
    text = w if n is None else f"{w} {n}"
    seen = pick(rng, (f"The image shows a {c} sign", f"There is a {c} sign in the picture",
                      f"I can see a {c} sign on a pole"))
    if n is None:
        seen += pick(rng, (f" with the word {w} written on it.", f" that reads {w}.", f" with {w} in large letters."))
    else:
        seen += pick(rng, (f" with the word {w} and the number {n} under it.", f" that reads {w} on top and {n} below.",
                           f". The top line says {w} and the bottom line shows {n}."))
    if spec.kind == "word":
        question = pick(rng, ("What word is written on the sign?", "What does the sign say?", "What is the word on the sign?"))
        end = pick(rng, (f"So the word is {w}.", f"The answer is {w}.", f"Therefore the sign says {w}."))
        facts = {"word": w}
    elif spec.kind == "number":
        question = pick(rng, ("What number is on the sign?", "Which number is shown on the sign?"))
        end = pick(rng, (f"So the number is {n}.", f"The answer is {n}."))
        facts = {"number": str(n)}
    elif spec.kind == "colour":
        question = pick(rng, ("What colour is the sign?", f"What colour is the sign that says {w}?"))
        end = pick(rng, (f"So the sign is {c}.", f"The answer is {c}."))
        facts = {"colour": c}
    else:
        question = pick(rng, ("What is written on the sign?", "What text can you read in the image?"))
        end = pick(rng, (f"Reading all of it, the text is {text}.", f"So the full text is {text}."))
        facts = {"text": text}
    facts.setdefault("word", w)
    caption = f"a {c} sign that says {text}"
    return Draft([img], f"{seen} {end}", facts, [caption], question)


# ----------------------------------------------------------------------------- object scenes


def draw_scene(rng: random.Random, n_min: int = 1, n_max: int = 5) -> tuple[Obj, ...]:
    """1-5 objects in distinct cells; colours and shapes from small per-scene pools so repeats occur."""
    n = rng.randint(n_min, n_max)
    colours = rng.sample(COLOUR_NAMES, rng.randint(2, 4))
    shapes = rng.sample(SHAPES, rng.randint(2, 4))
    cells = sorted(rng.sample(range(9), n))
    return tuple(Obj(rng.choice(colours), rng.choice(shapes), cell) for cell in cells)


def describe_scene(objs: tuple[Obj, ...]) -> str:
    """'a red circle in the top left and a blue star at the bottom'."""
    parts = [f"a {o.name} {where(o.position)}" for o in objs]
    if not parts:
        return "an empty background"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def count_phrase(k: int, noun: str, plural: str) -> str:
    return f"{k} {noun if k == 1 else plural}"


@dataclass(frozen=True)
class VqaSpec:
    objs: tuple[Obj, ...]
    kind: str  # "colour_of" | "count_colour" | "count_shape" | "count_all" | "position" | "shape_at"
    target: str  # the shape / colour / cell the question names


def draw_vqa(rng: random.Random) -> VqaSpec:
    objs = draw_scene(rng)
    unique_shapes = [o.shape for o in objs if sum(p.shape == o.shape for p in objs) == 1]
    unique_names = [o.name for o in objs if sum(p.name == o.name for p in objs) == 1]
    options = ["count_colour", "count_shape", "count_all", "shape_at"]
    if unique_shapes:
        options.append("colour_of")
    if unique_names:
        options.append("position")
    kind = rng.choice(options)
    if kind == "colour_of":
        target = rng.choice(unique_shapes)
    elif kind == "position":
        target = rng.choice(unique_names)
    elif kind == "count_colour":
        target = rng.choice([o.colour for o in objs] + [rng.choice(COLOUR_NAMES)])
    elif kind == "count_shape":
        target = rng.choice([o.shape for o in objs] + [rng.choice(SHAPES)])
    elif kind == "shape_at":
        target = rng.choice(objs).position
    else:
        target = ""
    return VqaSpec(objs, kind, target)


# the order of an object's words in a lookup question's reading: the question's key, then its answer
LOOKUP_ORDER = {"colour_of": ("shape", "colour", "position"),   # "star blue top left"
                "position": ("colour", "shape", "position"),    # "red circle top left" (the name is the key)
                "shape_at": ("position", "shape", "colour")}    # "top left star blue"


def _lookup_listing(objs: tuple[Obj, ...], order: tuple[str, str, str]) -> str:
    """'star blue top left, circle red bottom and ...': each object's words in ``order``."""
    parts = [" ".join(getattr(o, a) for a in order) for o in objs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _lookup_end(rng: random.Random, what: str, key_value: str) -> str:
    """The final sentence of a lookup answer: the key, then the value (``key_value``)."""
    return pick(rng, (f"So the asked {what} is {key_value}.", f"The answer is {key_value}.",
                      f"For the asked {what} that gives {key_value}."))


def render_vqa(spec: VqaSpec, rng: random.Random) -> Draft:
    objs, t = spec.objs, spec.target
    img = render_objects(list(objs), rng)
    n = len(objs)
    head = pick(rng, (f"The image shows {count_phrase(n, 'object', 'objects')}: ",
                      f"I can see {count_phrase(n, 'shape', 'shapes')} on a white background: ",
                      "Looking at the picture, I find "))
    # A lookup question's reading lists each object key first, the asked value right after it, and
    # the final sentence repeats the key and then the value (as a chart's "So the asked bar is hat
    # 5"): a small LM learned that lookup and not one with words between key and value
    # (docs/results/lookup-form-2026-11-23/). Counting is not a lookup and keeps the plain scene.
    seen = head + (_lookup_listing(objs, LOOKUP_ORDER[spec.kind]) if spec.kind in LOOKUP_ORDER
                   else describe_scene(objs)) + "."
    if spec.kind == "colour_of":
        o = next(o for o in objs if o.shape == t)
        question = pick(rng, (f"What colour is the {t}?", f"Which colour does the {t} have?"))
        end = _lookup_end(rng, "shape", f"{t} {o.colour}")
        facts = {"colour": o.colour}
    elif spec.kind == "position":
        o = next(o for o in objs if o.name == t)
        question = pick(rng, (f"Where is the {t}?", f"In which part of the image is the {t}?"))
        end = _lookup_end(rng, "shape", f"{t} {o.position}")
        facts = {"position": o.position, "colour": o.colour}
    elif spec.kind == "shape_at":
        o = next(o for o in objs if o.position == t)
        question = pick(rng, (f"What shape is {where(t)}?", f"Which shape can be seen {where(t)}?"))
        end = _lookup_end(rng, "place", f"{t} {o.shape}")
        facts = {"shape": o.shape}
    else:
        if spec.kind == "count_colour":
            k = sum(o.colour == t for o in objs)
            question = pick(rng, (f"How many {t} objects are there?", f"How many {t} shapes are in the image?"))
            thing = f"{t} objects" if k != 1 else f"{t} object"
            facts = {"count": str(k), "colour": t}
        elif spec.kind == "count_shape":
            k = sum(o.shape == t for o in objs)
            question = pick(rng, (f"How many {PLURAL[t]} are there?", f"How many {PLURAL[t]} can you see?"))
            thing = PLURAL[t] if k != 1 else t
            facts = {"count": str(k)}
        else:
            k = n
            question = pick(rng, ("How many objects are in the image?", "How many shapes are there in total?"))
            thing = "objects" if k != 1 else "object"
            facts = {"count": str(k)}
        end = pick(rng, (f"Counting them, there are {k} {thing}.", f"So the count is {k} {thing}.",
                         f"That makes {k} {thing} in total. The answer is {k}."))
    caption = describe_scene(objs)
    return Draft([img], f"{seen} {end}", facts, [caption], question)


# ----------------------------------------------------------------------------- hallusionbench


@dataclass(frozen=True)
class HalluSpec:
    objs: tuple[Obj, ...]
    kind: str  # "exists" | "count_claim"
    colour: str
    shape: str
    claim: int  # claimed count for "count_claim"


def draw_hallu(rng: random.Random) -> HalluSpec:
    objs = draw_scene(rng, 1, 4)
    kind = rng.choice(("exists", "exists", "count_claim"))
    if kind == "exists":
        if rng.random() < 0.5:
            o = rng.choice(objs)
            return HalluSpec(objs, kind, o.colour, o.shape, 0)
        # a near miss: shares the colour or the shape of something that is there
        names = {o.name for o in objs}
        base = rng.choice(objs)
        while True:
            c = base.colour if rng.random() < 0.5 else rng.choice(COLOUR_NAMES)
            s = rng.choice(SHAPES) if c == base.colour else base.shape
            if f"{c} {s}" not in names:
                return HalluSpec(objs, kind, c, s, 0)
    shape = rng.choice([o.shape for o in objs])
    true = sum(o.shape == shape for o in objs)
    claim = true if rng.random() < 0.5 else rng.choice([k for k in range(1, 6) if k != true])
    return HalluSpec(objs, kind, "", shape, claim)


def render_hallu(spec: HalluSpec, rng: random.Random) -> Draft:
    objs = spec.objs
    img = render_objects(list(objs), rng)
    seen = pick(rng, ("In the image there is ", "The picture contains ", "I can see ")) + describe_scene(objs) + "."
    if spec.kind == "exists":
        name = f"{spec.colour} {spec.shape}"
        question = pick(rng, (f"Is there a {name} in the image?", f"Does the image contain a {name}?",
                              f"Can you see a {name} in this picture?"))
        hit = next((o for o in objs if o.name == name), None)
        # The answer names the object it looks for, then decides right after the name: a tiny LM
        # compares a name it has just written with its scene list, but does not carry the question's
        # name across the list to the deciding word (docs/results/hallu-2026-11-23/).
        look = pick(rng, (f"Looking for a {name}:", f"Checking for a {name}:", f"Searching the image for a {name}:"))
        if hit is not None:
            at = where(hit.position)
            body = f"{look} " + pick(rng, (f"yes, it is {at}.", f"yes, there is one {at}."))
            facts = {"answer": "Yes", "position": hit.position}
            ans = "Yes"
        else:
            body = f"{look} " + pick(rng, ("no, there is none.", "no, I cannot find one."))
            facts = {"answer": "No"}
            ans = "No"
        cues = (body,)  # the deciding sentence: the word after the name decides
        near = [o for o in objs if o.colour == spec.colour or o.shape == spec.shape]
        if hit is None and near:
            body += pick(rng, (f" The closest thing is the {near[0].name}, which is not the same.",
                               f" There is a {near[0].name}, but that is different from a {name}."))
    else:
        s, k = spec.shape, spec.claim
        true = sum(o.shape == s for o in objs)
        question = pick(rng, (f"Are there exactly {count_phrase(k, s, PLURAL[s])} in the image?",
                              f"Does the image show {count_phrase(k, s, PLURAL[s])}?"))
        body = pick(rng, (f"Counting carefully, the image has {true} {PLURAL[s] if true != 1 else s}.",
                          f"I count {true} {PLURAL[s] if true != 1 else s} in total."))
        ans = "Yes" if true == k else "No"
        facts = {"answer": ans, "count": str(true)}
        cues = ()  # the stated count decides, and it is a fact already
    end = pick(rng, (f"So the answer is {ans}.", f"{ans}, that is my answer.", f"Therefore: {ans}."))
    if ans == "No":
        end = pick(rng, (f"So the answer is {ans}.", f"Therefore: {ans}.", f"The claim is wrong, so {ans}."))
    return Draft([img], f"{seen} {body} {end}", facts, [describe_scene(objs)], question, cues)
