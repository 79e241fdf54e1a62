"""Helpers for the bench tests: parquet fixtures in the lmms-lab schemas and hub snapshot layouts
(``data/{split}-0000k-of-0000n.parquet``), a fake backend that counts its calls, and hand-built
result rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from mmspec.bench.backend import Generation
from mmspec.bench.config import BenchConfig, RankInfo
from mmspec.bench.datasets import BenchSample
from mmspec.stats import BlockRecord, GenerationStats


def png_bytes(color: tuple[int, int, int], size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # the hub's datasets.Image in parquet


def _img(i: int) -> dict:
    return {"bytes": png_bytes(color_of(i)), "path": f"img{i}.png"}


def color_of(i: int) -> tuple[int, int, int]:
    """The colour of fixture image ``i`` (tests check images arrive in order by it)."""
    return (i * 40 % 256, 100, 200)


def write_rows(path: Path, rows: list[dict], schema: pa.Schema, row_group_size: int | None = None) -> Path:
    """One parquet file of ``rows`` (dicts) in ``schema``; small ``row_group_size`` for row-group tests."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_snapshot(root: Path, shards: dict[str, list[list[dict]]], schema: pa.Schema, folder: str = "data") -> Path:
    """A hub snapshot: ``{folder}/{split}-0000k-of-0000n.parquet``, one file per list of rows."""
    for split, files in shards.items():
        for k, rows in enumerate(files):
            write_rows(root / folder / f"{split}-{k:05d}-of-{len(files):05d}.parquet", rows, schema)
    return root


CHARTQA = pa.schema([("type", pa.string()), ("question", pa.string()), ("answer", pa.string()), ("image", IMAGE)])


def chartqa_rows(n: int, start: int = 0) -> list[dict]:
    return [{"type": "human_test", "question": f"What is the value of bar {i}?", "answer": str(i), "image": _img(i)}
            for i in range(start, start + n)]


def write_chartqa(path: Path, n: int = 4) -> Path:
    """lmms-lab/ChartQA schema: type, question, answer, image{bytes,path}."""
    return write_rows(path, chartqa_rows(n), CHARTQA)


TEXTVQA = pa.schema([("image_id", pa.string()), ("question_id", pa.int64()), ("question", pa.string()),
                     ("image", IMAGE), ("answers", pa.list_(pa.string())), ("set_name", pa.string())])


def textvqa_rows(split: str, ids: range) -> list[dict]:
    """lmms-lab/textvqa rows; the test split carries no answers."""
    return [{"image_id": f"im{q}", "question_id": q, "question": f"what is written on sign {q}?",
             "image": _img(q), "answers": None if split == "test" else [f"word{q}"] * 10, "set_name": split}
            for q in ids]


HALLUSION = pa.schema([("category", pa.string()), ("subcategory", pa.string()), ("visual_input", pa.string()),
                       ("set_id", pa.string()), ("figure_id", pa.string()), ("sample_note", pa.string()),
                       ("question_id", pa.string()), ("question", pa.string()),
                       ("gt_answer_details", pa.string()), ("gt_answer", pa.string()),
                       ("filename", pa.string()), ("image", IMAGE)])


def hallusion_rows(split: str) -> list[dict]:
    """lmms-lab/HallusionBench rows: ``question_id`` repeats across sets and figures; the
    ``non_image`` split's questions have no image."""
    keys = [("VD", "illusion", "0", "0", "0"), ("VD", "illusion", "0", "1", "0"),
            ("VS", "chart", "1", "0", "0"), ("VS", "chart", "1", "0", "1")]
    rows = []
    for k, (cat, sub, set_id, fig, qid) in enumerate(keys):
        image = _img(k) if split == "image" else None
        rows.append({"category": cat, "subcategory": sub, "visual_input": "1" if image else "0",
                     "set_id": set_id, "figure_id": fig, "sample_note": "", "question_id": qid,
                     "question": f"Is statement {k} true?", "gt_answer_details": "yes" if k % 2 else "no",
                     "gt_answer": str(k % 2), "filename": f"./{cat}/{sub}/{set_id}_{fig}.png", "image": image})
    return rows


def write_hallusion(path: Path) -> Path:
    """lmms-lab/HallusionBench schema in one file; the second row is a text-only question (null image)."""
    rows = hallusion_rows("image")
    rows[1] = {**rows[1], "image": None, "visual_input": "0"}
    return write_rows(path, rows, HALLUSION)


N_IMAGE_COLUMNS = 12  # image_0 .. image_11 in lmms-lab/LLaVA-NeXT-Interleave-Bench
INTERLEAVE = pa.schema([("sample_id", pa.int64()), ("sub_task", pa.string())]
                       + [(f"image_{k}", IMAGE) for k in range(N_IMAGE_COLUMNS)]
                       + [("question", pa.string()), ("answer", pa.string()), ("question_type", pa.string())])

