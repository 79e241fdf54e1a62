"""What ``logprobs`` cost a `mmspec serve` request (issue 53, item 7), with and without, in one run.

Starts one server (the embedded pack, `--threads 1`, the prefix cache off: no prompt reused from
an earlier request), sends each one-image world request once untimed (its image and first-use
shapes warm), then twice timed: without logprobs and with `logprobs` + `top_logprobs` (greedy,
which goes first alternating from request to request, so drift and any cache favour neither).
Per mode the mean client latency; the cost is mean(with) / mean(without) - 1, and the median of
the per-request ratios beside it. Where the server has ``/metrics``, each request's own time
inside the server is read from it too and split into ``engine`` (its e2e latency: admission,
prefill, decode, to its last token) and ``respond`` (the HTTP handler's time beyond that: the
response built, logprobs included, and sent). The answers must be the same text (exit 1 otherwise).
``--src DIR`` runs the server from another mmspec source tree (the code before this change,
``git archive``d), so one script measures before and after. Prints and writes (``--out``) JSON.

    PYTHONPATH=src python perf/logprobs_cost.py --requests 16 --repeats 2 --max-tokens 48 --top 5 --out runs/lp.json
    PYTHONPATH=src python perf/logprobs_cost.py --quick --out /tmp/lp.json    # the smoke test's run
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
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_IMAGE = ("chartqa", "hallusionbench", "textvqa", "vqav2")
START_S = 300  # bounded wait for /health (a loaded machine: imports + the embedded models)


def requests(n: int, max_tokens: int) -> list[dict]:
    """``n`` one-image world chat requests (test split, greedy)."""
    from mmspec.world import make_sample

    out = []
    for g in range(n):
        s = make_sample(ONE_IMAGE[g % len(ONE_IMAGE)], "test", g // len(ONE_IMAGE))
        parts = [{"type": "text", "text": s.prompt}]
        for im in s.images:
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                    + base64.b64encode(buf.getvalue()).decode()}})
        out.append({"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, "temperature": 0})
    return out


def start(src: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--threads", "1",
                                 "--prefix-cache-mb", "0"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=5).json()["status"] == "ok":
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not come up in {START_S} s; see {log}")


def server_seconds(url: str, answered: int = 0) -> tuple[float, float, int] | None:
    """(e2e, http) seconds the server has counted so far and the answers counted (its /metrics;
    None: no metrics), once at least ``answered`` answers are (it counts one after its last byte)."""
    import httpx

    for _ in range(100):
        r = httpx.get(url + "/metrics", timeout=30)
        if r.status_code != 200:
            return None
        m = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
        n = int(float(m.get("mmspec_http_request_seconds_count", 0)))
        if n >= answered:
            return (float(m.get("mmspec_e2e_request_latency_seconds_sum", 0)),
                    float(m.get("mmspec_http_request_seconds_sum", 0)), n)
        time.sleep(0.01)
    raise SystemExit("the server's /metrics did not count an answered request")


def ask(url: str, body: dict) -> tuple[float, dict, dict]:
    """One request -> (client seconds, its choice, its engine and respond seconds in the server)."""
    import httpx

    before = server_seconds(url)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    after = None if before is None else server_seconds(url, before[2] + 1)
    inside = {} if before is None else {"engine": after[0] - before[0], "respond": (after[1] - before[1])
                                        - (after[0] - before[0])}
    return seconds, r.json()["choices"][0], inside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="times the set is timed (each time both modes)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=5, help="top_logprobs asked")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the mmspec source tree the server runs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 requests, 1 repeat, 6 tokens")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats, args.max_tokens = 2, 1, 6
    reqs = requests(args.requests, args.max_tokens)
    lp = {"logprobs": True, "top_logprobs": args.top}
    proc, url = start(args.src.resolve(), Path(tempfile.mkdtemp(prefix="logprobs_cost-")) / "serve.log")
    rows, differ = [], 0
    try:
        for body in reqs:  # warm, untimed
            ask(url, body)
        for rep in range(args.repeats):
            for k, body in enumerate(reqs):
                order = ["without", "with"] if (k + rep) % 2 == 0 else ["with", "without"]
                got = {m: ask(url, {**body, **(lp if m == "with" else {})}) for m in order}
                (t0, c0, s0), (t1, c1, s1) = got["without"], got["with"]
                ok = c0["message"]["content"] == c1["message"]["content"] and c0["logprobs"] is None \
                    and len(c1["logprobs"]["content"][0]["top_logprobs"]) == args.top
                differ += not ok
                rows.append({"request": k, "repeat": rep, "without_s": t0, "with_s": t1, "same_answer": ok,
                             **{f"{part}_{m}_s": v for m, inside in (("without", s0), ("with", s1))
                                for part, v in inside.items()}})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    without = statistics.mean(r["without_s"] for r in rows)
    with_ = statistics.mean(r["with_s"] for r in rows)
    res = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "src": str(args.src),
           "command": "python perf/logprobs_cost.py " + " ".join(sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
           "requests": args.requests, "repeats": args.repeats, "max_tokens": args.max_tokens, "top_logprobs": args.top,
           "mean_without_s": round(without, 4), "mean_with_s": round(with_, 4),
           "cost": round(with_ / without - 1, 4),
           "median_ratio": round(statistics.median(r["with_s"] / r["without_s"] for r in rows), 4),
           **{f"mean_{k[:-2]}_ms": round(1e3 * statistics.mean(r[k] for r in rows), 2) for k in rows[0]
              if k.startswith(("engine_", "respond_"))},
           "answers_differ": differ, "rows": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
