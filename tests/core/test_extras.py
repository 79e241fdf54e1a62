"""Optional extras: decoding needs none of the benchmark's packages, and a missing one is one line.

``pip install mmspec`` installs the decoding library and the CLI; ``[bench]`` adds matplotlib,
pyarrow and datasets (``mmspec report``'s plots, real benchmark files). These tests check that
``import mmspec``, the decoder and ``mmspec generate`` never import them (in a fresh process),
and that a missing one stops ``mmspec report`` / reading benchmark files with a one-line error
naming the extra to install, before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmspec.errors import MMSpecError

ROOT = Path(__file__).resolve().parents[2]
BENCH_ONLY = ("matplotlib", "pyarrow", "datasets")

_DECODE = """
import json, sys
import torch
from helpers.tiny import make_llava, make_prompt, make_tokenizer, noisy_copy
import mmspec
from mmspec.decoder import SpecDecoder
target = make_llava(0)
ids, pv = make_prompt(1, 16)
dec = SpecDecoder(target, noisy_copy(target, 1), make_tokenizer(), views="MT", gamma=3)
res = dec.generate(ids, pixel_values=pv, max_new_tokens=6)
assert len(res.token_ids) == 6
from typer.testing import CliRunner
from mmspec.cli import app
r = CliRunner().invoke(app, ["generate", "--max-new-tokens", "4", "--threads", "1"])
assert r.exit_code == 0, r.output
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r or m.startswith("mmspec.bench.plots"))))
""" % (BENCH_ONLY,)  # noqa: UP031 (a program's text as a %-template, kept as written)


def test_decoding_and_generate_import_no_bench_package():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _DECODE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _without(monkeypatch, *modules: str) -> None:
    """Make ``import M`` fail as for a package that is not installed (None in sys.modules)."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_report_without_matplotlib_is_one_line_before_anything_is_written(monkeypatch, tmp_path):
    from mmspec.bench.report import render_report
    from mmspec.cli import app

    _without(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with pytest.raises(MMSpecError, match=r"^mmspec report's plots needs matplotlib: pip install 'mmspec\[bench\]'$"):
        render_report(tmp_path)
    r = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "needs matplotlib: pip install 'mmspec[bench]'" in r.output, r.output
    assert "Traceback" not in r.output and list(tmp_path.iterdir()) == []


def test_benchmark_files_without_pyarrow_or_datasets_name_the_extra(monkeypatch, tmp_path):
    from mmspec.bench.sources import open_parquet, open_rows

    (tmp_path / "test.parquet").write_bytes(b"PAR1")
    _without(monkeypatch, "pyarrow", "pyarrow.parquet")
    with pytest.raises(MMSpecError, match=r"needs pyarrow: pip install 'mmspec\[bench\]'$"):
        open_parquet(tmp_path / "test.parquet")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["test"]}')
    _without(monkeypatch, "datasets")
    with pytest.raises(MMSpecError, match=r"needs datasets: pip install 'mmspec\[bench\]'$"):
        open_rows(saved, "test", "textvqa")


def test_a_broken_install_is_not_reported_as_missing(monkeypatch):
    """Only the package's own absence becomes the one-line hint; another missing module inside
    it is raised as it is."""
    from mmspec.bench.optional import require

    def broken(name, *a, **k):
        raise ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")

    monkeypatch.setattr("importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="kiwisolver"):
        require("matplotlib", "plots")


def test_extras_in_pyproject():
    """The core install has no benchmark package; [test] pulls [bench] and the test tools
    ([qwen]'s torchvision is left out: installed, it changes which image-processor backend
    transformers picks for every model)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].split("~")[0]  # noqa: E731
                          .strip().lower() for r in reqs}
    core, extras = names(project["dependencies"]), project["optional-dependencies"]
    assert not core & {"matplotlib", "pyarrow", "datasets", "accelerate", "torchvision"}
    assert {"torch", "transformers", "safetensors", "tokenizers", "pillow", "numpy", "typer", "rich", "tqdm"} <= core
    assert names(extras["bench"]) == {"matplotlib", "pyarrow", "datasets"}
    assert names(extras["qwen"]) == {"torchvision"}
    assert names(extras["test"]) == {"mmspec", "pytest", "pytest-xdist", "ruff", "accelerate", "openai", "httpx",
                                     "jsonschema"}
    assert names(extras["structured"]) == {"xgrammar", "apache-tvm-ffi"}  # structured outputs (docs/structured.md)
    assert "mmspec[structured]" in extras["test"] and not core & {"xgrammar", "apache-tvm-ffi"}
    assert "mmspec[bench]" in extras["test"]  # the suite renders reports and reads parquet
    assert names(extras["serve"]) == {"fastapi", "uvicorn", "prometheus-client"}  # prometheus: GET /metrics
    assert not core & {"fastapi", "uvicorn", "prometheus-client"}
    assert "mmspec[serve]" in extras["test"]  # the server's tests drive a real server with the openai client
