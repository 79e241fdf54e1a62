"""Drafting with no model, measured: prompt lookup and suffix decoding, alone and beside the
embedded draft M, against the target alone, per family of the embedded world, in ONE run.

Systems (``--systems``): ``target`` (``target.generate(do_sample=False)``, the reference) and
mmspec methods in bench notation: ``lookup``, ``suffix``, ``M``, ``M+lookup``, ``M+suffix``, each
with ``+tree:DxKxB`` for a tree. Every prompt runs on every system back to back (round-robin, the
order rotated per prompt), so load on the machine hits all alike; greedy outputs must equal the
target's (exit 1 otherwise).

Suffix decoding learns from the requests its decoder served: before timing, every suffix
decoder serves ``--warmup`` requests of the world's *train* split (all families, and both turns
of conversations); the timed prompts are the *test* split's. Turn 2 of a conversation is built
from the target's own turn-1 answer. Prefix caching is off for every system (each prompt is
prefilled whole, as the target's own generate does).

Writes ``--out`` (JSON: per family and system tau, tokens, seconds, tokens/s, speed-up) and
prints a table. ``python perf/lookup_speed.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="target,lookup,suffix,M,M+lookup,M+suffix")
    ap.add_argument("--families", default="chartqa,textvqa,vqav2,hallusionbench,spot_the_diff,iedit,pororosv,vist,"
                    "conversation2")
    ap.add_argument("-n", type=int, default=4, help="test prompts per family")
    ap.add_argument("--warmup", type=int, default=100, help="train-split requests each suffix decoder serves first")
    ap.add_argument("--gamma", type=int, default=5, help="draft length of the M chain")
    ap.add_argument("--gamma-free", type=int, default=8, help="draft length of lookup / suffix alone")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def prompts(family: str, split: str, n: int, target, proc, start: int = 0):
    """[(label, prompt text, images)]: a world family's samples, or conversations' turn 2
    (``conversation2``, from the target's own turn-1 answer) / both turns (``conversation``)."""
    from mmspec.inputs import processor_inputs
    from mmspec.world import generate_conversations, generate_samples

    if family.startswith("conversation"):
        out = []
        for c in generate_conversations(split, n, start=start):
            inp = processor_inputs(proc, c.prompt1, c.images)
            a1 = target.generate(**inp, do_sample=False, max_new_tokens=64)[0, inp["input_ids"].shape[1]:]
            text1 = proc.tokenizer.decode(a1, skip_special_tokens=True)
            if family == "conversation":
                out.append((family, c.prompt1, c.images))
            out.append((family, c.turn2_prompt(text1), c.images))
        return out
    return [(family, s.prompt, s.images) for s in generate_samples(family, split, n, start=start)]


def decoder(method: str, m, gamma: int, gamma_free: int):
    from mmspec.bench.config import parse_method
    from mmspec.decoder import SpecDecoder

    views, kw = parse_method(method)
    draft = kw.pop("draft", m.draft)
    g = gamma_free if isinstance(draft, str) else gamma
    return SpecDecoder(m.target, draft, m.tokenizer, views=views or ("M",), gamma=g, prefix_cache_mb=0, **kw)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    from mmspec.embedded import load_embedded
    from mmspec.inputs import processor_inputs
    from mmspec.provenance import machine_info, now

    m = load_embedded()
    t, proc = m.target, m.processor
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    decs = {s: decoder(s, m, args.gamma, args.gamma_free) for s in systems if s != "target"}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    # warm-up: the suffix decoders serve train-split requests (the server's situation)
    warm = []
    fams = [f for f in ("chartqa", "textvqa", "vqav2", "hallusionbench", "spot_the_diff", "iedit", "pororosv", "vist",
                        "conversation")]
    per = max(1, args.warmup // len(fams) + 1)
    for f in fams:
        warm += prompts(f, "train", per if f != "conversation" else max(1, per // 2), t, proc)
    warm = warm[:args.warmup]
    for name, dec in decs.items():
        if dec.suffix_store is None or not args.warmup:
            continue
        for _, text, images in warm:
            inp = processor_inputs(proc, text, images)
            dec.generate(inp["input_ids"], inp.get("pixel_values"), max_new_tokens=args.max_new_tokens)
        print(f"warm-up {name}: {len(warm)} requests, store {dec.suffix_store.nbytes / 2**20:.1f} MiB "
              f"({len(dec.suffix_store.requests)} requests)", flush=True)
    warm_s = time.perf_counter() - t0

    rows = {}
    mismatches = []
    for fam in families:
        items = prompts(fam, "test", args.n, t, proc)
        acc = {s: {"tokens": 0, "seconds": 0.0, "blocks": 0} for s in systems}
        for i, (_, text, images) in enumerate(items):
            inp = processor_inputs(proc, text, images)
            n_in = inp["input_ids"].shape[1]
            order = systems[i % len(systems):] + systems[:i % len(systems)]
            ref = None
            outs = {}
            for s in order:
                s0 = time.perf_counter()
                if s == "target":
                    toks = t.generate(**inp, do_sample=False, max_new_tokens=args.max_new_tokens)[0, n_in:].tolist()
                    blocks = len(toks)
                else:
                    r = decs[s].generate(inp["input_ids"], inp.get("pixel_values"), max_new_tokens=args.max_new_tokens)
                    toks, blocks = r.token_ids, len(r.stats.blocks)
                acc[s]["seconds"] += time.perf_counter() - s0
                acc[s]["tokens"] += len(toks)
                acc[s]["blocks"] += blocks
                outs[s] = toks
            ref = outs.get("target")
            for s, toks in outs.items():
                if ref is not None and toks != ref:
                    mismatches.append(f"{fam}[{i}]/{s}")
        base = acc.get("target")
        rows[fam] = {}
        for s, a in acc.items():
            tps = a["tokens"] / a["seconds"]
            rows[fam][s] = {**a, "tau": a["tokens"] / max(1, a["blocks"]), "tokens_per_s": tps,
                            "speedup": tps / (base["tokens"] / base["seconds"]) if base else None}
        print(fam, " ".join(f"{s}: tau {r['tau']:.2f} {r['speedup']:.2f}x" for s, r in rows[fam].items()), flush=True)
    summary = {s: {"mean_speedup": statistics.mean(rows[f][s]["speedup"] for f in families),
                   "min_speedup": min(rows[f][s]["speedup"] for f in families),
                   "mean_tau": statistics.mean(rows[f][s]["tau"] for f in families)} for s in systems}
    report = {"command": "python perf/lookup_speed.py " + " ".join(argv or os.sys.argv[1:]), "date": now(),
              "machine": machine_info(), "load_before": load_before, "load_after": os.getloadavg(),
              "args": vars(args), "warmup_s": warm_s, "families": rows, "summary": summary,
              "mismatches": mismatches, "note": "tau counts the target's token (blocks of the target alone = tokens)"}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if mismatches:
        print("MISMATCH:", mismatches)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
