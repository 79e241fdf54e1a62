"""``mmspec bench run --batch-size``: validation before anything is written, the batched rows
(resumable), the target's batched output checked against its solo one, and the report's numbers."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from helpers.bench_data import FakeBackend, read_jsonl
from mmspec.bench.backend import Generation
from mmspec.bench.batch_report import batch_metrics, percentile, stops_paying
from mmspec.bench.batched import cut_at_eos
from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo, parse_batch_sizes
from mmspec.bench.report import render_report
from mmspec.bench.runner import run_bench
from mmspec.errors import MMSpecError

METHODS = ("M", "T")


class BatchFake(FakeBackend):
    """FakeBackend plus the batched calls: a batch of B takes 1 + 0.25 B s (target) or 0.5 + 0.1 B s (a
    method); ``target_flip`` makes the target's batched row differ from its solo output, ``bad_method``
    a method's batched row."""

    def __init__(self, target_flip: bool = False, bad_method: str | None = None, **kw):
        super().__init__(**kw)
        self.target_flip, self.bad_method = target_flip, bad_method

    def audit(self, sample, own, ours):  # a tiny margin: a near-tie in half precision, a bug in float32
        from mmspec.bench.audit import first_difference

        return {"position": first_difference(own, ours), "margin": 1e-6, "logit_gap": 1e-6}

    def target_batch(self, samples):
        self._tick("target_batch", samples[0].dataset, ",".join(s.uid for s in samples))
        wall = 1.0 + 0.25 * len(samples)
        gens = [Generation(self._tokens(s), "text", wall, 10) for s in samples]
        if self.target_flip:
            gens[0].token_ids = gens[0].token_ids[:-1] + [77]
        return gens, wall

    def spec_batch(self, samples, method):
        self._tick("spec_batch", samples[0].dataset, method)
        wall = 0.5 + 0.1 * len(samples)
        gens = []
        for s in samples:
            g = self.spec(s, method)
            self.calls.pop()
            g.wall_s = wall
            if method == self.bad_method:
                g.token_ids = g.token_ids[:3] + [98] + g.token_ids[4:]
            gens.append(g)
        return gens, wall


def _cfg(tmp_path, **kw) -> BenchConfig:
    base = {"out_dir": tmp_path / "out", "methods": METHODS, "n_samples": 5, "progress": False, "latency": False,
            "datasets": (DatasetSpec("chartqa"),), "max_new_tokens": 12}
    base.update(kw)
    return BenchConfig(**base)


@pytest.mark.parametrize("text,msg", [("0", "whole number >= 1"), ("2.5", "not a whole number"),
                                      ("x", "not a whole number"), ("", "not a whole number"),
                                      ("-1", "not a whole number"), ("2,,4", "not a whole number")])
def test_bad_batch_size_text_is_refused(text, msg):
    with pytest.raises(MMSpecError, match=msg):
        sizes = parse_batch_sizes(text)
        BenchConfig(batch_sizes=sizes, n_samples=16, progress=False)


def test_batch_sizes_parse_and_check():
    assert parse_batch_sizes("8") == (8,) and parse_batch_sizes(" 1, 2,4 ") == (1, 2, 4)
    with pytest.raises(MMSpecError, match="lists a size twice"):
        BenchConfig(batch_sizes=(2, 2), n_samples=4)
    with pytest.raises(MMSpecError, match="larger than --n-samples 4"):
        BenchConfig(batch_sizes=(8,), n_samples=4)
    with pytest.raises(MMSpecError, match="greedy only"):
        BenchConfig(batch_sizes=(2,), n_samples=4, temperature=0.7)
    BenchConfig(batch_sizes=(1,), n_samples=4, temperature=0.7)  # B = 1 is today's run, sampling too


def test_batch_under_torchrun_is_refused_before_anything_is_written(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(1, 2))
    with pytest.raises(MMSpecError, match="WORLD_SIZE=2"):
        run_bench(cfg, backend=BatchFake(), rank=RankInfo(0, 2, 0))
    assert not cfg.out_dir.exists()


