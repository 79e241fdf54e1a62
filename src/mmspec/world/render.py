"""Pillow drawing for the world: the closed vocabularies (colours, shapes, positions) and renderers.

Everything here is drawn big and flat (no anti-aliasing on shapes, exact palette RGB values) so
tiny vision towers can learn it and tests can check pixels against facts. This module knows the
look of things, not questions or answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from math import cos, pi, sin

from PIL import Image, ImageDraw, ImageFont

from mmspec.world.core import IMAGE_SIZE

# Eight object colours, far apart in RGB so a pixel's colour names it exactly.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 0),
    "orange": (245, 120, 0),
    "purple": (140, 50, 180),
    "pink": (245, 110, 190),
    "brown": (120, 70, 20),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross")
PLURAL = {s: s + ("es" if s.endswith("s") else "s") for s in SHAPES}
# Pale backgrounds (never an object colour).
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "grey": (205, 205, 205),
    "cream": (250, 240, 200),
    "pale blue": (200, 225, 250),
    "pale green": (205, 240, 205),
}
GRID = 3
CELL = IMAGE_SIZE // GRID  # 32 px
# Row-major 3x3 grid names; "center" is the middle cell.
POSITIONS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
BLACK = (15, 15, 15)
WHITE = (255, 255, 255)


@dataclass(frozen=True)
class Obj:
    """A flat coloured shape in one grid cell."""

    colour: str
    shape: str
    cell: int  # index into POSITIONS

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]


def where(position: str) -> str:
    """'in the top left' / 'at the top' / 'on the left' (always contains the position name)."""
    if position in ("top", "bottom"):
        return f"at the {position}"
    if position in ("left", "right"):
        return f"on the {position}"
    return f"in the {position}"


@lru_cache(maxsize=32)
def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's bundled scalable font (offline; Pillow >= 10.1)."""
    return ImageFont.load_default(size=size)


def canvas(background: tuple[int, int, int] = WHITE) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    return img, ImageDraw.Draw(img)


def cell_centre(cell: int) -> tuple[int, int]:
    row, col = divmod(cell, GRID)
    return CELL // 2 + CELL * col, CELL // 2 + CELL * row


def draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, rgb: tuple[int, int, int], cx: float, cy: float, r: float
) -> None:
    """A filled shape of 'radius' r centred at (cx, cy)."""
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rgb)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=rgb)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=rgb)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=rgb)
    elif shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            ang = -pi / 2 + k * pi / 5
            pts.append((cx + rad * cos(ang), cy + rad * sin(ang)))
        draw.polygon(pts, fill=rgb)
    elif shape == "cross":
        w = r * 0.38
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=rgb)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def render_objects(
    objs: list[Obj], rng: random.Random, background: tuple[int, int, int] = WHITE, jitter: int = 2
) -> Image.Image:
    """Each object centred in its own 32 px cell (radius 11-12, small jitter)."""
    img, draw = canvas(background)
    for obj in objs:
        cx, cy = cell_centre(obj.cell)
        draw_shape(
            draw,
            obj.shape,
            COLOURS[obj.colour],
            cx + rng.randint(-jitter, jitter),
            cy + rng.randint(-jitter, jitter),
            rng.choice((11, 12)),
        )
    return img


def text_colour_on(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Black on light fills, white on dark ones."""
    return BLACK if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 150 else WHITE


def draw_centred_text(
    draw: ImageDraw.ImageDraw, text: str, cx: float, cy: float, size: int, fill: tuple[int, int, int]
) -> None:
    draw.text((cx, cy), text, fill=fill, font=font(size), anchor="mm")


def fit_font_size(text: str, max_width: int, start: int) -> int:
    """The largest size <= start whose rendering of `text` fits in max_width pixels."""
    size = start
    while size > 8 and font(size).getlength(text) > max_width:
        size -= 1
    return size


# Chart geometry shared by the chart renderer and the tests that measure bars.
CHART_BASELINE = 78  # y of the x axis
CHART_UNIT = 6  # px per value unit (values 1..10 -> 6..60 px)
CHART_LEFT = 10


def bar_slots(n_bars: int) -> list[tuple[int, int]]:
    """(x0, x1) of each bar; 3 or 4 bars over the plot width."""
    width, gap = (18, 10) if n_bars == 3 else (16, 6)
    total = n_bars * width + (n_bars - 1) * gap
    x0 = CHART_LEFT + (IMAGE_SIZE - CHART_LEFT - total) // 2
    return [(x0 + k * (width + gap), x0 + k * (width + gap) + width - 1) for k in range(n_bars)]


def render_bar_chart(labels: list[str], values: list[int], colours: list[str]) -> Image.Image:
    """Vertical bars with the value above each bar and the label under it."""
    img, draw = canvas(WHITE)
    draw.line((CHART_LEFT - 2, CHART_BASELINE + 1, IMAGE_SIZE - 3, CHART_BASELINE + 1), fill=BLACK)
    draw.line((CHART_LEFT - 2, 6, CHART_LEFT - 2, CHART_BASELINE + 1), fill=BLACK)
    slots = bar_slots(len(values))
    pitch = slots[1][0] - slots[0][0]  # px between bar starts
    for (x0, x1), label, value, colour in zip(slots, labels, values, colours):
        top = CHART_BASELINE - value * CHART_UNIT + 1
        draw.rectangle((x0, top, x1, CHART_BASELINE), fill=COLOURS[colour])
        cx = (x0 + x1) / 2
        draw_centred_text(draw, str(value), cx, top - 6, 11, BLACK)
        size = fit_font_size(label, pitch - 1, 11)
        draw_centred_text(draw, label, cx, CHART_BASELINE + 9, size, BLACK)
    return img
