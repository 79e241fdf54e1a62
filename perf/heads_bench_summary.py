"""Tokens/s, τ and identical outputs per method of a ``mmspec bench run`` results file.

Tokens/s are new tokens over wall seconds summed over every sample of a method (the target's
baseline rows as ``target``); τ is tokens emitted per block over all of a method's blocks, per
data set and over all; ``identical`` counts outputs equal to the target's own; a block's drafting
milliseconds (mean and 10th percentile) from the engine's own time split.

    python perf/heads_bench_summary.py runs/bench/results.rank0.jsonl [--out summary.json]

A helper of docs/heads.md's measured sections (not in the package).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def summarise(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tokens, wall = defaultdict(int), defaultdict(float)
    emitted, blocks = defaultdict(int), defaultdict(int)
    same, total = defaultdict(int), defaultdict(int)
    draft_s: dict[str, list[float]] = defaultdict(list)  # every block's drafting seconds
    for r in rows:
        if r.get("kind") not in ("baseline", "spec"):
            continue
        m = r["method"] or "target"
        tokens[m] += len(r["token_ids"])
        wall[m] += r["wall_s"]
        if r["kind"] == "spec":
            total[m] += 1
            same[m] += bool(r["identical"])
            for b in (r.get("stats") or {}).get("blocks", []):
                draft_s[m].append(b.get("draft_s", 0.0))
                for key in (m, f"{m}|{r['dataset']}"):
                    emitted[key] += b["n_emitted"]
                    blocks[key] += 1
    tps = {m: tokens[m] / wall[m] for m in tokens}
    return {"tokens_per_s": {m: round(v, 1) for m, v in tps.items()},
            "vs_target": {m: round(v / tps["target"], 3) for m, v in tps.items()},
            "tau": {k: round(emitted[k] / blocks[k], 3) for k in sorted(blocks)},
            "identical": {m: f"{same[m]}/{total[m]}" for m in total},
            # a block's drafting (catch-up + the chain or tree) as the engine timed it: the mean, and the
            # 10th percentile (a block not preempted by other jobs on a shared machine)
            "draft_ms_per_block": {m: round(1e3 * sum(v) / len(v), 2) for m, v in draft_s.items() if v},
            "draft_ms_per_block_p10": {m: round(1e3 * sorted(v)[len(v) // 10], 2) for m, v in draft_s.items() if v}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = json.dumps(summarise(args.results), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
