"""`mmspec serve` on ONE core: speculation against `--speculate never` at 1 and C concurrent clients,
against the library's `generate` on the same requests, and where a served request's time goes
(issue 42, "Measure").

Starts one server per `--speculate` policy (`taskset -c CORE python -m mmspec serve --threads 1
--speculate P`, the embedded pack, each on a free port, pinned from its start) and a `generate`
worker pinned the same way (a subprocess of this script: the server's own decoder, built by the
code `mmspec serve` builds it with, `SpecDecoder.generate` one request after another). Each
repeat, each client count C gets a fresh set of N one-image world requests (chartqa,
hallusionbench, textvqa, vqav2; test split; greedy; `--max-tokens`): every server answers the
set (the openai client, C threads, non-streaming) and the worker decodes it, in an order that
rotates each repeat, one system at a time, so the systems share the machine's drift. No request
is sent twice to one system, so no prefix-cache hit flatters any of them (the servers' prefix
caches are on, as by default).

Per (system, C): tokens/s (completion tokens / wall; summed over repeats), tokens per CPU-second
(the server's whole process, or the generate calls': what a loaded machine disturbs less),
latency mean / p50 / p90, answers identical to `generate`'s; per server also where its requests' time went, from the
/metrics the server exposes (scraped before and after each set): the phases of
`mmspec_request_phase_seconds` (parse, images, processor, queue, prefill, decode, engine_other,
handoff; docs/serve.md), `respond` (`mmspec_http_request_seconds` beyond the e2e latency: the
response's JSON and its sending), `client_side` (the client's latency beyond that: uvicorn's read
of the request, the transport, the openai client on the client's core; the client's own CPU
seconds per request beside it), and the worker thread's
share of the server's CPU (`mmspec_engine_cpu_seconds_total` / `process_cpu_seconds_total`).
"Not the engine" is parse + images + processor + handoff + respond, as a share of the client's
latency, and the server's CPU outside the worker thread. Prints one JSON line per
(system, C) and writes the whole run (--out): rows, goals (speculation >= 1.8x never at 1 client
and >= 1.5x at 8; one client within 10% of generate; what is not the engine under 10%), load
average and the busiest processes before and after. Exits 1 when a request failed or a
one-client answer differs from `generate`'s (batched answers may differ in a float32 near-tie:
reported, see mmspec.batch).

    PYTHONPATH=src python perf/serve_speed.py --requests 16 --clients 1 8 --repeats 2 --out runs/serve_speed.json
    PYTHONPATH=src python perf/serve_speed.py --speculate always never auto --core 0 --client-core 1 --out ...
    PYTHONPATH=src python perf/serve_speed.py --quick --out /tmp/serve_speed.json    # the smoke test's run
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_IMAGE = ("chartqa", "hallusionbench", "textvqa", "vqav2")  # the world's one-image families
PHASES = ("parse", "images", "processor", "queue", "prefill", "decode", "engine_other", "handoff")  # docs/serve.md
NOT_ENGINE = ("parse", "images", "processor", "handoff", "respond")  # the server's time on a request outside the engine
GOALS = {"speculation_vs_never": {1: 1.8, 8: 1.5}, "one_client_vs_generate": 0.9, "not_engine_share": 0.10}
START_S = 300  # bounded wait for a server's /health (a loaded machine: imports + the embedded models)


# ----------------------------------------------------------------------- requests
def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request_set(set_id: int, n: int, max_tokens: int, split: str = "test") -> list[dict]:
    """Set ``set_id``'s ``n`` one-image world requests (sets never share a sample), as chat requests."""
    from mmspec.world import make_sample

    out = []
    for k in range(n):
        g = set_id * n + k
        family, index = ONE_IMAGE[g % len(ONE_IMAGE)], g // len(ONE_IMAGE)
        s = make_sample(family, split, index)
        out.append({"key": f"{family}/{split}/{index}", "prompt": s.prompt, "images": list(s.images),
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": s.prompt}] + [
                        {"type": "image_url", "image_url": {"url": data_url(im)}} for im in s.images]}]})
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


