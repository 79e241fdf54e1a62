"""Batch throughput, quickly: ``SpecDecoder.generate_batch`` against the target's own batched
greedy ``generate`` (left-padded, same prompts, same run) at a few batch sizes, on the
embedded pack. One run per setting (the full sweep with latency percentiles is
``mmspec bench run --batch-size``). Prints one JSON line per (B, system).

    PYTHONPATH=src python perf/batch_speed.py --batch 1 4 8 --new 48
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mmspec
from mmspec.world import FAMILIES, make_sample


def prompts(processor, n: int):
    fams = sorted(FAMILIES)
    out = []
    for i in range(n):
        s = make_sample(fams[i % len(fams)], "val", i // len(fams))
        out.append((s.prompt, list(s.images)))
    return out


def target_batched(em, batch, new: int) -> tuple[list[list[int]], float]:
    proc = em.processor
    proc.tokenizer.padding_side = "left"
    texts = [p for p, _ in batch]
    images = [im for _, ims in batch for im in ims]
    enc = proc(text=texts, images=images or None, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    out = em.target.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    wall = time.perf_counter() - t0
    L = enc["input_ids"].shape[1]
    return [row[L:].tolist() for row in out], wall


def spec_batched(dec, em, batch, new: int, speculate: str) -> tuple[list[list[int]], float]:
    reqs = []
    for text, ims in batch:
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        reqs.append({k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")} | {"max_new_tokens": new})
    t0 = time.perf_counter()
    res = dec.generate_batch(reqs, speculate=speculate)
    return [r.token_ids for r in res], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--views", default="M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speculate", nargs="+", default=["always"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    em = mmspec.load_embedded()
    eos = em.target.generation_config.eos_token_id
    em.target.generation_config.eos_token_id = None  # every system decodes exactly --new tokens
    dec = mmspec.SpecDecoder(em.target, em.draft, em.tokenizer, views=args.views)
    dec.options = type(dec.options)(**{**dec.options.__dict__, "eos_ids": frozenset()})
    with torch.inference_mode():
        spec_batched(dec, em, prompts(em.processor, 2), 8, "always")  # warm-up
        target_batched(em, prompts(em.processor, 2), 8)
        for B in args.batch:
            batch = prompts(em.processor, B)
            ref, wall_t = target_batched(em, batch, args.new)
            print(json.dumps({"B": B, "system": "target.generate", "tok_s": round(B * args.new / wall_t, 1),
                              "wall_s": round(wall_t, 3)}), flush=True)
            for mode in args.speculate:
                got, wall = spec_batched(dec, em, batch, args.new, mode)
                same = sum(a == b for a, b in zip(got, ref))
                print(json.dumps({"B": B, "system": f"mmspec {args.views} speculate={mode}",
                                  "tok_s": round(B * args.new / wall, 1), "wall_s": round(wall, 3),
                                  "speedup": round(wall_t / wall, 2), "same_as_target_batched": f"{same}/{B}"}),
                      flush=True)
    em.target.generation_config.eos_token_id = eos


if __name__ == "__main__":
    main()
