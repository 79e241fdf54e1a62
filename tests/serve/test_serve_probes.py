"""perf/serve_probes.py's quick subset against a real server (the embedded models, --api-key):
every hostile probe the expected 4xx in OpenAI's error shape, no 5xx, no server path in a
message, vanishing temperatures decode greedily, memory back near idle, and SIGTERM in the middle
of a body that never ends exits 0 within --shutdown-timeout (+1 s to answer the requests left)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from helpers.scripts import load_script  # noqa: E402


def test_the_fast_probe_set(tmp_path):
    probes = load_script("serve_probes")
    s = probes.run(argparse.Namespace(threads=1, fast=True, shutdown_timeout=3.0, idle_wait=1.0, out=tmp_path))
    assert s["wrong"] == [] and s["five_xx"] == [] and s["server_paths_shown"] == [], s["wrong"]
    assert s["probes"] >= 20 and s["server_alive_after"]
    assert all(e["ok"] for e in s["exact_probes"]), s["exact_probes"]
    assert s["rss_mb"]["within_bound"], s["rss_mb"]
    assert s["sigterm_mid_upload"]["exit_code"] == 0
    assert s["sigterm_mid_upload"]["seconds_to_exit"] < 3.0 + 1 + 3  # (+3 s: a loaded shared machine)
