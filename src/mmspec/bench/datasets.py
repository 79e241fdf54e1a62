"""Benchmark samples: the embedded synthetic world and the real IbED benchmarks from local files.

Owns :class:`BenchSample` and the loaders. Real benchmarks are read from parquet files (a file
or a directory of ``*.parquet``, e.g. a hub snapshot) or a ``datasets.save_to_disk`` directory,
and their prompts are built with the IbED Appendix C templates (:mod:`mmspec.prompt`). An image
cell that holds a relative path (a string, or a ``{bytes, path}`` struct without bytes) is read
from the data set's directory (the directory given, or the parquet file's), then from the
working directory. (A save_to_disk column of the ``datasets.Image`` type arrives decoded.)

Expected schemas (the lmms-lab hub datasets; images are ``{bytes, path}`` structs in parquet):

- ChartQA (``lmms-lab/ChartQA``): ``question``, ``image``; reference ``answer``.
- TextVQA (``lmms-lab/textvqa``): ``question``, ``image``; reference ``answers`` (list).
- VQAv2 (``lmms-lab/VQAv2``): ``question``, ``image``; reference ``multiple_choice_answer``.
- HallusionBench (``lmms-lab/HallusionBench``): ``question``, ``image`` (null for the
  text-only questions: those rows are skipped and counted); reference ``gt_answer_details``.
- LLaVA-NeXT-Interleave-Bench (``lmms-lab/LLaVA-NeXT-Interleave-Bench``): ``sub_task``
  (``Spot-the-Diff``, ``IEdit``, ``PororoSV``, ``VIST``), ``question`` (or ``conversations``),
  ``answer``, images in ``image_0`` .. ``image_15`` or in one list column ``image``. For the
  story tasks the captions of frames 1-4 are parsed from the question text
  (``Caption#k: ...`` labels, else the text after each of the first four ``<image>`` markers).

A missing path, or a file lacking a needed column, raises :class:`mmspec.errors.MMSpecError`
naming the file, the missing column and the expected schema. It knows nothing about models.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from PIL import Image

from mmspec.errors import MMSpecError
from mmspec.prompt import IMAGE_MARKER, TEMPLATES, fill_template

N_IMAGES: dict[str, int] = {
    "chartqa": 1, "textvqa": 1, "vqav2": 1, "hallusionbench": 1,
    "spot_the_diff": 2, "iedit": 2, "pororosv": 5, "vist": 5,
}
SINGLE_IMAGE = ("chartqa", "textvqa", "vqav2", "hallusionbench")
INTERLEAVE = ("spot_the_diff", "iedit", "pororosv", "vist")
STORY = ("pororosv", "vist")
# reference-answer columns, first present wins
REFERENCE_COLUMNS: dict[str, tuple[str, ...]] = {
    "chartqa": ("answer",),
    "textvqa": ("answers", "answer"),
    "vqav2": ("multiple_choice_answer", "answers", "answer"),
    "hallusionbench": ("gt_answer_details", "gt_answer", "answer"),
}
MAX_IMAGE_COLUMNS = 16


@dataclass
class BenchSample:
    """One prompt of a benchmark, ready for the target's processor."""

    uid: str
    dataset: str
    prompt: str  # full prompt text with one ``<image>`` per image, in order
    images: list[Image.Image] = field(default_factory=list)
    reference: str | None = None

    @property
    def n_images(self) -> int:
        return len(self.images)


@dataclass
class LoadReport:
    """What a loader skipped and why (e.g. HallusionBench rows without an image)."""

    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


# --------------------------------------------------------------------------- embedded world
def load_embedded(name: str, n: int, split: str = "test") -> list[BenchSample]:
    """``n`` samples of the synthetic world's family ``name`` (deterministic)."""
    from mmspec.world import generate_samples  # the world package is optional at import time

    out = []
    for s in generate_samples(name, split, n):
        ref = getattr(s, "answer", None)
        out.append(BenchSample(str(s.uid), name, s.prompt, list(s.images), ref))
    return out


# --------------------------------------------------------------------------- schema helpers
def schema_text(name: str) -> str:
    if name in SINGLE_IMAGE:
        return "columns question: string, image: struct{bytes: binary, path: string}"
    return (
        "columns sub_task: string, question: string (or conversations), image_0..image_N: "
        "struct{bytes, path} (or image: list<struct{bytes, path}>)"
    )