def test_cli_bad_batch_size_exits_2_and_writes_nothing(tmp_path):
    from mmspec.cli.app import app

    for bad in ("0", "two", "1.5"):
        res = CliRunner().invoke(app, ["bench", "run", "--out", str(tmp_path / "o"), "-d", "chartqa", "-m", "M",
                                       "-n", "2", "--batch-size", bad, "--no-progress"])
        assert res.exit_code == 2, res.output
        assert "--batch-size" in res.output and "error" in res.output
    assert not (tmp_path / "o").exists()


def test_batch_size_one_is_todays_run(tmp_path):
    be = BatchFake()
    run_bench(_cfg(tmp_path), backend=be, rank=RankInfo())
    rows = read_jsonl(tmp_path / "out" / "results.rank0.jsonl")
    assert {r["kind"] for r in rows} == {"baseline", "spec"}
    assert not any(c[0].endswith("_batch") for c in be.calls)


def test_batched_rows_timing_and_resume(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(1, 2, 4))
    be = BatchFake()
    s = run_bench(cfg, backend=be, rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    timing = [r for r in rows if r["kind"] == "batch"]
    # 5 samples: B=1 -> 5 batches, B=2 -> 3, B=4 -> 2; each for the target + 2 methods
    assert len(timing) == (5 + 3 + 2) * 3
    outs = [r for r in rows if r["kind"] == "batch_out"]
    assert len(outs) == 5 * 3 * 3 and len({r["uid"] + r["method"] for r in outs}) == len(outs)
    b4 = [t for t in timing if t["batch_size"] == 4 and t["method"] == "target"]
    assert [t["n_requests"] for t in b4] == [4, 1] and b4[0]["wall_s"] == 2.0
    assert b4[0]["tokens_per_s"] == pytest.approx(4 * 12 / 2.0) and b4[0]["latency_s"] == [2.0] * 4
    assert all(r["identical_to_solo"] for r in outs) and not s.lossless_failures and not s.target_batch_differs
    # the target's batch is called with consecutive samples, B of them
    calls = [c for c in be.calls if c[0] == "target_batch"]
    assert calls[5][2] == "chartqa-test-0,chartqa-test-1"
    again = run_bench(cfg, backend=BatchFake(), rank=RankInfo())  # resumed: nothing recomputed
    assert again.written == 0 and len(read_jsonl(cfg.out_dir / "results.rank0.jsonl")) == len(rows)


def test_batch_rows_resume_after_a_kill(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(2,))
    n_solo = 5 * 3  # baseline + 2 methods per sample
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, backend=BatchFake(fail_after=n_solo + 4), rank=RankInfo())
    first = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    assert sum(r["kind"] == "batch" for r in first) == 4
    be = BatchFake()
    run_bench(cfg, backend=be, rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    assert sum(r["kind"] == "batch" for r in rows) == 3 * 3
    assert len(be.calls) == 9 - 4  # only the batches not on disk


def test_target_batch_difference_is_reported_and_method_difference_fails(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(2,))
    s = run_bench(cfg, backend=BatchFake(target_flip=True, bad_method="T"), rank=RankInfo())
    assert s.target_batch_differs == ["chartqa/chartqa-test-0@b2", "chartqa/chartqa-test-2@b2",
                                      "chartqa/chartqa-test-4@b2"]
    assert len(s.lossless_failures) == 5 and all(f.endswith("/T@b2") for f in s.lossless_failures)
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    bad = [r for r in rows if r["kind"] == "batch_out" and r["method"] == "T"]
    assert all(r["audit_class"] == "bug" and r["dtype"] == "float32" for r in bad)  # float32: never a near-tie
    assert all(r["audit"]["position"] == 3 for r in bad)
    text = render_report(cfg.out_dir).read_text()
    assert "LOSSLESSNESS BUGS: 5 difference(s)" in text
    assert "The target's own batched generate differs from its solo output for: B = 2: 3/5" in text


def test_report_batch_numbers(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(1, 2, 4))
    run_bench(cfg, backend=BatchFake(), rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    ms = {(m["batch_size"], m["method"]): m for m in batch_metrics(rows)}
    t2, m2 = ms[(2, "target")], ms[(2, "M")]
    # B=2: batches of 2, 2, 1 -> target walls 1.5, 1.5, 1.25; method walls 0.7, 0.7, 0.6; 12 tokens each
    assert t2["tokens_per_s"] == pytest.approx(60 / 4.25) and m2["tokens_per_s"] == pytest.approx(60 / 2.0)
    assert m2["vs_target"] == pytest.approx(4.25 / 2.0)
    assert t2["p50_s"] == 1.5 and m2["p90_s"] == pytest.approx(0.7)
    assert m2["tau"] == pytest.approx(3.0) and m2["identical_to_solo"] == m2["checked"] == 5
    text = render_report(cfg.out_dir).read_text()
    assert "## Batches: mmspec vs the target's batched greedy generate" in text
    assert m2["p50_finish_s"] == pytest.approx(0.5)  # the fake's GenerationStats.total_s
    assert "| 2 | M | 5 | 30.0 | 2.12 | 0.700 | 0.700 | 0.500 | 3.00 | 5/5 |" in text
    assert "| 2 | target | 5 | 14.1 | 1.00 | 1.500 | 1.500 | 1.500 | – | 5/5 |" in text
    assert "Drafting stops paying (best method below the target's throughput) at: **no B of this run**" in text


def test_percentile_and_stops_paying():
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5 and percentile([1.0], 0.9) == 1.0
    assert percentile([], 0.5) is None and percentile([0, 10], 0.9) == pytest.approx(9.0)
    ms = [{"batch_size": b, "method": m, "vs_target": v} for b, m, v in
          [(1, "target", 1.0), (1, "M", 2.0), (4, "M", 1.1), (4, "T", 0.5), (8, "M", 0.9), (16, "M", 0.7)]]
    assert stops_paying(ms) == 8
    assert stops_paying(ms[:4]) is None


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 0, 0], 2) == [5, 6, 2]
    assert cut_at_eos([5, 6, 7], [2, 9]) == [5, 6, 7] and cut_at_eos([5, 9, 2], [2, 9]) == [5, 9]
    assert cut_at_eos([5], None) == [5]


