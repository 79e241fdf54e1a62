"""The five-image story families: pororosv (cartoon, snow) and vist (photo album, landscape).

Frames 1-4 show a steady progression the captions narrate; frame 5 holds the ending, and its
key facts (what is found, who is met, the mood; the place reached, the time of day) are visible
only in frame 5, so the image matters for the answer.

- pororosv: a named character (name fixed by its colour) walks or hops over snow towards a
  landmark; present tense, third person, "Pip walks to the tree."
- vist: a vehicle crosses a landscape under a moving sun; past tense, first person,
  "We drove our red car past the hills."
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mmspec.world.core import Draft, pick, sentence
from mmspec.world.render import COLOUR_NAMES, COLOURS, SHAPES, canvas, draw_shape

BLACK = (15, 15, 15)
WHITE = (255, 255, 255)

# ----------------------------------------------------------------------------- pororosv

CHARACTERS = {"Pip": "blue", "Lulu": "pink", "Bo": "green", "Max": "orange", "Tig": "yellow", "Rex": "purple"}
LANDMARKS = ("tree", "house", "igloo", "snowman")
SKY, SNOW, GROUND_Y = (170, 210, 240), (245, 245, 252), 64


@dataclass(frozen=True)
class PororoSpec:
    hero: str
    landmark: str
    rightward: bool
    gait: str  # "walks" | "hops"
    event: str  # "find" | "meet"
    item: str  # "red star" (find) or a friend's name (meet)
    mood: str  # "happy" | "sad"


def draw_pororo(rng: random.Random) -> PororoSpec:
    hero = rng.choice(tuple(CHARACTERS))
    event = rng.choice(("find", "meet"))
    if event == "find":
        item = f"{rng.choice(COLOUR_NAMES)} {rng.choice(SHAPES)}"
    else:
        item = rng.choice([n for n in CHARACTERS if n != hero])
    return PororoSpec(hero, rng.choice(LANDMARKS), rng.random() < 0.5, rng.choice(("walks", "hops")),
                      event, item, rng.choice(("happy", "sad")))


def _landmark(draw, kind: str, x: int) -> None:
    g = GROUND_Y
    if kind == "tree":
        draw.rectangle((x - 3, g - 14, x + 3, g + 2), fill=(110, 70, 30))
        draw.polygon([(x, g - 40), (x + 14, g - 12), (x - 14, g - 12)], fill=(20, 120, 40))
    elif kind == "house":
        draw.rectangle((x - 12, g - 20, x + 12, g + 2), fill=(200, 60, 40))
        draw.polygon([(x - 15, g - 20), (x + 15, g - 20), (x, g - 36)], fill=(90, 50, 30))
        draw.rectangle((x - 4, g - 10, x + 4, g + 2), fill=(60, 40, 20))
    elif kind == "igloo":
        draw.pieslice((x - 16, g - 18, x + 16, g + 14), 180, 360, fill=WHITE, outline=(120, 140, 170), width=2)
        draw.pieslice((x - 6, g - 8, x + 6, g + 4), 180, 360, fill=(60, 70, 90))
    else:  # snowman
        draw.ellipse((x - 10, g - 18, x + 10, g + 2), fill=WHITE, outline=(120, 140, 170), width=2)
        draw.ellipse((x - 7, g - 32, x + 7, g - 18), fill=WHITE, outline=(120, 140, 170), width=2)
        draw.polygon([(x, g - 26), (x + 8, g - 24), (x, g - 23)], fill=(245, 120, 0))


def _character(draw, colour: str, x: int, y: int, mood: str) -> None:
    """A round body with eyes and a mouth; y is the feet line."""
    r = 10
    cy = y - r
    draw.ellipse((x - r, cy - r, x + r, cy + r), fill=COLOURS[colour])
    for ex in (x - 4, x + 4):
        draw.ellipse((ex - 3, cy - 6, ex + 3, cy), fill=WHITE)
        draw.rectangle((ex - 1, cy - 4, ex, cy - 2), fill=BLACK)
    if mood == "happy":  # a smile and a red heart overhead
        draw.arc((x - 5, cy - 1, x + 5, cy + 6), 20, 160, fill=BLACK, width=2)
        hy = cy - r - 12
        draw.ellipse((x - 6, hy - 3, x, hy + 3), fill=(230, 20, 40))
        draw.ellipse((x, hy - 3, x + 6, hy + 3), fill=(230, 20, 40))
        draw.polygon([(x - 6, hy + 1), (x + 6, hy + 1), (x, hy + 8)], fill=(230, 20, 40))
    elif mood == "sad":  # a frown and a grey rain cloud overhead
        draw.arc((x - 5, cy + 3, x + 5, cy + 10), 200, 340, fill=BLACK, width=2)
        hy = cy - r - 12
        draw.ellipse((x - 9, hy - 4, x + 9, hy + 4), fill=(110, 110, 120))
        for dx in (-5, 0, 5):
            draw.line((x + dx, hy + 6, x + dx - 1, hy + 9), fill=(40, 90, 220), width=2)
    else:
        draw.line((x - 4, cy + 4, x + 4, cy + 4), fill=BLACK, width=2)


def _pororo_frame(spec: PororoSpec, k: int, rng: random.Random):
    img, draw = canvas(SKY)
    draw.rectangle((0, GROUND_Y, 95, 95), fill=SNOW)
    flip = (lambda x: x) if spec.rightward else (lambda x: 95 - x)
    _landmark(draw, spec.landmark, flip(80))
    hero_colour = CHARACTERS[spec.hero]
    feet = GROUND_Y + 10
    if k < 4:
        x = 12 + 14 * k + rng.randint(-1, 1)
        y = feet - (8 if spec.gait == "hops" and k % 2 == 1 else 0)
        _character(draw, hero_colour, flip(x), y, "neutral")
    else:
        _character(draw, hero_colour, flip(56), feet, spec.mood)
        if spec.event == "find":
            colour, shape = spec.item.split(" ")
            draw_shape(draw, shape, COLOURS[colour], flip(34), feet + 8, 8)
        else:
            _character(draw, CHARACTERS[spec.item], flip(28), feet + 6, spec.mood)
    return img


def render_pororo(spec: PororoSpec, rng: random.Random) -> Draft:
    h, lm, gait = spec.hero, spec.landmark, spec.gait
    side = "left" if spec.rightward else "right"
    other = "right" if spec.rightward else "left"
    move = "walking" if gait == "walks" else "hopping"
    captions = [
        f"{h} stands on the {side} in the snow, far from the {lm}",
        f"{h} {gait} toward the {lm}",
        f"{h} keeps {move} to the {other}, closer to the {lm}",
        f"{h} is almost at the {lm}",
    ]
    if spec.event == "find":
        last = f"{h} reaches the {lm}, finds a {spec.item} and is {spec.mood}"
        found = pick(rng, (f"there {h} finds a {spec.item} lying in the snow",
                           f"right there in the snow is a {spec.item}",
                           f"{h} spots a {spec.item} next to it"))
        facts = {"name": h, "landmark": lm, "item": spec.item, "mood": spec.mood}
    else:
        last = f"{h} reaches the {lm}, meets {spec.item} and is {spec.mood}"
        found = pick(rng, (f"there {h} meets {spec.item}", f"{spec.item} is waiting there",
                           f"{h} bumps into {spec.item}"))
        facts = {"name": h, "landmark": lm, "friend": spec.item, "mood": spec.mood}
    arrive = pick(rng, (f"At last {h} reaches the {lm}, and {found}.",
                        f"{h} finally gets to the {lm}. Then {found}.",
                        f"When {h} arrives at the {lm}, {found}."))
    if spec.mood == "happy":
        feel = pick(rng, (f"{h} smiles and looks happy.", f"{h} is so happy!", f"It makes {h} feel happy."))
        together = ("The friends play until dark.",) if spec.event == "meet" else ()
        close = pick(rng, ("What a good day in the snow.", "It was worth the long walk.", "") + together)
    else:
        feel = pick(rng, (f"But {h} frowns and looks sad.", f"{h} feels sad.", f"Somehow it makes {h} sad."))
        close = pick(rng, ("Maybe tomorrow will be better.", "The snow keeps falling quietly.", ""))
    answer = " ".join(t for t in (sentence(arrive), feel, close) if t)
    images = [_pororo_frame(spec, k, rng) for k in range(5)]
    return Draft(images, answer, facts, captions + [last])


# ----------------------------------------------------------------------------- vist

VEHICLES = ("car", "boat", "balloon")
PLACES = ("house", "tower", "flag", "tent")
ENDINGS = ("sunset", "night", "rain")
DAY_SKY = (150, 200, 245)
END_SKY = {"sunset": (245, 150, 80), "night": (20, 25, 70), "rain": (120, 125, 135)}


@dataclass(frozen=True)
class VistSpec:
    vehicle: str
    colour: str
    place: str
    place_colour: str
    ending: str


def draw_vist(rng: random.Random) -> VistSpec:
    colour, place_colour = rng.sample(COLOUR_NAMES, 2)
    return VistSpec(rng.choice(VEHICLES), colour, rng.choice(PLACES), place_colour, rng.choice(ENDINGS))


def _vehicle(draw, kind: str, rgb, x: int, y: int) -> None:
    if kind == "car":
        draw.rectangle((x - 11, y - 8, x + 11, y), fill=rgb)
        draw.rectangle((x - 6, y - 14, x + 6, y - 8), fill=rgb)
        for wx in (x - 6, x + 6):
            draw.ellipse((wx - 3, y - 2, wx + 3, y + 4), fill=BLACK)
    elif kind == "boat":
        draw.polygon([(x - 13, y - 6), (x + 13, y - 6), (x + 8, y + 2), (x - 8, y + 2)], fill=rgb)
        draw.line((x, y - 6, x, y - 22), fill=BLACK, width=2)
        draw.polygon([(x + 1, y - 22), (x + 11, y - 9), (x + 1, y - 9)], fill=WHITE)
    else:  # balloon
        draw.ellipse((x - 10, y - 34, x + 10, y - 10), fill=rgb)
        draw.line((x - 4, y - 11, x - 3, y - 3), fill=BLACK)
        draw.line((x + 4, y - 11, x + 3, y - 3), fill=BLACK)
        draw.rectangle((x - 4, y - 3, x + 4, y + 2), fill=(110, 70, 30))


def _place(draw, kind: str, rgb, x: int, y: int) -> None:
    if kind == "house":
        draw.rectangle((x - 11, y - 16, x + 11, y), fill=rgb)
        draw.polygon([(x - 14, y - 16), (x + 14, y - 16), (x, y - 30)], fill=BLACK)
    elif kind == "tower":
        draw.rectangle((x - 6, y - 36, x + 6, y), fill=rgb)
        draw.rectangle((x - 9, y - 40, x + 9, y - 34), fill=BLACK)
    elif kind == "flag":
        draw.line((x - 8, y, x - 8, y - 36), fill=BLACK, width=2)
        draw.rectangle((x - 7, y - 36, x + 12, y - 24), fill=rgb)
    else:  # tent
        draw.polygon([(x - 15, y), (x + 15, y), (x, y - 24)], fill=rgb)
        draw.polygon([(x - 4, y), (x + 4, y), (x, y - 10)], fill=BLACK)


def _vist_frame(spec: VistSpec, k: int, rng: random.Random):
    final = k == 4
    sky = END_SKY[spec.ending] if final else DAY_SKY
    img, draw = canvas(sky)
    ground = (60, 110, 200) if spec.vehicle == "boat" else (90, 160, 70)
    draw.rectangle((0, 62, 95, 95), fill=ground)
    if spec.vehicle == "car":
        draw.rectangle((0, 74, 95, 84), fill=(100, 100, 100))
    if not final:  # the sun climbs and sinks across frames 1-4
        sx, sy = 14 + 20 * k, (30, 14, 12, 24)[k]
        draw.ellipse((sx - 7, sy - 7, sx + 7, sy + 7), fill=(255, 220, 40))
    elif spec.ending == "sunset":
        draw.pieslice((70, 52, 92, 74), 180, 360, fill=(255, 90, 30))
    elif spec.ending == "night":
        draw.ellipse((70, 8, 84, 22), fill=(240, 240, 210))
        draw.ellipse((75, 6, 88, 19), fill=END_SKY["night"])
        for _ in range(6):
            x, y = rng.randint(4, 66), rng.randint(4, 40)
            draw.point([(x, y), (x + 1, y), (x, y + 1)], fill=WHITE)
    else:
        for _ in range(18):
            x, y = rng.randint(0, 95), rng.randint(0, 58)
            draw.line((x, y, x - 2, y + 5), fill=(200, 210, 230))
    vy = 82 if spec.vehicle == "car" else 72 if spec.vehicle == "boat" else 52
    if final:
        _place(draw, spec.place, COLOURS[spec.place_colour], 76, 74)
        _vehicle(draw, spec.vehicle, COLOURS[spec.colour], 46, vy)
    else:
        _vehicle(draw, spec.vehicle, COLOURS[spec.colour], 12 + 16 * k + rng.randint(-1, 1), vy)
    return img


def render_vist(spec: VistSpec, rng: random.Random) -> Draft:
    v, c = spec.vehicle, spec.colour
    verb = {"car": "drove", "boat": "sailed", "balloon": "flew"}[v]
    over = {"car": "down the road", "boat": "across the lake", "balloon": "over the fields"}[v]
    captions = [
        f"We set out in our {c} {v} early in the morning",
        f"We {verb} {over} as the sun rose",
        f"The sun was high and our {c} {v} kept going",
        "In the afternoon we were still far from home",
    ]
    place = f"{spec.place_colour} {spec.place}"
    when = {"sunset": "at sunset", "night": "at night", "rain": "in the rain"}[spec.ending]
    last = f"We reached a {place} {when}"
    became = {"sunset": "sunset", "night": "night", "rain": "starting to rain"}[spec.ending]
    arrive = pick(rng, (f"At last we reached a {place} {when}.",
                        f"Finally our {v} stopped by a {place}, and it was {became}.",
                        f"By the end of the trip we came to a {place} {when}."))
    mood = {
        "sunset": ("The sky turned orange behind us.", "We watched the sunset together.",
                   "The orange light was beautiful."),
        "night": ("The moon and stars came out.", "It was dark, so we rested there for the night.",
                  "We looked up at the stars."),
        "rain": ("We waited there until the rain stopped.", "We got a little wet, but we laughed about it.",
                 "Grey clouds covered the sky."),
    }[spec.ending]
    close = pick(rng, ("It was a day we will always remember.", "What a trip it was.",
                       "We could not wait to do it again.", ""))
    answer = " ".join(t for t in (arrive, pick(rng, mood), close) if t)
    facts = {"place": place, "time": spec.ending}
    images = [_vist_frame(spec, k, rng) for k in range(5)]
    return Draft(images, answer, facts, captions + [last])
