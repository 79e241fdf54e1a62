"""What `--api-key` and `/metrics` add to one request of `mmspec serve`, timed in isolation.

On a shared, loaded machine the load test's requests/s move by more than the 5% the issue
allows between runs of the SAME server, so this times the added code itself: the Guard's checks
of one request (Host, constant-time key compare, Content-Type, Content-Length), the metrics of
one answered request (counters, three histograms, its blocks' acceptance by position), one
metered scheduler step, and one `/metrics` scrape. Prints microseconds each; divide by a
request's service time (load test: wall / requests) for the share.

    python perf/serve_overhead.py --blocks 12 --gamma 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import timeit
from dataclasses import dataclass, field
from types import SimpleNamespace


@dataclass
class Block:
    n_drafted: int
    n_accepted: int
    n_emitted: int
    depth: int | None = None

    @property
    def drafted_depth(self) -> int:
        return self.n_drafted


@dataclass
class Stats:
    blocks: list = field(default_factory=list)
    prompt_tokens_reused: int = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=12, help="blocks per answer (48 tokens at tau ~4)")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20000)
    args = ap.parse_args()

    from mmspec.serve.guard import Guard
    from mmspec.serve.metrics import MeteredScheduler, Metrics

    service = SimpleNamespace(worker=SimpleNamespace(active=3, pending=1),
                              decoder=SimpleNamespace(prefix_cache=SimpleNamespace(nbytes=10, budget=100)))
    metrics = Metrics(service)
    result = SimpleNamespace(stats=Stats([Block(args.gamma, k % (args.gamma + 1), k % (args.gamma + 1) + 1)
                                          for k in range(args.blocks)], 7))

    async def app(scope, receive, send):
        return None

    guard = Guard(app, max_body=32 * 2**20, api_key="k" * 32, allowed_hosts=["127.0.0.1", "localhost"])
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"authorization", b"Bearer " + b"k" * 32),
                         (b"content-type", b"application/json"), (b"content-length", b"5000")]}
    loop = asyncio.new_event_loop()

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        return None

    def guarded():
        loop.run_until_complete(guard(scope, receive, send))

    def bare():
        loop.run_until_complete(app(scope, receive, send))

    class Sched:
        def step(self):
            return [SimpleNamespace(rid=k) for k in range(8)]

    metered, plain = MeteredScheduler(Sched(), metrics), Sched()
    t = lambda f, n=args.repeat: min(timeit.repeat(f, number=n, repeat=3)) / n * 1e6  # noqa: E731 - us per call
    out = {
        "guard_us": round(t(guarded) - t(bare), 2),
        "metrics_answered_us": round(t(lambda: metrics.answered("stop", 100, 48, 0.0, 0.1, result)), 2),
        "metered_step_us": round(t(metered.step) - t(plain.step), 2),
        "scrape_us": round(t(metrics.render, 200), 1),
        "blocks_per_answer": args.blocks, "gamma": args.gamma,
    }
    out["per_request_us"] = round(out["guard_us"] + out["metrics_answered_us"] + out["metered_step_us"] * args.blocks, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
