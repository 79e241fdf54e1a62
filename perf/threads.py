"""CPU threads and speed: the embedded pack's target alone and mmspec (M view) at each thread
count, in ONE interleaved run, with the machine's load beside it; what `--threads`' default
(:func:`mmspec.threads.default_threads`) would choose at that load.

Each repeat runs every thread count (order rotated each repeat) on the same world prompt: the
target's greedy ``generate`` and ``SpecDecoder.generate``, outputs checked identical. Medians
over repeats; the 1-minute load average is read before and after. Made to decide the default
(docs/perf.md, "Threads"): on a 2-core machine whose other core is busy, two threads make every
forward wait for a descheduled thread.

    python perf/threads.py --threads 1 2 --repeats 5 --new 32 --out runs/threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mmspec.provenance import stamp


def load() -> float:
    return os.getloadavg()[0]


def run(args) -> dict:
    from mmspec import SpecDecoder, load_embedded
    from mmspec.threads import default_threads, usable_cores
    from mmspec.world import make_sample

    m = load_embedded(torch.float32)
    dec = SpecDecoder(m.target, m.draft, tokenizer=m.tokenizer, processor=m.processor, views="M")
    s = make_sample(args.family, "test", 0)
    enc = m.processor(text=s.prompt, images=s.images, return_tensors="pt")
    n_prompt = enc["input_ids"].shape[1]
    times = {n: {"target": [], "mmspec": []} for n in args.threads}
    identical, load_before = True, load()
    for rep in range(args.repeats + 1):  # the first pass is a warm-up
        order = args.threads[rep % len(args.threads):] + args.threads[:rep % len(args.threads)]
        for n in order:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            with torch.inference_mode():
                ref = m.target.generate(**enc, do_sample=False, max_new_tokens=args.new)[0, n_prompt:].tolist()
            t1 = time.perf_counter()
            res = dec.generate(**enc, max_new_tokens=args.new)
            t2 = time.perf_counter()
            identical &= ref == res.token_ids
            if rep:
                times[n]["target"].append(t1 - t0)
                times[n]["mmspec"].append(t2 - t1)
    rows = []
    for n, t in times.items():
        tgt, spec = statistics.median(t["target"]), statistics.median(t["mmspec"])
        rows.append({"threads": n, "target_s": tgt, "mmspec_s": spec, "speedup": tgt / spec})
    return {**stamp("cpu"), "family": args.family, "new_tokens": args.new, "repeats": args.repeats,
            "usable_cores": usable_cores(), "load_before": load_before, "load_after": load(),
            "default_threads_now": default_threads(), "identical": identical, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=32, help="new tokens per answer")
    ap.add_argument("--family", default="chartqa")
    ap.add_argument("--out", type=Path, default=None, help="write threads.json here")
    args = ap.parse_args(argv)
    out = run(args)
    for r in out["rows"]:
        print(f"threads {r['threads']}: target {r['target_s']*1e3:.0f} ms, mmspec {r['mmspec_s']*1e3:.0f} ms, "
              f"speed-up {r['speedup']:.2f}x")
    print(f"load {out['load_before']:.2f} -> {out['load_after']:.2f} on {out['usable_cores']} usable cores; "
          f"the default now: {out['default_threads_now']} thread(s); outputs identical: {out['identical']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "threads.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