# ----------------------------------------------------------------------- the generate worker (a subprocess)
def generate_worker(threads: int) -> None:
    """The server's decoder (`mmspec serve`'s defaults, built by its code) in this process: per
    command line {"set", "n", "max_tokens", "split"} on stdin, every request of that set through
    ``SpecDecoder.generate``, one after another; one JSON line back per command."""
    proto = os.fdopen(os.dup(1), "w")  # the replies; anything the libraries print goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from mmspec.cli.checks import GenerateOptions, check_decoder
    from mmspec.cli.generate import build_decoder, load_models
    from mmspec.inputs import chat_prompt, processor_inputs
    from mmspec.threads import apply_threads

    o = check_decoder(GenerateOptions(threads=threads))
    apply_threads(o.threads)
    t, d, tok, proc, cap, _ = load_models(o.target, o.draft, o.captioner, o.captioner_prompt, o.dtype, o.device,
                                          head=o.head)
    dec = build_decoder(o, t, d, tok, proc, cap)
    print(json.dumps({"ready": True}), file=proto, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out = []
        for r in request_set(cmd["set"], cmd["n"], cmd["max_tokens"], cmd.get("split", "test")):
            t0 = time.perf_counter()
            inputs = processor_inputs(proc, chat_prompt(proc, r["prompt"], len(r["images"])), r["images"])
            t1, c1 = time.perf_counter(), time.process_time()
            res = dec.generate(**inputs, max_new_tokens=r["max_tokens"], images=r["images"])
            t2, c2 = time.perf_counter(), time.process_time()
            st = res.stats  # the same split as the server's phases: prefill, decode (its blocks), the rest
            prefill = st.vision_s + st.caption_s + st.substitute_s + st.prefill_s
            out.append({"key": r["key"], "text": res.text, "tokens": len(res.token_ids), "processor_s": t1 - t0,
                        "latency_s": t2 - t1, "cpu_s": c2 - c1, "prefill_s": prefill,
                        "decode_s": st.draft_s + st.verify_s})
        print(json.dumps({"results": out}), file=proto, flush=True)


class GenerateWorker:
    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True)

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the generate worker exited ({self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def wait_ready(self) -> None:
        assert self._reply()["ready"]

    def run(self, set_id: int, n: int, max_tokens: int, split: str = "test") -> list[dict]:
        self.proc.stdin.write(json.dumps({"set": set_id, "n": n, "max_tokens": max_tokens, "split": split}) + "\n")
        self.proc.stdin.flush()
        return self._reply()["results"]

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ----------------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(core: int | None) -> list[str]:
    return [] if core is None else ["taskset", "-c", str(core)]


class Server:
    def __init__(self, policy: str, args, env: dict, log: Path):
        self.policy, self.port, self.log = policy, free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*pinned(args.core), sys.executable, "-m", "mmspec", "serve", "--port", str(self.port), "--threads", "1",
               "--max-batch", str(args.max_batch), "--speculate", policy]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.client = None

    def wait_ready(self) -> None:
        import httpx
        import openai

        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the {self.policy} server exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).json()["status"] == "ok":
                    self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                                timeout=600)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise SystemExit(f"the {self.policy} server did not come up in {START_S} s; see {self.log}")

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        return dict((k, float(v)) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                               if line and not line.startswith("#")))

    def one(self, r: dict) -> dict:
        import openai

        t0 = time.perf_counter()
        try:
            c = self.client.chat.completions.create(model=self.model, messages=r["messages"],
                                                    max_tokens=r["max_tokens"], temperature=0)
            return {"key": r["key"], "status": 200, "text": c.choices[0].message.content,
                    "tokens": c.usage.completion_tokens, "latency_s": time.perf_counter() - t0,
                    "server_latency_s": c.model_extra["mmspec"]["latency_s"]}
        except openai.APIError as e:
            return {"key": r["key"], "status": getattr(e, "status_code", -1), "error": str(e)[:300],
                    "latency_s": time.perf_counter() - t0}

    def run(self, reqs: list[dict], clients: int) -> tuple[list[dict], float, dict]:
        """The requests from ``clients`` threads -> (results, wall seconds, /metrics deltas)."""
        before = self.metrics()
        t0, c0 = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(self.one, reqs))
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        after = self.metrics()
        deltas = {k: round(v - before.get(k, 0.0), 6) for k, v in after.items()
                  if "_bucket{" not in k and "_created" not in k}  # (the sums and counts are what is read)
        deltas["client_cpu_s"] = client_cpu  # this process: the clients' own work (the openai client, JSON)
        return results, wall, {k: v for k, v in deltas.items() if v}

    def stop(self) -> int | str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "killed after 60 s"


