"""What graphs-before-traffic costs at start-up: ``SpecDecoder.warm_up`` on the embedded pack,
per maximum batch and ``speculate``, the graphs it captures and its seconds; then a ragged batch
of requests (greedy and seeded sampling, logprobs of several widths) run after it, which must
capture nothing (``captured_after`` 0). On the CPU the capture is emulated
(``--graphs emulate``: each capture runs the step once, as a CUDA capture records it), so the
CPU figures count graphs and time the Python side; on a GPU pass ``--graphs on --device cuda``.

    PYTHONPATH=src taskset -c 0 python perf/graph_warmup.py --batch 8 32 --speculate always auto \
        --context 600 --out runs/graph_warmup.jsonl

One JSON line per (batch, speculate).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import batch_speed as bs  # noqa: E402  (its prompts)

import mmspec  # noqa: E402
from mmspec.batch import BatchScheduler  # noqa: E402
from mmspec.engine.warmup import captures  # noqa: E402


def requests(em, n: int, new: int) -> list[dict]:
    out = []
    for i, (text, ims) in enumerate(bs.prompts(em.processor, n)):
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        req = {k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")}
        req["max_new_tokens"] = 4 + (i * 7) % new
        if i % 3 == 1:
            req.update(temperature=0.8, seed=i, top_p=0.9)
        if i % 4 == 2:
            req["logprobs"] = i % 6
        out.append(req)
    return out


def one(em, B: int, speculate: str, args) -> dict:
    graphs = True if args.graphs == "on" else args.graphs
    dec = mmspec.SpecDecoder(em.target, em.draft, em.tokenizer, views=args.views, prefix_cache_mb=0,
                             cuda_graphs=graphs)
    w = dec.warm_up(max_batch=B, speculate=speculate, max_context=args.context)
    engine = dec.static_pool.leased["engine"][0]
    before = captures(engine)
    sched = BatchScheduler(dec, max_batch=B, speculate=speculate, stream_text=False)
    t0 = time.perf_counter()
    for r in requests(em, 2 * B, args.new):
        sched.submit(r)
    while sched.has_work():
        sched.step()
    sched.close()
    return dict(batch=B, speculate=speculate, graphs=w.captured, plans=w.plans, warm_up_s=round(w.seconds, 2),
                s_per_graph=round(w.seconds / max(w.captured, 1), 4), captured_after=captures(engine) - before,
                workload_s=round(time.perf_counter() - t0, 2), device=str(em.target.device), mode=dec.graph_mode,
                context=args.context)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--speculate", nargs="+", default=["always"], choices=["always", "auto", "never"])
    p.add_argument("--context", type=int, default=600, help="warm_up's max_context (positions)")
    p.add_argument("--new", type=int, default=24, help="the longest request's new tokens")
    p.add_argument("--views", default="M")
    p.add_argument("--graphs", default="emulate", choices=["emulate", "on"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    em = mmspec.load_embedded(device=args.device)
    rows = []
    for B in args.batch:
        for s in args.speculate:
            row = one(em, B, s, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if all(r["captured_after"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
