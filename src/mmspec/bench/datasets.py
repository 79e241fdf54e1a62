"""Benchmark samples: the embedded synthetic world and the real IbED benchmarks from local files.

Owns :class:`BenchSample`, the loaders and the image cells. Finding and reading the files of a
split is :mod:`mmspec.bench.sources`; the prompt text is :mod:`mmspec.prompt`. The embedded
world's prompts are the IbED Appendix C templates; the real benchmarks' prompts are built as
lmms-eval and the IbED authors' code build them for a LLaVA-1.5 target (llava-hf chat format):

- ChartQA, TextVQA, VQAv2, HallusionBench: ``USER: <image>\\n{instruction}\\n{question} ASSISTANT:``
  (:func:`mmspec.prompt.single_image_qa_prompt`; the question as stored, not stripped).
- LLaVA-NeXT-Interleave-Bench tasks: the row's own question, which carries its ``<image>``
  markers, as ``USER: {question} ASSISTANT:``, with the row's images (as many as markers).

Each real data set has its own default split (:data:`DEFAULT_SPLITS`, as lmms-eval reads it);
``--dataset NAME=PATH:SPLIT`` picks another. An image cell that holds a relative path (a
string, or a ``{bytes, path}`` struct without bytes) is read from the data set's directory (the
directory given, or the parquet file's), then from the working directory. (A save_to_disk
column of the ``datasets.Image`` type arrives decoded.)

Expected schemas (the lmms-lab hub datasets; images are ``{bytes, path}`` structs in parquet):

- ChartQA (``lmms-lab/ChartQA``, split ``test``): ``question``, ``image``; reference ``answer``.
- TextVQA (``lmms-lab/textvqa``, ``validation``; its ``test`` has no answers): ``question``,
  ``image``; reference ``answers`` (list).
- VQAv2 (``lmms-lab/VQAv2``, ``validation``): ``question``, ``image``; reference
  ``multiple_choice_answer``.
- HallusionBench (``lmms-lab/HallusionBench``, splits ``image`` / ``non_image``): ``question``,
  ``image`` (a null image is skipped and counted); reference ``gt_answer_details``; a sample is
  named by ``category/subcategory/set_id/figure_id/question_id`` (``question_id`` alone repeats).
- LLaVA-NeXT-Interleave-Bench (``lmms-lab/LLaVA-NeXT-Interleave-Bench``, config ``in_domain``,
  split ``test``; a snapshot's ``in_domain`` folder is read when the path holds one):
  ``sample_id``, ``sub_task`` (``Spot-the-Diff``, ``IEdit``, ``PororoSV``, ``VIST``),
  ``question`` (or ``conversations``), ``answer``, images in ``image_0`` .. ``image_11`` (null
  past the row's last image) or in one list column ``image``. Rows are picked on ``sub_task``
  before any image bytes are read; a row whose image count differs from its question's
  ``<image>`` markers is skipped and counted.

The embedded world's video families (``motion``, ``order``: :data:`mmspec.world.VIDEO_FAMILIES`)
are benchmarked on a Video-LLaVA pair such as ``mmspec train video``'s: a sample carries the
world's clip (:attr:`BenchSample.video`), which the backend turns into the target's video inputs.

MMSpec's splits (``-d mmspec=PATH[:SPLIT]``, :func:`load_mmspec`; the files are
:mod:`mmspec.bench.mmspec_split`'s) are multi-turn: a sample is turn 1 of a row's questions
(:attr:`BenchSample.questions`), in the LLaVA-1.5 chat format (:func:`mmspec.prompt.llava_chat`), of
dataset ``mmspec/{category}``; :meth:`BenchSample.next_turn` asks the next question after the
target's own answer.

A missing path, a split with no files, or a file lacking a needed column raises
:class:`mmspec.errors.MMSpecError` naming the file, the problem and the fix. It knows nothing
about models.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PIL import Image

from mmspec.bench.sources import RowSource, open_rows
from mmspec.errors import MMSpecError
from mmspec.prompt import IMAGE_MARKER, llava_chat, llava_user_turn, single_image_qa_prompt

N_IMAGES: dict[str, int] = {  # images a sample of the embedded world's family has
    "chartqa": 1, "textvqa": 1, "vqav2": 1, "hallusionbench": 1,
    "spot_the_diff": 2, "iedit": 2, "pororosv": 5, "vist": 5,
}
# the embedded world's multi-turn family (mmspec.world.conversation): turn 1 is a sample of it, turn
# 2 (BenchSample.followup) is built by the runner from the target's own turn-1 answer
MULTI_TURN: dict[str, int] = {"conversation": 1}
# the embedded world's video families: one clip a sample, for a Video-LLaVA target (mmspec train video's)
VIDEO_NAMES: tuple[str, ...] = ("motion", "order")
EMBEDDED_NAMES: tuple[str, ...] = (*N_IMAGES, *MULTI_TURN, *VIDEO_NAMES)
SINGLE_IMAGE = ("chartqa", "textvqa", "vqav2", "hallusionbench")
INTERLEAVE = ("spot_the_diff", "iedit", "pororosv", "vist")
# the split each real benchmark is read from unless NAME=PATH:SPLIT names another (lmms-eval's)
DEFAULT_SPLITS: dict[str, str] = {
    "chartqa": "test", "textvqa": "validation", "vqav2": "validation", "hallusionbench": "image",
    "spot_the_diff": "test", "iedit": "test", "pororosv": "test", "vist": "test",
}
EMBEDDED_SPLIT = "test"  # the embedded world's default split
MMSPEC = "mmspec"  # MMSpec's published splits (mmspec.bench.mmspec_split); its samples' dataset is mmspec/CATEGORY
INTERLEAVE_CONFIG = "in_domain"  # the interleave bench's config (hub snapshot folder) of these tasks
# reference-answer columns, first present wins
REFERENCE_COLUMNS: dict[str, tuple[str, ...]] = {
    "chartqa": ("answer",),
    "textvqa": ("answers", "answer"),
    "vqav2": ("multiple_choice_answer", "answers", "answer"),
    "hallusionbench": ("gt_answer_details", "gt_answer", "answer"),
}
MAX_IMAGE_COLUMNS = 16
HALLUSION_KEY = ("category", "subcategory", "set_id", "figure_id", "question_id")


@dataclass
class BenchSample:
    """One prompt of a benchmark, ready for the target's processor."""

    uid: str
    dataset: str
    prompt: str  # full prompt text with one ``<image>`` per image, in order
    images: list[Image.Image] = field(default_factory=list)
    reference: str | None = None
    turn: int = 1  # a conversation's turn (1 for every one-turn data set)
    followup: str | None = None  # a conversation's turn-2 user question (turn 1 only)
    followup_reference: str | None = None  # the world's reference answer to it
    video: Any = None  # the world's clip (mmspec.world.VideoSample) of a video family; prompt holds its <video>
    questions: tuple[str, ...] = ()  # a published multi-turn sample's user turns, all of them (MMSpec's ``turns``)
    answers: tuple[str, ...] = ()  # the target's own answers to the turns before this one (len = turn - 1)

    @property
    def has_next(self) -> bool:
        """Whether a later turn follows this one (a conversation's follow-up, or MMSpec's next question)."""
        return self.followup is not None or self.turn < len(self.questions)

    @property
    def multi_turn(self) -> bool:
        """Whether this sample is a turn of a conversation (its rows carry ``turn``)."""
        return self.turn > 1 or self.followup is not None or bool(self.questions)

    def next_turn(self, answer: str) -> BenchSample:
        """The next turn, asked after ``answer`` (the target's own output to this turn), same images:
        the world conversation's turn 2 (this prompt + answer + the follow-up question), or an MMSpec
        sample's next question (the chat rendered again, :func:`mmspec.prompt.llava_chat`).
        Its uid is the first turn's + ``/t{turn}``."""
        from mmspec.world.conversation import turn2_prompt

        if self.questions:
            if not self.has_next:
                raise MMSpecError(f"{self.uid} is the last of its {len(self.questions)} turn(s); it has no next turn")
            answers, turn = (*self.answers, answer.strip()), self.turn + 1
            base = self.uid if self.turn == 1 else self.uid.rsplit("/t", 1)[0]
            return replace(self, uid=f"{base}/t{turn}", prompt=llava_chat(self.questions[:turn], answers, self.n_images),
                           images=list(self.images), answers=answers, turn=turn)
        if self.followup is None:
            raise MMSpecError(f"{self.uid} has no follow-up question; only a conversation has a turn 2")
        return BenchSample(f"{self.uid}/t2", self.dataset, turn2_prompt(self.prompt, answer, self.followup),
                           list(self.images), self.followup_reference, turn=2)

    @property
    def n_images(self) -> int:
        return len(self.images)