# ----------------------------------------------------------------------- the report
def load_snapshot() -> dict:
    """The machine's load now: the load average and the busiest processes (which core they ran on)."""
    snap = {"loadavg": [round(x, 2) for x in os.getloadavg()], "utc": datetime.now(UTC).strftime("%H:%M:%S")}
    if shutil.which("ps"):
        out = subprocess.run(["ps", "-eo", "pid,psr,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
                             text=True).stdout.splitlines()
        snap["busiest"] = [line[:160] for line in out[1:6]]
    return snap


def phase_shares(deltas: list[dict], results: list[dict]) -> dict:
    """Mean seconds per request of each phase (the /metrics deltas of every run of this row), the
    client's latency beyond the server's e2e, the shares of the client's mean latency, and the
    engine thread's share of the server's CPU."""
    def total(name: str) -> float:
        return sum(d.get(name, 0.0) for d in deltas)

    count = total('mmspec_request_phase_seconds_count{phase="decode"}')
    if not count:
        return {}
    mean = {p: total(f'mmspec_request_phase_seconds_sum{{phase="{p}"}}') / count for p in PHASES}
    e2e = total("mmspec_e2e_request_latency_seconds_sum") / total("mmspec_e2e_request_latency_seconds_count")
    http = total("mmspec_http_request_seconds_sum") / total("mmspec_http_request_seconds_count")
    client = statistics.mean(r["latency_s"] for r in results if r["status"] == 200)
    mean["respond"] = max(0.0, http - e2e)  # after the last token: the response's JSON, its sending
    mean["client_side"] = max(0.0, client - http)  # uvicorn's read of the request, the transport, the openai client
    cpu, engine_cpu = total("process_cpu_seconds_total"), total("mmspec_engine_cpu_seconds_total")
    return {"mean_s": {k: round(v, 4) for k, v in mean.items()}, "server_e2e_mean_s": round(e2e, 4),
            "server_http_mean_s": round(http, 4), "client_mean_s": round(client, 4),
            "share_of_client_latency": {k: round(v / client, 4) for k, v in mean.items()},
            "not_engine_share": round(sum(mean[k] for k in NOT_ENGINE) / client, 4),
            "server_cpu_s": round(cpu, 2), "engine_thread_cpu_s": round(engine_cpu, 2),
            "engine_thread_cpu_share": round(engine_cpu / cpu, 4) if cpu else None,
            "engine_thread_wall_s": round(total("mmspec_engine_seconds_total"), 2),
            "client_cpu_per_request_s": round(total("client_cpu_s") / len(results), 4)}


def summarise(system: str, clients: int, runs: list[dict], reference: dict) -> dict:
    """One row: a system at one client count, over its repeats."""
    results = [r for run in runs for r in run["results"]]
    ok = [r for r in results if r["status"] == 200]
    wall = sum(run["wall_s"] for run in runs)
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["latency_s"] for r in ok]
    same = sum((r["text"], r["tokens"]) == reference.get(r["key"]) for r in ok)
    row = {"system": system, "clients": clients, "requests": len(results), "failed": len(results) - len(ok),
           "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall else None,
           "tokens_per_s_by_repeat": [round(sum(r["tokens"] for r in run["results"] if r["status"] == 200)
                                            / run["wall_s"], 2) for run in runs],
           "latency_s": {"mean": round(statistics.mean(lat), 3), "p50": round(percentile(lat, 0.5), 3),
                         "p90": round(percentile(lat, 0.9), 3)} if lat else None,
           "identical_to_generate": f"{same}/{len(ok)}"}
    cpu = sum(r["cpu_s"] for r in ok) if system == "generate" else \
        sum(run["metrics"].get("process_cpu_seconds_total", 0.0) for run in runs)  # the server's whole process
    row["cpu_s"] = round(cpu, 3)
    row["tokens_per_cpu_s"] = round(tokens / cpu, 2) if cpu else None  # what a loaded machine disturbs less
    if system == "generate":
        mean = {k: statistics.mean(r[f"{k}_s"] for r in ok) for k in ("processor", "prefill", "decode")}
        mean["other"] = statistics.mean(r["latency_s"] - r["prefill_s"] - r["decode_s"] for r in ok)
        row["time_goes"] = {"mean_s": {k: round(v, 4) for k, v in mean.items()}}  # (processor: outside latency_s)
        row["processor_mean_s"] = round(statistics.mean(r["processor_s"] for r in ok), 4)
        row["tokens_per_s_with_processor"] = round(tokens / (wall + sum(r["processor_s"] for r in ok)), 2)
    else:
        row["time_goes"] = phase_shares([run["metrics"] for run in runs], ok)
    return row


