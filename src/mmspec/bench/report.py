"""``mmspec report RESULTS_DIR``: merge all rank files and render ``report.md`` + PNG plots.

Owns the layout of the report: a header (commands, machine, date), a loud losslessness check,
the half-precision audit, the IbED Table 3 layout (datasets grouped by n = 1 / 2 / 5 images, MMSpec's categories apart, group averages) for block
efficiency and for mean accepted length, measured vs predicted (eq. 2) speed-up, acceptance per
draft position, time splits, latencies, MMSpec's own table (:mod:`mmspec.bench.mmspec_report`), the batched comparison and the conversations (:mod:`mmspec.bench.batch_report`), and the figures of :mod:`mmspec.bench.plots`. It also
writes ``metrics.json`` with every number. It reads rows only; it runs no model.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mmspec.bench import plots
from mmspec.bench.audit import audit_summary, near_tie_only
from mmspec.bench.batch_report import audit_section, batch_metrics, batch_section, conversation_section
from mmspec.bench.metrics import (
    MethodMetrics,
    accepted_over_time,
    accepted_sets,
    all_metrics,
    baseline_split,
    datasets_of,
    groups,
    latency_of,
    lossless_violations,
    methods_of,
)
from mmspec.bench.mmspec_report import mmspec_metrics, mmspec_section
from mmspec.bench.store import merge_rows, rank_files, read_run_meta
from mmspec.provenance import command_line, machine_info, now


def _fmt(v: float | None, nd: int = 2) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _group(n: int | str, datasets: list[str]) -> str:
    """A column's label: ``n=N`` images, ``video`` for the world's clip families (no images), or the
    name of a benchmark grouped apart (MMSpec's categories)."""
    from mmspec.bench.datasets import VIDEO_NAMES

    if isinstance(n, str):
        return n
    return "video" if n == 0 and all(d in VIDEO_NAMES for d in datasets) else f"n={n}"


def table3(metrics: list[MethodMetrics], attr: str, nd: int = 2) -> list[str]:
    """Paper Table 3 layout: one row per method; datasets grouped by n, then group averages."""
    grp = groups(metrics)
    cell = {(m.dataset, m.method): getattr(m, attr) for m in metrics}
    methods = [m for m in methods_of([{"kind": "spec", "method": x.method, "dataset": x.dataset}
                                      for x in metrics])]
    header = ["Method"] + [f"{d} ({_group(n, [d])})" for n, ds in grp.items() for d in ds]
    header += [f"Avg {_group(n, ds)}" for n, ds in grp.items()]
    rows = []
    for meth in methods:
        r = [meth] + [_fmt(cell.get((d, meth)), nd) for ds in grp.values() for d in ds]
        for ds in grp.values():
            vals = [cell[(d, meth)] for d in ds if (d, meth) in cell]
            r.append(_fmt(statistics.fmean(vals), nd) if len(vals) == len(ds) else "–")
        rows.append(r)
    return _table(header, rows)


def _header(results_dir: Path, command: str | None, metas: list[dict]) -> list[str]:
    date = now()
    lines = ["# mmspec benchmark report", "",
             f"- **report command:** `{command or command_line()}`",
             f"- **report date:** {date}",
             f"- **results:** `{results_dir}` ({len(rank_files(results_dir))} rank file(s))"]
    seen = set()
    for m in metas:
        key = (m.get("command"), m.get("rank"))
        if key in seen:
            continue
        seen.add(key)
        mach = m.get("machine", {})
        lines.append(
            f"- **run** (rank {m.get('rank')}/{m.get('world_size')}, {m.get('date')}): "
            f"`{m.get('command')}` on {mach.get('platform')}, {mach.get('cpu_count')} CPUs, "
            f"torch {mach.get('torch')}, device {mach.get('device')}"
            + (f" ({', '.join(mach['cuda_devices'])})" if mach.get("cuda_devices") else ""))
    if metas:
        cfg, models = metas[-1].get("config", {}), metas[-1].get("models", {})
        lines.append(
            f"- **settings:** gamma={cfg.get('gamma')}, max_new_tokens="
            f"{cfg.get('max_new_tokens') or 'each data set protocol (IbED 128; MMSpec 1024 a turn, cut to the context)'}, "
            f"temperature={cfg.get('temperature')} ({'greedy' if not cfg.get('temperature') else 'sampling'}), "
            f"n_samples={cfg.get('n_samples')} per dataset; models: {models.get('source')} "
            f"(target {models.get('target_params')} params, draft {models.get('draft_params')} params)")
    rm = machine_info()
    lines.append(f"- **report machine:** {rm['platform']}, {rm['cpu_count']} CPUs, torch {rm['torch']}")
    return lines + [""]


def _lossless_section(metrics: list[MethodMetrics], rows: list[dict] | None = None) -> list[str]:
    audits = audit_summary(rows or [])
    ties = [m for m in lossless_violations(metrics) if near_tie_only(audits, m.dataset, m.method)]
    bad = [m for m in lossless_violations(metrics) if m not in ties]
    checked = [m for m in metrics if m.identical_rate is not None]
    if bad:
        lines = ["## ⚠️ LOSSLESSNESS VIOLATED ⚠️", "",
                 "**Greedy speculative outputs must equal the target's own greedy output token for "
                 "token. These cells do not:**", ""]
        lines += [f"- **{m.dataset} / {m.method}: {100 * m.identical_rate:.1f}% identical**" for m in bad]
        return lines + ["", "(Near-tied logits in low precision can flip an argmax; see README.md, "
                        "'What \"lossless\" means here'. Investigate before trusting these numbers.)", ""]
    if not checked:
        return ["## Losslessness", "", "No baseline rows to compare with.", ""]
    if ties:
        return ["## Losslessness", "", "Every greedy output equals the target's own except half-precision near-ties "
                "(see the audit below): " + ", ".join(f"{m.dataset} / {m.method}: {100 * m.identical_rate:.1f}% "
                                                     "identical" for m in ties) + ".", ""]
    n = sum(m.n_samples for m in checked if m.lossless_expected)
    lossy = [m for m in checked if not m.lossless_expected]
    note = (f" ({len(lossy)} sampling or relaxed-acceptance cells are not expected to match token for token)"
            if lossy else "")
    lines = ["## Losslessness", "",
             f"Identical to the target's output: **100%** of greedy outputs ({n} outputs checked){note}.", ""]
    relaxed = [m for m in lossy if "relaxed" in m.method]
    if relaxed:
        lines += ["Relaxed acceptance is lossy by design (MSD); its outputs identical to the target's:", ""]
        lines += [f"- {m.dataset} / {m.method}: {100 * m.identical_rate:.1f}%" for m in relaxed] + [""]
    return lines


def render_report(results_dir: Path, command: str | None = None) -> Path:
    """Write ``report.md``, ``metrics.json`` and ``*.png`` into ``results_dir``; return the md path."""
    plots.pyplot()  # without matplotlib: one line naming the extra, before anything is read or written
    results_dir = Path(results_dir)
    rows, warnings = merge_rows(results_dir)
    metas = read_run_meta(results_dir)
    metrics = all_metrics(rows)
    datasets, methods = datasets_of(rows), methods_of(rows)
    lines = _header(results_dir, command, metas) + _lossless_section(metrics, rows) + audit_section(rows)

    lines += ["## Block efficiency τ (IbED Table 3 layout)", "",
              "τ = tokens per block **including** the bonus/recovered token from the target "
              "(pooled: total tokens / total blocks). Averages are over the datasets of a group.", ""]
    lines += table3(metrics, "tau") + [""]
    lines += ["## Mean accepted length (τ − 1)", "",
              "Draft tokens accepted per block, bonus/recovered token **excluded** "
              "(EAGLE-family convention).", ""]
    lines += table3(metrics, "mean_accepted_length") + [""]

    lines += ["## Speed-up over the target alone", "",
              "measured = Σ baseline wall / Σ method wall over the same samples; predicted = IbED "
              "eq. 2, τ / (γ·T_q/T_p + T_V(γ)/T_p), with T_q at batch = number of views.", ""]
    cell = {(m.dataset, m.method): m for m in metrics}
    lines += _table(["Method"] + datasets, [
        [meth] + [(f"{_fmt(c.speedup_measured)} / {_fmt(c.speedup_predicted)}" if c else "–")
                  for c in (cell.get((d, meth)) for d in datasets)] for meth in methods])
    lines += ["", "(cells: measured / predicted)", ""]

    gamma = max((len(m.acceptance_by_position) for m in metrics), default=0)
    lines += ["## Acceptance rate per draft position", "",
              "P(position i accepted | drafted), pooled over blocks; for a tree, position i is depth i "
              "(a tree drafts deeper than the chain's gamma).", ""]
    lines += _table(["dataset", "method"] + [f"pos {i + 1}" for i in range(gamma)], [
        [m.dataset, m.method] + [_fmt(a) for a in m.acceptance_by_position]
        + ["–"] * (gamma - len(m.acceptance_by_position)) for m in metrics])

    lines += ["", "## Time split (mean seconds per sample)", "", "Speculative methods:", ""]
    keys = ("vision_s", "caption_s", "prefill_target_s", "prefill_draft_s", "draft_s", "verify_s",
            "total_s", "wall_s")
    lines += _table(["dataset", "method", "vision", "caption", "prefill target", "prefill draft",
                     "draft decode", "target verify", "total", "wall"],
                    [[m.dataset, m.method] + [_fmt(m.time_split.get(k), 3) for k in keys] for m in metrics])
    lines += ["", "Target alone (vision and prefill from the latency probe; decode = wall − prefill):", ""]
    bs = {d: baseline_split(rows, d) for d in datasets}
    lines += _table(["dataset", "vision", "prefill", "decode", "wall", "new tokens"],
                    [[d] + [_fmt(b[k], 3) for k in ("vision_s", "prefill_s", "decode_s", "wall_s")]
                     + [_fmt(b["new_tokens"], 1)] for d, b in bs.items() if b])

    lines += [""] + mmspec_section(rows) + batch_section(rows) + conversation_section(rows)
    lats = {d: lat for d in datasets if (lat := latency_of(rows, d)) is not None}
    figs: list[tuple[str, Path]] = []
    if lats:
        batches = sorted({b for lat in lats.values() for b in lat["draft_decode_s"]}, key=int)
        lines += ["", "## Latency (median, ms)", ""]
        lines += _table(["dataset", "T_p", "T_V(γ)"] + [f"T_q b={b}" for b in batches] + ["T_q/T_p (b=1)"], [
            [d, _fmt(1e3 * lat["target_decode_s"]), _fmt(1e3 * lat["target_verify_s"])]
            + [_fmt(1e3 * lat["draft_decode_s"][b]) if b in lat["draft_decode_s"] else "–" for b in batches]
            + [_fmt(lat["draft_decode_s"].get("1", float("nan")) / lat["target_decode_s"], 3)]
            for d, lat in lats.items()])
        figs.append(("Draft per-step latency vs batch size (Fig. 9)",
                     plots.draft_latency_plot(lats, results_dir / "draft_latency.png")))

    if metrics:
        figs.insert(0, ("Block efficiency per method and dataset",
                        plots.block_efficiency_bars(metrics, datasets, methods,
                                                    results_dir / "block_efficiency.png")))
        hists = {d: accepted_over_time(rows, d) for d in datasets}
        figs.append(("Accepted tokens over normalised time (Fig. 11)",
                     plots.accepted_over_time_plot(hists, results_dir / "accepted_over_time.png")))
    upset_lines: list[str] = []
    for d in datasets:
        sets, total = accepted_sets(rows, d)
        if len(sets) >= 2:
            p = plots.upset_plot(sets, total, results_dir / f"upset_{d.replace('/', '_')}.png",  # mmspec/CATEGORY
                                 f"{d}: accepted target tokens per single drafting method")
            figs.append((f"Which target tokens each single method got accepted: {d} (Fig. 5)", p))
            union = set().union(*sets.values())
            upset_lines.append(f"- {d}: {total} target tokens; accepted by any single method "
                               f"{len(union)}; " + ", ".join(
                                   f"only {m}: {len(s - set().union(*(t for n, t in sets.items() if n != m)))}"
                                   for m, s in sets.items()))
    if upset_lines:
        lines += ["", "## Accepted-token overlap of single methods", ""] + upset_lines
    lines += ["", "## Figures", ""]
    for title, p in figs:
        lines += [f"### {title}", "", f"![{title}]({p.name})", ""]
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings]
    out = results_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    (results_dir / "metrics.json").write_text(json.dumps(
        {"metrics": [m.to_dict() for m in metrics], "latency": lats, "batches": batch_metrics(rows),
         "audit": {f"{d}/{m}": v for (d, m), v in audit_summary(rows).items()},
         "baseline_split": {d: b for d, b in bs.items() if b}, "mmspec": mmspec_metrics(rows)}, indent=1))
    return out
