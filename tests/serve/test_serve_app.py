"""The server's parts in one process: request parsing, stop strings, and the app + worker over
scheduler doubles that never finish on their own (tiny models from configs) — a client that
leaves frees its rows, a drain tells the requests left why, a failing step or request fails
only itself."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers.tiny import make_tokenizer  # noqa: E402
from mmspec.results import TokenLogprob  # noqa: E402
from mmspec.serve.protocol import parse_request  # noqa: E402
from mmspec.serve.responses import Answer  # noqa: E402
from mmspec.serve.schema import RequestError  # noqa: E402


# ----------------------------------------------------------------------- parsing
def body(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_parse_request_maps_openai_fields():
    r = parse_request(body(max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, user="u", metadata={},
                           stream=True, stream_options={"include_usage": True}, stop="x"), "m")
    assert (r.max_tokens, r.greedy, r.top_p, r.seed, r.stream, r.include_usage, r.stop) == \
        (7, True, None, None, True, True, ["x"])  # greedy: no filter and no seed (the output is the same)
    r = parse_request(body(temperature=0.7, top_p=1, top_k=-1, seed=5, frequency_penalty=0, logprobs=False), "m")
    assert (r.temperature, r.top_p, r.top_k, r.seed) == (0.7, None, None, 5)
    assert parse_request(body(), "m").temperature == 1.0  # OpenAI's and vLLM's default


@pytest.mark.parametrize("fields, phrase", [
    ({"best_of": 2}, "unknown argument(s) 'best_of'"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "disagree"),
    ({"max_tokens": True}, "whole number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"seed": -1}, "seed must be in"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"stop": [""]}, "non-empty string"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be from 0 to 20"),
    ({"n": 17}, "n must be from 1 to 16"),
    ({"messages": [{"role": "function", "content": "x"}]}, "role 'function'"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "text and image_url parts only"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "end messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "without a url"),
    # pydantic's own type errors: a 400 naming the field (never FastAPI's 422)
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": 3}}]}]},
     "messages[0].content[0].image_url.detail"),
])
def test_parse_request_refuses_with_the_fix(fields, phrase):
    with pytest.raises(RequestError, match=None) as e:
        parse_request(body(**fields), "m")
    assert phrase in str(e.value) and e.value.status == 400


def test_the_limits_are_checked_once_into_the_typed_request():
    """The body's limits come out of validation as the typed Decoding make_request takes (no dict
    in between), checked where generate()'s are (mmspec.request.decoding), each named as sent."""
    from mmspec.request import Decoding

    r = parse_request(body(max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=3, logprobs=True,
                           top_logprobs=2), "m")
    d = r.decoding
    assert isinstance(d, Decoding)
    assert (d.max_new_tokens, d.params.temperature, d.params.top_p, d.params.top_k, d.seed, d.logprobs) == \
        (7, 0.5, 0.9, None, 3, 2)
    assert parse_request(body(), "m").decoding.max_new_tokens is None  # the server's default, sized later
    completion = json.dumps({"model": "m", "prompt": "hi"}).encode()
    assert parse_request(completion, "m", completion=True).decoding.max_new_tokens == 16  # OpenAI's default there
    for fields, param, phrase in (({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens "
                                   "must be >= 1"), ({"top_k": -5}, "top_k", "top_k must be"),
                                  ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
                                  ({"temperature": 0, "top_p": 2}, "top_p", "top_p must be in (0, 1]")):
        with pytest.raises(RequestError) as e:
            parse_request(body(**fields), "m")
        assert (e.value.param, e.value.status) == (param, 400) and phrase in str(e.value)


def test_response_models_serialise_as_openai_clients_expect():
    from mmspec.serve import protocol as P

    stats = P.MMSpecStats(tokens_per_block=[2], blocks=1, tau=2.0, mean_accepted_length=1.0, seed=None, latency_s=0.1)
    chunk = P.ChatCompletionChunk(id="c", model="m", choices=[
        P.ChatCompletionChunkChoice(index=0, delta=P.DeltaMessage(content="hi"))]).body()
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk and "mmspec" not in chunk
    assert chunk["choices"][0] == {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"content": "hi"}}
    whole = P.ChatCompletionResponse(id="c", model="m", usage=P.Usage(prompt_tokens=1, completion_tokens=2,
                                                                     total_tokens=3), mmspec=stats, choices=[
        P.ChatCompletionChoice(index=0, message=P.ChatCompletionMessage(content="x"), finish_reason="stop")]).body()
    assert whole["mmspec"] == {"tokens_per_block": [2], "blocks": 1, "tau": 2.0, "mean_accepted_length": 1.0,
                               "seed": None, "latency_s": 0.1}  # the keys it was given, seed null included
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "x"} and whole["usage"]["total_tokens"] == 3
    assert P.ErrorResponse(error=P.ErrorInfo(message="no")).body() == \
        {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}}


