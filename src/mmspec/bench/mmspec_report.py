"""The MMSpec section of ``report.md``: MAT and walltime speed-up per category and overall, the
prefix cache's reuse on turns 2+, and the speed-up at each batch size, in MMSpec's own terms.

Owns the numbers and the markdown of that section (:mod:`mmspec.bench.report` places it), from
rows only (MMSpec's rows are those of datasets ``mmspec/{category}``, :mod:`mmspec.bench.datasets`):

- **MAT** (MMSpec's Mean Accepted Tokens): tokens per verification step, the target's own token
  (bonus or recovered) included, pooled over every turn of every sample of a cell: Σ tokens / Σ
  blocks = mmspec's **τ**; ``MAT − 1`` is the mean accepted length. (docs/bench.md says how this
  matches MMSpec's and Spec-Bench's counting.)
- **speed-up** = Σ the target's own wall time / Σ the method's, over the same turns (each turn a
  ``generate``; the target re-prefills the whole conversation every turn, as MMSpec's baseline does;
  mmspec's decoders keep the earlier turns in their prefix cache).
- **reused** = Σ prompt tokens the decoder took from its prefix cache / Σ prompt tokens, over the
  turns 2+ (``GenerationStats.prompt_tokens_reused``; turn 1 has no earlier turn to reuse).
- **batches**: per B, a method's throughput ÷ the target's batched generate at the same B (the
  :mod:`mmspec.bench.batch_report` numbers, MMSpec's rows only), B = 1, 8, 32 side by side.
"""

from __future__ import annotations

from mmspec.bench.batch_report import TARGET, batch_metrics, fmt, md_table

PREFIX = "mmspec/"
CATEGORY_ORDER = ("general_vqa", "text_vqa", "image_captioning", "chart_vqa", "complex_reasoning", "multi_turn")


def is_mmspec(dataset: str) -> bool:
    return dataset == "mmspec" or dataset.startswith(PREFIX)


def categories(rows: list[dict]) -> list[str]:
    """The MMSpec categories of ``rows``, in the paper's order, others after."""
    found = {r["dataset"][len(PREFIX):] for r in rows if r.get("dataset", "").startswith(PREFIX)}
    return [c for c in CATEGORY_ORDER if c in found] + sorted(found - set(CATEGORY_ORDER))


def cell(rows: list[dict], method: str, category: str | None = None) -> dict | None:
    """MAT, speed-up, identical outputs and turn-2+ reuse of one method in one category (None: overall)."""
    def mine(r: dict) -> bool:
        d = r.get("dataset", "")
        return d.startswith(PREFIX) and (category is None or d == PREFIX + category)

    spec = [r for r in rows if r.get("kind") == "spec" and r["method"] == method and mine(r)]
    if not spec:
        return None
    base = {(r["dataset"], r["uid"]): r for r in rows if r.get("kind") == "baseline" and mine(r)}
    blocks = [b for r in spec for b in (r.get("stats") or {}).get("blocks", [])]
    paired = [(base[(r["dataset"], r["uid"])]["wall_s"], r["wall_s"]) for r in spec if (r["dataset"], r["uid"]) in base]
    later = [r for r in spec if int(r.get("turn") or 1) > 1]
    prompt = sum(int(r.get("input_len") or 0) for r in later)
    reused = sum(int((r.get("stats") or {}).get("prompt_tokens_reused") or 0) for r in later)
    same = [r["token_ids"] == base[(r["dataset"], r["uid"])]["token_ids"] for r in spec if (r["dataset"], r["uid"]) in base]
    return {"method": method, "category": category or "overall", "turns": len(spec),
            "samples": len({r["uid"].split("/t")[0] for r in spec}),
            "mat": sum(int(b["n_emitted"]) for b in blocks) / len(blocks) if blocks else None,
            "speedup": sum(b for b, _ in paired) / sum(s for _, s in paired) if paired else None,
            "identical": sum(same), "checked": len(same),
            "later_turns": len(later), "later_prompt_tokens": prompt, "reused_tokens": reused,
            "reused_share": reused / prompt if prompt else None}


