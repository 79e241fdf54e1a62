"""Every script in the top-level ``perf/`` runs: a smoke test each, on tiny settings (the embedded
pack or tiny random models, a few seconds), through its own command line where it has one, so no
script rots between the measurements that use it.

These check code paths and the files a run writes, not speed: timings under a test runner mean
nothing. ``speed.py`` (with its helpers ``breakdown.py`` and ``draftstep.py``), ``gpu_shapes.py``,
``profile_draft_step.py``, ``video_speed.py`` and ``ceilings.py`` are run by the tests
:data:`ELSEWHERE` names (``gpu_pass.sh``, the GPU pass: ``tests/perf/test_gpu_pass.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"
# script -> {test file that runs it: what that file names of it}
ELSEWHERE = {
    "speed": {"tests/bench/test_speed_bench.py": "load_script(\"speed\")"},
    "breakdown": {"tests/bench/test_speed_bench.py": "load_script(\"breakdown\")"},
    "draftstep": {"tests/bench/test_speed_bench.py": "draft_step"},  # speed.run's draft-step timing
    "gpu_shapes": {"tests/bench/test_speed_bench.py": "load_script(\"gpu_shapes\")"},
    "profile_draft_step": {"tests/bench/test_speed_bench.py": "profile_draft_step.py"},
    "serve_probes": {"tests/serve/test_serve_probes.py": "load_script(\"serve_probes\")"},
    "video_speed": {"tests/bench/test_speed_bench.py": "load_script(\"video_speed\")",
                    "tests/train/test_video_pair.py": "video_speed.py"},
    "ceilings": {"tests/perf/test_gpu_pass.py": "env.json"},  # gpu_pass.sh's env step, dry run
}
TESTED_HERE = ["batch_speed", "prefix_speed", "tree_sweep", "cpu_shapes", "serve_load", "head_formats_check",
               "serve_overhead", "lookup_speed", "serve_speed", "logprobs_cost", "mmspec_split",
               "threads", "policy_speed", "graph_warmup", "constrained_speed",
               "seed_coupling", "host_breakdown", "head_cost", "heads_bench_summary"]


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python perf/<name>.py ARGS`` from the repository root, this checkout's ``src/`` first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(PERF / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_every_perf_script_has_a_smoke_test():
    """A new script in perf/ needs a test here (or in a file named in ELSEWHERE) to be kept."""
    scripts = {p.stem for p in PERF.glob("*.py")}
    assert scripts == set(ELSEWHERE) | set(TESTED_HERE), "perf/ scripts without a smoke test, or tests of gone ones"
    for name, files in ELSEWHERE.items():
        for f, mark in files.items():
            assert mark in (ROOT / f).read_text(), f"{f} does not run perf/{name}.py"


def test_batch_speed():
    out = run_script("batch_speed", "--batch", "2", "--new", "4", "--speculate", "always", "never")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["target.generate", "mmspec M speculate=always", "mmspec M speculate=never"]
    assert all(r["B"] == 2 and r["tok_s"] > 0 for r in rows)
    assert all(r["same_as_target_batched"].endswith("/2") for r in rows[1:])


def test_batch_speed_engines():
    """The batched engine eager, with fixed shapes, and with (emulated) graphs: the same tokens."""
    out = run_script("batch_speed", "--batch", "3", "--new", "4", "--engine", "eager", "static", "graphs")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows[1:]] == [f"mmspec M speculate=always engine={e}" for e in ("eager", "static", "graphs")]
    assert all(r["same_as_target_batched"] == "3/3" for r in rows[1:])


def test_batch_speed_writes_each_row_and_goes_past_a_failing_setting(tmp_path, monkeypatch, capsys):
    """--out gets each row as it is measured; a setting that raises becomes an error row, the
    settings after it still run, and the exit status is 3."""
    bs = load_script("batch_speed")
    real = bs.spec_batched

    def flaky(dec, em, batch, new, speculate, overlap=None):
        if speculate == "never" and len(batch) == 2:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        return real(dec, em, batch, new, speculate, overlap)

    monkeypatch.setattr(bs, "spec_batched", flaky)
    out = tmp_path / "batch.jsonl"
    assert bs.main(["--batch", "2", "1", "--new", "3", "--speculate", "never", "always", "--out", str(out)]) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["B"], r["system"], "error" in r) for r in rows] == [
        (2, "target.generate", False), (2, "mmspec M speculate=never", True), (2, "mmspec M speculate=always", False),
        (1, "target.generate", False), (1, "mmspec M speculate=never", False), (1, "mmspec M speculate=always", False)]
    assert "INTERNAL ASSERT" in rows[1]["error"]
    assert capsys.readouterr().out.count("{") == 6  # the same rows on stdout


def test_batch_speed_admission():
    out = run_script("batch_speed", "--batch", "3", "--new", "3", "--admission", "--repeats", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["admission"] for r in rows] == ["one by one", "together"]
    assert all(r["same_tokens"] and r["ttft_cpu_s"] > 0 for r in rows)


def test_prefix_speed(tmp_path):
    """Exits 1 if an output with reuse differs from the fresh one."""
    out = run_script("prefix_speed", "--families", "chartqa", "--repeats", "1", "--turn1-tokens", "4",
                     "--turn2-tokens", "2", "--out", str(tmp_path / "prefix_speed"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    res = json.loads((tmp_path / "prefix_speed.json").read_text())
    assert res["all_identical"]
    assert "chartqa" in (tmp_path / "prefix_speed.md").read_text()
    out = run_script("prefix_speed", "--lookup", "3", "40", "--out", str(tmp_path / "prefix_speed"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = json.loads((tmp_path / "prefix_speed.lookup.json").read_text())
    assert [r["entries"] for r in rows] == [3, 40] and all(r["match_us"] > 0 for r in rows)


def test_tree_sweep(tmp_path):
    """Exits 1 if a tree's output differs from the target's. With emulated graphs (fixed shapes,
    the GPU's path); the report is written after each repeat; ``--auto``: tree="auto" beside, with
    the steps it drafted per shape and the figures it chose by."""
    out = run_script("tree_sweep", "--families", "chartqa", "--n-per-family", "1", "--max-new-tokens", "8",
                     "--shapes", "3x2x4", "--repeats", "2", "--threads", "1", "--graphs", "emulate", "--auto",
                     "--out", str(tmp_path))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert {"tree_sweep.json", "tree_sweep.md"} <= {p.name for p in tmp_path.iterdir()}
    assert "tree 3x2x4" in (tmp_path / "tree_sweep.md").read_text()
    res = json.loads((tmp_path / "tree_sweep.json").read_text())
    assert res["repeats_done"] == 2 and res["config"]["graphs"] == "emulate" and res["identical"]
    assert "auto" in [r["setting"] for r in res["rows"]] and sum(res["auto"]["steps"].values()) > 0
    assert res["auto"]["rates"]["1"]["choice"] and "chosen: **" in (tmp_path / "tree_sweep.md").read_text()


def test_cpu_shapes(monkeypatch, capsys):
    """The full run takes ~30 s of one thread; one tiny shape shows the table's line."""
    cs = load_script("cpu_shapes")
    monkeypatch.setattr(cs, "SHAPES", [("tiny 1x64", 64, 1, 128)])
    cs.main()
    line = capsys.readouterr().out.strip()
    assert line.startswith("tiny 1x64") and "one-token" in line and "6-token verify" in line


@pytest.mark.slow
def test_serve_load(tmp_path):
    """A real server (~15 s): every good answer identical to its solo run, every bad one a 400."""
    for module in ("fastapi", "uvicorn", "openai", "httpx"):
        pytest.importorskip(module)
    out = run_script("serve_load", "--out", str(tmp_path), "--requests", "6", "--clients", "2", "--bad", "0.34",
                     "--distinct", "2", "--max-tokens", "4", "--idle-wait", "0", "--threads", "1")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    res = json.loads((tmp_path / "serve_load.json").read_text())
    assert (res["good"], res["bad"]) == (4, 2)
    assert res["good_identical_to_solo"] == 4 and res["bad_got_400"] == 2
    assert res["server_alive_after"] and res["server"]["exit_code_on_sigterm"] == 0


@pytest.mark.slow
def test_serve_speed(tmp_path):
    """Two real servers and the generate worker (~20 s on a free machine: three processes load the
    pack), --quick: every system at 1 and 2 clients, answers identical to generate's, where the
    servers' time went read from their /metrics, the goals computed."""
    for module in ("fastapi", "uvicorn", "openai", "httpx", "prometheus_client"):
        pytest.importorskip(module)
    out_json = tmp_path / "serve_speed.json"
    out = run_script("serve_speed", "--quick", "--core", "none", "--out", str(out_json))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]  # exit 1: a failed request or a 1-client diff
    res = json.loads(out_json.read_text())
    rows = {(r["system"], r["clients"]): r for r in res["rows"]}
    assert set(rows) == {(s, c) for s in ("serve always", "serve never", "generate") for c in (1, 2)}
    assert all(r["identical_to_generate"] == "2/2" and r["tokens_per_s"] > 0 for r in rows.values())
    t = rows[("serve always", 1)]["time_goes"]
    assert t["mean_s"]["decode"] > 0 and t["mean_s"]["images"] > 0 and 0 < t["engine_thread_cpu_share"] <= 1
    assert sum(t["share_of_client_latency"].values()) == pytest.approx(1, abs=0.02)  # the phases cover it all
    assert {"speculation_vs_never_1_clients", "one_client_vs_generate"} <= set(res["goals"])
    assert res["setup"]["exit_codes_on_sigterm"] == {"always": 0, "never": 0}


