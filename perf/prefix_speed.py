"""Prefix caching on the embedded pack: the target's prefill time of a conversation's second
turn with the first turn's cache reused, against a fresh prefill of the same conversation, in
ONE interleaved run; and what the cache costs a single-turn decode that reuses nothing.

Turn 1 is a world sample (its images and question); turn 2 is turn 1's prompt, its answer and a
second question about the same images (`` USER: ... ASSISTANT:``). Each repeat clears the cache,
decodes turn 1, then decodes turn 2 with reuse (cache on) and without (a decoder with
``prefix_cache_mb=0``), the order alternating; outputs are checked equal. Medians over repeats.
``--lookup 10 1000 10000``: only what finding a stored prefix costs with that many entries held.
Run ``python perf/prefix_speed.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from mmspec.provenance import stamp

SECOND = " USER: Describe the picture once more, in other words. ASSISTANT:"


def conversation(models, family: str, index: int, n1: int):
    from mmspec.world import make_sample

    s = make_sample(family, "test", index)
    enc = models.processor(text=s.prompt, images=s.images, return_tensors="pt")
    return s.uid, enc["input_ids"], enc["pixel_values"]


def what_caching_adds(dec, ids, pv, answer: list[int], repeats: int = 9) -> dict:
    """The work the cache adds to a decode that reuses nothing, timed alone (median): digesting
    the pixels and keying the prompt, and copying its caches into an entry after the decode."""
    from mmspec.batch import BatchScheduler
    from mmspec.prefix_cache import prompt_keys, segment_digests
    from mmspec.timing import median_time

    cpu = torch.device("cpu")
    mm = {"pixel_values": pv}
    layout = dec.mm.layout(ids[0], mm)
    enc = dec.encode_prompt(ids[0], mm, layout, dec.new_stats())

    def keys():
        digests = (tuple(segment_digests(mm, layout.kinds)), None)
        prompt_keys(ids[0], dec.target.placeholders(), enc.encoded, dec.mm.rows(enc.encoded), dec.views, digests)

    sched = BatchScheduler(dec, max_batch=1)  # a request admitted, holding the answer's length of tokens
    sched.submit(dict(input_ids=ids, pixel_values=pv, max_new_tokens=len(answer)))
    sched.admit()
    active = sched._active[0]
    out = {"keys_ms": 1e3 * median_time(keys, cpu, repeats),
           "store_ms": 1e3 * median_time(lambda: sched._remember(0, active), cpu, repeats)}
    sched.cancel(active.rid)
    dec.prefix_cache.clear()
    return out


def run(args) -> dict:
    from mmspec import SpecDecoder, load_embedded

    torch.set_num_threads(args.threads)
    m = load_embedded(torch.float32)
    kw = dict(tokenizer=m.tokenizer, processor=m.processor, views=args.views)
    on = SpecDecoder(m.target, m.draft, **kw)
    off = SpecDecoder(m.target, m.draft, prefix_cache_mb=0, **kw)
    second = torch.tensor([m.tokenizer.encode(SECOND, add_special_tokens=False)])
    rows = []
    for fam in args.families.split(","):
        uid, ids1, pv = conversation(m, fam, 0, args.turn1_tokens)
        times = {"reuse": [], "fresh": [], "turn1_on": [], "turn1_off": []}
        reused, same, held_mb = None, True, 0.0
        for rep in range(args.repeats + 1):  # the first pass is a warm-up
            on.prefix_cache.clear()
            # the cost when nothing is reused: turn 1 with the cache on (hash + store) vs off
            pair = [("turn1_on", on), ("turn1_off", off)][:: 1 if rep % 2 else -1]
            r1 = {name: d.generate(ids1, pv, max_new_tokens=args.turn1_tokens) for name, d in pair}
            ids2 = torch.cat([ids1, torch.tensor([r1["turn1_on"].token_ids]), second], dim=1)
            order = [("reuse", on), ("fresh", off)][:: 1 if rep % 2 else -1]
            r2 = {name: d.generate(ids2, pv, max_new_tokens=args.turn2_tokens) for name, d in order}
            same &= r2["reuse"].token_ids == r2["fresh"].token_ids
            same &= r1["turn1_on"].token_ids == r1["turn1_off"].token_ids
            reused = r2["reuse"].stats.prompt_tokens_reused
            held_mb = on.prefix_cache.nbytes / 2**20  # turn 1's and turn 2's entries
            if rep:
                times["reuse"].append(r2["reuse"].stats.prefill_target_s)
                times["fresh"].append(r2["fresh"].stats.prefill_target_s)
                times["turn1_on"].append(r1["turn1_on"].stats.total_s)
                times["turn1_off"].append(r1["turn1_off"].stats.total_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        on.prefix_cache.clear()
        overhead = what_caching_adds(on, ids1, pv, r1["turn1_on"].token_ids)
        rows.append(dict(uid=uid, turn1_len=ids1.shape[1], turn2_len=ids2.shape[1], reused=reused, identical=same,
                         prefill_reuse_ms=1e3 * med["reuse"], prefill_fresh_ms=1e3 * med["fresh"],
                         ratio=med["reuse"] / med["fresh"], cache_mb=held_mb, turn1_total_on_ms=1e3 * med["turn1_on"],
                         turn1_total_off_ms=1e3 * med["turn1_off"], **overhead, raw_s=times))
    return {**stamp("cpu"), "views": args.views, "threads": args.threads, "repeats": args.repeats,
            "turn1_tokens": args.turn1_tokens, "turn2_tokens": args.turn2_tokens, "rows": rows,
            "median_ratio": statistics.median(r["ratio"] for r in rows),
            "all_identical": all(r["identical"] for r in rows)}


def table(res: dict) -> str:
    head = ("| sample | turn-2 prompt | reused | target prefill, reuse (ms) | fresh (ms) | ratio | "
            "turn 1 total, cache on / off (ms) | keying + storing (ms) | cache held (MiB) | same output |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['uid']} | {r['turn2_len']} | {r['reused']} | {r['prefill_reuse_ms']:.1f} | "
                     f"{r['prefill_fresh_ms']:.1f} | {r['ratio']:.3f} | {r['turn1_total_on_ms']:.0f} / "
                     f"{r['turn1_total_off_ms']:.0f} | {r['keys_ms']:.1f} + {r['store_ms']:.1f} | {r['cache_mb']:.2f} | "
                     f"{r['identical']} |")
    lines.append(f"\nmedian ratio {res['median_ratio']:.3f}; every output identical: {res['all_identical']}")
    return "\n".join(lines)


def lookup_cost(sizes: list[int], prompt: int = 600, shared: int = 64, repeats: int = 200) -> list[dict]:
    """What finding a prompt's stored prefix costs with N entries held (``--lookup N ...``):
    synthetic entries of ``prompt`` positions sharing a ``shared``-position system prompt, then a
    new prompt extending one of them; the median seconds of ``PrefixCache.match`` and
    ``encoded_for`` (run it with another ``PYTHONPATH`` to time the code before a change)."""
    import time

    from mmspec.prefix_cache import PrefixCache, PrefixEntry, RowPrefix

    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 30000, (shared,), generator=g)
    rows = []
    for n in sizes:
        pc = PrefixCache(budget_mb=1 << 20)
        kv = [(torch.zeros(1, 1, prompt, 1), torch.zeros(1, 1, prompt, 1))]
        for i in range(n):
            key = torch.cat([system, torch.randint(0, 30000, (prompt - shared,), generator=g)])
            pc.store(PrefixEntry(target=RowPrefix(key=key, kv=kv), digests=(i,), encoded=object()))
        last = list(pc.entries.values())[-1].target.key
        query = torch.cat([last, torch.tensor([7, 8, 9])])
        times, enc = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            m = pc.match(query)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            pc.encoded_for((n - 1,))
            enc.append(time.perf_counter() - t)
        assert m is not None and m.target == prompt
        rows.append({"entries": n, "match_us": statistics.median(times) * 1e6,
                     "encoded_for_us": statistics.median(enc) * 1e6})
        print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="chartqa,spot_the_diff,pororosv,vist")
    p.add_argument("--views", default="M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--turn1-tokens", type=int, default=32)
    p.add_argument("--turn2-tokens", type=int, default=8)
    p.add_argument("--out", default="runs/prefix-speed")
    p.add_argument("--lookup", type=int, nargs="*", default=None, metavar="N",
                   help="only time a prefix lookup with N synthetic entries held (each N given), then exit")
    args = p.parse_args()
    if args.lookup:
        torch.set_num_threads(args.threads)
        out = Path(args.out).with_suffix(".lookup.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(lookup_cost(args.lookup), indent=1))
        return
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(table(res) + "\n")
    print(table(res))
    raise SystemExit(0 if res["all_identical"] else 1)


if __name__ == "__main__":
    main()