def to_pil(value: Any, where: str, base: Path | None = None) -> Image.Image:
    """An image cell (PIL image, {bytes, path} dict, raw bytes, or a file path) as RGB PIL;
    a cell that is no readable image is refused with its place in the data set. A relative path
    is looked for under ``base`` (the data set's directory) first, then the working directory."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open(io.BytesIO(value["bytes"]), where, "its image bytes")
        if value.get("path"):
            return to_pil(value["path"], where, base)
    if isinstance(value, (bytes, bytearray)):
        return _open(io.BytesIO(value), where, "its image bytes")
    if isinstance(value, str):
        path = Path(value)
        tried = [path] if path.is_absolute() or base is None else [base / path, path]
        found = next((p for p in tried if p.is_file()), None)  # a file anywhere beats a directory first
        if found is None:
            found = next((p for p in tried if p.exists()), tried[0])  # for the error: a directory, or missing
        if found.is_dir():
            at = "" if found == path else f" (at {found})"
            raise MMSpecError(f"{where}: image path {value!r}{at} is a directory, not an image file; fix that row")
        if not found.is_file():
            where_from = "" if path.is_absolute() else (
                " (a relative path is read from "
                + (f"the data set's directory, {base.resolve()}, then " if base is not None else "")
                + f"the directory mmspec runs in, {Path.cwd()}: put the images there, or store the image bytes "
                "in the data set)")
            raise MMSpecError(f"{where}: image file {value!r} not found{where_from}")
        return _open(found, where, f"image file {str(found)!r}")
    raise MMSpecError(f"{where}: cannot decode image cell of type {type(value).__name__}")


def _open(source, where: str, what: str) -> Image.Image:
    try:
        with Image.open(source) as im:
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
        raise MMSpecError(f"{where}: {what} cannot be read as an image ({e.__class__.__name__}: {e}); "
                          "fix or drop that row") from None


def _norm_task(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(text).lower())


def _parquet_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.rglob("*.parquet"))


def _open_parquet(f: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid (a ValueError): not a parquet file
        raise MMSpecError(f"{f} is not a readable parquet file ({e.__class__.__name__}: {e}); fix or remove "
                          "it, or pass a datasets.save_to_disk directory instead") from None


def _base_dir(path: Path) -> Path:
    """The directory a data set's relative image paths start from: the path itself when it is a
    directory (a hub snapshot, a save_to_disk dir), else the parquet file's directory."""
    return path if path.is_dir() else path.parent


def _iter_rows(path: Path, split: str) -> tuple[Iterator[dict], list[str], str]:
    """Rows of a parquet file/dir or a save_to_disk dir: (row iterator, column names, label)."""
    if not path.exists():
        raise MMSpecError(
            f"dataset path {path} does not exist; pass a parquet file, a directory of parquet "
            "files, or a datasets.save_to_disk directory"
        )
    files = _parquet_files(path)
    if files:
        columns = _open_parquet(files[0]).schema_arrow.names

        def gen() -> Iterator[dict]:
            for f in files:
                for batch in _open_parquet(f).iter_batches(batch_size=64):
                    yield from batch.to_pylist()

        return gen(), columns, str(files[0] if len(files) == 1 else path)
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                if len(ds) != 1:
                    raise MMSpecError(f"{path}: no split {split!r}; it has {list(ds)}")
                split = next(iter(ds))
            ds = ds[split]
        return iter(ds), list(ds.column_names), str(path)
    raise MMSpecError(
        f"{path} holds no *.parquet files and is not a datasets.save_to_disk directory"
    )


def _require(columns: list[str], needed: list[str], label: str, name: str) -> None:
    for col in needed:
        if col not in columns:
            raise MMSpecError(
                f"{label}: missing column {col!r} needed for {name}; found {columns}; expected "
                f"the lmms-lab schema: {schema_text(name)}"
            )


def _reference(row: dict, cols: tuple[str, ...]) -> str | None:
    for c in cols:
        v = row.get(c)
        if v is None:
            continue
        if isinstance(v, list):
            v = v[0] if v else None
            if isinstance(v, dict):
                v = v.get("answer")
        return None if v is None else str(v)
    return None


# --------------------------------------------------------------------------- single image
def _single_image(name: str, path: Path, n: int, split: str, report: LoadReport) -> list[BenchSample]:
    rows, columns, label = _iter_rows(path, split)
    base = _base_dir(path)  # where the rows' relative image paths start
    _require(columns, ["question", "image"], label, name)
    out: list[BenchSample] = []
    for i, row in enumerate(rows):
        if len(out) >= n:
            break
        if row.get("image") is None:
            report.skip("no image (text-only question)")
            continue
        uid = str(row.get("question_id", row.get("id", i)))
        image = to_pil(row["image"], f"{label} row {i}", base)
        prompt = fill_template(TEMPLATES[name], question=str(row["question"]))
        out.append(BenchSample(uid, name, prompt, [image], _reference(row, REFERENCE_COLUMNS[name])))
    return out


