"""Operator profile of one engine draft step (feed + mix + pick) with the embedded pack.

Shows where a batched ensemble's draft step (`perf/draftstep.py`: one forward over the view
rows, the mixture, the pick) spends CPU time:

    python perf/profile_draft_step.py --family vist --views MTCP --steps 200

Prints the per-step self CPU time of the top operators (``torch.profiler``).
"""

from __future__ import annotations

import argparse

import torch
import torch.profiler as tp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="vist")
    ap.add_argument("--views", default="MTCP")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from draftstep import draft_step

    from mmspec import SpecDecoder
    from mmspec.embedded import load_embedded
    from mmspec.models.captioner import FixedCaptioner
    from mmspec.world import make_sample

    e = load_embedded()
    s = make_sample(args.family, "test", 0)
    enc = e.processor(text=s.prompt, images=s.images, return_tensors="pt")
    dec = SpecDecoder(e.target, e.draft, e.tokenizer, views=args.views, captioner=FixedCaptioner(s.captions))
    step, _ = draft_step(dec, enc["input_ids"], enc["pixel_values"], captions=s.captions)
    for _ in range(20):  # warm-up
        step()
    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    ops = prof.key_averages()
    total = sum(o.self_cpu_time_total for o in ops)
    print(f"\n{args.views} on {s.uid}: {total / args.steps:.0f} us self CPU per draft step")
    for o in sorted(ops, key=lambda o: -o.self_cpu_time_total)[: args.top]:
        print(f"  {o.key[:48]:48s} {o.self_cpu_time_total / args.steps:8.1f} us  "
              f"{100 * o.self_cpu_time_total / total:5.1f}%  calls/step {o.count / args.steps:.0f}")

if __name__ == "__main__":
    main()
