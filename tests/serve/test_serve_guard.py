"""Hostile input, keys and metrics in one process (tiny models from configs, a scheduler double
that hands out one token per step): every probe a 4xx in OpenAI's error shape before anything is
read, decoded or tokenized past its bound; the API key, the Host check and CORS; /metrics."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")



@dataclass
class Event:
    rid: int
    new_token_ids: list
    text: str
    finished: bool
    result: object = None
    error: str | None = None
    logprobs: list | None = None


class CountingScheduler:
    """One token (" w9") per step for each active request, until its max_new_tokens."""

    def __init__(self):
        self.active: dict = {}
        self.next_rid = 0
        self.submitted = 0

    def submit(self, request, **defaults):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.active[rid] = [request.max_new_tokens, 0]
        self.submitted += 1
        return rid

    def step(self):
        events = []
        for rid, job in list(self.active.items()):
            job[1] += 1
            done = job[1] >= job[0]
            if done:
                del self.active[rid]
            events.append(Event(rid, [9], " w9", done))
        return events

    def cancel(self, rid):
        self.active.pop(rid, None)

    def has_work(self):
        return bool(self.active)


@contextmanager
def serve(decoder, **config):
    """(base url, scheduler, service) of an in-process server with ServeConfig(**config)."""
    from mmspec.serve.app import create_app
    from mmspec.serve.service import ServeConfig, Service

    dec, proc = decoder
    sched = CountingScheduler()
    service = Service(dec, proc, ServeConfig(model_name="m", **config), scheduler=sched)
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
    try:
        yield url, sched, service
    finally:
        server.should_exit = True
        thread.join(30)


def ask(content="w5 w6", **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **kw}


def png(w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (w, h)).save(buf, "PNG")  # a flat image compresses to a few KB however large
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_image(url: str) -> dict:
    return ask([{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": url}}])


def post(url: str, body, headers=None, **kw):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return httpx.post(url + "/v1/chat/completions", content=body, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})}, **kw)


def refused(r, status: int, phrase: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and phrase in error["message"], error
    return error


DEEP = b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"


@pytest.mark.parametrize("what, body, status, phrase", [
    ("JSON nested 10,000 deep", DEEP, 400, "deeper than 32 levels"),
    ("JSON nested 40 deep", json.dumps({**ask(), "metadata": json.loads("[" * 40 + "]" * 40)}).encode(), 400,
     "deeper than 32"),
    ("a NUL byte in the text", ask("w5\u0000w6"), 400, "messages[0].content contains a NUL character"),
    ("a NUL byte in a file path", with_image("file:///tmp/a\u0000.png"), 400, "NUL character"),
    ("a lone surrogate", ask("w5 \ud800 w6"), 400, "lone surrogate"),
    ("invalid UTF-8", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "not valid UTF-8 (byte 0xff"),
    ("a 12000x12000 PNG", with_image(png(12000, 12000)), 400, "past this server's limit of 16.8 M per image"),
    ("a text past the context by its bytes", ask("w5 " * 200_000), 400, "bytes of text"),
    ("a temperature of NaN", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     400, "not valid JSON"),
])
def test_hostile_bodies_are_4xx_before_any_work(decoder, what, body, status, phrase):
    with serve(decoder) as (url, sched, _):
        if isinstance(body, dict):
            body = json.dumps(body, ensure_ascii=True).encode()
        refused(post(url, body), status, phrase)
        assert sched.submitted == 0
        assert post(url, ask()).status_code == 200  # still serving


def test_the_pixel_limit_per_request_and_tokenizing_only_after_the_byte_check(decoder, monkeypatch):
    import mmspec.serve.service as service_mod

    with serve(decoder, max_image_pixels=100 * 100, max_request_pixels=150 * 100) as (url, _, service):
        two = ask([{"type": "image_url", "image_url": {"url": png(100, 100)}}] * 2 + [{"type": "text", "text": "?"}])
        refused(post(url, two), 400, "messages[0].content[1]: the images so far come to 0.0 M pixels")
        refused(post(url, with_image(png(101, 100))), 400, "101x100")
        called = []
        monkeypatch.setattr(service_mod, "build_prompt", lambda *a: called.append(1) or "")
        refused(post(url, ask("w5 " * 200_000)), 400, "shorten the messages")
        assert called == []  # refused from its length, never tokenized
        assert service.max_token_bytes >= 2


def test_bodies_past_the_limit_are_413_while_they_arrive(decoder):
    with serve(decoder, max_request_mb=0.01) as (url, sched, _):
        big = json.dumps(ask("w5 " * 10_000)).encode()
        refused(post(url, big), 413, "past this server's limit of 0.01 MiB (--max-request-mb)")

        # chunked, no Content-Length, and the body never ends: the 413 comes once the limit is passed
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n".encode())
            for _ in range(3):
                s.sendall(b"2000\r\n" + b" " * 0x2000 + b"\r\n")
            head = b""
            while b"refused while" not in head and (chunk := s.recv(65536)):
                head += chunk
            head = head.decode()
        assert head.startswith("HTTP/1.1 413") and "refused while it arrived" in head, head
        assert sched.submitted == 0 and post(url, ask()).status_code == 200
        text = httpx.get(url + "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['mmspec_requests_total{outcome="too_large"}']) == 2  # the declared one and the chunked one


@pytest.mark.parametrize("headers, status, phrase", [
    ({"content-type": "text/plain"}, 415, "Content-Type 'text/plain' is not application/json"),
    ({"content-type": "application/x-www-form-urlencoded"}, 415, "is not application/json"),
    ({"content-type": ""}, 415, "Content-Type '(none)'"),
])
def test_a_body_that_is_not_declared_json_is_415(decoder, headers, status, phrase):
    with serve(decoder) as (url, sched, _):
        r = httpx.post(url + "/v1/chat/completions", content=json.dumps(ask()).encode(), headers=headers, timeout=30)
        refused(r, status, phrase)
        assert sched.submitted == 0
        ok = post(url, ask(), headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_api_key_host_check_and_cors(decoder):
    openai = pytest.importorskip("openai")
    with serve(decoder, api_key="s3cret", allowed_hosts=["127.0.0.1", "localhost"],
               cors_origins=["https://app.example"]) as (url, sched, _):
        refused(post(url, ask()), 401, "no API key")
        e = refused(post(url, ask(), headers={"authorization": "Bearer nope"}), 401, "the API key is wrong")
        assert e["code"] == "invalid_api_key" and "s3cret" not in json.dumps(e)
        assert post(url, ask(), headers={"authorization": "Bearer s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(**ask()).choices[0].message.content == " w9 w9 w9"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(**ask())
        assert httpx.get(url + "/health").status_code == 200  # health and metrics need no key
        assert httpx.get(url + "/metrics").status_code == 200
        # DNS rebinding: a page at evil.example re-pointed to 127.0.0.1 sends its own name as Host
        refused(post(url, ask(), headers={"authorization": "Bearer s3cret", "host": "evil.example:8000"}), 400,
                "the Host header 'evil.example:8000' is not a name this server answers to")
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(url + "/v1/chat/completions", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in other.headers
    with serve(decoder) as (url, _, _):  # no --cors-origins: no CORS headers at all
        r = post(url, ask(), headers={"origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_errors_never_show_server_paths(decoder, tmp_path):
    from mmspec.serve.guard import redact_paths

    inside = tmp_path / "media"
    inside.mkdir()
    assert redact_paths(f"cannot read '{inside}/x.png' (see {tmp_path})") == "cannot read '<path>' (see <path>)"
    assert redact_paths("POST /v1/chat/completions, data:image/png;base64") == \
        "POST /v1/chat/completions, data:image/png;base64"
    with serve(decoder, allowed_media=[inside]) as (url, _, _):
        e = refused(post(url, with_image("/etc/hostname")), 400, "outside the directories")
        assert str(inside) not in e["message"] and str(tmp_path) not in e["message"]


def test_metrics_count_what_happened(decoder):
    with serve(decoder) as (url, _, _):
        for stream in (False, True):
            assert post(url, ask(stream=stream)).status_code == 200
        post(url, ask(max_tokens=0))
        httpx.post(url + "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
        text = httpx.get(url + "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['mmspec_requests_total{outcome="length"}']) == 2
    assert float(lines['mmspec_requests_total{outcome="bad_request"}']) == 1
    assert float(lines['mmspec_requests_total{outcome="unsupported_media_type"}']) == 1
    assert float(lines["mmspec_generation_tokens_total"]) == 6
    assert float(lines["mmspec_time_to_first_token_seconds_count"]) == 2
    assert float(lines["mmspec_batch_size_count"]) >= 3
    for name in ("mmspec_requests_running", "mmspec_requests_waiting", "mmspec_prefix_cache_bytes",
                 "mmspec_time_per_output_token_seconds_count", "mmspec_prompt_tokens_total"):
        assert name in lines, name
    # where the two answered requests' time went: the phases before the scheduler (this double
    # returns no stats, so none of the engine's), and the worker thread's time in the scheduler
    for phase in ("parse", "images", "processor", "queue"):
        assert float(lines[f'mmspec_request_phase_seconds_count{{phase="{phase}"}}']) == 2, phase
    assert 'mmspec_request_phase_seconds_count{phase="decode"}' not in lines
    assert float(lines["mmspec_http_request_seconds_count"]) == 2  # the answers, to their last byte (not the 4xx)
    assert float(lines["mmspec_http_request_seconds_sum"]) >= float(lines["mmspec_e2e_request_latency_seconds_sum"])
    assert 0 < float(lines["mmspec_engine_cpu_seconds_total"]) and 0 < float(lines["mmspec_engine_seconds_total"])
    assert float(lines["process_cpu_seconds_total"]) >= float(lines["mmspec_engine_cpu_seconds_total"])
    with serve(decoder, metrics=False) as (url, _, _):
        assert httpx.get(url + "/metrics").status_code == 404


def test_a_requests_phases_add_up_to_its_latency():
    """Each phase from its own clock; with the scheduler's stats the engine's phases too, and the
    hand-offs between threads are what is left of the e2e latency."""
    from types import SimpleNamespace

    from mmspec.serve.metrics import PHASES, Metrics
    from mmspec.stats import BlockRecord, GenerationStats

    m = Metrics(SimpleNamespace(worker=SimpleNamespace(active=0, pending=0), decoder=None))
    st = GenerationStats(gamma=5, views=("M",), vision_s=0.01, prefill_target_s=0.02, prefill_draft_s=0.005,
                         total_s=0.5, blocks=[BlockRecord(5, 3, 4, draft_s=0.05, verify_s=0.1)] * 2)
    t0 = time.perf_counter() - 1.0  # the request arrived a second ago
    m.answered("length", 90, 8, t0, t0 + 0.6, SimpleNamespace(stats=st),
               timings={"parse": 0.001, "images": 0.002, "processor": 0.03, "queue": 0.004})

    def read() -> dict:
        return dict(line.rsplit(" ", 1) for line in m.render()[0].decode().splitlines() if not line.startswith("#"))

    lines = read()
    spent = {p: float(lines[f'mmspec_request_phase_seconds_sum{{phase="{p}"}}']) for p in PHASES}
    assert spent["prefill"] == pytest.approx(0.035) and spent["decode"] == pytest.approx(0.3)
    assert spent["engine_other"] == pytest.approx(0.5 - 0.335)
    assert sum(spent.values()) == pytest.approx(float(lines["mmspec_e2e_request_latency_seconds_sum"]), abs=1e-9)
    assert 0.463 <= spent["handoff"] < 0.5  # 1 s less the 0.537 s above, and the moment since t0 was read
    m.answered("length", 0, 8, t0, None, SimpleNamespace(stats=st))  # a second choice: its phases are not counted
    lines = read()
    assert all(float(lines[f'mmspec_request_phase_seconds_count{{phase="{p}"}}']) == 1 for p in PHASES)


def test_one_typed_request_from_the_wire_to_the_scheduler(decoder, monkeypatch):
    """The scheduler gets mmspec.request.Request s (checked, their seed chosen once, by
    mmspec.request.prepare); n choices get seed, seed + 1; the default max_tokens is the context's
    room by the engine's own rule, and one token more is refused naming that room."""
    import mmspec.request as request_mod
    from mmspec.request import Request, context_room

    got = []
    with serve(decoder) as (url, sched, service):
        real = sched.submit
        sched.submit = lambda request, **kw: got.append(request) or real(request, **kw)
        monkeypatch.setattr(request_mod, "new_seed", lambda: 2**63 - 1)
        r = post(url, ask(temperature=0.5, n=2, max_tokens=2))
        assert r.status_code == 200, r.text
        seeds = [c["seed"] for c in r.json()["mmspec"]["choices"]]
        assert seeds == [2**63 - 1, 0]  # chosen once, then seed + i (mod 2**63)
        assert all(isinstance(q, Request) for q in got) and [q.seed for q in got] == seeds
        dec = service.decoder
        ids = dec.tokenizer("w5 " * 900)["input_ids"]  # near the tiny target's 1024 positions
        text = "w5 " * 900
        got.clear()
        r = post(url, {"model": "m", "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
        n_prompt = r.json()["usage"]["prompt_tokens"]
        room = context_room(service.context, n_prompt, dec.tree.max_depth)
        assert 0 < room < service.config.max_tokens and len(ids) <= n_prompt
        assert got[0].max_new_tokens == room == r.json()["usage"]["completion_tokens"]
        dec.check_context(n_prompt, room)  # the engine's rule agrees: it fits, one more does not
        with pytest.raises(request_mod.ContextError):
            dec.check_context(n_prompt, room + 1)
        refused(post(url, {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": room + 1}),
                400, f"so at most {room} new tokens fit; ask for max_tokens <= {room}")
        refused(post(url, {"model": "m", "messages": [{"role": "user", "content": "w5 " * 1100}]}), 400,
                "no room for an answer")


def test_the_speculate_choices_are_the_engines():
    from mmspec.options import SPECULATE
    from mmspec.serve.service import ServeConfig

    assert SPECULATE == ("always", "never", "auto")
    for mode in SPECULATE:
        ServeConfig(speculate=mode)
    with pytest.raises(ValueError, match="speculate must be one of always, never, auto"):
        ServeConfig(speculate="sometimes")