# --------------------------------------------------------------------------- interleave bench
def _row_images(row: dict, columns: list[str], where: str, base: Path | None = None) -> list[Image.Image]:
    if "image_0" in columns:
        cells = [row.get(f"image_{k}") for k in range(MAX_IMAGE_COLUMNS)]
        return [to_pil(c, where, base) for c in cells if c is not None]
    return [to_pil(c, where, base) for c in (row.get("image") or [])]


def _question_text(row: dict) -> str:
    q = row.get("question")
    if q is None:
        conv = row.get("conversations") or []
        if isinstance(conv, str):
            return conv
        firsts = [c.get("value", "") for c in conv if isinstance(c, dict)]
        q = firsts[0] if firsts else ""
    return str(q)


_CAPTION_LABEL = re.compile(r"caption\s*#?\s*(\d+)\s*:\s*", re.IGNORECASE)


def story_captions(question: str, n: int = 4) -> list[str] | None:
    """Captions of frames 1..n from an interleave-bench story question, or None."""
    parts = _CAPTION_LABEL.split(question)
    found: dict[int, str] = {}
    for k in range(1, len(parts) - 1, 2):
        text = parts[k + 1].split(IMAGE_MARKER)[0].strip().rstrip(".").strip()
        found.setdefault(int(parts[k]), text)
    if all(found.get(k) for k in range(1, n + 1)):
        return [found[k] for k in range(1, n + 1)]
    chunks = [c.strip() for c in question.split(IMAGE_MARKER)[1:]]
    chunks = [c for c in chunks if c]
    return chunks[:n] if len(chunks) >= n else None


def _interleave(name: str, path: Path, n: int, split: str, report: LoadReport) -> list[BenchSample]:
    rows, columns, label = _iter_rows(path, split)
    base = _base_dir(path)  # where the rows' relative image paths start
    task_col = "sub_task" if "sub_task" in columns else ("dataset" if "dataset" in columns else None)
    if task_col is None:
        _require(columns, ["sub_task"], label, name)
    if "question" not in columns and "conversations" not in columns:
        _require(columns, ["question"], label, name)
    if "image_0" not in columns and "image" not in columns:
        _require(columns, ["image_0"], label, name)
    want = _norm_task(name)
    out: list[BenchSample] = []
    n_imgs = N_IMAGES[name]
    for i, row in enumerate(rows):
        if len(out) >= n:
            break
        if _norm_task(row.get(task_col, "")) != want:
            continue
        where = f"{label} row {i}"
        images = _row_images(row, columns, where, base)
        if len(images) != n_imgs:
            report.skip(f"{len(images)} images, template needs {n_imgs}")
            continue
        captions: list[str] = []
        if name in STORY:
            caps = story_captions(_question_text(row))
            if caps is None:
                report.skip("could not find captions #1-#4 in the question text")
                continue
            captions = caps
        prompt = fill_template(TEMPLATES[name], captions=captions)
        uid = str(row.get("sample_id", row.get("id", i)))
        ref = row.get("answer")
        out.append(BenchSample(uid, name, prompt, images, None if ref is None else str(ref)))
    return out


def load_real(name: str, path: Path, n: int, split: str = "test") -> tuple[list[BenchSample], LoadReport]:
    """The first ``n`` usable samples of real benchmark ``name`` read from ``path``."""
    report = LoadReport()
    if name in SINGLE_IMAGE:
        samples = _single_image(name, Path(path), n, split, report)
    elif name in INTERLEAVE:
        samples = _interleave(name, Path(path), n, split, report)
    else:
        raise MMSpecError(f"unknown benchmark {name!r}; choose from {sorted(N_IMAGES)}")
    if not samples:
        raise MMSpecError(
            f"{path}: no usable {name} samples (skipped: {report.skipped or 'none'}); expected "
            f"{schema_text(name)}"
        )
    return samples, report


def load_dataset(name: str, path: Path | None, n: int, split: str = "test") -> tuple[list[BenchSample], LoadReport]:
    """Embedded world when ``path`` is None, else the real benchmark from local files."""
    if path is None:
        if name not in N_IMAGES:
            raise MMSpecError(f"unknown dataset {name!r}; choose from {sorted(N_IMAGES)}")
        return load_embedded(name, n, split), LoadReport()
    return load_real(name, path, n, split)
