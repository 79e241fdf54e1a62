"""PNG figures of a benchmark report (matplotlib, Agg backend; no other plotting deps).

Owns the four figures: block efficiency per method and dataset (grouped bars, Fig. 7 style),
an UpSet plot of which target tokens each single method got accepted (Fig. 5, drawn by hand),
accepted tokens over normalised time (Fig. 11) and draft per-step latency against batch size
(Fig. 9). Each function takes already-aggregated numbers and a path, and returns the path.
Bars start at zero (a cut axis magnifies small differences); lines that may coincide are drawn
widest first, each with its own dash, so none hides another.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

from mmspec.bench.metrics import MethodMetrics
from mmspec.bench.optional import require

LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 2)), (0, (8, 2, 2, 2)))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display; safe under torchrun / CI), imported
    on first use: without matplotlib, one line naming the extra to install."""
    require("matplotlib", "mmspec report's plots").use("Agg")
    return require("matplotlib.pyplot", "mmspec report's plots")


def _save(fig, path: Path) -> Path:
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def block_efficiency_bars(metrics: list[MethodMetrics], datasets: list[str], methods: list[str],
                          path: Path) -> Path:
    """Grouped bars: x = dataset, one bar per method, height = tau (bonus token included)."""
    plt = pyplot()
    cell = {(m.dataset, m.method): m.tau for m in metrics}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(datasets) + 2), 3.8))
    width = 0.8 / max(1, len(methods))
    for j, meth in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        bars = ax.bar(xs, [cell.get((d, meth), 0.0) for d in datasets], width, label=meth)
        ax.bar_label(bars, fmt="%.2f", fontsize=5, rotation=90, padding=1)  # the values, read exactly
    ax.set_xticks(range(len(datasets)), datasets, rotation=20)
    ax.set_ylabel("block efficiency τ (incl. bonus token)")
    ax.set_ylim(0.0, 1.12 * max(cell.values() or [1.0]) + 0.1)  # from zero: bar heights compare honestly
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")  # τ = 1: the target alone (no draft token accepted)
    ax.legend(ncol=min(len(methods), 8), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.set_title("Block efficiency by dataset and drafting method")
    return _save(fig, path)


def upset_counts(sets: dict[str, set]) -> list[tuple[tuple[str, ...], int]]:
    """Exclusive intersections: for each non-empty member combination, elements in exactly it."""
    names = list(sets)
    universe = set().union(*sets.values()) if sets else set()
    counts: dict[tuple[str, ...], int] = {}
    for e in universe:
        key = tuple(n for n in names if e in sets[n])
        counts[key] = counts.get(key, 0) + 1
    for k in range(1, len(names) + 1):  # show empty combinations too, for a complete picture
        for combo in combinations(names, k):
            counts.setdefault(combo, 0)
    return sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0])))


def upset_plot(sets: dict[str, set], total: int, path: Path, title: str = "") -> Path:
    """UpSet plot: bars of exclusive intersection sizes over a dot matrix of members."""
    plt = pyplot()
    names = list(sets)
    inter = upset_counts(sets)
    fig = plt.figure(figsize=(max(6.0, 0.45 * len(inter) + 3.0), 4.4))
    grid = fig.add_gridspec(2, 2, width_ratios=(1, 4), height_ratios=(3, 1.3), wspace=0.05, hspace=0.05)
    ax_bar = fig.add_subplot(grid[0, 1])
    ax_dots = fig.add_subplot(grid[1, 1], sharex=ax_bar)
    ax_set = fig.add_subplot(grid[1, 0], sharey=ax_dots)
    xs = list(range(len(inter)))
    heights = [c for _, c in inter]
    ax_bar.bar(xs, heights, color="#3a6ea5")
    for x, h in zip(xs, heights):
        pct = f"\n{100 * h / total:.1f}%" if total else ""
        ax_bar.text(x, h, f"{h}{pct}", ha="center", va="bottom", fontsize=6)
    ax_bar.set_ylim(0, 1.25 * max(heights + [1]))
    ax_bar.set_ylabel("accepted target tokens")
    ax_bar.tick_params(labelbottom=False)
    ax_bar.set_title(title or "Accepted target tokens by drafting method", fontsize=9)
    for x, (members, _) in enumerate(inter):
        ys = [names.index(n) for n in members]
        ax_dots.scatter([x] * len(names), range(len(names)), color="#dddddd", s=30)
        ax_dots.scatter([x] * len(ys), ys, color="black", s=30)
        if len(ys) > 1:
            ax_dots.plot([x, x], [min(ys), max(ys)], color="black", lw=1.5)
    ax_dots.set_xticks([])
    ax_dots.set_yticks(range(len(names)), names)
    ax_dots.tick_params(labelleft=False)
    sizes = [len(sets[n]) for n in names]
    ax_set.barh(range(len(names)), sizes, color="#888888")
    ax_set.invert_xaxis()
    ax_set.set_yticks(range(len(names)), names)
    ax_set.set_xlabel("set size", fontsize=7)
    ax_set.tick_params(axis="x", labelsize=6)
    for spine in ("top", "right"):
        ax_bar.spines[spine].set_visible(False)
    fig.text(0.99, 0.01, "bars: target tokens accepted by exactly that set of methods (% of all)",
             ha="right", fontsize=6)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.1)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accepted_over_time_plot(hists: dict[str, dict[str, list[int]]], path: Path) -> Path:
    """Fig. 11: one panel per dataset; per method, accepted tokens per normalised-time bin."""
    plt = pyplot()
    datasets = list(hists)
    cols = min(4, max(1, len(datasets)))
    rows = -(-len(datasets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, d in zip(axes.flat, datasets):
        k = len(hists[d])
        for j, (meth, counts) in enumerate(hists[d].items()):
            n = len(counts)
            edges = [i / n for i in range(n + 1)]
            # equal curves stay visible: each drawn narrower than the one before, with its own dash
            ax.stairs(counts, edges, label=meth, linewidth=1.0 + 2.0 * (k - 1 - j) / max(1, k - 1),
                      linestyle=LINE_STYLES[j % len(LINE_STYLES)], color=f"C{j % 10}", alpha=0.85)
        ax.set_title(d, fontsize=9)
        ax.set_xlabel("normalised time step", fontsize=7)
        ax.set_ylabel("accepted tokens", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(datasets):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draft_latency_plot(latency: dict[str, dict], path: Path) -> Path:
    """Fig. 9 (per batch size): draft per-step decode latency in ms, one line per dataset."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for d, lat in latency.items():
        bs = sorted(lat["draft_decode_s"], key=int)
        ax.plot([int(b) for b in bs], [1e3 * lat["draft_decode_s"][b] for b in bs], marker="o",
                label=f"{d} (T_p={1e3 * lat['target_decode_s']:.2f} ms)")
    ax.set_xlabel("draft batch size (views in the ensemble)")
    ax.set_ylabel("draft per-step latency T_q (ms)")
    ax.set_title("Draft decode latency vs batch size")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)
    return _save(fig, path)
