"""MMSpec's published splits (arXiv 2603.14989, ``killthefullmoon/MMSpec``) read as they are.

Owns the file side of ``-d mmspec=PATH[:SPLIT]``: finding a split's ``mmspec.jsonl``, reading its
rows one at a time, the checks each row must pass, and a row's category. The samples built from
them (prompts, turns) are :mod:`mmspec.bench.datasets`'; this module knows nothing about models.

A split is a folder holding ``mmspec.jsonl`` and ``images/``; MMSpec ships ``testmini`` and
``test`` (the full benchmark: 600 samples, 100 per category) under ``dataset/MMSpec/`` of its
repository. ``PATH`` is that ``dataset/MMSpec`` folder (the split is ``SPLIT``, default
``test``), the repository itself, one split's folder, or the ``mmspec.jsonl`` file. A row is one
JSON object a line::

    {"id": "img_000002", "image": "general_vqa/img_000002.png",
     "turns": ["What type of structure is shown in the image?", "How is the pavilion supported ..."],
     "category": "...", "topic": "general vqa"}

``image`` is relative to the split's ``images/`` folder; ``turns`` are the user's successive
questions. A row is reported under its **category**: whichever of ``category`` and ``topic``
names one of MMSpec's six task categories (:data:`CATEGORIES`, under any of its spellings;
MMSpec's published rows put the task in ``topic`` and a description of the picture in
``category``), else its ``category`` as written.

A bad row (not JSON, no ``turns``, no ``image``, an image path that leaves ``images/`` — absolute
or through ``..`` —, a missing or unreadable image) is skipped with a message naming
``FILE:LINE`` and its id and the fix; the rest of the split goes on. A missing path or split, or a
split with no usable row, is an :class:`mmspec.errors.MMSpecError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mmspec.errors import MMSpecError

JSONL = "mmspec.jsonl"
IMAGES = "images"
DEFAULT_SPLIT = "test"  # the full benchmark (the paper's tables); testmini is its quick subset
SPLITS = ("testmini", "test")
# MMSpec's six task categories (the paper's order) and the spellings a row may use for each
CATEGORIES: dict[str, tuple[str, ...]] = {
    "general_vqa": ("general vqa", "gqa"),
    "text_vqa": ("text vqa", "textvqa"),
    "image_captioning": ("image captioning", "captioning", "coco", "coco caption"),
    "chart_vqa": ("chart vqa", "chart understanding", "charxiv"),
    "complex_reasoning": ("complex reasoning", "complex reasoning pro", "mmmu pro", "mmmu"),
    "multi_turn": ("multi turn conversation", "multi turn", "conversation", "convbench", "mm mt bench"),
}
_ALIASES = {re.sub(r"[^a-z0-9]+", " ", a).strip(): c for c, names in CATEGORIES.items() for a in (c, *names)}


def category_of(row: dict) -> str:
    """The task category a row is reported under (see the module doc), as a short name."""
    for key in ("category", "topic"):
        name = _ALIASES.get(_words(row.get(key)))
        if name:
            return name
    return _words(row.get("category") or row.get("topic") or "uncategorized").replace(" ", "_") or "uncategorized"


def _words(value) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(value or "").lower()).strip()


def find_split(path: Path, split: str | None) -> Path:
    """The ``mmspec.jsonl`` of ``split`` (None: test) at ``path`` (see the module doc for the forms)."""
    path = Path(path)
    split = split or DEFAULT_SPLIT
    if not path.exists():
        raise MMSpecError(f"MMSpec path {path} does not exist; pass the dataset/MMSpec folder of a clone of "
                          "killthefullmoon/MMSpec (with -d mmspec=PATH:testmini for its quick split), or one split's "
                          f"folder (holding {JSONL} and {IMAGES}/)")
    if path.is_file():
        return path
    for candidate in (path / split / JSONL, path / "dataset" / "MMSpec" / split / JSONL):
        if candidate.is_file():
            return candidate
    if (path / JSONL).is_file():  # a split's own folder: the folder is the choice
        return path / JSONL
    found = sorted(p.parent.name for p in path.glob(f"*/{JSONL}"))
    there = f"; its splits: {', '.join(found)} (pick one with -d mmspec={path}:SPLIT)" if found else ""
    raise MMSpecError(f"{path} has no MMSpec split {split!r}: expected {path / split / JSONL} (a split is a folder "
                      f"holding {JSONL} and {IMAGES}/){there}")


@dataclass
class MMSpecRow:
    """One usable row: its id, category, image and user turns."""

    uid: str
    category: str
    image: Image.Image
    turns: tuple[str, ...]
    topic: str | None = None
    where: str = ""  # FILE:LINE


@dataclass
class SplitRead:
    """The usable rows of a split (file order) and what was skipped: counts by reason, and each
    skipped row's message."""

    file: Path
    rows: list[MMSpecRow] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class BadRow(Exception):
    """A row that cannot be used: ``reason`` (short, for counts) and ``fix`` (the message's tail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def read_split(path: Path, split: str | None, per_category: int) -> SplitRead:
    """The first ``per_category`` usable rows of each category of the split at ``path``."""
    file = find_split(path, split)
    images = file.parent / IMAGES
    out = SplitRead(file)
    taken: dict[str, int] = {}
    seen: set[str] = set()
    for line_no, text in _lines(file):
        where = f"{file}:{line_no}"
        row_id = None
        try:
            row = _parse(text)
            row_id = row.get("id")
            cat = category_of(row)
            if taken.get(cat, 0) >= per_category:
                continue
            turns = _turns(row)
            image = _image(row, images)
        except BadRow as e:
            out.skipped[e.reason] = out.skipped.get(e.reason, 0) + 1
            named = f" (id {row_id!r})" if row_id is not None else ""
            out.errors.append(f"{where}{named}: {e.detail}; row skipped")
            continue
        uid = str(row_id) if row_id is not None else f"line{line_no}"
        if uid in seen:
            uid = f"{uid}@{line_no}"
        seen.add(uid)
        taken[cat] = taken.get(cat, 0) + 1
        topic = row.get("topic")
        out.rows.append(MMSpecRow(uid, cat, image, turns, None if topic is None else str(topic), where))
    return out


def _lines(file: Path) -> Iterator[tuple[int, str]]:
    with open(file, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                yield i, line


def _parse(text: str) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow("not valid JSON", f"not valid JSON ({e}); write one JSON object a line") from None
    if not isinstance(row, dict):
        raise BadRow("not a JSON object", f"a JSON {type(row).__name__}, not an object with id, image, turns")
    return row


def _turns(row: dict) -> tuple[str, ...]:
    turns = row.get("turns")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        got = "no 'turns'" if turns is None else f"'turns' {json.dumps(turns)[:60]}"
        raise BadRow("no turns", f"{got}; MMSpec's 'turns' is the list of the user's questions (non-empty strings)")
    return tuple(t.strip() for t in turns)


def _image(row: dict, images: Path) -> Image.Image:
    rel = row.get("image")
    if not isinstance(rel, str) or not rel.strip():
        raise BadRow("no image", "no 'image'; MMSpec's 'image' is a path relative to the split's images/ folder")
    p = Path(rel)
    root = images.resolve()
    full = (images / p).resolve()
    if p.is_absolute() or root not in full.parents:
        raise BadRow("image path outside images/",
                     f"image path {rel!r} leaves the split's {IMAGES}/ folder ({root}); MMSpec's image paths are "
                     "relative to it, with no '..' and no leading '/'")
    if not full.is_file():
        raise BadRow("image not found", f"image file {rel!r} not found in {root}")
    try:
        with Image.open(full) as im:
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise BadRow("image unreadable", f"image file {rel!r} cannot be read as an image "
                                         f"({e.__class__.__name__}: {e}); fix or drop that row") from None
