"""``mmspec audit`` against endpoints: small FastAPI servers in the test (a near-tie built by
hand, a reference that gives logprobs, an endpoint that refuses them, ones that are no OpenAI
server), and real ``mmspec serve`` processes (speculation on and off, and behind a proxy that
flips one token of some answers) against the local embedded target."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from helpers.servers import ThreadServer, free_port  # noqa: E402
from mmspec.cli import app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


# ------------------------------------------------------------------------------ fake endpoints
def completion(text: str, tokens: list[tuple[str, float, dict]] | None, finish: str = "stop") -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    if tokens is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                           "top_logprobs": [{"token": a, "logprob": b} for a, b in top.items()]}
                                          for t, lp, top in tokens]}
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice]}


def fake(answer, logprobs: bool = True, key: str | None = None) -> FastAPI:
    """An OpenAI-ish server: ``answer(question) -> (text, tokens)``; without ``logprobs`` a request
    asking for them gets vLLM-style 400 "logprobs is not supported"."""
    api = FastAPI()
    api.state.seen = []

    @api.get("/v1/models")
    def models(request: Request):
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, status_code=401)
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        api.state.seen.append((request.headers.get("content-type"), body))
        if body.get("logprobs") and not logprobs:
            return JSONResponse({"error": {"message": "logprobs is not supported", "type": "invalid"}}, 400)
        text, tokens = answer(body["messages"][-1]["content"])
        return completion(text, tokens if body.get("logprobs") else None)

    return api


TIE = {" red": math.log(0.5), " blue": math.log(0.4995), " green": math.log(0.0004)}
FAR = {" red": math.log(0.9), " blue": math.log(0.05)}


def ref_answer(q: str):
    top = TIE if q == "tie" else FAR
    return "The bar is red.", [("The", -0.01, {"The": -0.01}), (" bar", -0.02, {" bar": -0.02}),
                               (" is", -0.01, {" is": -0.01}), (" red", top[" red"], top), (".", -0.1, {".": -0.1})]


def spec_answer(q: str):
    word = " red" if q == "same" else " blue"
    text = f"The bar is{word}."
    return text, [(t, -0.1, {}) for t in ("The", " bar", " is", word, ".")]


@pytest.fixture(scope="module")
def fakes():
    servers = {"ref": ThreadServer(fake(ref_answer)), "spec": ThreadServer(fake(spec_answer)),
               "textonly": ThreadServer(fake(spec_answer, logprobs=False)),
               "keyed": ThreadServer(fake(spec_answer, key="sekret"))}
    yield servers
    for s in servers.values():
        s.stop()


def requests_file(tmp_path: Path, questions: list[str]) -> Path:
    p = tmp_path / "requests.jsonl"
    p.write_text("".join(json.dumps({"id": q + str(i), "messages": [{"role": "user", "content": q}],
                                     "max_tokens": 8}) + "\n" for i, q in enumerate(questions)))
    return p


class Ran:
    """A CLI run: its exit code and its output with rich's line wrapping undone."""

    def __init__(self, result):
        self.exit_code, self.output = result.exit_code, " ".join(result.output.split())


def audit(*args: str) -> Ran:
    return Ran(runner.invoke(app, ["audit", *args], catch_exceptions=False))