def _ratio(a: dict, b: dict) -> float | None:
    """a's tokens per CPU-second over b's (the same comparison in CPU time, the load's disturbance less)."""
    return round(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 3) if a["tokens_per_cpu_s"] and b["tokens_per_cpu_s"] \
        else None


def goals(rows: list[dict], policies: list[str]) -> dict:
    """The issue's targets, each with its figures and whether the run meets it."""
    by = {(r["system"], r["clients"]): r for r in rows}
    out = {}
    spec = "always" if "always" in policies else policies[0]
    for c, want in GOALS["speculation_vs_never"].items():
        a, n = by.get((f"serve {spec}", c)), by.get(("serve never", c))
        if a and n and spec != "never":
            ratio = a["tokens_per_s"] / n["tokens_per_s"]
            out[f"speculation_vs_never_{c}_clients"] = {"ratio": round(ratio, 3), "goal": want, "met": ratio >= want,
                                                        "ratio_cpu": _ratio(a, n)}
    a, g = by.get((f"serve {spec}", 1)), by.get(("generate", 1))
    if a and g:
        ratio = a["tokens_per_s"] / g["tokens_per_s"]
        out["one_client_vs_generate"] = {"ratio": round(ratio, 3), "goal": GOALS["one_client_vs_generate"],
                                         "met": ratio >= GOALS["one_client_vs_generate"], "ratio_cpu": _ratio(a, g)}
    for r in rows:  # what is not the engine: of a request's latency, and of the server's CPU
        t = {} if r["system"] == "generate" else (r.get("time_goes") or {})
        if t.get("engine_thread_cpu_share") is not None:
            cpu = round(1 - t["engine_thread_cpu_share"], 4)
            out[f"not_engine {r['system']} {r['clients']} clients"] = {
                "latency_share": t["not_engine_share"], "cpu_share": cpu, "threshold": GOALS["not_engine_share"],
                "over": t["not_engine_share"] > GOALS["not_engine_share"] or cpu > GOALS["not_engine_share"],
                "runs_on": "the event loop (parse, respond), a pool thread (images, processor): not the "
                           "engine's thread; the engine's process and core"}
    return out


