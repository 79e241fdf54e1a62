"""τ per image-count group and tokens/s per method from a bench results file (this run's table)."""
import json
import sys
from collections import defaultdict

rows = [json.loads(x) for x in open(sys.argv[1])]
base = {r["uid"]: r for r in rows if r["kind"] == "baseline"}
tok, blk, toks, secs, same, n = (defaultdict(int) for _ in range(6))
group = lambda k: 1 if k == 1 else (2 if k == 2 else 5)  # noqa: E731
for r in rows:
    if r["kind"] != "spec":
        continue
    m, g = r["method"], group(r["n_images"])
    st = r["stats"]
    tok[m, g] += st["n_tokens"]
    blk[m, g] += st["n_blocks"]
    toks[m] += len(r["token_ids"])
    secs[m] += r["wall_s"]
    same[m] += bool(r["identical"])
    n[m] += 1
    toks["target"] += len(base[r["uid"]]["token_ids"]) if m == "M" else 0
    secs["target"] += base[r["uid"]]["wall_s"] if m == "M" else 0
methods = sorted(n, key=lambda m: (m.split("+")[0] != "M", m))
print("| method | τ n=1 | τ n=2 | τ n=5 | tokens/s | vs target | identical |")
print("|---|---|---|---|---|---|---|")
tps_t = toks["target"] / secs["target"]
for m in methods:
    taus = [f"{tok[m, g] / blk[m, g]:.2f}" if blk[m, g] else "-" for g in (1, 2, 5)]
    tps = toks[m] / secs[m]
    print(f"| {m} | {' | '.join(taus)} | {tps:.1f} | {tps / tps_t:.2f}x | {same[m]}/{n[m]} |")
print(f"| target | - | - | - | {tps_t:.1f} | 1.00x | - |")