def mmspec_metrics(rows: list[dict]) -> dict:
    """Every number of the section: per method, each category's cell and the overall one; the batches."""
    methods = list(dict.fromkeys(r["method"] for r in rows if r.get("kind") == "spec" and is_mmspec(r["dataset"])))
    cats = categories(rows)
    cells = {m: {c: cell(rows, m, c) for c in cats} | {"overall": cell(rows, m)} for m in methods}
    batches = batch_metrics([r for r in rows if is_mmspec(r.get("dataset", ""))])
    return {"categories": cats, "methods": methods, "cells": cells, "batches": batches}


def mmspec_section(rows: list[dict]) -> list[str]:
    """The "MMSpec" section (empty without MMSpec rows)."""
    m = mmspec_metrics(rows)
    if not m["methods"]:
        return []
    cats, cells = m["categories"], m["cells"]
    lines = ["## MMSpec (its table: MAT and walltime speed-up per category)", "",
             ("MAT = tokens per verification step, the target's own (bonus/recovered) token included = τ, pooled "
              "over every turn; speed-up = Σ the target's own wall time / Σ the method's over the same turns (each "
              "turn asked after the target's own earlier answers; the target re-prefills the conversation every turn, "
              "mmspec reuses its prefix cache). Cells: MAT / speed-up. docs/bench.md: how to put this row beside the "
              "paper's."), ""]
    lines += md_table(["Method"] + cats + ["Overall"],
                    [[meth] + [(f"{fmt(c['mat'])} / {fmt(c['speedup'])}x" if c else "–")
                               for c in (cells[meth][k] for k in (*cats, "overall"))] for meth in m["methods"]])
    lines += ["", ("Every turn against the target's own greedy output, and the prefix cache on turns 2+: reused = "
                   "prompt tokens taken from the cache of the conversation's earlier turns / all their prompt tokens."),
              ""]
    lines += md_table(["Method", "samples", "turns", "identical to the target", "turns 2+", "their prompt tokens",
                     "reused", "reused share"],
                    [[meth, str(c["samples"]), str(c["turns"]), f"{c['identical']}/{c['checked']}", str(c["later_turns"]),
                      str(c["later_prompt_tokens"]), str(c["reused_tokens"]),
                      "–" if c["reused_share"] is None else f"{100 * c['reused_share']:.1f}%"]
                     for meth in m["methods"] if (c := cells[meth]["overall"])])
    lines += _batch_table(m["batches"], {meth: cells[meth]["overall"] for meth in m["methods"]})
    return lines + [""]


def _batch_table(batches: list[dict], solo: dict[str, dict | None]) -> list[str]:
    """Speed-up per B; without a batched pass at B = 1, its column is the one-at-a-time rows' (generate
    against the target's own generate: the same ratio for one request)."""
    sizes = sorted({b["batch_size"] for b in batches})
    if not sizes:
        return []
    by = {(b["batch_size"], b["method"]): b for b in batches}
    methods = list(dict.fromkeys(b["method"] for b in batches if b["method"] != TARGET))
    lines = ["", ("Concurrency as MMSpec measures it: each turn of every sample B at a time (turn 1 of all, then turn 2, "
                  "...); cells: throughput ÷ the target's batched generate at the same B (τ; outputs identical to "
                  "the target's solo ones)."
                  + ("" if 1 in sizes else " B = 1: the one-at-a-time rows (speed-up over the target's own generate).")),
             ""]
    head = ([] if 1 in sizes else ["B = 1 (one at a time)"]) + [f"B = {s}" for s in sizes]
    rows = []
    for meth in methods:
        c1 = solo.get(meth)
        first = [] if 1 in sizes else [f"{fmt(c1['speedup'])}x (τ {fmt(c1['mat'])}; {c1['identical']}/{c1['checked']})"
                                       if c1 else "–"]
        rows.append([meth] + first + [
            (f"{fmt(c['vs_target'])}x (τ {fmt(c['tau'])}; {c['identical_to_solo']}/{c['checked']})" if c else "–")
            for c in (by.get((s, meth)) for s in sizes)])
    return lines + md_table(["Method"] + head, rows)
