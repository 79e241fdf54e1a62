"""``mmspec serve`` end to end: a real server process on 127.0.0.1 (the embedded models, CPU),
the real ``openai`` client; answers equal to solo ``SpecDecoder.generate`` runs and to
``target.generate`` greedy, concurrency, every bad request a 400 that leaves the server serving,
a client that leaves mid-stream freeing its rows, SIGTERM -> exit 0."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mmspec-embedded"
START_S = 120  # bounded wait for /health (imports + the embedded models: ~10 s on a free core)


# ----------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    media: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp: Path, *args: str) -> Server:
    port = free_port()
    media = tmp / "media"
    media.mkdir(exist_ok=True)
    log = tmp / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # --speculate always: these tests check each answer's blocks against a solo generate (the
    # default, auto, decides the blocks by measured time; its answers: tests/serve/test_serve_seed.py)
    cmd = [sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--threads", "1", "--speculate", "always",
           "--allowed-local-media-path", str(media), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    server = Server(proc, port, log, media)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if server.health()["status"] == "ok":
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise AssertionError(f"the server did not answer /health within {START_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve"), "--max-batch", "8")
    yield s
    assert s.stop() == 0, s.log.read_text()


# ----------------------------------------------------------------------- solo references
@pytest.fixture(scope="module")
def solo():
    """The embedded models in this process: solo SpecDecoder.generate and target.generate runs."""
    import torch

    from mmspec import SpecDecoder, load_embedded

    e = load_embedded(dtype=torch.float32)
    dec = SpecDecoder(e.target, e.draft, e.tokenizer)
    return Solo(e, dec)


class Solo:
    def __init__(self, e, dec):
        self.e, self.dec = e, dec

    def inputs(self, prompt: str, images: list) -> dict:
        from mmspec.inputs import chat_prompt, processor_inputs

        return processor_inputs(self.e.processor, chat_prompt(self.e.processor, prompt, len(images)), images)

    def generate(self, prompt: str, images: list, max_tokens: int, **kw):
        return self.dec.generate(**self.inputs(prompt, images), max_new_tokens=max_tokens, images=images or None, **kw)

    def target_greedy(self, prompt: str, images: list, max_tokens: int) -> list[int]:
        import torch

        inputs = self.inputs(prompt, images)
        with torch.inference_mode():
            out = self.e.target.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------- requests
def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def sample(family: str, index: int):
    from mmspec.world import make_sample

    return make_sample(family, "test", index)


def user_message(prompt: str, images: list, urls: list[str] | None = None) -> list[dict]:
    """One user message: the prompt's text (its <image> markers included) and one image part per image."""
    urls = urls or [data_url(im) for im in images]
    return [{"role": "user", "content": [{"type": "text", "text": prompt}]
             + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]


CASES = [("chartqa", 10, 40), ("textvqa", 1, 24), ("vqav2", 2, 24), ("spot_the_diff", 0, 32),
         ("pororosv", 0, 24), ("hallusionbench", 3, 3)]


def ask(client, family: str, index: int, max_tokens: int, stream: bool = False, **kw):
    """(content, completion tokens, finish reason, mmspec stats) of one request."""
    s = sample(family, index)
    args = dict(model=MODEL, messages=user_message(s.prompt, s.images), max_tokens=max_tokens, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason, r.model_extra["mmspec"]
    text, usage, reason, stats = "", None, None, None
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            reason = ch.choices[0].finish_reason or reason
        else:
            usage, stats = ch.usage, ch.model_extra["mmspec"]
    return text, usage.completion_tokens, reason, stats


def check_equal(solo, family: str, index: int, max_tokens: int, got) -> None:
    s = sample(family, index)
    ref = solo.generate(s.prompt, s.images, max_tokens)
    text, n, reason, stats = got
    assert (text, n) == (ref.text, len(ref.token_ids)), (family, index)
    assert stats["tokens_per_block"] == ref.stats.tokens_per_block
    assert reason == ("stop" if ref.token_ids[-1] in solo.dec.eos_ids else "length")


# ----------------------------------------------------------------------- tests
def test_answers_equal_solo_runs_and_the_targets_greedy(server, solo):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    for family, index, max_tokens in CASES[:3]:
        got = ask(client, family, index, max_tokens, temperature=0)
        check_equal(solo, family, index, max_tokens, got)
        s = sample(family, index)
        ref_ids = solo.target_greedy(s.prompt, s.images, max_tokens)
        assert got[0] == solo.e.tokenizer.decode(ref_ids, skip_special_tokens=True)
        stats = got[3]
        assert stats["tau"] == pytest.approx(sum(stats["tokens_per_block"]) / stats["blocks"], abs=1e-3)
        assert stats["mean_accepted_length"] == pytest.approx(stats["tau"] - 1, abs=1e-3)


def test_streaming_equals_the_whole_answer(server, solo):
    client = server.client()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user_message(sample("chartqa", 10).prompt, sample("chartqa", 10).images),
        max_tokens=40, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # pieces, block by block
    check_equal(solo, "chartqa", 10, 40, ask(client, "chartqa", 10, 40, stream=True, temperature=0))
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is shown?"}], "max_tokens": 5,
            "temperature": 0, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_concurrent_clients_get_their_solo_answers(server, solo):
    client = server.client()
    jobs = [(f, i, m, k % 2 == 1) for k, (f, i, m) in enumerate(CASES)] + [("chartqa", 11, 32, True),
                                                                            ("vqav2", 5, 32, False)]
    barrier = threading.Barrier(len(jobs))

    def run(job):
        family, index, max_tokens, stream = job
        barrier.wait(30)
        return ask(client, family, index, max_tokens, stream=stream, temperature=0)

    steps = server.health()["steps"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    for (family, index, max_tokens, _), got in zip(jobs, answers, strict=True):
        check_equal(solo, family, index, max_tokens, got)
    blocks = sum(got[3]["blocks"] for got in answers)
    assert server.health()["steps"] - steps < blocks  # the requests shared blocks: decoded as one batch


def test_seeded_sampling_equals_solo_generate(server, solo):
    client = server.client()
    s = sample("textvqa", 1)
    ref = solo.generate(s.prompt, s.images, 24, temperature=0.8, top_p=0.9, seed=3)
    text, n, _, stats = ask(client, "textvqa", 1, 24, temperature=0.8, top_p=0.9, seed=3)
    assert (text, n, stats["seed"]) == (ref.text, len(ref.token_ids), 3)
    text, _, _, stats = ask(client, "textvqa", 1, 24, temperature=0.8)  # no seed: the server's, reported
    again = ask(client, "textvqa", 1, 24, temperature=0.8, seed=stats["seed"])
    assert again[0] == text


def test_stop_strings_cut_the_answer(server, solo):
    client = server.client()
    s = sample("chartqa", 10)
    full = solo.generate(s.prompt, s.images, 40).text
    stop = full.split()[4]  # a word inside the answer
    expected = full[: full.index(stop)]
    for stream in (False, True):
        text, n, reason, _ = ask(client, "chartqa", 10, 40, stream=stream, temperature=0, stop=[stop, "zzz"])
        assert (text, reason) == (expected, "stop")
        assert 0 < n < len(solo.generate(s.prompt, s.images, 40).token_ids)


def test_conversation_and_local_images(server, solo):
    from mmspec.inputs import frame_prompt

    s = sample("chartqa", 10)
    path = server.media / "chart.png"
    s.images[0].save(path)
    first = solo.generate(s.prompt, s.images, 40)
    r = server.client().chat.completions.create(model=MODEL, max_tokens=40, temperature=0,
                                                messages=user_message(s.prompt, s.images, urls=[str(path)]))
    assert r.choices[0].message.content == first.text
    messages = user_message(s.prompt, s.images, urls=[f"file://{path}"]) + [
        {"role": "assistant", "content": first.text}, {"role": "user", "content": "Which bar is the lowest?"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    prompt = s.prompt + first.text + solo.e.tokenizer.eos_token + frame_prompt("Which bar is the lowest?", 0)
    ref = solo.dec.generate(**solo.e.processor(text=prompt, images=s.images, return_tensors="pt"),
                            max_new_tokens=24)
    assert r.choices[0].message.content == ref.text
    assert r.model_extra["mmspec"]["prompt_tokens_reused"] > 0  # turn 2 extends turn 1: its cache is reused


def _flat_png(w: int, h: int) -> str:
    from PIL import Image

    return data_url(Image.new("L", (w, h)))  # a few KB on the wire, w * h pixels decoded


def test_logprobs_are_the_targets_own(server, solo):
    import torch

    from helpers.reference import target_logprobs

    s = sample("chartqa", 10)
    r = server.client().chat.completions.create(model=MODEL, messages=user_message(s.prompt, s.images), max_tokens=12,
                                                temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ref = solo.target_greedy(s.prompt, s.images, 12)
    ids = [t for t in ref if t not in solo.dec.eos_ids]
    assert [c.model_extra["token_id"] for c in content] == ids
    want = target_logprobs(solo.e.target, solo.inputs(s.prompt, s.images), ids)  # [n, V]
    for c, w, t in zip(content, want, ids):
        assert c.logprob == pytest.approx(w[t].item(), abs=1e-4)
        assert c.top_logprobs[0].model_extra["token_id"] == c.model_extra["token_id"]  # greedy: the top-1
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(w.topk(3).values.tolist(), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8")) and len(c.top_logprobs) == 3
    assert "".join(c.token for c in content).strip() == r.choices[0].message.content.strip()
    assert torch.isfinite(torch.tensor([c.logprob for c in content])).all()
    # sampled and streamed, two choices: each chunk carries its own tokens' (raw logits, not tempered)
    got: dict[int, list] = {0: [], 1: []}
    for ch in server.client().chat.completions.create(model=MODEL, messages=user_message(s.prompt, s.images),
                                                      max_tokens=8, temperature=0.8, seed=3, n=2, stream=True,
                                                      logprobs=True, top_logprobs=2):
        for c in ch.choices:
            entries = c.logprobs.content if c.logprobs is not None else []
            if c.delta.content:  # the world's text is ASCII: a chunk's tokens spell its text
                assert "".join(e.token for e in entries) == c.delta.content, (c.delta.content, entries)
            got[c.index] += entries
    for i in (0, 1):
        answer = solo.generate(s.prompt, s.images, 8, temperature=0.8, seed=3 + i).token_ids
        ids = [t for t in answer if t not in solo.dec.eos_ids]
        assert [c.model_extra["token_id"] for c in got[i]] == ids
        want = target_logprobs(solo.e.target, solo.inputs(s.prompt, s.images), ids)
        assert [c.logprob for c in got[i]] == pytest.approx([w[t].item() for w, t in zip(want, ids)], abs=1e-4)
        assert all(len(c.top_logprobs) == 2 for c in got[i])


def test_n_choices_and_raw_completions(server, solo):
    client = server.client()
    s = sample("textvqa", 1)
    r = client.chat.completions.create(model=MODEL, messages=user_message(s.prompt, s.images), max_tokens=10,
                                       temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.message.content == solo.generate(s.prompt, s.images, 10, temperature=1.0, seed=7 + c.index).text
    assert r.usage.completion_tokens == sum(c["blocks"] and sum(c["tokens_per_block"])
                                            for c in r.model_extra["mmspec"]["choices"])
    texts = ["", ""]
    for ch in client.chat.completions.create(model=MODEL, messages=user_message(s.prompt, s.images), max_tokens=10,
                                             temperature=1.0, seed=7, n=2, stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices[:2]]
    # /v1/completions: the prompt as sent, no chat framing; an image through mmspec's parts extension
    from mmspec.inputs import processor_inputs

    raw = "USER: <image>\nWhat is the title? ASSISTANT:"
    ref = solo.dec.generate(**processor_inputs(solo.e.processor, raw, s.images), max_new_tokens=8, images=s.images)
    c = client.completions.create(model=MODEL, max_tokens=8, temperature=0, logprobs=2, prompt=[], extra_body={
        "prompt": [{"type": "text", "text": raw}, {"type": "image_url", "image_url": {"url": data_url(s.images[0])}}]})
    assert c.object == "text_completion" and c.choices[0].text == ref.text
    assert c.choices[0].logprobs.model_extra["token_ids"] == [t for t in ref.token_ids if t not in solo.dec.eos_ids]
    assert all(len(t) == 2 for t in c.choices[0].logprobs.top_logprobs)
    plain = client.completions.create(model=MODEL, prompt="The chart shows", max_tokens=5, temperature=0)
    ref = solo.dec.generate(**processor_inputs(solo.e.processor, "The chart shows", []), max_new_tokens=5)
    assert plain.choices[0].text == ref.text and plain.usage.completion_tokens == len(ref.token_ids)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", echo=True)


def test_api_key_and_metrics_on_a_real_server(tmp_path, solo):
    s = start_server(tmp_path, "--api-key", "k1")
    try:
        with pytest.raises(openai.AuthenticationError, match="no API key|wrong"):
            s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="k1", max_retries=0, timeout=120)
        got = ask(c, "chartqa", 10, 24, temperature=0)
        check_equal(solo, "chartqa", 10, 24, got)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert 'mmspec_requests_total{outcome="unauthorized"} 1.0' in metrics
        blocks = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("mmspec_spec_blocks_total{"))
        assert blocks == got[3]["blocks"]
        assert f"mmspec_spec_block_tokens_total {float(got[1])}" in metrics
        assert 'mmspec_spec_draft_accepted_total{position="1"}' in metrics
        assert "mmspec_batch_size_count" in metrics and "mmspec_prefix_cache_bytes" in metrics
        # the one answered request's time, by phase: each observed once, adding up to its e2e latency
        lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        phases = ("parse", "images", "processor", "queue", "prefill", "decode", "engine_other", "handoff")
        assert all(float(lines[f'mmspec_request_phase_seconds_count{{phase="{p}"}}']) == 1 for p in phases)
        spent = {p: float(lines[f'mmspec_request_phase_seconds_sum{{phase="{p}"}}']) for p in phases}
        e2e = float(lines["mmspec_e2e_request_latency_seconds_sum"])
        assert sum(spent.values()) == pytest.approx(e2e, rel=1e-6) and spent["decode"] > spent["images"] > 0
        assert float(lines["mmspec_http_request_seconds_count"]) == 1  # (the 401 is not an answer)
        assert float(lines["mmspec_http_request_seconds_sum"]) > e2e
        assert 0 < float(lines["mmspec_engine_cpu_seconds_total"]) <= float(lines["process_cpu_seconds_total"])
    finally:
        assert s.stop() == 0, s.log.read_text()


def _bad_requests(server) -> list[tuple[str, dict | bytes, str]]:
    """(what, body, a phrase the 400's message must hold)."""
    chart = sample("chartqa", 10)
    good = user_message(chart.prompt, chart.images)
    not_image = server.media / "notes.png"
    not_image.write_text("not an image")
    img = {"type": "image_url", "image_url": {"url": data_url(chart.images[0])}}
    many = [{"role": "user", "content": [{"type": "text", "text": "Describe them."}] + [img] * 16}]
    base = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    return [
        ("wrong number of images", {**base, "messages": user_message("Compare <image> with <image>.", chart.images)},
         "2 <image> slot(s) but 1 image"),
        ("unreadable image file", {**base, "messages": user_message("What?", [], urls=[str(not_image)])},
         "not an image"),
        ("missing image file", {**base, "messages": user_message("What?", [], urls=[str(server.media / "no.png")])},
         "not found"),
        ("base64 that is not an image", {**base, "messages": user_message(
            "What?", [], urls=["data:image/png;base64," + base64.b64encode(b"hello, world").decode()])},
         "the base64 data is not an image"),
        ("bad base64", {**base, "messages": user_message("What?", [], urls=["data:image/png;base64,@@@"])},
         "not valid base64"),
        ("prompt past the context", {**base, "messages": [{"role": "user", "content": "word " * 1100}]},
         "no room for an answer"),
        ("unknown argument", {**base, "messages": good, "best_of": 3}, "unknown argument(s) 'best_of'"),
        ("max_tokens 0", {**base, "messages": good, "max_tokens": 0}, "max_tokens must be >= 1"),
        ("max_tokens a million", {**base, "messages": good, "max_tokens": 1_000_000}, "past the context"),
        ("malformed JSON", b'{"model": "x", "messages": [', "not valid JSON"),
        ("more images than the family supports", {**base, "messages": many}, "at most 15"),
        ("n=17", {**base, "messages": good, "n": 17}, "n must be from 1 to 16"),
        ("a NUL byte in a file path", {**base, "messages": user_message("What?", [], urls=["file:///etc/a\u0000b"])},
         "NUL character"),
        ("JSON nested 10,000 deep", b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "deeper than 32"),
        ("a lone surrogate", json.dumps({**base, "messages": [{"role": "user", "content": "a \ud800 b"}]}).encode(),
         "lone surrogate"),
        ("a 12000x12000 PNG", {**base, "messages": user_message("What?", [], urls=[_flat_png(12000, 12000)])},
         "per image (--max-image-pixels)"),
        ("100 KB of text", {**base, "messages": [{"role": "user", "content": "word " * 20_000}]}, "bytes of text"),
        ("a penalty", {**base, "messages": good, "frequency_penalty": 0.5}, "penalties change"),
        ("a remote image", {**base, "messages": user_message("What?", [], urls=["https://example.com/a.png"])},
         "does not fetch remote images"),
        ("a file outside the media directory", {**base, "messages": user_message("What?", [], urls=["/etc/hostname"])},
         "outside the directories"),
        ("temperature -1", {**base, "messages": good, "temperature": -1}, "temperature must be"),
        ("no messages", {**base, "messages": []}, "messages must be"),
        ("a stream_options without stream", {**base, "messages": good, "stream_options": {"include_usage": True}},
         "only allowed with stream=true"),
    ]


def test_each_bad_request_gets_a_400_and_the_server_keeps_serving(server, solo):
    for what, body, phrase in _bad_requests(server):
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, **kw)
        assert r.status_code == 400, (what, r.status_code, r.text)
        error = r.json()["error"]
        assert phrase in error["message"], (what, error)
        assert error["type"] == "invalid_request_error"
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="best_of"):  # the client sees the message too
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"best_of": 2})
    with pytest.raises(openai.NotFoundError, match="serves 'mmspec-embedded'"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    check_equal(solo, "chartqa", 10, 40, ask(client, "chartqa", 10, 40, temperature=0))
    assert server.proc.poll() is None


def test_bad_requests_among_good_ones_change_nothing(server, solo):
    client = server.client()
    bad = _bad_requests(server)

    def run(k):
        if k % 3 == 2:
            _, body, _ = bad[k % len(bad)]
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            return httpx.post(server.url + "/v1/chat/completions", timeout=60, **kw).status_code
        family, index, max_tokens = CASES[k % 4]
        return ask(client, family, index, max_tokens, stream=k % 2 == 0, temperature=0)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(12)))
    for k, got in enumerate(results):
        if k % 3 == 2:
            assert got == 400
        else:
            check_equal(solo, *CASES[k % 4], got)


def test_a_client_that_leaves_mid_stream_is_no_harm(server, solo):
    s = sample("pororosv", 0)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": user_message(s.prompt, s.images), "max_tokens": 64, "temperature": 0,
            "stream": True}) as r:
        next(r.iter_lines())  # the first chunk, then hang up
    deadline = time.monotonic() + 30
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health()["active"] == 0
    check_equal(solo, "chartqa", 10, 40, ask(server.client(), "chartqa", 10, 40, temperature=0))


