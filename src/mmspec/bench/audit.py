"""The losslessness audit: where a greedy output differs from the target's own, and by how much.

Owns, for one differing output: the first position where it leaves the target's own greedy
output, and the target's **probability margin** there, ``p_target(own) - p_target(ours)``, from the
target's logits at that position given the common prefix (one extra target forward, made only for
differing rows); and the classification of a difference as a **near-tie** or a **bug**.

Why a tolerance, and which one. In bfloat16/float16 a verify forward over several tokens and the
one-token decode of ``target.generate`` round differently, so two tokens whose logits lie within
that rounding noise can swap places without any bug. For two tokens with logit gap ``g`` the
probability margin is ``p_b (e^g - 1) <= tanh(g / 2) <= g / 2``, so a margin below the dtype's
machine epsilon (:data:`NEAR_TIE_TOLERANCE`: bfloat16 2^-7 = 7.8e-3, float16 2^-10 = 9.8e-4) means
logits within about two units in the last place of a logit of magnitude ~1: rounding noise. The
choice is conservative: at larger logits the real noise is larger, so a few true near-ties may be
flagged as bugs, never the other way round. **float32 has tolerance 0: every float32 difference is
a bug** (mmspec is exact there). The logit gap is recorded too, for a reader who wants a
scale-aware view. Relaxed acceptance and sampling are not audited (not expected to match).

Pure functions, except :func:`audit_difference`, which runs the one target forward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

NEAR_TIE_TOLERANCE: dict[str, float] = {"float32": 0.0, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def first_difference(own: list[int], ours: list[int]) -> int | None:
    """The first position where two outputs differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(own, ours)):
        if a != b:
            return i
    return None if len(own) == len(ours) else min(len(own), len(ours))


def margin_from_logits(logits: torch.Tensor, own: int, ours: int) -> dict[str, float]:
    """``logits`` [vocab] of the target at the differing position -> p(own), p(ours), their margin
    p(own) - p(ours) and the logit gap, computed in float64 (the audit adds no rounding of its own)."""
    z = logits.detach().to(torch.float64)  # [vocab]
    p = torch.softmax(z, dim=-1)  # [vocab]
    return {"p_own": float(p[own]), "p_ours": float(p[ours]), "margin": float(p[own] - p[ours]),
            "logit_gap": float(z[own] - z[ours]), "own_is_argmax": bool(int(z.argmax()) == own)}


@torch.inference_mode()
def audit_difference(target: Any, inputs: dict[str, torch.Tensor], own: list[int], ours: list[int]) -> dict | None:
    """Audit one output against the target's own: None when equal, else ``{"position", "own", "ours",
    "p_own", "p_ours", "margin", "logit_gap", "own_is_argmax"}``. One target forward over the prompt
    (``inputs``: the processor's tensors for one prompt, ``input_ids`` [1, L]) + the common prefix.
    When one output stops where the other goes on (``own`` or ``ours`` is None there), there is no
    token pair: ``margin`` is None (a bug by :func:`classify`)."""
    k = first_difference(own, ours)
    if k is None:
        return None
    entry: dict[str, Any] = {"position": k, "own": own[k] if k < len(own) else None,
                             "ours": ours[k] if k < len(ours) else None}
    if entry["own"] is None or entry["ours"] is None:
        return {**entry, "p_own": None, "p_ours": None, "margin": None, "logit_gap": None, "own_is_argmax": None}
    ids = inputs["input_ids"].reshape(1, -1)  # [1, L]
    prefix = torch.tensor([own[:k]], dtype=ids.dtype, device=ids.device)  # [1, k]
    full = torch.cat([ids, prefix], dim=1)  # [1, L + k]
    extra = {n: v for n, v in inputs.items() if n not in ("input_ids", "attention_mask")}
    out = target(input_ids=full, attention_mask=torch.ones_like(full), **extra)
    return {**entry, **margin_from_logits(out.logits[0, -1], entry["own"], entry["ours"])}


def classify(audit: dict | None, dtype: str, tolerance: float | None = None) -> str | None:
    """"near-tie" (|margin| <= the dtype's tolerance, never in float32), "bug", or None (no audit).
    ``tolerance``: another bound on the margin than the dtype's (``mmspec audit --tolerance``)."""
    if not audit:
        return None
    margin = audit.get("margin")
    tol = NEAR_TIE_TOLERANCE.get(str(dtype), 0.0) if tolerance is None else tolerance
    return "near-tie" if margin is not None and tol > 0 and abs(margin) <= tol else "bug"


def audit_summary(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (dataset, method) cell of rows holding an ``audit``: ``{"differ", "near_tie", "bug",
    "unaudited", "entries"}``; ``differ`` counts greedy exact-acceptance rows unlike the reference
    (spec rows vs the target's solo output; batch rows too, under their own method label)."""
    out: dict[tuple[str, str], dict] = defaultdict(lambda: {"differ": 0, "near_tie": 0, "bug": 0, "unaudited": 0,
                                                            "entries": []})
    for r in rows:
        if "audit_class" not in r and "audit" not in r:
            continue
        cell = out[(r["dataset"], r.get("audit_label") or r["method"])]
        cell["differ"] += 1
        cls = r.get("audit_class")
        key = {"near-tie": "near_tie", "bug": "bug"}.get(cls or "", "unaudited")
        cell[key] += 1
        a = r.get("audit") or {}
        cell["entries"].append({"uid": r["uid"], "position": a.get("position"), "margin": a.get("margin"),
                                "logit_gap": a.get("logit_gap"), "class": cls or "unaudited",
                                "dtype": r.get("dtype")})
    return dict(out)


def near_tie_only(summary: dict[tuple[str, str], dict], dataset: str, method: str) -> bool:
    """Every difference of this cell was audited and is a near-tie (so not a lossless violation)."""
    cell = summary.get((dataset, method))
    return bool(cell) and cell["differ"] == cell["near_tie"]
