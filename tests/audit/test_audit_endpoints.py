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
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse  # noqa: E402
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


# a near-tie planted at a known margin, in mmspec's own logprobs form (each entry with its token_id)
MARGIN = 3e-4
IDS = {"The": 10, " bar": 11, " is": 12, " red": 13, " blue": 14, ".": 15}


def id_entries(words: list[str], top3: dict[str, float] | None = None) -> list[dict]:
    def entry(w, lp):
        return {"token": w, "logprob": lp, "bytes": list(w.encode()), "token_id": IDS[w]}

    tops = [top3 if k == 3 and top3 else {} for k in range(len(words))]
    return [{**entry(w, top.get(w, -0.01)), "top_logprobs": [entry(a, b) for a, b in top.items()]}
            for w, top in zip(words, tops)]


def ids_server(words_of) -> FastAPI:
    """An endpoint that writes mmspec's logprobs (a ``token_id`` per entry): ``words_of(question) ->
    (words, top of position 3)``."""
    api = FastAPI()

    @api.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        words, top = words_of(body["messages"][-1]["content"])
        data = completion("".join(words), None)
        data["choices"][0]["logprobs"] = {"content": id_entries(words, top)}
        return data

    return api


def ids_reference(q: str):
    top = {" red": math.log(0.5), " blue": math.log(0.5 - MARGIN)} if q == "tie" else \
        {" red": math.log(0.9), " blue": math.log(0.05)}
    return ["The", " bar", " is", " red", "."], top


def ids_endpoint(q: str):
    return ["The", " bar", " is", " red" if q == "same" else " blue", "."], None


def test_a_near_tie_planted_at_a_known_margin_is_told_from_a_divergence(tmp_path):
    """mmspec's ``token_id`` fields are compared as ids; the reference puts the endpoint's token
    MARGIN below its own in one question ('tie') and 0.85 below in another ('far'). A tolerance
    just above MARGIN calls the first a near-tie and the second a bug; just below, both are bugs;
    the report gives the margin planted."""
    ref, spec = ThreadServer(ids_server(ids_reference)), ThreadServer(ids_server(ids_endpoint))
    try:
        reqs = str(requests_file(tmp_path, ["same", "tie", "far"]))
        for tol, exit_code, classes in ((MARGIN * 1.01, 1, ["near-tie", "bug"]), (MARGIN * 0.99, 1, ["bug", "bug"])):
            out = tmp_path / f"out{tol}"
            r = audit("--endpoint", spec.url, "--reference", ref.url, "--requests", reqs, "--tolerance", repr(tol),
                      "--out", str(out))
            assert r.exit_code == exit_code, r.output
            rep = json.loads((out / "report.json").read_text())
            assert rep["identical"] == 1 and [d["class"] for d in rep["differences"]] == classes, rep
            tie, far = (d["difference"] for d in rep["differences"])
            assert (tie["compared"], tie["position"], tie["reference_token"], tie["endpoint_token"]) == \
                ("ids", 3, IDS[" red"], IDS[" blue"])
            assert tie["margin"] == pytest.approx(MARGIN, rel=1e-9) and far["margin"] == pytest.approx(0.85)
        r = audit("--endpoint", spec.url, "--reference", ref.url, "--requests",
                  str(requests_file(tmp_path, ["same", "tie"])), "--tolerance", repr(MARGIN * 1.01))
        assert r.exit_code == 0 and "near-ties" in r.output, r.output  # only a near-tie: exit 0
    finally:
        ref.stop()
        spec.stop()


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
    page = ("<!DOCTYPE html>\n<html>\n<head>\n  <title>404 Not Found</title>\n</head>\n<body>\n<h1>Not Found</h1>\n"
            + "<p>The requested URL was not found on this server.</p>\n" * 20 + "</body>\n</html>\n")
    nginx = FastAPI()
    nginx.get("/v1/models")(lambda: HTMLResponse(page, status_code=404))
    s = ThreadServer(nginx)
    try:  # a web server that is no OpenAI server: one line naming the page, no markup
        raw = runner.invoke(app, ["audit", "--endpoint", s.url, "--reference", fakes["ref"].url, "--requests", reqs])
        assert raw.exit_code == 2 and "HTTP 404 (an HTML page ('404 Not Found'))" in " ".join(raw.output.split())
        assert "<" not in raw.output and len(raw.output) < 400, raw.output
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
        assert {row["compared"] for row in rows} == {"ids"}  # by mmspec's token ids (and the texts)
    finally:
        stop(proc)


