"""Helpers for the bench tests: parquet fixtures in the lmms-lab schemas, a fake backend that
counts its calls, and hand-built result rows."""

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


def _img(i: int) -> dict:
    return {"bytes": png_bytes((i * 40 % 256, 100, 200)), "path": f"img{i}.png"}


def write_chartqa(path: Path, n: int = 4) -> Path:
    """lmms-lab/ChartQA schema: type, question, answer, image{bytes,path}."""
    table = pa.table({
        "type": ["human_test"] * n,
        "question": [f"What is the value of bar {i}?" for i in range(n)],
        "answer": [str(i) for i in range(n)],
        "image": [_img(i) for i in range(n)],
    })
    pq.write_table(table, path)
    return path


def write_hallusion(path: Path) -> Path:
    """lmms-lab/HallusionBench schema; the second row is a text-only question (null image)."""
    table = pa.table({
        "category": ["VD", "VS", "VD"],
        "question_id": ["q0", "q1", "q2"],
        "question": ["Is the sky green?", "Is Paris in France?", "Is the cat black?"],
        "gt_answer_details": ["no", "yes", "yes"],
        "gt_answer": ["0", "1", "1"],
        "image": [_img(0), None, _img(2)],
    }, schema=pa.schema([("category", pa.string()), ("question_id", pa.string()),
                         ("question", pa.string()), ("gt_answer_details", pa.string()),
                         ("gt_answer", pa.string()),
                         ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))]))
    pq.write_table(table, path)
    return path


def write_interleave(path: Path) -> Path:
    """lmms-lab/LLaVA-NeXT-Interleave-Bench schema: sample_id, sub_task, question, answer,
    question_type, image_0..image_5 (unused slots null)."""
    story_q = ("Write a story. <image> Caption#1: Pororo wakes up. <image> Caption#2: He eats. "
               "<image> Caption#3: Crong arrives. <image> Caption#4: They play. <image> Caption#5:")
    rows = [
        ("Spot-the-Diff", "What changed?", 2),
        ("IEdit", "Edit instruction?", 2),
        ("PororoSV", story_q, 5),
        ("VIST", story_q.replace("Pororo", "Ann"), 5),
        ("VIST", "no captions here <image><image><image>", 3),  # wrong image count: skipped
        ("NLVR2_Mantis", "Is it true?", 2),  # another sub_task: ignored
    ]
    data: dict[str, list] = {"sample_id": [], "sub_task": [], "question": [], "answer": [],
                             "question_type": []}
    for k in range(6):
        data[f"image_{k}"] = []
    for i, (task, q, n_img) in enumerate(rows):
        data["sample_id"].append(i)
        data["sub_task"].append(task)
        data["question"].append(q)
        data["answer"].append(f"answer {i}")
        data["question_type"].append("open-ended")
        for k in range(6):
            data[f"image_{k}"].append(_img(k) if k < n_img else None)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("sample_id", pa.int64()), ("sub_task", pa.string()), ("question", pa.string()),
                        ("answer", pa.string()), ("question_type", pa.string())]
                       + [(f"image_{k}", struct) for k in range(6)])
    pq.write_table(pa.table(data, schema=schema), path)
    return path


class FakeBackend:
    """Deterministic stand-in for HFBackend: counts calls; can raise after ``fail_after`` calls."""

    def __init__(self, fail_after: int | None = None, gamma: int = 5, lossy_method: str | None = None):
        self.calls: list[tuple[str, str, str]] = []
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
