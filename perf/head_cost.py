"""What a block costs to draft: feature-level heads of several shapes against the draft LM, in ONE run.

A block's drafting (``BlockRecord.draft_s``: the drafter's catch-up on the accepted tokens, then
gamma draft steps of a chain) is timed by the engine itself while ``SpecDecoder.generate`` decodes
the embedded world's test prompts, greedy, a chain of ``--gamma``. The drafters take turns prompt
by prompt, round after round (machine noise hits them alike); the figure is the median over rounds
of each drafter's draft seconds per block. Untrained heads accept little, so their catch-up feeds
one token a block where a trained drafter feeds several: give trained heads with ``--head
NAME=DIR`` to time them too. Every output is checked against the target's greedy output.

    taskset -c 1 python perf/head_cost.py --threads 1 --rounds 5 --out runs/head_cost.json

Drafters: ``M`` (the pack's draft LM), untrained ``eagle3`` (three fused target layers, the
target's vocabulary), ``eagle3-v256`` (a 256-token draft vocabulary, d2t), ``eagle`` (the last
layer only), and each ``--head``. A helper of docs/heads.md's measured sections (not in the package).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def drafters(pack, heads: dict[str, str]) -> dict[str, object]:
    from mmspec.heads import build_head, load_head

    t = pack.target
    out = {"M": pack.draft,
           "eagle3": build_head(t, "eagle3"),
           "eagle3-v256": build_head(t, "eagle3", draft_vocab=torch.arange(256)),
           "eagle": build_head(t, "eagle")}
    out.update({name: load_head(d) for name, d in heads.items()})
    return out


def run(args) -> dict:
    from mmspec import SpecDecoder
    from mmspec.embedded import load_embedded
    from mmspec.heads.check import prompt_inputs, world_prompts
    from mmspec.provenance import machine_info, now

    torch.set_num_threads(args.threads)
    pack = load_embedded()
    heads = dict(h.split("=", 1) for h in args.head)
    decs = {name: SpecDecoder(pack.target, d, pack.tokenizer, processor=pack.processor, gamma=args.gamma,
                              prefix_cache_mb=0)
            for name, d in drafters(pack, heads).items()}
    prompts = world_prompts(args.prompts, tuple(args.families.split(",")))
    any_dec = next(iter(decs.values()))
    inputs = [prompt_inputs(any_dec, cp) for cp in prompts]
    ref = []
    for x, _ in inputs:
        with torch.inference_mode():
            out = pack.target.generate(**x, do_sample=False, max_new_tokens=args.max_new_tokens)
        ref.append(out[0, x["input_ids"].shape[1]:].tolist())
    per_round: dict[str, list[float]] = {n: [] for n in decs}
    verify: dict[str, list[float]] = {n: [] for n in decs}
    tau: dict[str, list[float]] = {n: [] for n in decs}
    each: dict[str, list[float]] = {n: [] for n in decs}  # every counted block's draft seconds
    cpu: dict[str, list[float]] = {n: [] for n in decs}  # process CPU seconds per block, drafting and verifying
    started, load0 = now(), _load()
    for r in range(args.rounds + 1):  # round 0 warms every drafter up and is not counted
        for name, dec in decs.items():
            blocks, c0 = [], time.process_time()
            for (x, images), want in zip(inputs, ref, strict=True):
                res = dec.generate(**x, max_new_tokens=args.max_new_tokens, images=images or None)
                if res.token_ids != want:
                    sys.exit(f"{name}: output differs from the target's greedy output")
                blocks += res.stats.blocks
            if r:
                cpu[name].append((time.process_time() - c0) / len(blocks))
                each[name] += [b.draft_s for b in blocks]
                per_round[name].append(sum(b.draft_s for b in blocks) / len(blocks))
                verify[name].append(sum(b.verify_s for b in blocks) / len(blocks))
                tau[name].append(sum(b.n_emitted for b in blocks) / len(blocks))
    ms = {n: 1e3 * statistics.median(v) for n, v in per_round.items()}
    return {"started": started, "ended": now(), "load_before": load0, "load_after": _load(),
            "machine": machine_info(), "command": " ".join(sys.argv), "gamma": args.gamma,
            "prompts": len(prompts), "families": args.families, "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens, "outputs_identical": True,
            "draft_ms_per_block": {n: round(v, 3) for n, v in ms.items()},
            "vs_M": {n: round(v / ms["M"], 3) for n, v in ms.items()},
            # a block's draft seconds at the 10th percentile: what a block costs when the process is not
            # preempted (the machine is shared: the median carries other jobs' time slices)
            "draft_ms_per_block_p10": {n: round(1e3 * _quantile(v, 0.1), 3) for n, v in each.items()},
            "cpu_ms_per_block": {n: round(1e3 * statistics.median(v), 3) for n, v in cpu.items()},
            "verify_ms_per_block": {n: round(1e3 * statistics.median(v), 3) for n, v in verify.items()},
            "tau": {n: round(statistics.median(v), 3) for n, v in tau.items()},
            "rounds_ms": {n: [round(1e3 * x, 3) for x in v] for n, v in per_round.items()}}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--families", default="chartqa,spot_the_diff")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--head", action="append", default=[], help="NAME=DIR: a trained head to time as well")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