def test_parse_request_refuses_bad_json_and_other_models():
    for raw in (b"{", b"[1]", b'{"messages": NaN}'):
        with pytest.raises(RequestError, match="JSON"):
            parse_request(raw, "m")
    with pytest.raises(RequestError, match="serves 'm'") as e:
        parse_request(body(model="gpt"), "m")
    assert e.value.status == 404


def test_stop_strings_are_held_back_across_blocks():
    a = Answer(stops=["dog 7"], eos_ids=frozenset({2}))
    assert a.add([1], "The do") == "The "  # "do" might begin the stop string: held back
    assert a.add([1], "ll is") == "doll is"  # it did not
    assert a.add([1], " dog") == " "
    assert a.add([1], " 7 and") == ""  # cut before the stop string
    assert a.stopped and a.content == "The doll is " and a.finish_reason == "stop"
    b = Answer(stops=[], eos_ids=frozenset({2}))
    b.add([5, 6], "ab")
    assert b.finish(None) == "" and b.finish_reason == "length"


def test_an_answers_logprobs_are_those_of_its_content_tokens():
    """The engine's TokenLogprob of each token, cut as the content is: an EOS and the tokens past a
    stop string left out."""
    from types import SimpleNamespace

    from mmspec.results import TokenLogprob
    from mmspec.serve.responses import answer_logprobs

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(f"w{i} " for i in ids if i != 2))
    lps = [TokenLogprob(t, -0.1 * t, ((t, -0.1 * t),)) for t in (5, 6, 7, 2)]
    a = Answer(stops=["w7"], eos_ids=frozenset({2}))
    a.add([5, 6], "w5 w6 ", lps[:2])
    a.add([7, 2], "w7 ", lps[2:])
    assert a.stopped and a.content == "w5 w6 " and answer_logprobs(a, tok) == lps[:2]
    b = Answer(stops=[], eos_ids=frozenset({2}))
    b.add([5, 6], "w5 w6 ", lps[:2])
    b.add([7, 2], "w7 ", lps[2:])
    assert answer_logprobs(b, tok) == lps[:3]


# ----------------------------------------------------------------------- app + worker, in process
@dataclass
class Event:
    rid: int
    new_token_ids: list
    text: str
    finished: bool
    result: object = None
    error: str | None = None
    logprobs: list | None = None


@dataclass
class Asked:
    """What these scheduler doubles read of a request (the server hands a mmspec.request.Request)."""

    max_new_tokens: int