@dataclass
class LoadReport:
    """What a loader skipped and why (e.g. HallusionBench rows without an image)."""

    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # each skipped row's own message (file:line, id, the fix)

    def skip(self, reason: str, message: str | None = None) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if message is not None:
            self.errors.append(message)


# --------------------------------------------------------------------------- embedded world
def load_embedded(name: str, n: int, split: str = EMBEDDED_SPLIT) -> list[BenchSample]:
    """``n`` samples of the synthetic world's family ``name`` (deterministic)."""
    from mmspec.world import generate_conversations, generate_samples

    if name in MULTI_TURN:
        return [BenchSample(c.uid, name, c.prompt1, list(c.images), c.answer1, followup=c.question2,
                            followup_reference=c.answer2) for c in generate_conversations(split, n)]
    if name in VIDEO_NAMES:
        from mmspec.world import make_video_sample

        return [BenchSample(str(v.uid), name, v.prompt, [], v.answer, video=v)
                for v in (make_video_sample(name, split, i) for i in range(n))]
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
        "columns sub_task: string, question: string with one <image> per image (or conversations), "
        "image_0..image_11: struct{bytes, path}, null past the last image (or image: list<struct{bytes, path}>)"
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


def _norm_task(text: Any) -> str:
    return re.sub(r"[^a-z0-9]", "", str(text or "").lower())


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