@pytest.mark.parametrize("spec", ["spec", "textonly"])
def test_near_tie_and_bug_against_a_reference_endpoint(fakes, tmp_path, spec):
    """Hand-built: the reference puts ' red' and ' blue' within 5e-4 (a bfloat16 near-tie) in one
    question and far apart in another; the endpoint answers ' blue' to both, ' red' to 'same'.
    With logprobs the endpoints' token strings are compared; without, the text is aligned."""
    out = tmp_path / "out"
    r = audit("--endpoint", fakes[spec].url, "--reference", fakes["ref"].url, "--dtype", "bfloat16",
              "--requests", str(requests_file(tmp_path, ["same", "tie", "far"])), "--out", str(out))
    assert r.exit_code == 1, r.output  # the far one is a bug
    rep = json.loads((out / "report.json").read_text())
    assert (rep["requests"], rep["identical"], rep["near_ties"], rep["bugs"]) == (3, 1, 1, 1), rep
    tie, bug = rep["differences"]
    assert tie["id"] == "tie1" and tie["class"] == "near-tie"
    d = tie["difference"]
    assert (d["position"], d["reference_token"], d["endpoint_token"]) == (3, " red", " blue")
    assert d["margin"] == pytest.approx(0.0005) and d["compared"] == ("tokens" if spec == "spec" else "text")
    assert bug["id"] == "far2" and bug["difference"]["margin"] == pytest.approx(0.85)
    seen = fakes[spec].server.config.app.state.seen
    assert {c for c, _ in seen} == {"application/json"}  # standard OpenAI: a JSON body, said so
    assert all(b["temperature"] == 0 and b["model"] == "m" for _, b in seen)
    # float32 (the default): every difference is a bug; only-near-ties exits 0
    out2 = tmp_path / "out2"
    r = audit("--endpoint", fakes[spec].url, "--reference", fakes["ref"].url,
              "--requests", str(requests_file(tmp_path, ["tie"])), "--out", str(out2))
    assert r.exit_code == 1 and json.loads((out2 / "report.json").read_text())["bugs"] == 1
    r = audit("--endpoint", fakes[spec].url, "--reference", fakes["ref"].url, "--tolerance", "1e-3",
              "--requests", str(requests_file(tmp_path, ["tie", "same"])))
    assert r.exit_code == 0, r.output
    assert "near-ties" in r.output


def test_resume_skips_finished_requests(fakes, tmp_path):
    out = tmp_path / "out"
    args = ["--endpoint", fakes["spec"].url, "--reference", fakes["ref"].url, "--dtype", "bfloat16",
            "--requests", str(requests_file(tmp_path, ["same", "tie"])), "--out", str(out)]
    assert audit(*args).exit_code == 0
    n_seen = len(fakes["spec"].server.config.app.state.seen)
    assert audit(*args).exit_code == 0
    assert len(fakes["spec"].server.config.app.state.seen) == n_seen  # nothing sent again
    rows = (out / "audit.jsonl").read_text().splitlines()
    assert "settings" in json.loads(rows[0]) and len(rows) == 3
    r = audit(*args[:-4], "--dtype", "float16", *args[-4:])
    assert r.exit_code == 2 and "other settings" in r.output


