"""`mmspec serve` under load: N requests from C concurrent clients, a share of them malformed.

Starts a real server process (`python -m mmspec serve`, the embedded models unless --target/
--draft are passed through), waits for /health, warms it up, and records its idle RSS; then C
client threads send N requests (the openai client for the good ones, half of them streamed;
raw HTTP for the malformed ones, every kind of bad request in turn), timing each. Afterwards:
every good answer is compared with a solo `SpecDecoder.generate` of the same request (and its
token count), every bad one must be a 400, the server must still answer, and its RSS is read
again after it has been idle a few seconds. Writes a JSON summary (requests/s, latency p50/p90,
tokens/s, RSS idle/peak/after, every mismatch) and stops the server with SIGTERM (exit code
recorded).

    python perf/serve_load.py --out runs/serve-load --requests 200 --clients 16 --bad 0.1 --threads 1
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("chartqa", "textvqa", "vqav2", "hallusionbench", "spot_the_diff", "iedit", "pororosv", "vist")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def good_requests(n_distinct: int, max_tokens: int) -> list[dict]:
    """Distinct world samples (every family: 1, 2 and 5 images) as chat requests."""
    from mmspec.world import make_sample

    out = []
    for k in range(n_distinct):
        family = FAMILIES[k % len(FAMILIES)]
        s = make_sample(family, "test", 100 + k // len(FAMILIES))
        out.append({"key": f"{family}/{100 + k // len(FAMILIES)}", "prompt": s.prompt, "images": s.images,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": s.prompt}] + [
                        {"type": "image_url", "image_url": {"url": data_url(im)}} for im in s.images]}],
                    "max_tokens": max_tokens})
    return out


def bad_bodies(model: str, good: dict) -> list[tuple[str, bytes]]:
    """Each kind of malformed request the issue names, as raw bodies."""
    url = good["messages"][0]["content"][1]["image_url"]["url"]
    img = {"type": "image_url", "image_url": {"url": url}}
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode()

    def body(**kw) -> bytes:
        return json.dumps({"model": model, "max_tokens": 8, "temperature": 0, **kw}).encode()

    text = [{"type": "text", "text": "Compare <image> with <image>."}]
    return [
        ("wrong image count", body(messages=[{"role": "user", "content": text + [img]}])),
        ("not an image", body(messages=[{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                                    {"type": "image_url", "image_url": {"url": not_image}}]}])),
        ("bad base64", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}])),
        ("past the context", body(messages=[{"role": "user", "content": "word " * 1100}])),
        ("unknown argument", body(messages=good["messages"], best_of=2)),
        ("max_tokens 0", body(messages=good["messages"], max_tokens=0)),
        ("max_tokens a million", body(messages=good["messages"], max_tokens=1_000_000)),
        ("malformed JSON", b'{"model": "x", "messages": [{"role": "user"'),
        ("too many images", body(messages=[{"role": "user", "content": [{"type": "text", "text": "Describe."}] + [img] * 40}])),
        ("NUL byte in a path", body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/a\u0000b"}}]}])),
        ("JSON nested 10,000 deep", b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
        ("100 KB of text", body(messages=[{"role": "user", "content": "word " * 20_000}])),
    ]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--max-batch", str(args.max_batch),
           *(["--threads", str(args.threads)] if args.threads else []),
           *(["--api-key", args.api_key] if args.api_key else []), *([] if args.metrics else ["--no-metrics"]),
           *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok":
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not come up in 300 s; see {log}")


def one(client, url: str, model: str, job: dict) -> dict:
    t0 = time.perf_counter()
    if job["bad"] is not None:
        kind, body = job["bad"]
        r = httpx.post(url + "/v1/chat/completions", content=body, timeout=600,
                       headers={"content-type": "application/json", "authorization": f"Bearer {client.api_key}"})
        return {"bad": kind, "status": r.status_code, "latency_s": time.perf_counter() - t0,
                "message": r.json().get("error", {}).get("message", "")[:200]}
    g = job["good"]
    args = dict(model=model, messages=g["messages"], max_tokens=g["max_tokens"], temperature=0)
    try:
        if job["stream"]:
            text, n, first = "", None, None
            for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter() - t0
                    text += ch.choices[0].delta.content
                if ch.usage is not None:
                    n = ch.usage.completion_tokens
        else:
            r = client.chat.completions.create(**args)
            text, n, first = r.choices[0].message.content, r.usage.completion_tokens, None
        return {"key": g["key"], "stream": job["stream"], "status": 200, "text": text, "tokens": n,
                "latency_s": time.perf_counter() - t0, "first_token_s": first}
    except openai.APIError as e:
        return {"key": g["key"], "stream": job["stream"], "status": getattr(e, "status_code", -1), "error": str(e)[:300],
                "latency_s": time.perf_counter() - t0}


def solo_answers(goods: list[dict], serve_args: list[str], threads: int | None) -> tuple[dict, dict]:
    """key -> (text, tokens) of a solo SpecDecoder.generate, built as the server builds the request;
    and the speed of those solo runs one after another (in this process, no HTTP): the baseline."""
    import torch

    from mmspec import SpecDecoder, load_embedded
    from mmspec.inputs import chat_prompt, processor_inputs

    if serve_args:
        raise SystemExit("solo references are built for the embedded models only")
    if threads:
        torch.set_num_threads(threads)  # the server's share, so the baseline runs as the server did
    e = load_embedded(dtype=torch.float32)
    dec = SpecDecoder(e.target, e.draft, e.tokenizer)
    out, tokens, seconds = {}, 0, 0.0
    for g in goods:
        inputs = processor_inputs(e.processor, chat_prompt(e.processor, g["prompt"], len(g["images"])), g["images"])
        t0 = time.perf_counter()
        res = dec.generate(**inputs, max_new_tokens=g["max_tokens"], images=g["images"])
        seconds += time.perf_counter() - t0
        tokens += len(res.token_ids)
        out[g["key"]] = (res.text, len(res.token_ids))
    return out, {"requests": len(goods), "tokens_per_s": round(tokens / seconds, 1),
                 "requests_per_s": round(len(goods) / seconds, 2), "mean_latency_s": round(seconds / len(goods), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--bad", type=float, default=0.1, help="share of malformed requests")
    ap.add_argument("--distinct", type=int, default=40, help="distinct good requests (each sent several times)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="the server's --threads")
    ap.add_argument("--idle-wait", type=float, default=5.0, help="seconds idle before the last RSS reading")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None, help="start the server with this --api-key (the clients send it)")
    ap.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                    help="GET /metrics on (the server's default) or --no-metrics")
    ap.add_argument("serve_args", nargs="*", help="more `mmspec serve` flags (after --)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"serve_load-{port}.log"  # not kept with the results (docs/results/README.md)
    t_start = time.perf_counter()
    proc = start_server(args, port, log)
    startup_s = time.perf_counter() - t_start
    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "unused", max_retries=0, timeout=600)

    goods = good_requests(args.distinct, args.max_tokens)
    bads = bad_bodies(model, goods[0])
    n_bad = round(args.requests * args.bad)
    jobs = [{"good": None, "bad": bads[k % len(bads)], "stream": False} for k in range(n_bad)]
    jobs += [{"good": goods[k % len(goods)], "bad": None, "stream": k % 2 == 1} for k in range(args.requests - n_bad)]
    rng.shuffle(jobs)

    for g in goods[:4]:  # warm-up: first-call costs out of the idle reading and the timings
        one(client, url, model, {"good": g, "bad": None, "stream": False})
    time.sleep(1.0)
    rss_idle = rss_mb(proc.pid)
    peak = [rss_idle]
    stop_sampling = threading.Event()

    def sample_rss():
        while not stop_sampling.wait(0.2):
            peak.append(rss_mb(proc.pid))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda j: one(client, url, model, j), jobs))
    wall = time.perf_counter() - t0
    stop_sampling.set()
    sampler.join()
    alive = proc.poll() is None and httpx.get(url + "/health", timeout=10).status_code == 200
    time.sleep(args.idle_wait)
    rss_after = rss_mb(proc.pid)
    health = httpx.get(url + "/health", timeout=10).json()
    metrics_text = httpx.get(url + "/metrics", timeout=10).text if args.metrics else ""
    if metrics_text:
        (args.out / "metrics.txt").write_text(metrics_text)
    proc.send_signal(signal.SIGTERM)
    try:
        exit_code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        exit_code = "killed after 120 s"

    solo, solo_speed = solo_answers(goods, args.serve_args, args.threads)
    good_res = [r for r in results if "bad" not in r]
    bad_res = [r for r in results if "bad" in r]
    mismatches = [{"key": r["key"], "stream": r["stream"], "status": r["status"], "got": r.get("text"),
                   "tokens": r.get("tokens"), "solo": solo[r["key"]][0], "solo_tokens": solo[r["key"]][1],
                   "error": r.get("error")}
                  for r in good_res if r["status"] != 200 or (r["text"], r["tokens"]) != solo[r["key"]]]
    not_400 = [r for r in bad_res if r["status"] != 400]
    lat = [r["latency_s"] for r in good_res]
    ttft = [r["first_token_s"] for r in good_res if r.get("first_token_s") is not None]
    tokens = sum(r.get("tokens") or 0 for r in good_res)
    summary = {
        "command": "python perf/serve_load.py " + " ".join(sys.argv[1:]),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "loadavg_after": os.getloadavg()},
        "server": {"args": ["--max-batch", args.max_batch, "--threads", args.threads, *args.serve_args], "log": str(log),
                   "api_key": bool(args.api_key), "metrics": args.metrics,
                   "metrics_scrape_bytes": len(metrics_text),
                   "startup_s": round(startup_s, 1), "steps": health["steps"], "exit_code_on_sigterm": exit_code},
        "requests": len(results), "clients": args.clients, "good": len(good_res), "bad": len(bad_res),
        "distinct_good": len(goods), "streamed": sum(r.get("stream", False) for r in good_res),
        "good_identical_to_solo": len(good_res) - len(mismatches), "bad_got_400": len(bad_res) - len(not_400),
        "server_alive_after": alive,
        "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 2),
        "good_requests_per_s": round(len(good_res) / wall, 2), "completion_tokens_per_s": round(tokens / wall, 1),
        "latency_s": {"p50": round(percentile(lat, 0.5), 3), "p90": round(percentile(lat, 0.9), 3),
                      "max": round(max(lat), 3)},
        "first_token_s_streamed": {"p50": round(percentile(ttft, 0.5), 3), "p90": round(percentile(ttft, 0.9), 3)},
        "solo_sequential": solo_speed,
        "bad_latency_s_p50": round(percentile([r["latency_s"] for r in bad_res], 0.5), 4),
        "rss_mb": {"idle": round(rss_idle, 1), "peak": round(max(peak), 1), "after": round(rss_after, 1),
                   "prefix_cache_after": health.get("prefix_cache_mb"),  # kept by design, within its budget
                   "after_less_prefix_cache": round(rss_after - (health.get("prefix_cache_mb") or 0.0), 1)},
        "mismatches": mismatches, "bad_not_400": not_400,
        "bad_kinds": sorted({r["bad"] for r in bad_res}),
    }
    (args.out / "serve_load.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("mismatches", "bad_not_400")}, indent=2))


if __name__ == "__main__":
    main()
