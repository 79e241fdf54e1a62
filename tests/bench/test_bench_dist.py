"""Scale-out: the same `bench run` under torchrun with 2 CPU processes shards samples by RANK,
each rank writes its own file, a re-run resumes, and `report` merges the rank files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from helpers.bench_data import read_jsonl, write_chartqa
from mmspec.cli.bench import bench_app

TESTS = Path(__file__).parents[1]


def _torchrun(out: Path, data: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mmspec.cli.bench", "run", "--out", str(out), "--dataset", f"chartqa={data}",
           "--method", "M,T", "--n-samples", "5", "--no-progress",
           "--backend", "helpers.bench_data:make_fake_backend"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)


def test_torchrun_two_ranks_shard_resume_and_merge(tmp_path):
    data = write_chartqa(tmp_path / "c.parquet", n=5)
    out = tmp_path / "out"
    proc = _torchrun(out, data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    uids = {}
    for r in (0, 1):
        rows = read_jsonl(out / f"results.rank{r}.jsonl")
        uids[r] = sorted(x["uid"] for x in rows if x["kind"] == "baseline")
        assert all(x["rank"] == r for x in rows)
    assert uids == {0: ["0", "2", "4"], 1: ["1", "3"]}
    again = _torchrun(out, data)  # resume: nothing left to do on either rank
    assert again.returncode == 0 and again.stdout.count("wrote 0 rows") == 2, again.stdout
    res = CliRunner().invoke(bench_app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    text = (out / "report.md").read_text()
    assert "2 rank file(s)" in text and "rank 1/2" in text
    assert "(10 outputs checked)" in text  # 5 samples x 2 methods, merged from both ranks