class EndlessScheduler:
    """Hands each active request one token (" w9", its k-th with logprob -0.5 k) per step, until its max_new_tokens; a request
    whose max_new_tokens is 13 fails alone; a step raises while one with 17 is active."""

    def __init__(self):
        self.active: dict = {}
        self.cancelled: list = []
        self.next_rid = 0
        self.lock = threading.Lock()

    def submit(self, request, **defaults):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.active[rid] = [request.max_new_tokens, 0]
        return rid

    def step(self):
        time.sleep(0.005)
        if any(m == 17 for m, _ in self.active.values()):
            raise RuntimeError("a broken step")
        events = []
        for rid, job in list(self.active.items()):
            if job[0] == 13:
                del self.active[rid]
                events.append(Event(rid, [], "", True, error="request 0: this request alone is bad; fix it"))
                continue
            job[1] += 1
            done = job[1] >= job[0]
            if done:
                del self.active[rid]
            events.append(Event(rid, [9], " w9", done, logprobs=[TokenLogprob(9, -0.5 * job[1], ((9, -0.5),))]))
        return events

    def cancel(self, rid):
        self.cancelled.append(rid)
        self.active.pop(rid, None)

    def has_work(self):
        return bool(self.active)


@pytest.fixture
def app_server(decoder):
    """(base url, scheduler, service) of an in-process server over an EndlessScheduler."""
    from mmspec.serve.app import create_app
    from mmspec.serve.service import ServeConfig, Service

    dec, proc = decoder
    sched = EndlessScheduler()
    service = Service(dec, proc, ServeConfig(model_name="m", max_tokens=100000), scheduler=sched)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=5)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url, sched, service
    server.should_exit = True
    thread.join(30)


def ask(url: str, max_tokens: int, stream: bool = False, **kw):
    return {"model": "m", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": max_tokens,
            "stream": stream, **kw}


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_client_that_leaves_mid_stream_frees_its_rows(app_server):
    url, sched, service = app_server
    with httpx.stream("POST", url + "/v1/chat/completions", json=ask(url, 900, stream=True), timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert wait_until(lambda: service.worker.active == 1)
    assert wait_until(lambda: sched.cancelled == [0]), sched.cancelled
    assert wait_until(lambda: service.worker.active == 0)


def test_a_waiting_client_that_leaves_frees_its_rows(app_server):
    url, sched, _ = app_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=ask(url, 900), timeout=0.5)
    assert wait_until(lambda: sched.cancelled == [0]), sched.cancelled
    r = httpx.post(url + "/v1/chat/completions", json=ask(url, 3), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " w9 w9 w9"
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stop", [None, [" w9 wX"]])
def test_streamed_logprobs_come_with_the_chunk_of_their_tokens(app_server, stop):
    """Issue 61.6: streamed logprobs came only with each choice's last chunk. Through the openai
    client, n=2: every chunk with text carries its tokens' logprobs, in order, none twice; with a
    stop string that holds text back (" w9" may begin " w9 wX"), a token's logprobs come with the
    chunk that releases its text."""
    openai = pytest.importorskip("openai")
    url, _, _ = app_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    got: dict[int, list] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for ch in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w5 w6"}], n=2,
                                             max_tokens=5, stream=True, logprobs=True, top_logprobs=1, stop=stop):
        for c in ch.choices:
            text = c.delta.content or ""
            entries = c.logprobs.content if c.logprobs is not None else []
            assert len(entries) == text.count(" w9"), (text, entries)  # the chunk's own tokens, no more, no fewer
            texts[c.index] += text
            got[c.index] += [e.logprob for e in entries]
    for i in (0, 1):
        assert texts[i] == " w9" * 5 and got[i] == [-0.5 * k for k in range(1, 6)], (texts, got)
    # legacy completions: the same, each chunk's text_offset counting from the answer's start
    offsets, logprobs = [], []
    for ch in client.completions.create(model="m", prompt="w5 w6", max_tokens=4, stream=True, logprobs=1, stop=stop):
        for c in ch.choices:
            lp = c.logprobs
            assert len(lp.tokens if lp is not None else []) == (c.text or "").count(" w9"), (c.text, lp)
            if lp is not None:
                offsets += lp.text_offset
                logprobs += lp.token_logprobs
    piece = len(make_tokenizer().decode([9]))  # the offsets add up the tokens' own texts
    assert logprobs == [-0.5 * k for k in range(1, 5)] and offsets == [piece * k for k in range(4)], offsets


