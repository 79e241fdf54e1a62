"""The report sections of issue 37: batched throughput and latency, conversations, the half-precision audit.

Owns the numbers and the markdown of three sections of ``report.md`` (:mod:`mmspec.bench.report`
places them), from rows only:

- **Batches** (``batch`` / ``batch_out`` rows of :mod:`mmspec.bench.batched`), pooled over the
  datasets of the run: per B and decoder, throughput = Σ new tokens / Σ batch wall time, and
  per-request latency p50 / p90 (linear interpolation between order statistics, numpy's default);
  mmspec's throughput ÷ the target's batched generate at the same B; the first B where the best
  method's ratio falls below 1 ("drafting stops paying"); each output against the target's solo
  greedy output.
- **Conversations** (spec rows with ``turn``): τ per turn, prompt tokens reused on turn 2
  (``GenerationStats.prompt_tokens_reused``, 0 where the decoder keeps no cache) and the target's
  prefill time per turn, beside an estimate of a fresh turn-2 prefill (turn 1's prefill time per
  prompt token × turn 2's prompt length).
- **Audit** (rows with ``audit_class``, :mod:`mmspec.bench.audit`): near-ties and bugs per cell, the
  target's own batched-vs-solo differences kept apart (they are not mmspec's).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from mmspec.bench.audit import NEAR_TIE_TOLERANCE, audit_summary

TARGET = "target"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def batch_metrics(rows: list[dict]) -> list[dict]:
    """One dict per (batch size, decoder), pooled over datasets: ``batch_size``, ``method``,
    ``n_requests``, ``new_tokens``, ``wall_s``, ``tokens_per_s``, ``p50_s``, ``p90_s``,
    ``identical_to_solo`` (count), ``checked``, ``tau`` (methods) and ``vs_target`` (throughput
    ÷ the target's at the same B)."""
    timing: dict[tuple[int, str], list[dict]] = defaultdict(list)
    outs: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "batch":
            timing[(int(r["batch_size"]), r["method"])].append(r)
        elif r.get("kind") == "batch_out":
            outs[(int(r["batch_size"]), r["method"])].append(r)
    out = []
    for (size, who), ts in sorted(timing.items(), key=lambda kv: (kv[0][0], kv[0][1] != TARGET, kv[0][1])):
        wall, toks = sum(t["wall_s"] for t in ts), sum(t["new_tokens"] for t in ts)
        lats = [x for t in ts for x in t["latency_s"]]
        fins = [x for t in ts for x in t.get("finish_s", t["latency_s"])]
        o = outs.get((size, who), [])
        checked = [r["identical_to_solo"] for r in o if r.get("identical_to_solo") is not None]
        blocks = [b for r in o for b in (r.get("stats") or {}).get("blocks", [])]
        out.append({"batch_size": size, "method": who, "n_requests": len(lats), "new_tokens": toks, "wall_s": wall,
                    "tokens_per_s": toks / wall if wall > 0 else None, "p50_s": percentile(lats, 0.5),
                    "p90_s": percentile(lats, 0.9), "p50_finish_s": percentile(fins, 0.5), "identical_to_solo": sum(checked), "checked": len(checked),
                    "tau": (sum(int(b["n_emitted"]) for b in blocks) / len(blocks)) if blocks else None})
    target_tps = {m["batch_size"]: m["tokens_per_s"] for m in out if m["method"] == TARGET}
    for m in out:
        t = target_tps.get(m["batch_size"])
        m["vs_target"] = (m["tokens_per_s"] / t) if (t and m["tokens_per_s"] is not None) else None
    return out


def stops_paying(metrics: list[dict]) -> int | None:
    """The smallest B where no method beats the target's batched generate in throughput (None: always pays)."""
    best: dict[int, float] = {}
    for m in metrics:
        if m["method"] != TARGET and m["vs_target"] is not None:
            best[m["batch_size"]] = max(best.get(m["batch_size"], 0.0), m["vs_target"])
    return next((b for b in sorted(best) if best[b] < 1.0), None)


def fmt(v: float | None, nd: int = 2) -> str:
    """A figure for a report's table ("–" where there is none)."""
    return "–" if v is None else f"{v:.{nd}f}"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def batch_section(rows: list[dict]) -> list[str]:
    """The "Batches" section (empty when the run had no batched pass)."""
    ms = batch_metrics(rows)
    if not ms:
        return []
    lines = ["## Batches: mmspec vs the target's batched greedy generate", "",
             ("Same prompts, same run. throughput = new tokens of the whole batch / its wall time (pooled over "
             "batches and datasets); latency = per request, from its batch's start until its result returns (a "
             "static batch returns all together); finish = when a request's last token was committed (what a "
             "streaming client of the scheduler waits; the batch wall for the target); ×target = throughput ÷ the "
             "target's at the same B. "
             "identical = outputs equal to the target's **solo** greedy output."), ""]
    lines += md_table(["B", "decoder", "requests", "tokens/s", "×target", "p50 latency s", "p90 latency s",
                     "p50 finish s", "τ", "identical to solo"],
                    [[str(m["batch_size"]), m["method"], str(m["n_requests"]), fmt(m["tokens_per_s"], 1),
                      fmt(m["vs_target"]), fmt(m["p50_s"], 3), fmt(m["p90_s"], 3), fmt(m["p50_finish_s"], 3), fmt(m["tau"]),
                      f"{m['identical_to_solo']}/{m['checked']}"] for m in ms])
    stop = stops_paying(ms)
    lines += ["", (f"Drafting stops paying (best method below the target's throughput) at: "
              f"**{'B = ' + str(stop) if stop else 'no B of this run'}**.")]
    by = {(m["batch_size"], m["method"]): m for m in ms}
    t1 = by.get((1, TARGET))
    if t1 is None:  # B = 1 not in the sweep: the solo baseline rows are the target at batch 1
        walls = [r["wall_s"] for r in rows if r.get("kind") == "baseline"]
        t1 = {"p50_s": percentile(walls, 0.5)} if walls else None
    for m in (x for x in ms if x["batch_size"] == 8 and x["method"] != TARGET):
        p50_ok = None if t1 is None or m["p50_s"] is None else m["p50_s"] <= t1["p50_s"]
        lines.append(f"- goal at B = 8, {m['method']}: throughput ×target {fmt(m['vs_target'])} (goal ≥ 1.50: "
                     f"{'met' if (m['vs_target'] or 0) >= 1.5 else 'NOT met'}); p50 {fmt(m['p50_s'], 3)} s vs the "
                     f"target's p50 at B = 1 {fmt(t1 and t1['p50_s'], 3)} s (goal ≤: "
                     f"{'–' if p50_ok is None else 'met' if p50_ok else 'NOT met'})")
    differ = [m for m in ms if m["method"] == TARGET and m["identical_to_solo"] < m["checked"]]
    if differ:
        lines += ["", "The target's own batched generate differs from its solo output for: " + ", ".join(
            f"B = {m['batch_size']}: {m['checked'] - m['identical_to_solo']}/{m['checked']}" for m in differ)
            + " (left padding changes the shapes it rounds in; the audit below gives the margins)."]
    return lines + [""]


def tau(rows: list[dict]) -> float | None:
    """Pooled block efficiency of spec rows (tokens / blocks, the bonus token included)."""
    blocks = [b for r in rows for b in r["stats"]["blocks"]]
    return sum(int(b["n_emitted"]) for b in blocks) / len(blocks) if blocks else None


def mean(rows: list[dict], f) -> float | None:
    return statistics.fmean(f(r) for r in rows) if rows else None


def conversation_section(rows: list[dict]) -> list[str]:
    """τ per turn and the turn-2 prefill against a fresh one (empty without conversation rows)."""
    spec = [r for r in rows if r.get("kind") == "spec" and r.get("turn")
            and not r["dataset"].startswith("mmspec/")]  # MMSpec's turns: mmspec.bench.mmspec_report
    if not spec:
        return []
    base = {(r["dataset"], r["uid"]): r for r in rows if r.get("kind") == "baseline"}
    lines = ["## Conversations (two turns)", "",
             ("Turn 2 = turn 1's prompt + the target's own turn-1 answer + a new question about the same image. "
             "τ per turn; reused = prompt tokens the decoder took from its cache of turn 1 "
             "(GenerationStats.prompt_tokens_reused); fresh prefill (est.) = turn 1's target prefill per prompt "
             "token × turn 2's prompt length."), ""]
    table = []
    for (dataset, method) in sorted({(r["dataset"], r["method"]) for r in spec}):
        cell = [r for r in spec if r["dataset"] == dataset and r["method"] == method]
        t1, t2 = ([r for r in cell if r["turn"] == k] for k in (1, 2))

        pre1 = mean(t1, lambda r: float(r["stats"].get("prefill_target_s") or 0.0))
        per_tok = (sum(float(r["stats"].get("prefill_target_s") or 0.0) for r in t1)
                   / max(1, sum(int(r.get("input_len") or 0) for r in t1))) if t1 else None
        fresh = mean(t2, lambda r, k=per_tok: k * int(r.get("input_len") or 0)) if per_tok is not None else None
        pre2 = mean(t2, lambda r: float(r["stats"].get("prefill_target_s") or 0.0))
        reused = mean(t2, lambda r: int(r["stats"].get("prompt_tokens_reused", 0) or 0))
        same = sum(r["token_ids"] == base[(r["dataset"], r["uid"])]["token_ids"] for r in t2
                   if (r["dataset"], r["uid"]) in base)
        table.append([dataset, method, fmt(tau(t1)), fmt(tau(t2)), fmt(mean(t2, lambda r: int(r.get("input_len") or 0)), 0),
                      fmt(reused, 1), fmt(pre1, 4), fmt(pre2, 4), fmt(fresh, 4),
                      fmt(pre2 / fresh if pre2 is not None and fresh else None), f"{same}/{len(t2)}"])
    lines += md_table(["dataset", "method", "τ turn 1", "τ turn 2", "turn-2 prompt tokens", "reused", "prefill t1 s",
                     "prefill t2 s", "fresh t2 s (est.)", "t2 ÷ fresh", "turn 2 identical"], table)
    return lines + [""]


def audit_section(rows: list[dict]) -> list[str]:
    """Near-ties vs bugs per cell; loud when any difference of mmspec's is not a near-tie."""
    summ = audit_summary(rows)
    if not summ:
        return []
    mine = {k: v for k, v in summ.items() if not k[1].startswith(TARGET + "@")}
    theirs = {k: v for k, v in summ.items() if k[1].startswith(TARGET + "@")}
    bugs = sum(v["bug"] + v["unaudited"] for v in mine.values())
    tol = ", ".join(f"{k} {v:.1e}" if v else f"{k} 0 (exact)" for k, v in NEAR_TIE_TOLERANCE.items())
    lines = [f"## {'⚠️ LOSSLESSNESS BUGS: ' + str(bugs) + ' difference(s) are not near-ties ⚠️' if bugs else 'Half-precision audit'}",
             "", ("Each greedy output unlike the target's own: the first differing position and the target's margin "
             "p(own) − p(ours) there (its logits given the common prefix). A near-tie is |margin| ≤ the dtype's "
             f"tolerance ({tol}; mmspec.bench.audit says why); anything else is a bug."), ""]
    for title, cells in (("mmspec", mine), ("the target's batched generate vs its solo output", theirs)):
        if not cells:
            continue
        lines += [f"{title}:", ""]
        lines += md_table(["dataset", "decoder", "differ", "near-ties", "bugs", "unaudited", "margins (position: margin)"],
                        [[d, m, str(v["differ"]), str(v["near_tie"]), str(v["bug"]), str(v["unaudited"]),
                          "; ".join(f"{e['uid']}@{e['position']}: {fmt(e['margin'], 5)}" for e in v["entries"][:6])]
                         for (d, m), v in sorted(cells.items())])
        lines.append("")
    return lines
