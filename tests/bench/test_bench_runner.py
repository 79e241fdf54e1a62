"""The resumable runner: rows are durable, a kill or a torn line loses nothing finished, and a
re-run never recomputes a finished row."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.bench_data import FakeBackend, read_jsonl, write_chartqa, write_interleave
from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo
from mmspec.bench.runner import run_bench
from mmspec.bench.store import RowWriter, merge_rows, row_key
from mmspec.errors import MMSpecError

METHODS = ("M", "T", "MT")


def _cfg(tmp_path, **kw) -> BenchConfig:
    chart = write_chartqa(tmp_path / "chartqa.parquet", n=4)
    inter = write_interleave(tmp_path / "interleave.parquet")
    base = dict(out_dir=tmp_path / "out", methods=METHODS, n_samples=3, progress=False,
                datasets=(DatasetSpec("chartqa", chart), DatasetSpec("spot_the_diff", inter)))
    base.update(kw)
    return BenchConfig(**base)


def _keys(path):
    return [row_key(r) for r in read_jsonl(path)]


def test_full_run_rows(tmp_path):
    cfg = _cfg(tmp_path)
    be = FakeBackend()
    s = run_bench(cfg, backend=be, rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    # chartqa 3 samples, spot_the_diff 1 sample; each: baseline + 3 methods; + 2 latency rows
    assert s.written == s.rows_on_disk == len(rows) == 4 * 4 + 2 and s.latency_written == 2  # every row counted
    spec = [r for r in rows if r["kind"] == "spec"]
    assert all(r["identical"] for r in spec)
    r = next(r for r in spec if r["method"] == "M")
    assert r["accepted"] == [1, 1, 0] * 4 and r["views"] == ["M"]
    assert (cfg.out_dir / "run.rank0.json").exists()


def test_resume_after_kill_recomputes_nothing_finished(tmp_path):
    cfg = _cfg(tmp_path)
    killed = FakeBackend(fail_after=7)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, backend=killed, rank=RankInfo())
    path = cfg.out_dir / "results.rank0.jsonl"
    done = _keys(path)
    assert len(done) == 7  # every finished call was written before the kill
    # a kill mid-write leaves a torn line
    with open(path, "a") as f:
        f.write('{"kind": "spec", "dataset": "chartqa", "uid": "1", "meth')
    again = FakeBackend()
    s = run_bench(cfg, backend=again, rank=RankInfo())
    assert any("torn" in w for w in s.warnings)
    keys = _keys(path)
    assert len(keys) == len(set(keys)) == 4 * 4 + 2
    assert keys[:7] == done
    # the second run only did what was missing
    assert len(again.calls) == 4 * 4 + 2 - 7
    redone = {(k, d, u) for k, d, u in again.calls}
    assert not redone & {(k, d, u) for k, d, u in killed.calls}
    # a third run does nothing and never builds a backend
    third = run_bench(cfg, backend_factory=lambda c, r: pytest.fail("backend built"), rank=RankInfo())
    assert third.written == 0 and third.skipped == third.rows_on_disk == 18


def test_more_methods_later_only_adds_them(tmp_path):
    cfg = _cfg(tmp_path, methods=("M",))
    run_bench(cfg, backend=FakeBackend(), rank=RankInfo())
    be = FakeBackend()
    run_bench(_cfg(tmp_path, methods=("M", "C")), backend=be, rank=RankInfo())
    assert {c[0] for c in be.calls} == {"spec"} and all(c[2].endswith("/C") for c in be.calls)


def test_lossy_output_is_reported_at_run_time(tmp_path):
    s = run_bench(_cfg(tmp_path), backend=FakeBackend(lossy_method="T"), rank=RankInfo())
    assert len(s.lossless_failures) == 4 and all(f.endswith("/T") for f in s.lossless_failures)
    # relaxed acceptance is lossy by design: its differences are not lossless failures
    s = run_bench(_cfg(tmp_path / "relaxed"), backend=FakeBackend(lossy_method="T", lossy_acceptance="relaxed (lossy)"),
                  rank=RankInfo())
    assert s.lossless_failures == [] and s.written


def test_changed_settings_refuse_to_mix(tmp_path):
    run_bench(_cfg(tmp_path), backend=FakeBackend(), rank=RankInfo())
    with pytest.raises(MMSpecError, match="gamma"):
        run_bench(_cfg(tmp_path, gamma=3), backend=FakeBackend(), rank=RankInfo())


def test_torn_line_truncated_and_garbage_in_middle_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    good = {"kind": "baseline", "dataset": "d", "uid": "1", "method": ""}
    path.write_text(json.dumps(good) + "\n" + "{not json\n")
    w = RowWriter(path)
    w.close()
    assert path.read_text() == json.dumps(good) + "\n" and w.warnings
    path.write_text("{bad\n" + json.dumps(good) + "\n")
    with pytest.raises(MMSpecError, match="not valid JSON"):
        RowWriter(path)


def test_rank_sharding_and_merge(tmp_path):
    cfg = _cfg(tmp_path)
    for r in (0, 1):
        run_bench(cfg, backend=FakeBackend(), rank=RankInfo(r, 2, r))
    r0 = {(x["dataset"], x["uid"]) for x in read_jsonl(cfg.out_dir / "results.rank0.jsonl") if x["kind"] == "baseline"}
    r1 = {(x["dataset"], x["uid"]) for x in read_jsonl(cfg.out_dir / "results.rank1.jsonl") if x["kind"] == "baseline"}
    assert r0 and r1 and not r0 & r1
    assert r0 | r1 == {("chartqa", "0"), ("chartqa", "1"), ("chartqa", "2"), ("spot_the_diff", "0")}
    rows, _ = merge_rows(cfg.out_dir)
    assert len([x for x in rows if x["kind"] == "baseline"]) == 4
    assert len([x for x in rows if x["kind"] == "latency"]) == 3  # rank 1 has no spot_the_diff


def test_rank_from_env():
    assert RankInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).shard(list(range(5))) == [1, 3]
    assert RankInfo.from_env({}) == RankInfo(0, 1, 0)
    with pytest.raises(MMSpecError):
        RankInfo.from_env({"RANK": "2", "WORLD_SIZE": "2"})


def _cli(*args):
    from typer.testing import CliRunner

    from mmspec.cli.bench import bench_app

    return CliRunner().invoke(bench_app, ["run", "--no-progress", *map(str, args)])


def test_ctrl_c_says_what_is_kept_and_the_same_command_resumes(tmp_path):
    """Ctrl-C exited silently: it now says how many rows are kept and that the same command
    resumes; "wrote N rows" counts every row the file holds (latency rows were left out)."""
    data = write_chartqa(tmp_path / "c.parquet", n=3)
    args = ["--out", tmp_path / "out", "-d", f"chartqa={data}", "-m", "M,T", "-n", "3"]
    r = _cli(*args, "--backend", "helpers.bench_data:make_interrupted_backend")
    out = " ".join(r.output.split())
    path = tmp_path / "out" / "results.rank0.jsonl"
    assert r.exit_code == 130, r.output
    assert (f"interrupted: rank 0 keeps 5 finished rows in {path} (5 written by this run); run the same command "
            "again to resume from there") in out, out
    assert len(read_jsonl(path)) == 5
    r = _cli(*args, "--backend", "helpers.bench_data:make_fake_backend")
    assert r.exit_code == 0, r.output
    total = len(read_jsonl(path))
    assert total == 1 + 3 * 3  # a latency row, then baseline + 2 methods for each of 3 samples
    assert f"wrote {total - 5} rows (0 of them latency), 5 already done -> {path} ({total} rows)" in r.output, r.output


def test_threads_default_and_flag(tmp_path, monkeypatch):
    """--threads sets torch's threads before any model runs and is recorded with the run; the
    default is the idle cores shared among the local ranks of a torchrun job (the load's part:
    tests/core/test_threads.py)."""
    import torch

    from mmspec.bench.store import read_run_meta
    from mmspec.threads import default_threads

    assert default_threads({"LOCAL_WORLD_SIZE": "2"}, available=8, cores=8, load=0.0) == 4
    assert default_threads({"LOCAL_WORLD_SIZE": "4"}, available=2, cores=2, load=0.0) == 1  # never 0
    assert default_threads({}, available=2, cores=2, load=0.0) == 2
    data = write_chartqa(tmp_path / "c.parquet", n=1)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    r = _cli("--out", tmp_path / "out", "-d", f"chartqa={data}", "-m", "M", "-n", "1", "--threads", "3",
             "--backend", "helpers.bench_data:make_fake_backend")
    assert r.exit_code == 0 and set_to == [3], r.output
    assert read_run_meta(tmp_path / "out")[0]["config"]["extra"] == {"threads": 3}
    r = _cli("--out", tmp_path / "out", "--threads", "0")
    assert r.exit_code == 2 and "--threads must be >= 1" in r.output, r.output


# ------------------------------------------------------------------ methods, heads, bad options
def test_method_notation_suffixes_in_any_order_and_the_old_form_named():
    from mmspec.bench.config import parse_method, split_methods

    assert parse_method("eagle+relaxed+tree") == parse_method("eagle+tree+relaxed") == \
        ((), {"acceptance": "relaxed", "tree": "dynamic", "head": "eagle"})
    assert parse_method("MT+tree:6x4x16") == (("M", "T"), {"tree": "6x4x16"})
    assert parse_method("M+relaxed+tree:[[0],[1],[0,0]]")[1]["tree"] == "[[0],[1],[0,0]]"
    assert split_methods(["M,M+tree:[[0],[1]]", "eagle3+tree"]) == ("M", "M+tree:[[0],[1]]", "eagle3+tree")
    for bad, msg in [("M+tree@16", "old tree@BUDGET form; give the whole shape as \\+tree:DEPTHxTOPKxBUDGET"),
                     ("M+tree:0x4x16", "the depth in tree '0x4x16' must be >= 1"),
                     ("M+tree:[[0],[2]]", "skips rank 1"),
                     ("M+tree+tree:6x4x16", "two tree parts"),
                     ("tree", "has no views")]:
        with pytest.raises(MMSpecError, match=msg):
            parse_method(bad)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    from helpers.tiny import make_llava
    from mmspec.heads import build_head

    root = tmp_path_factory.mktemp("heads")
    target = make_llava(0, dtype=torch.float32)
    for name, variant, seed in (("eagle_a", "eagle", 1), ("eagle_b", "eagle", 2), ("eagle3", "eagle3", 3)):
        build_head(target, variant, seed=seed).save(root / name)
    return root


@pytest.mark.parametrize("args, phrase", [
    (["-m", "eagle", "--head", "eagle=HEADS/eagle3"], "holds an eagle3 head, not an eagle one"),
    (["-m", "eagle"], "-m eagle needs --head eagle=DIR (no head ships with the embedded pack"),
    (["-m", "M", "--head", "eagle=HEADS/eagle_a"], "--head eagle=... is given but no method drafts with it"),
    (["-m", "eagle", "--head", "eagle=HEADS"], "is not a draft head directory"),
    (["-m", "M+tree@16"], "old tree@BUDGET form"),
    (["-m", "M", "--threads", "0"], "--threads must be >= 1"),
    (["-m", "M", "--latency-repeats", "0"], "--latency-repeats) must be >= 1"),
    (["-m", "M", "-n", "0"], "n_samples (-n / --n-samples) must be >= 1 sample per dataset, got 0"),
    (["-m", "M", "--gamma", "0"], "--gamma"),
    (["-m", "M,M"], "listed twice"),
    (["-m", "M,M+relaxed", "--temperature", "0.7"], "+relaxed (MSD's relaxed acceptance) is defined for greedy"),
    (["-m", "M,MT", "--pool-tokens", "4"], "--pool-tokens 4 sets the pooled view (P), which no method uses"),
    (["-m", "M", "--target", "HEADS/eagle_a", "--draft", "HEADS"], "--target 'HEADS/eagle_a' is a draft head directory"),
    (["-m", "M", "--target", "HEADS", "--draft", "HEADS"], "--target 'HEADS' is not a model directory (no config.json)"),
])
def test_bad_bench_options_are_refused_and_leave_no_file(tmp_path, heads, args, phrase):
    r = _cli("--out", tmp_path / "out", "-d", "chartqa", *[str(a).replace("HEADS", str(heads)) for a in args])
    out = " ".join(r.output.split())
    phrase = phrase.replace("HEADS", str(heads))
    assert r.exit_code == 2 and phrase in out and "Traceback" not in out, r.output
    assert not (tmp_path / "out").exists()


def test_cuda_on_a_cpu_only_torch_is_refused_by_bench(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = _cli("--out", tmp_path / "out", "-d", "chartqa", "-m", "M", "--device", "cuda")
    assert r.exit_code == 2 and "has no CUDA GPU; use --device cpu" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "out").exists()


def test_resuming_with_another_head_names_the_setting_and_both_values(tmp_path, heads, monkeypatch):
    monkeypatch.setattr("mmspec.heads.directory.target_shape", lambda target: (64, 96, 2))  # the fake's target: the
    # heads' own (width, vocabulary, layers), so the preflight's fit check passes them
    a, b = str(heads / "eagle_a"), str(heads / "eagle_b")
    run_bench(_cfg(tmp_path, methods=("M", "eagle"), heads=(("eagle", a),)), backend=FakeBackend(), rank=RankInfo())
    with pytest.raises(MMSpecError) as e:
        run_bench(_cfg(tmp_path, methods=("M", "eagle"), heads=(("eagle", b),)), backend=FakeBackend(), rank=RankInfo())
    msg = str(e.value)
    assert "different settings (heads: " in msg and a in msg and b in msg, msg
    with pytest.raises(MMSpecError, match=r"different settings \(gamma: 5 there, 3 now"):
        run_bench(_cfg(tmp_path, methods=("M", "eagle"), heads=(("eagle", a),), gamma=3), backend=FakeBackend(),
                  rank=RankInfo())


def test_bench_help_says_every_head_method_needs_a_head():
    from typer.testing import CliRunner

    from mmspec.cli.bench import bench_app

    out = " ".join(CliRunner().invoke(bench_app, ["run", "--help"], env={"COLUMNS": "300"}).output.split())
    assert "none ships with the embedded pack" in out and "found without" not in out
    assert "+tree:DEPTHxTOPKxBUDGET" in out and "Token trees" in out


def test_a_target_without_a_processor_is_refused_before_the_results_directory(tmp_path):
    from helpers.tiny import make_llava

    make_llava(0, dtype=torch.float32).save_pretrained(tmp_path / "bare")
    r = _cli("--out", tmp_path / "out", "-d", "chartqa", "-m", "M", "--target", tmp_path / "bare", "--draft",
             tmp_path / "bare")
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "has no processor or tokenizer" in out and "processor.save_pretrained" in out, r.output
    assert not (tmp_path / "out").exists()