def _uid(name: str, row: dict, i: int, seen: set[str]) -> str:
    """A sample's name, unique in the load: the row's id column (HallusionBench: its full key),
    else the row's index in the split; a repeated id gets ``@{index}`` appended."""
    if name == "hallusionbench" and all(row.get(c) is not None for c in HALLUSION_KEY):
        uid = "/".join(str(row[c]) for c in HALLUSION_KEY)
    else:
        uid = next((str(row[c]) for c in ("question_id", "sample_id", "id") if row.get(c) is not None), str(i))
    if uid in seen:
        uid = f"{uid}@{i}"
    seen.add(uid)
    return uid


# --------------------------------------------------------------------------- single image
def _single_image(name: str, src: RowSource, n: int, report: LoadReport) -> list[BenchSample]:
    _require(src.columns, ["question", "image"], src.label, name)
    out: list[BenchSample] = []
    seen: set[str] = set()
    for i, row in src.rows():
        if row.get("image") is None:
            report.skip("no image (text-only question)")
            continue
        image = to_pil(row["image"], f"{src.label} row {i}", src.base)
        prompt = single_image_qa_prompt(str(row["question"]))
        out.append(BenchSample(_uid(name, row, i, seen), name, prompt, [image],
                               _reference(row, REFERENCE_COLUMNS[name])))
        if len(out) >= n:
            break
    return out


# --------------------------------------------------------------------------- interleave bench
def _image_cells(row: dict, columns: list[str]) -> list[Any]:
    """The row's image cells in order, not decoded: ``image_0`` .. (nulls dropped) or ``image``."""
    if "image_0" in columns:
        return [c for c in (row.get(f"image_{k}") for k in range(MAX_IMAGE_COLUMNS)) if c is not None]
    return [c for c in (row.get("image") or []) if c is not None]


def _question_text(row: dict) -> str:
    """The row's instruction: ``question``, else the first turn of ``conversations``."""
    q = row.get("question")
    if q is None:
        conv = row.get("conversations") or []
        if isinstance(conv, str):
            return conv
        firsts = [c.get("value", "") for c in conv if isinstance(c, dict)]
        q = firsts[0] if firsts else ""
    return str(q)


def _interleave(name: str, src: RowSource, n: int, report: LoadReport) -> list[BenchSample]:
    columns = src.columns
    task_col = "sub_task" if "sub_task" in columns else ("dataset" if "dataset" in columns else None)
    if task_col is None:
        _require(columns, ["sub_task"], src.label, name)
    if "question" not in columns and "conversations" not in columns:
        _require(columns, ["question"], src.label, name)
    if "image_0" not in columns and "image" not in columns:
        _require(columns, ["image_0"], src.label, name)
    want = _norm_task(name)
    out: list[BenchSample] = []
    seen: set[str] = set()
    for i, row in src.rows(where=task_col, keep=lambda task: _norm_task(task) == want):
        question = _question_text(row)
        cells = _image_cells(row, columns)
        n_markers = question.count(IMAGE_MARKER)
        if not cells or len(cells) != n_markers:
            report.skip(f"{len(cells)} image(s) but {n_markers} {IMAGE_MARKER} marker(s) in the question")
            continue
        images = [to_pil(c, f"{src.label} row {i}", src.base) for c in cells]
        ref = row.get("answer")
        out.append(BenchSample(_uid(name, row, i, seen), name, llava_user_turn(question), images,
                               None if ref is None else str(ref)))
        if len(out) >= n:
            break
    return out


