"""Seeded sampling's two exact samplers, measured: acceptance (tau) of the Gumbel-max coupling
against rejection sampling, per temperature and drafting shape, on the same prompts and seeds.

Both samplers are lossless (each token is an exact draw from the target's filtered
distribution). Rejection sampling (``Request.coupled = False``: recursive rejection over a
tree's siblings, drawn chains tested against q) draws by the step's shape; the coupling (every
sampling request's default, :func:`mmspec.request.coupled`) draws token t as
``argmax(log p_t + g_t)`` with the seed's noise at output position t, so the answer depends on
the seed only, and the draft proposes with the same noise. What the coupling costs in
acceptance is what this script measures: tau (tokens per block, the bonus / recovered token
included) per (drafting, temperature, sampler), pooled over every prompt and seed, with the
standard error over requests. Each setting's requests run together in one batch (the answers
do not depend on it); the coupled answers are also checked against the same decode alone
(the seed's promise).

Models: the embedded pack (``mmspec.embedded``); prompts: world samples
(:func:`mmspec.world.make_sample`) through the target's processor. Writes ``--out``
(``seed_coupling.json``) after each setting; exits 1 when a coupled answer alone differs from
the same request's in the batch. Run ``python perf/seed_coupling.py --help``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from mmspec.provenance import machine_info, now

SHAPES = {"chain": dict(views="M", gamma=5), "tree": dict(views="M", tree="dynamic", tree_depth=5, tree_topk=4,
                                                          tree_budget=12)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="chartqa,spot_the_diff,vist", help="world families, comma-separated")
    ap.add_argument("--n-per-family", type=int, default=3, help="test-split samples per family")
    ap.add_argument("--seeds", type=int, default=4, help="seeds per prompt (0 .. N-1)")
    ap.add_argument("--temperatures", default="0.3,0.5,0.7,1.0")
    ap.add_argument("--shapes", default="chain,tree", help=f"drafting shapes: some of {', '.join(SHAPES)}")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    ap.add_argument("--out", default="seed_coupling.json")
    return ap.parse_args(argv)


def prompts(families: list[str], n: int, processor) -> list[dict]:
    from mmspec.world import make_sample

    out = []
    for fam in families:
        for i in range(n):
            s = make_sample(fam, "test", i)
            enc = processor(text=s.prompt, images=s.images, return_tensors="pt")
            out.append({k: v for k, v in enc.items() if isinstance(v, torch.Tensor)})
    return out


def decode(dec, reqs: list) -> list:
    """Every prepared request's result (input order), all in one batch."""
    from mmspec.batch import BatchScheduler

    sched = BatchScheduler(dec, max_batch=len(reqs), speculate="always", overlap=False)
    rids = [sched.submit(r) for r in reqs]
    results = {}
    while sched.has_work():
        for ev in sched.step():
            if ev.error is not None:
                raise ev.error
            if ev.finished:
                results[ev.rid] = ev.result
    sched.close()
    return [results[r] for r in rids]


def measure(dec, inputs: list[dict], temperature: float, seeds: int, max_new: int, coupled: bool) -> dict:
    from mmspec.request import prepare

    reqs = [replace(prepare(dec, dict(x, max_new_tokens=max_new, temperature=temperature, seed=s)), coupled=coupled)
            for x in inputs for s in range(seeds)]
    t0 = time.perf_counter()
    res = decode(dec, reqs)
    wall = time.perf_counter() - t0
    taus = [r.stats.tau for r in res]
    tokens, blocks = sum(r.stats.n_tokens for r in res), sum(r.stats.n_blocks for r in res)
    row = dict(sampler="coupling" if coupled else "rejection", temperature=temperature, n_requests=len(res),
               n_tokens=tokens, n_blocks=blocks, tau=tokens / blocks,
               tau_se=statistics.stdev(taus) / math.sqrt(len(taus)) if len(taus) > 1 else 0.0, wall_s=wall)
    if coupled:  # the promise: the same answer alone as in the batch
        alone = [decode(dec, [r])[0].token_ids for r in reqs[:3]]
        row["same_alone"] = alone == [r.token_ids for r in res[:3]]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from mmspec.decoder import SpecDecoder
    from mmspec.embedded import load_embedded

    e = load_embedded(dtype=torch.float32)
    inputs = prompts(args.families.split(","), args.n_per_family, e.processor)
    report = dict(command="python perf/seed_coupling.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=now(), machine=machine_info("cpu"), rows=[])
    for shape in args.shapes.split(","):
        dec = SpecDecoder(e.target, e.draft, e.tokenizer, processor=e.processor, prefix_cache_mb=0, **SHAPES[shape])
        for t in (float(x) for x in args.temperatures.split(",")):
            for coupled in (False, True):  # the same prompts and seeds, one sampler after the other
                row = dict(shape=shape, **measure(dec, inputs, t, args.seeds, args.max_new_tokens, coupled))
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps(report, indent=1))
    broken = [r for r in report["rows"] if r.get("same_alone") is False]
    if broken:
        print(f"a seeded answer changed with the batch in {len(broken)} setting(s)", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