@pytest.mark.slow
def test_logprobs_cost(tmp_path):
    """One real server, --quick: each request without and with logprobs, the same answers, the cost computed."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    out_json = tmp_path / "logprobs_cost.json"
    out = run_script("logprobs_cost", "--quick", "--out", str(out_json))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]  # exit 1: an answer changed with logprobs
    res = json.loads(out_json.read_text())
    assert res["answers_differ"] == 0 and len(res["rows"]) == 2 and res["mean_with_s"] > 0 < res["mean_without_s"]
    assert res["cost"] == pytest.approx(res["mean_with_s"] / res["mean_without_s"] - 1, abs=1e-3)


@pytest.mark.slow
def test_head_formats_check_mmspec_phase(tmp_path):
    """The mmspec phase in full (~15 s: build, save, ``mmspec export head`` twice, load back); the
    reference phase needs a venv with speculators and eagle-llm, so a stand-in python answers it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho \'{"reference": "stand-in"}\'\n')
    (venv / "bin" / "python").chmod(0o755)
    out = run_script("head_formats_check", "--venv", str(venv), "--work", str(tmp_path / "work"),
                     "--out", str(tmp_path / "out"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    res = json.loads((tmp_path / "out" / "check.json").read_text())
    assert res["mmspec"]["round_trip_identical"] and res["reference"] == "stand-in"
    assert {"eagle3", "eagle", "mine-eagle3", "target"} <= {p.name for p in (tmp_path / "work").iterdir()}


def test_serve_overhead():
    out = run_script("serve_overhead", "--blocks", "2", "--repeat", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "serve_overhead printed nothing"


def test_lookup_speed(tmp_path):
    out_json = tmp_path / "lookup.json"
    out = run_script("lookup_speed", "--systems", "target,suffix,M+lookup", "--families", "chartqa", "-n", "1",
                     "--warmup", "2", "--max-new-tokens", "6", "--out", str(out_json))
    assert out.returncode == 0, out.stderr[-3000:]  # exit 1 when an output differs from the target's
    assert out_json.exists()


def test_lookup_speed_batch(tmp_path):
    """--batch-size 2: generate_batch against the target's batched generate, CPU seconds beside wall."""
    out_json = tmp_path / "lookup_b2.json"
    out = run_script("lookup_speed", "--systems", "target,suffix,M+suffix", "--families", "single,conversation2",
                     "-n", "2", "--warmup", "2", "--max-new-tokens", "6", "--batch-size", "2", "--out", str(out_json))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]  # exit 1 when an output differs
    res = json.loads(out_json.read_text())
    assert res["args"]["batch_size"] == 2 and res["mismatches"] == []
    for fam in ("single", "conversation2"):
        for s in ("target", "suffix", "M+suffix"):
            row = res["families"][fam][s]
            assert row["tokens"] > 0 and row["cpu_seconds"] > 0 and row["cpu_speedup"] > 0


def test_seed_coupling(tmp_path):
    out_json = tmp_path / "seed_coupling.json"
    out = run_script("seed_coupling", "--families", "chartqa", "--n-per-family", "1", "--seeds", "2",
                     "--temperatures", "0.7", "--max-new-tokens", "6", "--out", str(out_json))
    assert out.returncode == 0, out.stderr[-3000:]  # exit 1 when a coupled answer depends on its batch
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["shape"], r["sampler"]) for r in rows} == {(s, m) for s in ("chain", "tree")
                                                         for m in ("rejection", "coupling")}
    assert all(r["tau"] >= 1 for r in rows) and all(r["same_alone"] for r in rows if r["sampler"] == "coupling")


