"""``perf/gpu_pass.sh``, the prepared GPU pass, proven on the CPU so no GPU minute goes to a wrong
argument: every step's command line (the GPU's and the dry run's) parses through its script's own
argument parser, the CUDA test files exist, and a short dry run shows that a failing step loses
no other step's results and that the pack holds everything after each step.

The whole dry run (all eight steps, ~1.5 minutes on two cores) is ``bash perf/gpu_pass.sh DIR
--dry-run``; here a part of it runs, in seconds (the dry run of each script's step is also
run by its own smoke test: ``tests/bench/test_speed_bench.py``, ``tests/perf/test_perf_scripts.py``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PASS = ROOT / "perf" / "gpu_pass.sh"
STEPS = ["env", "tests", "speed", "bf16", "batch", "trees", "shapes", "compile"]


def gpu_pass(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PASS), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def listed(out: Path, *args: str) -> list[tuple[str, int, list[str]]]:
    res = gpu_pass(str(out), "--list", *args)
    assert res.returncode == 0, res.stderr
    rows = [line.split("\t") for line in res.stdout.splitlines()]
    return [(name, int(limit), shlex.split(cmd)) for name, limit, cmd in rows]


@pytest.mark.parametrize("mode", [(), ("--dry-run",)], ids=["gpu", "dry-run"])
def test_every_command_line_parses(tmp_path, mode):
    """Each python step's arguments go through its script's parse_args (a typo, a removed flag,
    a bad choice fail here, not on the GPU); the pytest step names files that exist."""
    steps = listed(tmp_path / "out", *mode)
    assert [s for s, _, _ in steps] == STEPS
    gpu = not mode
    for name, limit, argv in steps:
        assert 0 < limit <= 150, name
        assert argv[0] == "python3"
        if argv[1] == "-m":
            assert argv[2] == "pytest"
            files = [a for a in argv if a.endswith(".py")]
            assert {"tests/core/test_graphs.py", "tests/core/test_batch_graphs.py"} <= set(files)
            assert all((ROOT / f).is_file() for f in files)
            assert ("--collect-only" in argv) != gpu
            continue
        script = Path(argv[1])
        assert script.parent == Path("perf") and (ROOT / script).is_file()
        parsed = load_script(script.stem).parse_args(argv[2:])
        device = getattr(parsed, "device", None)
        assert device == ("cuda" if gpu else "cpu"), (name, device)
        out = getattr(parsed, "out", None)
        assert out and Path(out).is_relative_to(tmp_path / "out"), (name, out)
        if script.stem == "gpu_shapes":
            assert parsed.small != gpu
        if name == "bf16":
            assert parsed.dtype == "bfloat16"
        if not gpu and script.stem in ("speed", "tree_sweep"):
            assert parsed.graphs == "emulate"  # the dry run takes the GPU's fixed-shape path


def test_dry_run_goes_past_a_failing_step_and_packs_everything(tmp_path):
    """batch fails at once (a stand-in python), then env runs for real on the CPU: batch's rc is
    recorded, the step after it still runs, the pack holds every log and JSON."""
    py = tmp_path / "py"
    py.write_text(f'#!/bin/sh\ncase "$*" in *batch_speed*) echo "boom" >&2; exit 7 ;; esac\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    out, pack = tmp_path / "out", tmp_path / "res" / "results.tgz"
    res = gpu_pass(str(out), "--dry-run", "--steps", "batch,env", "--pack", str(pack), env={"PY": str(py)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = {r["step"]: r for r in map(json.loads, (out / "pass.jsonl").read_text().splitlines())}
    assert list(steps) == ["batch", "env"] and (steps["batch"]["rc"], steps["env"]["rc"]) == (7, 0)
    assert "boom" in (out / "batch.log").read_text()
    env = json.loads((out / "env" / "env.json").read_text())
    assert env["copy_GBps_read_plus_write"] > 0 and env["bf16_matmul_TFLOPs"] > 0 and env["torch"]
    with tarfile.open(pack) as tar:
        names = set(tar.getnames())
    assert {"./pass.jsonl", "./pass.txt", "./env.log", "./batch.log", "./env/env.json"} <= names
    assert re.search(r"^batch +rc=7 ", res.stdout, re.M)  # the closing summary


def test_budget_skips_a_step_that_cannot_finish(tmp_path):
    res = gpu_pass(str(tmp_path / "out"), "--dry-run", "--steps", "env", "--budget", "15",
                   "--pack", str(tmp_path / "p.tgz"))
    assert res.returncode == 0, res.stderr
    (row,) = map(json.loads, (tmp_path / "out" / "pass.jsonl").read_text().splitlines())
    assert row["rc"] == -1 and row["note"].startswith("skipped")
    assert not (tmp_path / "out" / "env.log").exists() and (tmp_path / "p.tgz").exists()


@pytest.mark.parametrize(("args", "error"), [
    (("--steps", "env,nosuch"), "unknown step 'nosuch'"),
    (("--pack", "{out}/r.tgz"), "lies inside OUTDIR"),
    (("--bogus",), "unknown option --bogus"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, error):
    out = tmp_path / "out"
    res = gpu_pass(str(out), *(a.format(out=out) for a in args))
    assert res.returncode == 2 and error in res.stderr
    assert not (out / "pass.jsonl").exists()
