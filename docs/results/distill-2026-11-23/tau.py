"""τ per dataset of one method on the first N test samples, v12's benchmark rows against candidate drafts.

    python docs/results/distill-2026-11-23/tau.py METHOD N NAME [NAME ...]

Reads v12's shipped rows (docs/results/embedded-2026-11-23-v12/, same target, same samples) and
runs/distill/bench-NAME/ for each candidate NAME (`mmspec bench run --draft DIR --method METHOD
-n N`), or a results dir given as a path; τ = tokens / blocks summed over a dataset's samples.
"""
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def rows(paths):
    for p in paths:
        op = gzip.open if p.endswith(".gz") else open
        for line in op(p, "rt"):
            yield json.loads(line)


def tau(paths, method="M", nmax=20):
    tok, blk, ident, n = defaultdict(int), defaultdict(int), 0, 0
    for r in rows(paths):
        if r.get("kind") != "spec" or r["method"] != method or int(r["uid"].rsplit("-", 1)[1]) >= nmax:
            continue
        tok[r["dataset"]] += r["stats"]["n_tokens"]
        blk[r["dataset"]] += r["stats"]["n_blocks"]
        ident += r["identical"]
        n += 1
    return {d: tok[d] / blk[d] for d in sorted(tok)}, ident, n


method, nmax = sys.argv[1], int(sys.argv[2])
base = ["docs/results/embedded-2026-11-23-v12/results.rank0.jsonl.gz", "docs/results/embedded-2026-11-23-v12/results.rank1.jsonl.gz"]
res = {"v12 pack (v11 draft)": tau(base, method, nmax)}
for name in sys.argv[3:]:  # a results dir, or NAME for runs/distill/bench-NAME
    d = Path(name) if Path(name).is_dir() else Path(f"runs/distill/bench-{name}")
    res[name] = tau([str(f) for f in sorted(d.glob("results.rank*.jsonl*"))], method, nmax)
ds = list(next(iter(res.values()))[0])
print("| draft | " + " | ".join(ds) + " | mean | identical |")
for k, (t, i, n) in res.items():
    print(f"| {k} | " + " | ".join(f"{t.get(d, float('nan')):.2f}" for d in ds) + f" | {sum(t.values())/len(t):.2f} | {i}/{n} |")