def test_threads(tmp_path):
    out = run_script("threads", "--threads", "1", "--repeats", "1", "--new", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "threads.json").read_text())
    assert got["identical"] and [r["threads"] for r in got["rows"]] == [1] and got["default_threads_now"] >= 1


def test_mmspec_split(tmp_path):
    """The MMSpec-format split of the world's images reads back through the bench's loader: six
    categories, 2-3 turns each, no row skipped."""
    from mmspec.bench.datasets import load_dataset

    out = run_script("mmspec_split", "--out", str(tmp_path / "w"), "--n", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    samples, report = load_dataset("mmspec", tmp_path / "w", 2)
    assert len({s.dataset for s in samples}) == 6 and len(samples) == 12 and not report.skipped
    assert all(2 <= len(s.questions) <= 3 for s in samples)


def test_policy_speed(tmp_path):
    out = tmp_path / "p.jsonl"
    res = run_script("policy_speed", "--batch", "2", "--new", "3", "--ragged", "--ragged-n", "5", "--drafts", "random",
                     "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in rows if not r.get("summary")]
    assert {(r["workload"], r["mode"]) for r in runs} == {(w, m) for w in (2, "ragged") for m in ("always", "never", "auto")}
    sums = [r for r in rows if r.get("summary")]
    assert len(sums) == 2 and all(r["same_as_never"] for r in sums) and all(r["auto_vs_best"] > 0 for r in sums)


def test_host_breakdown(tmp_path):
    """Two batch sizes, streamed text: a line per B with every component, then the fit."""
    out = tmp_path / "h.jsonl"
    res = run_script("host_breakdown", "--batch", "1", "3", "--new", "16", "--stream", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    per_b, fit = rows[:-1], rows[-1]["fit"]
    assert [r["B"] for r in per_b] == [1, 3] and all(r["steady_steps"] > 0 and r["host_ms"] > 0 for r in per_b)
    assert set(fit) == {"host", "step_maths", "model_glue", "draft", "verify", "plan", "policy", "emit", "events",
                        "other"}
    res = run_script("host_breakdown", "--handoff", "--batch", "2", "--steps", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(json.loads(res.stdout.splitlines()[-1])["handoff_us_per_step"]) == {"per_update", "mailbox"}


def test_graph_warmup(tmp_path):
    out = tmp_path / "g.jsonl"
    res = run_script("graph_warmup", "--batch", "1", "--speculate", "never", "--context", "64", "--new", "3",
                     "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r.get("captured_after", 0) == 0 for r in rows), rows
def test_constrained_speed(tmp_path):
    """One bounded schema on the embedded pack: the constrained answer equals the target's own,
    validates and ends with EOS (exit 1 otherwise); the B=2 grammar-work probe is recorded."""
    out_json = tmp_path / "constrained.json"
    out = run_script("constrained_speed", "--schemas", "1", "--methods", "lookup", "--max-new-tokens", "32",
                     "--repeats", "1", "--warmup", "0", "--batch", "2", "--out", str(out_json), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    res = json.loads(out_json.read_text())
    assert res["failures"] == [] and res["rows"][0]["valid"]
    assert 0 < res["rows"][0]["lookup"]["forced_share"] <= 1 and res["batch"]["grammar_s"] > 0


def test_head_cost(tmp_path):
    """Every drafter's block timed by the engine in one run, every output the target's."""
    out = tmp_path / "head_cost.json"
    res = run_script("head_cost", "--rounds", "1", "--prompts", "1", "--families", "chartqa", "--gamma", "2",
                     "--max-new-tokens", "6", "--out", str(out))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    text = out.read_text()
    assert '"M"' in text and '"eagle3"' in text


def test_heads_bench_summary(tmp_path):
    """Tokens/s, τ and identical outputs per method of a bench results file (rows in its format)."""
    rows = [{"kind": "baseline", "method": None, "dataset": "chartqa", "token_ids": [1, 2, 3, 4], "wall_s": 2.0},
            {"kind": "spec", "method": "M", "dataset": "chartqa", "token_ids": [1, 2, 3, 4], "wall_s": 1.0,
             "identical": True, "stats": {"blocks": [{"n_emitted": 3, "draft_s": 0.01}, {"n_emitted": 1}]}},
            {"kind": "note"}]
    src = tmp_path / "results.rank0.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_script("heads_bench_summary", str(src), "--out", str(tmp_path / "summary.json"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["vs_target"]["M"] == 2.0 and summary["tau"]["M"] == 2.0 and summary["identical"]["M"] == "1/1"