def proxy(upstream: str, change) -> FastAPI:
    """A proxy in front of mmspec serve: ``change(body, data)`` may rewrite each 200 answer's JSON."""
    api = FastAPI()

    @api.get("/v1/models")
    def models():
        return httpx.get(upstream + "/v1/models").json()

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        r = httpx.post(upstream + "/v1/chat/completions", json=body, timeout=300)
        data = r.json()
        if r.status_code == 200:
            change(body, data)
        return JSONResponse(data, status_code=r.status_code)

    return api


def tamperer(upstream: str, tokenizer, kind: str, tampered: list, word: str = " purple") -> FastAPI:
    """A proxy that changes the 4th token of every answer long enough: ``kind`` "text" in
    ``message.content`` only (its logprobs left alone), "token" in the logprobs only (the token,
    its id and bytes; the text left alone)."""
    (other,) = tokenizer.encode(word, add_special_tokens=False)  # one token of the world's vocabulary

    def change(body: dict, data: dict) -> None:
        choice = data["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) > 4 and content[3]["token_id"] != other:
            if kind == "text":
                ids = [c["token_id"] for c in content]
                ids[3] = other
                choice["message"]["content"] = tokenizer.decode(ids)
            else:
                piece = tokenizer.decode([other])
                content[3].update(token=piece, token_id=other, bytes=list(piece.encode()))
            tampered.append(json.dumps(body["messages"]))

    return proxy(upstream, change)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One mmspec serve (speculation on) for the tampering tests, and the embedded tokenizer."""
    from mmspec.embedded import default_path, load_embedded

    proc, url = start_serve(tmp_path_factory.mktemp("serve"))
    yield url, load_embedded().tokenizer, str(default_path() / "target")
    stop(proc)


@pytest.mark.parametrize("reference", ["local", "endpoint"])
@pytest.mark.parametrize("kind", ["text", "token"])
def test_tampered_answers_are_bugs(served, tmp_path, kind, reference):
    """mmspec serve behind a proxy that changes one token of each answer in its text alone, or in its
    logprobs alone: every tampered answer is a bug, the others identical, against the local target
    and against mmspec serve itself as the reference (``--reference URL --tokenizer DIR``)."""
    url, tok, tok_dir = served
    tampered: list = []
    proxy = ThreadServer(tamperer(url, tok, kind, tampered))
    try:
        out = tmp_path / "out"
        ref = [] if reference == "local" else ["--reference", url, "--tokenizer", tok_dir]
        r = audit("--endpoint", proxy.url, *ref, "-n", str(N), "--max-tokens", str(MAX_TOKENS), "--threads", "1",
                  "--out", str(out))
        rep = json.loads((out / "report.json").read_text())
        assert tampered, "the proxy changed nothing: the answers are too short"
        assert r.exit_code == 1, r.output
        assert (rep["bugs"], rep["identical"]) == (len(tampered), N - len(tampered)), rep
        rows = [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()[1:]]
        assert {row["compared"] for row in rows} == {"ids"}  # mmspec's token_id fields read as ids
        for d in rep["differences"]:
            diff = d["difference"]
            assert d["class"] == "bug" and diff["position"] <= 3, diff
            assert diff["compared"] == ("text" if kind == "text" else "ids")
            if kind == "token":
                assert diff["position"] == 3 and diff["endpoint_token"]["text"] == " purple"
            else:
                assert "texts differ" in diff["note"]
    finally:
        proxy.stop()


def stripper(upstream: str, stripped: list) -> FastAPI:
    """A proxy that writes logprobs as vLLM does by default (token strings, no ``token_id``) and
    changes the 3rd token's string to " banana" in the logprobs alone (the text left alone)."""

    def change(body: dict, data: dict) -> None:
        content = (data["choices"][0].get("logprobs") or {}).get("content") or []
        for entry in content:
            entry.pop("token_id", None)
            for alt in entry.get("top_logprobs") or []:
                alt.pop("token_id", None)
        if len(content) > 3:
            content[2].update(token=" banana", bytes=list(b" banana"))
            stripped.append(json.dumps(body["messages"]))

    return proxy(upstream, change)


def test_rewritten_logprobs_strings_without_ids_are_bugs(served, tmp_path):
    """Issue 61.2: with no token ids (vLLM's default), a rewritten logprobs token was "identical"
    against the local reference (compared by text alone); the strings are compared with the
    reference's tokens, so it is a bug at its position."""
    url, _, _ = served
    stripped: list = []
    proxy_ = ThreadServer(stripper(url, stripped))
    try:
        out = tmp_path / "out"
        r = audit("--endpoint", proxy_.url, "-n", str(N), "--max-tokens", str(MAX_TOKENS), "--threads", "1",
                  "--out", str(out))
        rep = json.loads((out / "report.json").read_text())
        assert stripped, "the proxy changed nothing: the answers are too short"
        assert r.exit_code == 1, r.output
        assert (rep["bugs"], rep["identical"]) == (len(stripped), N - len(stripped)), rep
        rows = [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()[1:]]
        assert {row["compared"] for row in rows} == {"tokens"}  # the strings, against the reference's ids
        for d in rep["differences"]:
            diff = d["difference"]
            assert (diff["position"], diff["endpoint_token"], diff["compared"]) == (2, " banana", "tokens"), diff
    finally:
        proxy_.stop()


def test_a_text_change_against_a_reference_endpoint_without_tokenizer_is_a_bug(served, tmp_path):
    """Issue 61.3: --reference URL without --tokenizer: the text change is aligned with the
    reference's tokens and bounded by its top_logprobs: a bug at position 3 (it was "unclassified",
    endpoint token "(end)": "could not be aligned token by token")."""
    url, tok, _ = served
    tampered: list = []
    proxy_ = ThreadServer(tamperer(url, tok, "text", tampered, word=" disparities"))  # a word rarely in the top 5
    try:
        out = tmp_path / "out"
        r = audit("--endpoint", proxy_.url, "--reference", url, "-n", str(N), "--max-tokens", str(MAX_TOKENS),
                  "--threads", "1", "--out", str(out))
        rep = json.loads((out / "report.json").read_text())
        assert tampered, "the proxy changed nothing: the answers are too short"
        assert r.exit_code == 1, r.output
        assert (rep["bugs"], rep["unclassified"]) == (len(tampered), 0), rep
        bounded = 0
        for d in rep["differences"]:
            diff = d["difference"]
            assert diff["position"] == 3 and diff["endpoint_token"] == " disparities", diff
            if diff["endpoint_token_logprob"] is None:  # not among the reference's top_logprobs: the bound decides
                assert "no tokenizer" in diff["note"] and diff["margin_at_least"] > 0, diff
                bounded += 1
        assert bounded, rep  # the case the fix is for: without it these were "unclassified"
    finally:
        proxy_.stop()


def flipper(upstream: str, tokenizer, flipped: list) -> FastAPI:
    """A proxy that drops the logprobs and replaces the 4th token of about half the answers."""
    other = tokenizer.encode(" zebra", add_special_tokens=False)[0]

    def change(body: dict, data: dict) -> None:
        question = json.dumps(body["messages"])
        choice = data["choices"][0]
        choice.pop("logprobs", None)
        ids = tokenizer.encode(choice["message"]["content"], add_special_tokens=False)
        if zlib.crc32(question.encode()) % 2 == 0 and len(ids) > 4 and ids[3] != other:
            ids[3] = other
            choice["message"]["content"] = tokenizer.decode(ids)
            flipped.append(question)

    return proxy(upstream, change)


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