def test_goal_lines_use_the_solo_baseline_when_b1_is_not_swept(tmp_path):
    cfg = _cfg(tmp_path, batch_sizes=(4,), n_samples=8)
    run_bench(cfg, backend=BatchFake(), rank=RankInfo())
    text = render_report(cfg.out_dir).read_text()
    # no B = 8 here: no goal line; B = 4 rows only
    assert "| 4 | target | 8 |" in text and "goal at B = 8" not in text
    cfg8 = _cfg(tmp_path / "b", batch_sizes=(8,), n_samples=8)
    run_bench(cfg8, backend=BatchFake(), rank=RankInfo())
    text = render_report(cfg8.out_dir).read_text()
    # M at B = 8: 96 tokens / 1.3 s vs the target's 96 / 3.0 s -> 2.31x; p50 1.300 s vs solo baseline wall 1.000 s
    assert ("- goal at B = 8, M: throughput ×target 2.31 (goal ≥ 1.50: met); p50 1.300 s vs the target's p50 at "
            "B = 1 1.000 s (goal ≤: NOT met)") in text


def test_auto_suffix_is_the_batched_speculation_policy():
    from mmspec.bench.config import method_tree, method_views

    assert method_tree("M+auto") == {"speculate": "auto"} and method_views("MT+auto") == ("M", "T")
    assert method_tree("M+tree+auto") == {"tree": "dynamic", "speculate": "auto"}
    with pytest.raises(MMSpecError, match="twice"):
        method_tree("M+auto+auto")