def test_sigterm_lets_running_requests_finish_and_exits_0(tmp_path, solo):
    s = start_server(tmp_path)
    client = s.client()
    answers = {}

    def run(stream):
        answers[stream] = ask(client, "spot_the_diff", 0, 32, stream=stream, temperature=0)

    threads = [threading.Thread(target=run, args=(st,)) for st in (False, True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while s.health()["active"] + s.health()["queued"] == 0 and not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert s.proc.wait(60) == 0, s.log.read_text()
    for got in answers.values():
        check_equal(solo, "spot_the_diff", 0, 32, got)
    assert len(answers) == 2


def test_flags_are_checked_before_anything_loads(tmp_path):
    from typer.testing import CliRunner

    from mmspec.cli import app

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, phrase in ((["--port", str(port)], "cannot listen on 127.0.0.1"),
                             (["--max-batch", "0"], "--max-batch must be >= 1"),
                             (["--speculate", "sometimes"], "--speculate must be one of always, never, auto"),
                             (["--tool-call-parser", "llama3"], "--tool-call-parser must be one of hermes"),
                             (["--prefix-cache-mb", "-1"], "--prefix-cache-mb must be a number of MiB >= 0"),
                             (["--warm-up-context", "1"], "--warm-up-context must be 0 (no warm-up) or a number"),
                             (["--allowed-local-media-path", str(tmp_path / "nope")], "is not a directory"),
                             (["--max-request-mb", "0"], "--max-request-mb must be a number of MiB > 0"),
                             (["--max-image-pixels", "0"], "--max-image-pixels must be >= 1"),
                             (["--max-request-pixels", "0"], "--max-request-pixels must be >= 1"),
                             (["--api-key", " "], "--api-key (or MMSPEC_API_KEY) is empty"),
                             (["--cors-origins", "not a url"], "--cors-origins 'not a url' is not an origin"),
                             (["--cors-origins", "https://app.example/"], "without the path: https://app.example"),
                             (["--target", str(tmp_path)], "--target was given without --draft")):
            r = CliRunner().invoke(app, ["serve", *args])
            assert r.exit_code == 2 and phrase in " ".join(r.output.split()), (args, r.output)
            assert "Using the embedded" not in r.output
