"""τ per dataset of one method on the first N test samples, v12's benchmark rows against candidate drafts.

    python docs/results/distill-2026-11-23/tau.py METHOD N NAME [NAME ...]

Reads v12's shipped rows (docs/results/embedded-2026-11-23-v12/, same target, same samples) and
runs/distill/bench-NAME/ for each candidate NAME (`mmspec bench run --draft DIR --method METHOD
-n N`), or a results dir given as a path. τ and the identical share come from
`mmspec.bench.metrics.method_metrics` (tokens / blocks summed over a dataset's samples), on the
rows of the first N samples.
"""
import gzip
import json
import sys
from pathlib import Path

from mmspec.bench.metrics import datasets_of, method_metrics


def rows(d: Path, nmax: int) -> list[dict]:
    out = []
    for f in sorted(d.glob("results.rank*.jsonl*")):
        with (gzip.open if f.suffix == ".gz" else open)(f, "rt") as fh:
            out += [r for r in map(json.loads, fh) if r["kind"] == "latency" or int(r["uid"].rsplit("-", 1)[1]) < nmax]
    return out


method, nmax = sys.argv[1], int(sys.argv[2])
runs = {"v12 pack (v11 draft)": Path("docs/results/embedded-2026-11-23-v12")}
for name in sys.argv[3:]:
    runs[name] = Path(name) if Path(name).is_dir() else Path(f"runs/distill/bench-{name}")
table = {}
for name, d in runs.items():
    r = rows(d, nmax)
    table[name] = {ds: method_metrics(r, ds, method) for ds in datasets_of(r)}
ds = sorted(next(iter(table.values())))
print("| draft | " + " | ".join(ds) + " | mean | identical |")
for name, m in table.items():
    ok = [x for x in m.values() if x is not None]
    same = sum(round(x.identical_rate * x.n_samples) for x in ok)
    print(f"| {name} | " + " | ".join(f"{m[d].tau:.2f}" if m.get(d) else "nan" for d in ds)
          + f" | {sum(x.tau for x in ok) / len(ok):.2f} | {same}/{sum(x.n_samples for x in ok)} |")