# ----------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the JSON file written (required)")
    ap.add_argument("--requests", type=int, default=16, help="N: requests per set (one set per repeat and clients)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--speculate", nargs="+", default=["always", "never"], choices=["always", "never", "auto"])
    ap.add_argument("--max-batch", type=int, default=16, help="the servers' --max-batch")
    ap.add_argument("--core", default="0", help="the core the servers and the generate worker are pinned to "
                                                "('none': not pinned)")
    ap.add_argument("--client-core", default=None, help="the core this script (the clients) is pinned to "
                                                        "(default: none)")
    ap.add_argument("--warmup", type=int, default=2, help="requests each system answers first, untimed (and one "
                                                          "round at the largest client count)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 requests, 1 and 2 clients, 1 repeat, "
                                                         "8 tokens")
    ap.add_argument("--generate-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_worker:
        return generate_worker(threads=1)
    if args.out is None:
        ap.error("--out is required")
    if args.quick:
        args.requests, args.clients, args.repeats, args.max_tokens, args.warmup = 2, [1, 2], 1, 8, 1
    args.core = None if args.core == "none" else int(args.core)
    if args.core is not None and not shutil.which("taskset"):
        raise SystemExit("taskset is not installed (util-linux); install it or pass --core none")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = Path(tempfile.mkdtemp(prefix="serve_speed-"))  # not kept with the results (docs/results/README.md)
    load_before = load_snapshot()
    t_start = time.perf_counter()

    servers = [Server(p, args, env, logs / f"serve-{p}.log") for p in args.speculate]
    worker = GenerateWorker([*pinned(args.core), sys.executable, str(Path(__file__).resolve()), "--generate-worker"],
                            env, logs / "generate.log")
    if args.client_core is not None:  # (after the servers and the worker started: they are pinned on their own)
        os.sched_setaffinity(0, {int(args.client_core)})  # this thread, and the client threads made from it
    try:
        for s in servers:
            s.wait_ready()
        worker.wait_ready()
        startup_s = time.perf_counter() - t_start
        # warm-up, untimed: the validation split, never measured
        warm = request_set(0, args.warmup, args.max_tokens, split="val")
        wide = request_set(1, max(args.clients), args.max_tokens, split="val")
        for s in servers:
            s.run(warm, 1)
            s.run(wide, max(args.clients))
        worker.run(0, args.warmup, args.max_tokens, split="val")

        systems = [f"serve {s.policy}" for s in servers] + ["generate"]
        runs: dict[tuple[str, int], list[dict]] = {(name, c): [] for name in systems for c in args.clients}
        reference: dict[str, tuple[str, int]] = {}  # request key -> generate's (text, tokens)
        set_id = 0
        for rep in range(args.repeats):
            for c in args.clients:
                reqs = request_set(set_id, args.requests, args.max_tokens)
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                for name in order:
                    if name == "generate":
                        res = worker.run(set_id, args.requests, args.max_tokens)
                        for r in res:
                            r["status"] = 200
                            reference[r["key"]] = (r["text"], r["tokens"])
                        run = {"results": res, "wall_s": sum(r["latency_s"] for r in res)}
                    else:
                        s = servers[systems.index(name)]
                        res, wall, deltas = s.run(reqs, c)
                        run = {"results": res, "wall_s": wall, "metrics": deltas}
                    run["set"], run["order"] = set_id, order
                    runs[(name, c)].append(run)
                set_id += 1
        exit_codes = {s.policy: s.stop() for s in servers}
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.proc.kill()
        worker.stop()

    rows = []
    for (name, c), rs in runs.items():
        row = summarise(name, c, rs, reference)
        rows.append(row)
        print(json.dumps(row), flush=True)
    failed = sum(r["failed"] for r in rows)
    one_client_diff = [r for r in rows if r["clients"] == 1 and r["identical_to_generate"].split("/")[0]
                       != r["identical_to_generate"].split("/")[1]]
    policies = list(args.speculate)
    summary = {
        "command": "python perf/serve_speed.py " + " ".join(sys.argv[1:]),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine()},
        "load_before": load_before, "load_after": load_snapshot(),
        "setup": {"core": args.core, "client_core": args.client_core, "server_threads": 1,
                  "max_batch": args.max_batch, "requests_per_set": args.requests, "clients": args.clients,
                  "repeats": args.repeats, "max_tokens": args.max_tokens, "families": ONE_IMAGE, "greedy": True,
                  "warmup": args.warmup, "startup_s": round(startup_s, 1), "logs": str(logs),
                  "exit_codes_on_sigterm": exit_codes},
        "goals": goals(rows, policies), "rows": rows, "failed_requests": failed,
        "runs": {f"{name} @ {c}": rs for (name, c), rs in runs.items()},
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({"goals": summary["goals"]}), flush=True)
    if failed or one_client_diff:
        print(f"\n*** {failed} request(s) failed; one-client answers differing from generate's: "
              f"{[(r['system'], r['identical_to_generate']) for r in one_client_diff]} ***", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
