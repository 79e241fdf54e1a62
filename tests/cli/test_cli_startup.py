"""The command line starts light: importing ``mmspec.cli.app``, printing any command's ``--help``
and refusing a bad flag load no torch, no transformers and none of mmspec's training, world or
decoding packages (each command imports them inside its function, once its flags are read).

What is imported is measured, not how long it takes (docs/perf.md has the timings), in a fresh
interpreter so that no other test's imports count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mmspec

HEAVY = ("torch", "transformers", "numpy", "mmspec.train", "mmspec.world", "mmspec.engine", "mmspec.models",
         "mmspec.decoder", "mmspec.serve.app", "mmspec.audit")

PROBE = """
import json, sys
from mmspec.cli.app import app
codes = []
for args in json.loads(sys.argv[1]):
    try:
        app(args, prog_name="mmspec")
    except SystemExit as e:
        codes.append(e.code)
heavy = json.loads(sys.argv[2])
print(json.dumps({"codes": codes, "loaded": sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".")
                                                                                for h in heavy))}))
"""


def _probe(runs: list[list[str]]) -> dict:
    """Run the command lines ``runs`` one after the other in one fresh interpreter: their exit codes
    and the heavy modules loaded at the end (none at the end: none by any of them)."""
    env = dict(os.environ, PYTHONPATH=str(Path(mmspec.__file__).parents[1]), COLUMNS="100")
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(runs), json.dumps(HEAVY)], env=env,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_app_loads_nothing_heavy():
    assert _probe([]) == {"codes": [], "loaded": []}


def test_help_and_bad_flags_load_nothing_heavy():
    commands = [[], ["generate"], ["demo"], ["serve"], ["audit"], ["bench"], ["bench", "run"], ["report"],
                ["train"], ["train", "head"], ["train", "answers"], ["train", "embedded"], ["train", "stage"],
                ["train", "video"], ["train", "align"], ["train", "evaluate"], ["train", "facts"],
                ["export", "head"], ["check", "head"]]
    bad = [["generate"], ["demo"], ["serve"], ["bench", "run"], ["train", "head"], ["train", "answers"]]
    r = _probe([c + ["--help"] for c in commands] + [c + ["--bad-flag"] for c in bad])
    assert r == {"codes": [0] * len(commands) + [2] * len(bad), "loaded": []}


def test_every_dtype_flag_names_the_dtypes_it_accepts():
    """Issue 61 item 8: `--dtype` took float64 but its help did not say so."""
    from typer.testing import CliRunner

    from mmspec.cli.app import app
    from mmspec.models.loading import resolve_dtype

    names = ("float32", "bfloat16", "float16", "float64")
    for name in names:
        assert resolve_dtype(name) != "auto"
    for cmd in (["generate"], ["serve"], ["bench", "run"]):
        out = " ".join(CliRunner().invoke(app, cmd + ["--help"], env={"COLUMNS": "300"}).output.split())
        line = out[out.index("--dtype"):][:200]
        assert all(n in line for n in names), (cmd, line)