# (sub_task, question with its own <image> markers, number of images, question_type); the
# instructions vary per row, as in the bench (Appendix C's strings are one variant each)
INTERLEAVE_ROWS = [
    ("Spot-the-Diff", "Explain the disparities between the first and second image.\n<image>\n<image>\nDifference:",
     2, "open-ended"),
    ("IEdit", "Please provide instructions for editing the source image to match the target image.\n"
              "Source Image: <image>\nTarget Image: <image>\nInstruction:", 2, "open-ended"),
    ("NLVR2_Mantis", "<image> <image> Is there a dog in the left image? A. yes B. no", 2, "multi-choice"),
    ("IEdit", "<image><image>\nHow would the first picture have to change to become the second?", 2, "open-ended"),
    ("PororoSV", "Given the progression of the story with the first few images, can you write a fitting end "
                 "considering the last image?\n<image> Caption#1: Pororo wakes up.\n<image> Caption#2: He eats.\n"
                 "<image> Caption#3: Crong arrives.\n<image> Caption#4: They play.\n<image> Caption#5:", 5, "open-ended"),
    ("VIST", "With the narratives paired with the initial images, how would you conclude the story using the "
             "last picture?\n<image> Caption#1: We drove to the lake.\n<image> Caption#2: The water was cold.\n"
             "<image> Caption#3:", 3, "open-ended"),
    ("VIST", "Finish the story told by these photos.\n<image> Story#1: A birthday.\n<image> Story#2: Cake.\n"
             "<image> Story#3: Gifts.\n<image> Story#4: Songs.\n<image> Story#5:", 5, "open-ended"),
    ("VIST", "<image> <image> <image> A story with one picture too many:", 4, "open-ended"),  # skipped: 4 images, 3 markers
]


def interleave_rows(rows=INTERLEAVE_ROWS, first_id: int = 0) -> list[dict]:
    """lmms-lab/LLaVA-NeXT-Interleave-Bench (in_domain) rows: image_k null past the row's last image."""
    out = []
    for i, (task, q, n_img, qtype) in enumerate(rows):
        row = {"sample_id": first_id + i, "sub_task": task, "question": q, "answer": f"answer {first_id + i}",
               "question_type": qtype}
        row.update({f"image_{k}": _img(k) if k < n_img else None for k in range(N_IMAGE_COLUMNS)})
        out.append(row)
    return out


def write_interleave(path: Path, rows: list[dict] | None = None, row_group_size: int | None = None) -> Path:
    """The interleave bench's schema in one file (default rows: :data:`INTERLEAVE_ROWS`)."""
    return write_rows(path, interleave_rows() if rows is None else rows, INTERLEAVE, row_group_size)


class FakeBackend:
    """Deterministic stand-in for HFBackend: counts calls; can raise after ``fail_after`` calls."""

    def __init__(self, fail_after: int | None = None, gamma: int = 5, lossy_method: str | None = None,
                 lossy_acceptance: str = "exact"):
        self.calls: list[tuple[str, str, str]] = []
        self.lossy_acceptance = lossy_acceptance  # "relaxed (lossy)": the lossy method says it is lossy
        self.fail_after = fail_after
        self.gamma = gamma
        self.lossy_method = lossy_method

    def _tick(self, *call: str) -> None:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated kill")
        self.calls.append(call)

    def _tokens(self, sample: BenchSample) -> list[int]:
        return [(sum(map(ord, sample.uid)) % 7 + i) % 50 for i in range(12)]

    def baseline(self, sample: BenchSample) -> Generation:
        self._tick("baseline", sample.dataset, sample.uid)
        return Generation(self._tokens(sample), "text", 1.0, 10)

    def spec(self, sample: BenchSample, method: str) -> Generation:
        self._tick("spec", sample.dataset, f"{sample.uid}/{method}")
        acc = {"M": 2, "T": 1, "C": 3}.get(method, 2)
        stats = GenerationStats(gamma=self.gamma, views=tuple(method))
        left = 12
        while left > 0:
            emit = min(acc + 1, left)
            stats.blocks.append(BlockRecord(self.gamma, acc, emit, 0.01, 0.02))
            left -= emit
        stats.total_s = 0.5
        toks = self._tokens(sample)
        if method == self.lossy_method:
            toks = toks[:-1] + [99]
            stats.acceptance = self.lossy_acceptance
        return Generation(toks, "text", 0.5, 10, stats.to_dict())

    def latency(self, sample: BenchSample) -> dict:
        self._tick("latency", sample.dataset, "")
        return {"target_decode_s": 0.01, "target_verify_s": 0.012, "target_vision_s": 0.002,
                "target_prefill_s": 0.02, "context_len": 10, "gamma": self.gamma, "repeats": 1,
                "device": "cpu",
                "draft_decode_s": {str(b): 0.001 + 0.0001 * b for b in range(1, 9)}}

    def describe(self) -> dict:
        return {"source": "fake", "device": "cpu", "target_params": 0, "draft_params": 0}


def make_fake_backend(cfg: BenchConfig, rank: RankInfo) -> FakeBackend:
    """Factory for ``mmspec bench run --backend fixtures_bench:make_fake_backend``."""
    return FakeBackend(gamma=cfg.gamma)


def make_interrupted_backend(cfg: BenchConfig, rank: RankInfo) -> FakeBackend:
    """Factory for a run that gets Ctrl-C after 5 finished calls (latency, baseline, spec...)."""
    return FakeBackend(fail_after=5, gamma=cfg.gamma)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