def test_bad_endpoints_and_flags(fakes, tmp_path):
    reqs = str(requests_file(tmp_path, ["same"]))
    port = free_port()
    r = audit("--endpoint", f"http://127.0.0.1:{port}", "--reference", fakes["ref"].url, "--requests", reqs)
    assert r.exit_code == 2 and "cannot reach the endpoint" in r.output and "connection refused" in r.output
    r = audit("--endpoint", fakes["keyed"].url, "--reference", fakes["ref"].url, "--requests", reqs)
    assert r.exit_code == 2 and "HTTP 401" in r.output and "--api-key" in r.output
    r = audit("--endpoint", fakes["keyed"].url, "--api-key", "sekret", "--reference", fakes["ref"].url,
              "--requests", reqs, "--tolerance", "1")
    assert r.exit_code == 0, r.output
    html = FastAPI()
    html.get("/v1/models")(lambda: PlainTextResponse("<html>hello</html>"))
    s = ThreadServer(html)
    try:
        r = audit("--endpoint", s.url, "--reference", fakes["ref"].url, "--requests", reqs)
        assert r.exit_code == 2 and "not JSON" in r.output and "OpenAI-compatible" in r.output
    finally:
        s.stop()
    r = audit("--endpoint", fakes["spec"].url, "--model", "gpt-4o", "--reference", fakes["ref"].url, "--requests", reqs)
    assert r.exit_code == 2 and "does not serve the model 'gpt-4o'" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{oops\n')
    r = audit("--endpoint", fakes["spec"].url, "--reference", fakes["ref"].url, "--requests", str(bad))
    assert r.exit_code == 2 and "bad.jsonl line 2: not valid JSON" in r.output
    for flags, says in ((["--concurrency", "0"], "--concurrency must be >= 1"),
                        (["--dtype", "fp8"], "--dtype must be one of"),
                        (["--tolerance", "2"], "--tolerance bounds"),
                        (["--top-logprobs", "50"], "--top-logprobs must be from 0 to 20"),
                        (["--reference-target", str(tmp_path)], "two references"),
                        (["--endpoint", "localhost:8000"], "no http(s) URL"),
                        (["--out", reqs], "is a file, not a directory")):
        r = audit("--endpoint", fakes["spec"].url, "--reference", fakes["ref"].url, "--requests", reqs, *flags)
        assert r.exit_code == 2 and says in r.output, (flags, r.output)


# ------------------------------------------------------------------------------ real mmspec serve
def start_serve(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(tmp / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--threads", "1", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"serve-{port}.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("mmspec serve did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


N, MAX_TOKENS = 6, 24


@pytest.mark.parametrize("speculate", ["always", "never"])
def test_mmspec_serve_is_identical_to_the_local_target(tmp_path, speculate):
    proc, url = start_serve(tmp_path, "--speculate", speculate)
    try:
        out = tmp_path / "out"
        r = audit("--endpoint", url, "-n", str(N), "--max-tokens", str(MAX_TOKENS), "--threads", "1",
                  "--out", str(out))
        assert r.exit_code == 0, r.output
        rep = json.loads((out / "report.json").read_text())
        assert (rep["requests"], rep["identical"]) == (N, N), rep
        rows = [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()[1:]]
        assert all(row["chars"] > 0 for row in rows)  # real answers, not empty ones
    finally:
        stop(proc)


def flipper(upstream: str, tokenizer, flipped: list) -> FastAPI:
    """A proxy in front of mmspec serve that replaces the 4th token of about half the answers."""
    api = FastAPI()
    other = tokenizer.encode(" zebra", add_special_tokens=False)[0]

    @api.get("/v1/models")
    def models():
        return httpx.get(upstream + "/v1/models").json()

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        r = httpx.post(upstream + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            return JSONResponse(r.json(), status_code=r.status_code)
        data = r.json()
        question = json.dumps(body["messages"])
        choice = data["choices"][0]
        choice.pop("logprobs", None)
        ids = tokenizer.encode(choice["message"]["content"], add_special_tokens=False)
        if zlib.crc32(question.encode()) % 2 == 0 and len(ids) > 4 and ids[3] != other:
            ids[3] = other
            choice["message"]["content"] = tokenizer.decode(ids)
            flipped.append(question)
        return data

    return api


def test_flipped_tokens_are_bugs(tmp_path):
    from mmspec.embedded import load_embedded

    tok = load_embedded().tokenizer
    proc, url = start_serve(tmp_path)
    flipped: list = []
    proxy = ThreadServer(flipper(url, tok, flipped))
    try:
        out = tmp_path / "out"
        r = audit("--endpoint", proxy.url, "-n", str(N), "--max-tokens", str(MAX_TOKENS), "--threads", "1",
                  "--out", str(out))
        rep = json.loads((out / "report.json").read_text())
        assert flipped, "the proxy flipped nothing: pick other requests"
        assert r.exit_code == 1, r.output
        assert rep["bugs"] == len(flipped) and rep["identical"] == N - len(flipped), rep
        for d in rep["differences"]:
            assert d["class"] == "bug" and d["difference"]["position"] <= 3
            assert d["difference"]["margin"] > 0  # the target preferred its own token
    finally:
        proxy.stop()
        stop(proc)
