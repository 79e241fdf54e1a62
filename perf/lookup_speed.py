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

``--batch-size N`` (N > 1): the mmspec systems decode each family's prompts N at a time through
``SpecDecoder.generate_batch`` (the one engine, continuous batching, ``--speculate``, or a
system's own ``@always|never|auto``: ``suffix@auto`` is suffix under the goodput policy), the
``target`` its own batched ``generate`` (left-padded, the same N prompts); the suffix decoders'
warm-up is served in batches of N too. Family ``single`` / ``multi`` mixes the world's
single-image / multi-image families (round-robin, ``-n`` prompts in all). Greedy outputs are
checked against the target's batched ones, and a request that differs there against the target's
own ``generate`` of it alone (the lossless reference; padding may move the batched target).
CPU seconds (``time.process_time``) are recorded beside wall seconds: on a loaded machine they
move less.

Writes ``--out`` (JSON: per family and system tau, tokens, seconds, CPU seconds, tokens/s,
speed-up) and prints a table. ``python perf/lookup_speed.py --help``.
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
    ap.add_argument("--batch-size", type=int, default=1,
                    help="N > 1: decode N prompts at a time (generate_batch; the target's batched generate)")
    ap.add_argument("--speculate", default="always", choices=("always", "never", "auto"),
                    help="generate_batch's speculate= (with --batch-size > 1)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def prompts(family: str, split: str, n: int, target, proc, start: int = 0):
    """[(label, prompt text, images)]: a world family's samples, or conversations' turn 2
    (``conversation2``, from the target's own turn-1 answer) / both turns (``conversation``)."""
    from mmspec.inputs import processor_inputs
    from mmspec.world import generate_conversations, generate_samples

    if family in GROUPS:  # a mix of families, round-robin, n prompts in all
        fams = GROUPS[family]
        per = {f: prompts(f, split, -(-n // len(fams)), target, proc, start) for f in fams}
        mixed = [per[f][i] for i in range(-(-n // len(fams))) for f in fams if i < len(per[f])]
        return [(family, text, images) for _, text, images in mixed[:n]]
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


GROUPS = {"single": ("chartqa", "textvqa", "vqav2", "hallusionbench"),
          "multi": ("spot_the_diff", "iedit", "pororosv", "vist")}


def eos_ids(target) -> set[int]:
    e = target.generation_config.eos_token_id
    return set() if e is None else {e} if isinstance(e, int) else set(e)


def cut_at_eos(row: list[int], eos: set[int]) -> list[int]:
    for j, tok in enumerate(row):
        if tok in eos:
            return row[:j + 1]
    return row


def batch_encode(proc, items) -> dict:
    """``items``' prompts as one left-padded batch for the target's own ``generate``."""
    side = proc.tokenizer.padding_side
    proc.tokenizer.padding_side = "left"
    try:
        images = [im for _, _, ims in items for im in ims]
        return dict(proc(text=[text for _, text, _ in items], images=images or None, return_tensors="pt",
                         padding=True))
    finally:
        proc.tokenizer.padding_side = side


def target_batched(target, enc: dict, max_new_tokens: int) -> list[list[int]]:
    """The target's own batched greedy ``generate`` of a left-padded batch; each row's new tokens
    up to and including its first EOS (what follows is padding)."""
    out = target.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    n_in = enc["input_ids"].shape[1]
    return [cut_at_eos(row[n_in:].tolist(), eos_ids(target)) for row in out]


def batch_requests(proc, items, max_new_tokens: int) -> list[dict]:
    from mmspec.inputs import processor_inputs

    reqs = []
    for _, text, images in items:
        inp = processor_inputs(proc, text, images)
        reqs.append({k: v for k, v in inp.items() if k in ("input_ids", "pixel_values")}
                    | {"max_new_tokens": max_new_tokens})
    return reqs


def speculate(system: str, args) -> str:
    """generate_batch's ``speculate=``: the system's own ``@always|never|auto``, else ``--speculate``."""
    return system.split("@")[1] if "@" in system else args.speculate


def decoder(method: str, m, gamma: int, gamma_free: int):
    from mmspec.bench.config import parse_method
    from mmspec.decoder import SpecDecoder

    views, kw = parse_method(method.split("@")[0])
    draft = kw.pop("draft", m.draft)
    from mmspec.drafting.tree import reads_gamma

    if reads_gamma(kw.get("tree")):  # a tree has a shape of its own
        kw["gamma"] = gamma_free if isinstance(draft, str) else gamma
    return SpecDecoder(m.target, draft, m.tokenizer, views=views or ("M",), prefix_cache_mb=0, **kw)


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
        if args.batch_size > 1:  # served in batches, as the timed prompts
            for k in range(0, len(warm), args.batch_size):
                dec.generate_batch(batch_requests(proc, warm[k:k + args.batch_size], args.max_new_tokens),
                                   speculate=speculate(name, args))
        else:
            for _, text, images in warm:
                inp = processor_inputs(proc, text, images)
                dec.generate(inp["input_ids"], inp.get("pixel_values"), max_new_tokens=args.max_new_tokens)
        print(f"warm-up {name}: {len(warm)} requests, store {dec.suffix_store.nbytes / 2**20:.1f} MiB "
              f"({len(dec.suffix_store.requests)} requests)", flush=True)
    warm_s = time.perf_counter() - t0

    rows = {}
    mismatches = []
    batched_target_differs = []  # where the target's batched generate moved off its generate alone
    for fam in families:
        items = prompts(fam, "test", args.n, t, proc)
        acc = {s: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "blocks": 0} for s in systems}
        B = max(1, args.batch_size)
        for i in range(0, len(items), B):  # one unit: a prompt (batch 1) or a batch of B prompts
            unit = items[i:i + B]
            k = i // B
            order = systems[k % len(systems):] + systems[:k % len(systems)]
            outs = {}
            # the processor's work is not timed
            inp = processor_inputs(proc, unit[0][1], unit[0][2]) if B == 1 else None
            n_in = inp["input_ids"].shape[1] if B == 1 else 0
            enc = batch_encode(proc, unit) if B > 1 and "target" in systems else None
            reqs = batch_requests(proc, unit, args.max_new_tokens) if B > 1 else None
            for s in order:
                s0, c0 = time.perf_counter(), time.process_time()
                if s == "target" and B > 1:
                    toks = target_batched(t, enc, args.max_new_tokens)
                    blocks = [len(x) for x in toks]
                elif s == "target":
                    toks = [t.generate(**inp, do_sample=False, max_new_tokens=args.max_new_tokens)[0, n_in:].tolist()]
                    blocks = [len(toks[0])]
                elif B > 1:
                    res = decs[s].generate_batch(reqs, speculate=speculate(s, args))
                    toks, blocks = [r.token_ids for r in res], [len(r.stats.blocks) for r in res]
                else:
                    r = decs[s].generate(inp["input_ids"], inp.get("pixel_values"), max_new_tokens=args.max_new_tokens)
                    toks, blocks = [r.token_ids], [len(r.stats.blocks)]
                acc[s]["seconds"] += time.perf_counter() - s0
                acc[s]["cpu_seconds"] += time.process_time() - c0
                acc[s]["tokens"] += sum(len(x) for x in toks)
                acc[s]["blocks"] += sum(blocks)
                outs[s] = toks
            ref = outs.get("target")
            if ref is None:
                continue
            alone = {}  # the target's generate of one request alone, where the batched target is not enough
            for s, toks in outs.items():
                for j, (got, want) in enumerate(zip(toks, ref)):
                    if got == want:
                        continue
                    if B > 1 and j not in alone:
                        one = processor_inputs(proc, unit[j][1], unit[j][2])
                        alone[j] = t.generate(**one, do_sample=False, max_new_tokens=args.max_new_tokens)[
                            0, one["input_ids"].shape[1]:].tolist()
                        if alone[j] != want:
                            batched_target_differs.append(f"{fam}[{i + j}]")
                    if B == 1 or got != alone[j]:
                        mismatches.append(f"{fam}[{i + j}]/{s}")
        base = acc.get("target")
        rows[fam] = {}
        for s, a in acc.items():
            tps = a["tokens"] / a["seconds"]
            rows[fam][s] = {**a, "tau": a["tokens"] / max(1, a["blocks"]), "tokens_per_s": tps,
                            "tokens_per_cpu_s": a["tokens"] / a["cpu_seconds"],
                            "speedup": tps / (base["tokens"] / base["seconds"]) if base else None,
                            "cpu_speedup": (a["tokens"] / a["cpu_seconds"]) / (base["tokens"] / base["cpu_seconds"])
                            if base else None}
        print(fam, " ".join(f"{s}: tau {r['tau']:.2f} {r['speedup']:.2f}x (cpu {r['cpu_speedup']:.2f}x)"
                            for s, r in rows[fam].items()), flush=True)
    summary = {s: {"mean_speedup": statistics.mean(rows[f][s]["speedup"] for f in families),
                   "min_speedup": min(rows[f][s]["speedup"] for f in families),
                   "mean_cpu_speedup": statistics.mean(rows[f][s]["cpu_speedup"] for f in families),
                   "min_cpu_speedup": min(rows[f][s]["cpu_speedup"] for f in families),
                   "mean_tau": statistics.mean(rows[f][s]["tau"] for f in families)} for s in systems}
    report = {"command": "python perf/lookup_speed.py " + " ".join(argv or os.sys.argv[1:]), "date": now(),
              "machine": machine_info(), "load_before": load_before, "load_after": os.getloadavg(),
              "args": vars(args), "warmup_s": warm_s, "families": rows, "summary": summary,
              "mismatches": mismatches,
              "batched_target_differs_from_alone": batched_target_differs, "note": "tau counts the target's token (blocks of the target alone = tokens)"}
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