def test_a_stop_string_frees_the_rows_at_once(app_server):
    url, sched, _ = app_server
    r = httpx.post(url + "/v1/chat/completions", json=ask(url, 900, stop=[" w9 w9"]), timeout=30)
    assert r.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": ""},
                                      "finish_reason": "stop", "logprobs": None}
    assert wait_until(lambda: sched.cancelled == [0]), sched.cancelled


def test_drain_tells_the_requests_left_why(app_server):
    url, _, service = app_server
    out = {}

    def plain():
        out["plain"] = httpx.post(url + "/v1/chat/completions", json=ask(url, 900), timeout=30)

    t = threading.Thread(target=plain)
    t.start()
    with httpx.stream("POST", url + "/v1/chat/completions", json=ask(url, 900, stream=True), timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        assert wait_until(lambda: service.worker.active == 2)
        service.worker.drain(0.2, "shutting down: too slow, send it again")
        rest = [ln for ln in lines if ln]
    t.join(30)
    assert json.loads(rest[-2][6:])["error"]["message"] == "shutting down: too slow, send it again"
    assert rest[-1] == "data: [DONE]"
    assert out["plain"].status_code == 503 and "too slow" in out["plain"].json()["error"]["message"]
    late = httpx.post(url + "/v1/chat/completions", json=ask(url, 3), timeout=30)
    assert late.status_code == 503 and "takes no new requests" in late.json()["error"]["message"]


def test_a_request_that_fails_alone_or_a_failing_step_spare_the_rest(app_server):
    url, _, _ = app_server
    out = {}

    def run(key, n):
        out[key] = httpx.post(url + "/v1/chat/completions", json=ask(url, n), timeout=30)

    threads = [threading.Thread(target=run, args=(k, n)) for k, n in (("good", 40), ("bad", 13))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out["bad"].status_code == 400 and out["bad"].json()["error"]["message"] == "this request alone is bad; fix it"
    assert out["good"].status_code == 200 and out["good"].json()["usage"]["completion_tokens"] == 40
    broken = httpx.post(url + "/v1/chat/completions", json=ask(url, 17), timeout=30)
    assert broken.status_code == 500 and "a broken step" in broken.json()["error"]["message"]
    assert httpx.post(url + "/v1/chat/completions", json=ask(url, 2), timeout=30).status_code == 200


def test_unknown_routes_get_openai_style_errors(app_server):
    """A client's mistake is a 4xx of OpenAI's invalid_request_error (404: not_found_error), never
    server_error; a 404 lists every route, /v1/completions included, and a 405 names the method."""
    url, _, _ = app_server
    r = httpx.get(url + "/v1/completions", timeout=10)
    error = r.json()["error"]
    assert r.status_code == 405 and error["type"] == "invalid_request_error", error
    assert "GET /v1/completions (/v1/completions takes POST)" in error["message"], error
    r = httpx.get(url + "/v1/nosuch", timeout=10)
    error = r.json()["error"]
    assert r.status_code == 404 and error["type"] == "not_found_error"
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"):
        assert route in error["message"], (route, error)


def test_serve_without_the_extra_is_one_line(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from mmspec.cli import app

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as for a package that is not installed
    r = CliRunner().invoke(app, ["serve"])
    assert r.exit_code == 2 and "mmspec serve needs fastapi: pip install 'mmspec[serve]'" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_bound_socket_gives_connections_tcp_nodelay():
    """serve binds its port itself; asyncio sets TCP_NODELAY on what such a socket accepts only when
    it is made with IPPROTO_TCP. Without it a kept-alive connection's every response after the
    first waited 40 ms more (Nagle against the client's delayed ACK; perf/serve_speed.py found it)."""
    import asyncio

    from mmspec.cli.serve import _bind

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = _bind("127.0.0.1", port)
    sock.listen()
    seen = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_the_worker_gives_memory_back_when_the_batch_empties(app_server, monkeypatch):
    import mmspec.serve.worker as worker

    calls = []
    monkeypatch.setattr(worker, "release_memory", lambda: calls.append(1))
    url, _, _ = app_server
    assert httpx.post(url + "/v1/chat/completions", json=ask(url, 5), timeout=30).status_code == 200
    assert wait_until(lambda: calls == [1]), calls  # once per burst, not per block


def test_the_worker_renews_the_scheduler_when_the_batch_empties_and_a_stale_cancel_is_harmless(monkeypatch):
    import mmspec.serve.worker as worker
    from mmspec.serve.worker import Job, Worker

    monkeypatch.setattr(worker, "release_memory", lambda: None)
    made = [EndlessScheduler()]

    def renew(old):
        assert old is made[-1] and not old.has_work()
        made.append(EndlessScheduler())
        return made[-1]

    w = Worker(made[0], renew=renew, idle_poll_s=0.02)
    w.start()
    try:
        done: dict = {}

        def run(name: str, n: int) -> Job:
            ups: list = []
            job = Job(request=Asked(n), sink=ups.append)
            done[name] = ups
            w.submit(job)
            return job

        first = run("first", 2)
        assert wait_until(lambda: len(made) == 2)  # the burst ended: a fresh scheduler (its buffers gone)
        assert [u.kind for u in done["first"]] == ["admitted", "event", "event"]
        second = run("second", 50)  # the fresh scheduler gives it rid 0 again, as it gave the first
        assert wait_until(lambda: second.rid == 0 and w.active == 1)
        w.cancel(first)  # a late cancel of the finished first request must not touch the second
        assert wait_until(lambda: done["second"][-1].event.finished), [u.kind for u in done["second"]]
        assert made[1].cancelled == [] and len(done["second"]) == 51
    finally:
        w.stop()


def test_the_serve_package_is_library_code():
    """mmspec.serve imports neither typer nor mmspec.cli (the CLI maps flags onto it)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "mmspec" / "serve"
    files = sorted(root.glob("*.py"))
    assert len(files) >= 6
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n == "typer" or n.startswith(("typer.", "mmspec.cli"))]
            assert not bad, (f.name, bad)


def test_the_worker_outlives_a_broken_scheduler_call(monkeypatch):
    import mmspec.serve.worker as worker
    from mmspec.serve.worker import Job, Worker

    monkeypatch.setattr(worker, "release_memory", lambda: None)

    class Flaky(EndlessScheduler):
        broken = 1

        def has_work(self):
            if self.broken and self.active:
                self.broken -= 1
                raise RuntimeError("has_work broke")
            return super().has_work()

    w = Worker(Flaky(), idle_poll_s=0.02)
    w.start()
    try:
        first, second = [], []
        w.submit(Job(request=Asked(3), sink=first.append))
        assert wait_until(lambda: first and first[-1].kind == "failed")
        assert first[-1].status == 500 and "has_work broke" in first[-1].message
        w.submit(Job(request=Asked(3), sink=second.append))
        assert wait_until(lambda: second and second[-1].kind == "event" and second[-1].event.finished)
    finally:
        w.stop()


def test_a_steps_updates_reach_the_loop_in_order_with_one_wake_up():
    """The worker hands a step's updates to the event loop through LoopMailbox: every one arrives,
    in order, in its own queue, and a step's worth wakes the loop once (not once per row)."""
    import asyncio

    from mmspec.serve.worker import LoopMailbox

    loop = asyncio.new_event_loop()
    wakes = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))  # counts the wake-ups

    async def main():
        box = LoopMailbox(loop)
        queues = [asyncio.Queue(), asyncio.Queue()]
        worker = threading.Thread(target=lambda: [box.put(queues[i % 2], i) for i in range(32)])
        worker.start()
        worker.join()
        got = [[await q.get() for _ in range(16)] for q in queues]
        return got, box

    try:
        got, box = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [list(range(0, 32, 2)), list(range(1, 32, 2))]
    assert len(wakes) == 1
    box.put(asyncio.Queue(), "late")  # a closed loop: nobody waits, nothing raised
