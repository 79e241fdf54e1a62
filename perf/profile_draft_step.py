"""Operator profile of one engine draft step (feed + mix + pick) with the embedded pack.

Shows where a batched ensemble step spends CPU time, for the preallocated cache the engine uses
and for a growing ``DynamicCache`` (the engine before docs/perf.md §2's change):

    python perf/profile_draft_step.py --family vist --views MTCP --steps 200

Prints, per cache, the per-step self CPU time of the top operators (``torch.profiler``).
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

    from mmspec import SpecDecoder
    from mmspec.embedded import load_embedded
    from mmspec.models.captioner import FixedCaptioner
    from mmspec.verify import SamplingParams
    from mmspec.world import make_sample

    e = load_embedded()
    s = make_sample(args.family, "test", 0)
    enc = e.processor(text=s.prompt, images=s.images, return_tensors="pt")
    dec = SpecDecoder(e.target, e.draft, e.tokenizer, views=args.views, captioner=FixedCaptioner(s.captions))
    token, params = int(enc["input_ids"][0, -1]), SamplingParams()
    from transformers import DynamicCache

    for preallocate in (True, False):
        cache = None if preallocate else DynamicCache(config=e.draft.config)  # the engine before models/cache.py
        d = dec.new_drafter(enc["input_ids"], enc["pixel_values"], captions=s.captions, cache=cache)
        with torch.inference_mode():
            for _ in range(20):  # warm-up
                d.step(token, params)  # feeds, picks and drops the token again
            with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    d.step(token, params)
        ops = prof.key_averages()
        total = sum(o.self_cpu_time_total for o in ops)
        print(f"\n{args.views} on {s.uid}, {'preallocated cache' if preallocate else 'DynamicCache'}: "
              f"{total / args.steps:.0f} us self CPU per step")
        for o in sorted(ops, key=lambda o: -o.self_cpu_time_total)[: args.top]:
            print(f"  {o.key[:48]:48s} {o.self_cpu_time_total / args.steps:8.1f} us  "
                  f"{100 * o.self_cpu_time_total / total:5.1f}%  calls/step {o.count / args.steps:.0f}")


if __name__ == "__main__":
    main()
