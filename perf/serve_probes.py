"""`mmspec serve` probed as an attacker would (issue 43): every hostile request a 4xx in OpenAI's
error shape, none a 5xx, the server's memory back near idle after, SIGTERM honoured mid-upload.

Starts a real server process (the embedded models, `--api-key`, the default limits), reads its
idle RSS, sends every probe of PROBES (raw HTTP: bodies too large, too deep, of the wrong type,
with NUL bytes, lone surrogates, invalid UTF-8, image bombs, server paths, a DNS-rebinding Host,
a wrong key, vanishing temperatures ...), checks each status and that no error message shows a
server path, reads the RSS again, then sends SIGTERM in the middle of a body that never ends and
times the exit. Writes `serve_probes.json`.

    python perf/serve_probes.py --out runs/serve-probes --threads 1
    python perf/serve_probes.py --out runs/serve-probes --fast      # the quick subset the tests run
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "probe-key"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def png(w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (w, h)).save(buf, "PNG")  # flat: a few KB on the wire, w * h pixels decoded
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(content, **kw) -> dict:
    return {"model": "mmspec-embedded", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}


def image(url: str) -> dict:
    return chat([{"type": "text", "text": "What is in the image?"}, {"type": "image_url", "image_url": {"url": url}}])


def probes(media: Path, fast: bool) -> list[dict]:
    """(name, body, headers, expected status); body a dict (JSON), bytes, or a callable (sent as a stream)."""
    j = lambda d: json.dumps(d, ensure_ascii=True).encode()  # noqa: E731 - \\u escapes kept as written
    out = [
        ("NUL byte in a file:// path", j(image("file:///etc/pass\u0000wd")), {}, 400),
        ("JSON nested 10,000 deep", b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", {}, 400),
        ("JSON nested 40 deep in metadata", j({**chat("hi"), "metadata": json.loads("[" * 40 + "]" * 40)}), {}, 400),
        ("12000x12000 PNG", j(image(png(12000, 12000))), {}, 400),
        ("body as text/plain", j(chat("hi")), {"content-type": "text/plain"}, 415),
        ("body as a form", b"messages=hi", {"content-type": "application/x-www-form-urlencoded"}, 415),
        ("body without Content-Type", j(chat("hi")), {"content-type": ""}, 415),
        ("lone surrogate", j(chat("a \ud800 b")), {}, 400),
        ("NUL byte in the text", j(chat("a \u0000 b")), {}, 400),
        ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, 400),
        ("a path outside the media folder", j(image(str(media.parent / "secret.png"))), {}, 400),
        ("/etc/passwd", j(image("file:///etc/passwd")), {}, 400),
        ("metadata service URL", j(image("http://169.254.169.254/latest/meta-data")), {}, 400),
        ("SVG data URL", j(image("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode())), {}, 400),
        ("DNS rebinding Host", j(chat("hi")), {"host": "attacker.example"}, 400),
        ("no API key", j(chat("hi")), {"authorization": ""}, 401),
        ("wrong API key", j(chat("hi")), {"authorization": "Bearer nope"}, 401),
        ("a 1 MB model name", j({**chat("hi"), "model": "m" * 2**20}), {}, 404),
        ("n = 1000", j(chat("hi", n=1000)), {}, 400),
        ("top_logprobs = 1000", j(chat("hi", logprobs=True, top_logprobs=1000)), {}, 400),
        ("seed 2**64", j(chat("hi", seed=2**64)), {}, 400),
        ("best_of", j(chat("hi", best_of=4)), {}, 400),
        ("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', {}, 400),
    ]
    if not fast:
        out += [
            ("30000x30000 PNG (bomb)", j(image(png(30000, 30000))), {}, 400),
            ("50 MB of prompt text", j(chat("word " * 10_000_000)), {}, 413),
            ("Content-Length of 1 TB", b"{}", {"content-length": str(2**40)}, 413),
            ("100,000 messages", j({**chat("hi"), "messages": [{"role": "user", "content": "hi"}] * 100_000}), {}, 400),
            ("200 KB of text", j(chat("word " * 40_000)), {}, 400),
            ("1000 image parts", j(chat([{"type": "text", "text": "Describe."}]
                                        + [{"type": "image_url", "image_url": {"url": png(8, 8)}}] * 1000)), {}, 400),
            ("5 images of 4096x4096 (past the request's pixels)", j(chat(
                [{"type": "text", "text": "Describe."}]
                + [{"type": "image_url", "image_url": {"url": png(4096, 4096)}}] * 5)), {}, 400),
        ]
    return [{"name": n, "body": b, "headers": h, "want": w} for n, b, h, w in out]


def send(url: str, p: dict) -> dict:
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    for k, v in p["headers"].items():
        if v == "":
            headers.pop(k, None)
        else:
            headers[k] = v
    t0 = time.perf_counter()
    if "content-length" in headers:  # a lie about the size: raw socket, the body never sent
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as s:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
            raw = s.recv(65536).decode("latin-1")
        status = int(raw.split()[1])
        body = raw.partition("\r\n\r\n")[2]
    else:
        r = httpx.post(url + "/v1/chat/completions", content=p["body"], headers=headers, timeout=600)
        status, body = r.status_code, r.text
    try:
        error = json.loads(body)["error"] if status >= 400 else None
    except (ValueError, KeyError, TypeError):
        error = {"unparsed": body[:200]}
    return {"name": p["name"], "want": p["want"], "status": status, "seconds": round(time.perf_counter() - t0, 3),
            "openai_shape": error is None or set(error) == {"message", "type", "param", "code"},
            "message": (error or {}).get("message", "")[:240] if isinstance(error, dict) else ""}


def exact_probes(url: str) -> list[dict]:
    """Sampling settings too small for the dtype: the greedy answer, exactly."""
    h = {"authorization": f"Bearer {KEY}"}
    ask = lambda **kw: httpx.post(url + "/v1/chat/completions", json=chat("Describe a red square.", max_tokens=16,  # noqa: E731
                                                                          **kw), headers=h, timeout=600).json()
    greedy = ask(temperature=0)["choices"][0]["message"]["content"]
    out = []
    for kw in ({"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-300}):
        got = ask(**kw)
        text = got.get("choices", [{}])[0].get("message", {}).get("content")
        out.append({"name": f"{kw} decodes greedily", "greedy": greedy, "got": text, "ok": text == greedy})
    return out


def start(args, port: int, log: Path, media: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--api-key", KEY,
           "--allowed-local-media-path", str(media), "--shutdown-timeout", str(args.shutdown_timeout),
           *(["--threads", str(args.threads)] if args.threads else [])]
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


def sigterm_mid_upload(proc: subprocess.Popen, port: int) -> dict:
    """A body that keeps coming (under the size limit, never finished) while SIGTERM arrives."""
    stop = threading.Event()

    def trickle():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                          "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
                while not stop.is_set():
                    s.sendall(b"400\r\n" + b" " * 0x400 + b"\r\n")
                    time.sleep(0.05)
        except OSError:
            pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 120 s"
    stop.set()
    return {"exit_code": code, "seconds_to_exit": round(time.perf_counter() - t0, 2)}


def run(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="serve_probes-"))
    media = tmp / "media"
    media.mkdir()
    log = tmp / "serve.log"
    proc = start(args, port, log, media)
    h = {"authorization": f"Bearer {KEY}"}
    httpx.post(url + "/v1/chat/completions", json=chat("hi"), headers=h, timeout=600)  # warm-up
    time.sleep(1.0)
    idle = rss_mb(proc.pid)
    peak = [idle]
    done = threading.Event()
    sampler = threading.Thread(target=lambda: [peak.append(rss_mb(proc.pid)) for _ in iter(lambda: done.wait(0.1), True)],
                               daemon=True)
    sampler.start()
    results = [send(url, p) for p in probes(media, args.fast)]
    exact = exact_probes(url)
    done.set()
    sampler.join()
    alive = httpx.get(url + "/health", timeout=10).json()
    time.sleep(args.idle_wait)
    after = rss_mb(proc.pid)
    cache_mb = httpx.get(url + "/health", timeout=10).json().get("prefix_cache_mb") or 0.0
    shutdown = sigterm_mid_upload(proc, port)
    leaks = [r["name"] for r in results if str(tmp) in r["message"] or str(ROOT) in r["message"]]
    wrong = [r for r in results if r["status"] != r["want"] or not r["openai_shape"]]
    return {
        "command": "python perf/serve_probes.py " + " ".join(sys.argv[1:]),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "probes": len(results), "as_expected": len(results) - len(wrong), "wrong": wrong,
        "five_xx": [r["name"] for r in results if r["status"] >= 500], "server_paths_shown": leaks,
        "exact_probes": exact, "server_alive_after": alive.get("status") == "ok",
        "rss_mb": {"idle": round(idle, 1), "peak": round(max(peak), 1), "after": round(after, 1),
                   "prefix_cache": cache_mb, "bound": round(1.5 * idle + cache_mb, 1),
                   "within_bound": after <= 1.5 * idle + cache_mb},
        "sigterm_mid_upload": {**shutdown, "shutdown_timeout_s": args.shutdown_timeout},
        "results": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fast", action="store_true", help="the quick subset (no 50 MB bodies or pixel bombs)")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    ap.add_argument("--idle-wait", type=float, default=3.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args)
    (args.out / "serve_probes.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    bad = summary["wrong"] or summary["five_xx"] or summary["server_paths_shown"] or \
        not all(e["ok"] for e in summary["exact_probes"]) or not summary["rss_mb"]["within_bound"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