def load_real(name: str, path: Path, n: int, split: str | None = None) -> tuple[list[BenchSample], LoadReport]:
    """The first ``n`` usable samples of real benchmark ``name`` read from ``path``, from
    ``split`` (None: the benchmark's default, :data:`DEFAULT_SPLITS`)."""
    if name in MULTI_TURN or name in VIDEO_NAMES:
        kind = "multi-turn" if name in MULTI_TURN else "video"
        raise MMSpecError(f"{name!r} is the embedded world's {kind} family, with no loader of local files; "
                          f"write -d {name} (no =PATH)")
    if name not in N_IMAGES:
        raise MMSpecError(f"unknown benchmark {name!r}; choose from {sorted(N_IMAGES)}")
    split = split or DEFAULT_SPLITS[name]
    path = Path(path)
    if name in INTERLEAVE and path.is_dir() and (path / INTERLEAVE_CONFIG).is_dir():
        path = path / INTERLEAVE_CONFIG  # a snapshot of the whole bench: these tasks are in_domain's
    src = open_rows(path, split, name)
    report = LoadReport()
    if name in SINGLE_IMAGE:
        samples = _single_image(name, src, n, report)
    else:
        samples = _interleave(name, src, n, report)
    if not samples:
        raise MMSpecError(
            f"{src.label}: no usable {name} samples (skipped: {report.skipped or 'none'}); expected "
            f"{schema_text(name)}"
        )
    return samples, report


def load_mmspec(path: Path, n: int, split: str | None = None) -> tuple[list[BenchSample], LoadReport]:
    """The first ``n`` usable samples of each category of an MMSpec split (:mod:`mmspec.bench.mmspec_split`;
    ``split`` None: test), in file order. A sample is turn 1 of its row's conversation: the LLaVA-1.5
    chat (:func:`mmspec.prompt.llava_chat`) of its first question, its dataset ``mmspec/{category}``;
    :meth:`BenchSample.next_turn` asks the next one after the target's own answer. Bad rows are
    skipped and reported (``LoadReport.errors``: FILE:LINE, id, the fix); none usable is an error."""
    from mmspec.bench.mmspec_split import read_split

    read = read_split(path, split, n)
    report = LoadReport(dict(read.skipped), list(read.errors))
    if not read.rows:
        first = f" (first: {read.errors[0]})" if read.errors else ""
        raise MMSpecError(f"{read.file}: no usable MMSpec rows (skipped: {read.skipped or 'none'}){first}; expected "
                          "one JSON object a line with id, image (a path under the split's images/ folder), turns "
                          "(the user's questions), category, topic")
    samples = [BenchSample(r.uid, f"{MMSPEC}/{r.category}", llava_chat(r.turns[:1], ()), [r.image],
                           questions=r.turns) for r in read.rows]
    return samples, report


def load_dataset(name: str, path: Path | None, n: int,
                 split: str | None = None) -> tuple[list[BenchSample], LoadReport]:
    """Embedded world when ``path`` is None (``split`` None: test), else the real benchmark
    from local files (``split`` None: its own default split, :data:`DEFAULT_SPLITS`)."""
    if name == MMSPEC:
        if path is None:
            raise MMSpecError("-d mmspec needs the split's path: -d mmspec=PATH[:SPLIT], PATH a clone's dataset/MMSpec "
                              "folder (or one split's folder, holding mmspec.jsonl and images/)")
        return load_mmspec(Path(path), n, split)
    if path is None:
        if name not in EMBEDDED_NAMES:
            raise MMSpecError(f"unknown dataset {name!r}; choose from {sorted(EMBEDDED_NAMES)}")
        return load_embedded(name, n, split or EMBEDDED_SPLIT), LoadReport()
    return load_real(name, path, n, split)
