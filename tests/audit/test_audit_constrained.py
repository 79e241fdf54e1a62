"""Constrained requests end to end on the embedded models: `mmspec serve` (speculative) answers a
JSON schema, json_object, a choice, a regex, a named tool and "required" tool calls, and `mmspec
audit` finds every answer identical to the target's own decoding under the same constraint (its
local reference); the schema's answer validates. Needs the constrained-decoding core (xgrammar)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
httpx = pytest.importorskip("httpx")
if importlib.util.find_spec("mmspec.constrain.compile") is None:
    pytest.skip("needs mmspec.constrain.compile (the constrained-decoding core)", allow_module_level=True)

from typer.testing import CliRunner  # noqa: E402

from helpers.servers import free_port  # noqa: E402
from mmspec.cli import app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                           "value": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "value"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "report", "parameters": SCHEMA}}
FORMS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA}}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"choice": ["red", "blue", "green", "yellow"]}},
    {"structured_outputs": {"regex": "[a-z]+( [a-z]+){0,3}"}},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "report"}}},
    {"tools": [TOOL, {"type": "function", "function": {"name": "done"}}], "tool_choice": "required"},
]


def start_serve(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "serve.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("mmspec serve did not start")


@pytest.mark.slow
def test_constrained_answers_are_identical_to_the_targets_constrained_decoding(tmp_path):
    from mmspec.audit.requests import world_requests

    jsonschema = pytest.importorskip("jsonschema")
    reqs = world_requests(len(FORMS), max_tokens=32)
    lines = [json.dumps({**r.body, **form, "id": f"form-{k}"}) for k, (r, form) in enumerate(zip(reqs, FORMS))]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    proc, url = start_serve(tmp_path)
    try:
        first = {**json.loads(lines[0]), "temperature": 0}
        first.pop("id")
        answer = httpx.post(url + "/v1/chat/completions", json=first, timeout=300).json()["choices"][0]
        if answer["finish_reason"] == "stop":  # a complete answer validates (a cut one says "length")
            jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)
        out = tmp_path / "out"
        r = CliRunner().invoke(app, ["audit", "--endpoint", url, "--requests", str(tmp_path / "requests.jsonl"),
                                     "--threads", "1", "--out", str(out), "--concurrency", "1"])
        assert r.exit_code == 0, r.output
        rep = json.loads((out / "report.json").read_text())
        assert (rep["requests"], rep["identical"]) == (len(FORMS), len(FORMS)), rep
        rows = [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()[1:]]
        assert {row["compared"] for row in rows} == {"ids"} and all(row["chars"] > 0 for row in rows)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
