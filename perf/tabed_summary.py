"""Tables, the goal check and the weights' plot from measure.py's rows.

    python perf/tabed_summary.py rows.jsonl docs/results/tabed-2026-11-25
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

GROUPS = {
    "n=1": ["chartqa", "textvqa", "vqav2", "hallusionbench"],
    "n=2": ["spot_the_diff", "iedit"],
    "n=5": ["pororosv", "vist"],
    "ood images": ["vqav2_inverted", "chartqa_inverted", "vqav2_scrambled"],
    "text follow-up": ["followup"],
    "ten images": ["vist_long"],
}
SINGLE_CHAIN = ["M", "T", "C", "P"]
SINGLE_TREE = ["M+tree", "T+tree"]
ADAPTIVE_CHAIN = ["MTCP+adaptive", "MTCP+adaptive:tabed:0.1", "MTCP+adaptive:loglik"]


def main(rows_path: str, out_dir: str) -> None:
    with open(rows_path) as fh:
        rows = [json.loads(line) for line in fh]
    tok, blk = defaultdict(int), defaultdict(int)
    outputs = defaultdict(set)
    for r in rows:
        if r["method"] == "MTCP+adaptive@turn1":
            continue
        tok[r["family"], r["method"]] += r["n_tokens"]
        blk[r["family"], r["method"]] += r["n_blocks"]
        if r["method"] != "MTCP+adaptive+carry":
            outputs[r["uid"]].add(r["tokens_sha"] if "tokens_sha" in r else tuple(r["tokens"]))
    tau = {k: tok[k] / blk[k] for k in tok}
    methods = sorted({m for _, m in tau}, key=lambda m: ("tree" in m, len(m), m))
    families = sorted({f for f, _ in tau})
    groups = {g: [f for f in fs if f in families] for g, fs in GROUPS.items()}
    groups = {g: fs for g, fs in groups.items() if fs}
    gtau = {(g, m): sum(tau[f, m] for f in fs) / len(fs) for g, fs in groups.items() for m in methods
            if all((f, m) in tau for f in fs)}
    n_samples = {f: len({r["uid"] for r in rows if r["family"] == f}) for f in families}
    summary = {"tau_by_family": {f"{f}|{m}": v for (f, m), v in tau.items()},
               "tau_by_group": {f"{g}|{m}": v for (g, m), v in gtau.items()},
               "samples_per_family": n_samples,
               "identical_outputs": all(len(v) == 1 for v in outputs.values()),
               "n_prompts": len(outputs)}
    goals = {}
    for kind, singles, adaptives in (("chain", SINGLE_CHAIN, ADAPTIVE_CHAIN + ["MTCP", "MT", "MT+adaptive:tabed:0.1"]),
                                     ("tree", SINGLE_TREE, ["MTCP+tree", "MTCP+adaptive:tabed:0.1+tree"])):
        for a in adaptives:
            if not all((g, a) in gtau for g in groups):
                continue
            within = {g: gtau[g, a] / max(gtau[g, s] for s in singles) - 1 for g in groups}
            avg = {m: sum(gtau[g, m] for g in groups) / len(groups) for m in singles + [a]}
            goals[f"{kind}|{a}"] = {"vs_best_single_by_group": within,
                                    "within_2pct_every_group": all(v >= -0.02 for v in within.values()),
                                    "avg_over_groups": avg,
                                    "above_every_single_on_average": all(avg[a] > avg[s] for s in singles)}
    summary["goals"] = goals
    # carry-over (followup): turn 2 fresh vs from turn 1's final weights
    carry = {m: tau.get(("followup", m)) for m in ("MTCP+adaptive", "MTCP+adaptive+carry")}
    summary["carry_over_followup"] = carry
    # what adapting costs: wall time of the same prompts, adaptive vs equal weights (loaded machine: rough)
    wall = defaultdict(float)
    for r in rows:
        wall[r["method"]] += r["wall_s"]
    cost = {a: wall[a] / wall[b] for a, b in (("MTCP+adaptive", "MTCP"), ("MTCP+adaptive:tabed:0.1", "MTCP"),
                                              ("MTCP+adaptive:tabed:0.1+tree", "MTCP+tree")) if wall[b]}
    summary["wall_ratio_vs_equal_weights"] = cost
    out = Path(out_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    lines = ["| method | " + " | ".join(f"{f} ({n_samples[f]})" for f in families) + " |",
             "|---" * (len(families) + 1) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{tau[f, m]:.2f}" if (f, m) in tau else "" for f in families) + " |")
    lines += ["", "| method | " + " | ".join(groups) + " | avg |", "|---" * (len(groups) + 2) + "|"]
    for m in methods:
        if all((g, m) in gtau for g in groups):
            vals = [gtau[g, m] for g in groups]
            lines.append(f"| {m} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    lines += ["", "| adaptive | vs best single view, per group | within 2% everywhere | above every single on average |",
              "|---|---|---|---|"]
    for k, v in goals.items():
        per = ", ".join(f"{g} {100 * x:+.1f}%" for g, x in v["vs_best_single_by_group"].items())
        lines.append(f"| {k} | {per} | {v['within_2pct_every_group']} | {v['above_every_single_on_average']} |")
    lines += ["", (f"carry-over (followup turn 2): fresh {carry['MTCP+adaptive']}, from turn 1's weights "
                   f"{carry['MTCP+adaptive+carry']}"),
              "wall time vs equal weights (same prompts, loaded machine): "
              + ", ".join(f"{k} {v:.3f}x" for k, v in cost.items()),
              f"identical outputs across methods: {summary['identical_outputs']} ({summary['n_prompts']} prompts)"]
    (out / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "weights.png")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = [("vqav2", 0), ("vqav2_inverted", 0), ("followup", 1), ("vist_long", 0), ("chartqa_inverted", 2),
             ("pororosv", 0)]
    method = "MTCP+adaptive:tabed:0.1"
    fig, axes = plt.subplots(2, 3, figsize=(12, 6), sharey=True)
    for ax, (fam, i) in zip(axes.flat, picks):
        r = next((r for r in rows if r["family"] == fam and r["method"] == method
                  and r["uid"].endswith(f"-{i}")), None)
        if r is None:
            continue
        w = r["view_weights"] + [r["final_weights"]]
        for v, name in enumerate("MTCP"):
            ax.plot(range(len(w)), [x[v] for x in w], marker=".", label=name)
        ax.set_title(f"{r['uid']} (tau {r['tau']:.2f})", fontsize=9)
        ax.set_xlabel("block")
    axes.flat[0].set_ylabel("weight")
    next(ax for ax in axes.flat if ax.lines).legend()
    fig.suptitle(f"{method}: each view's weight before each block (last point: after the last block)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
