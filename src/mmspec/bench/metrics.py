"""Numbers from benchmark rows: block efficiency, acceptance, speed-ups, time split, losslessness.

Owns every aggregation the report shows. Conventions (DEVELOPERS.md / :mod:`mmspec.stats`):

- ``tau`` (block efficiency) = tokens produced per block *including* the bonus/recovered token
  from the target, pooled over all blocks of a dataset x method (sum tokens / sum blocks).
  ``mean_accepted_length`` = ``tau - 1`` (draft tokens accepted per block, EAGLE convention).
- acceptance by position i = P(draft position i accepted | drafted), pooled over blocks.
- measured speed-up = sum of baseline wall times / sum of method wall times over the samples
  that have both (the same samples, the same target).
- predicted speed-up = IbED eq. 2 with the measured T_p, T_q(batch = number of views), T_V(gamma).
- identical rate = fraction of outputs token-for-token equal to the target's own greedy output;
  anything below 1.0 in a greedy (lossless) run is flagged by :func:`lossless_violations`.

Pure functions over lists of row dicts; no files, no models.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from mmspec.bench.latency import predicted_speedup

DATASET_ORDER = ("chartqa", "textvqa", "vqav2", "hallusionbench", "spot_the_diff", "iedit",
                 "pororosv", "vist", "conversation", "mmspec/general_vqa", "mmspec/text_vqa",
                 "mmspec/image_captioning", "mmspec/chart_vqa", "mmspec/complex_reasoning", "mmspec/multi_turn")
GROUPED_APART = {"mmspec/": "MMSpec"}  # a benchmark's datasets (by prefix) averaged as one group, whatever their images
METHOD_ORDER = ("M", "T", "C", "P", "MT", "MC", "MTC", "MTCP")
SPEC_SPLIT_KEYS = ("vision_s", "caption_s", "prefill_target_s", "prefill_draft_s", "draft_s",
                   "verify_s", "total_s")


def _get(block: Any, name: str) -> Any:
    return block[name] if isinstance(block, dict) else getattr(block, name)


def accepted_flags(blocks: Iterable[Any]) -> list[int]:
    """Per output position: 1 if it was an accepted draft token, 0 if the target produced it.

    A block's first min(n_accepted, n_emitted) emitted tokens are accepted drafts; its remaining
    emitted token (if any) is the recovered/bonus token from the target.
    """
    flags: list[int] = []
    for b in blocks:
        n_emit, n_acc = int(_get(b, "n_emitted")), int(_get(b, "n_accepted"))
        k = min(n_acc, n_emit)
        flags += [1] * k + [0] * (n_emit - k)
    return flags


def _order(names: Iterable[str], preferred: tuple[str, ...]) -> list[str]:
    names = set(names)
    return [n for n in preferred if n in names] + sorted(names - set(preferred))


def datasets_of(rows: list[dict]) -> list[str]:
    return _order((r["dataset"] for r in rows), DATASET_ORDER)


def methods_of(rows: list[dict]) -> list[str]:
    return _order((r["method"] for r in rows if r["kind"] == "spec"), METHOD_ORDER)


def n_images_of(rows: list[dict], dataset: str) -> int:
    ns = [r.get("n_images", 0) for r in rows if r["dataset"] == dataset and "n_images" in r]
    return statistics.mode(ns) if ns else 0


def latency_of(rows: list[dict], dataset: str) -> dict | None:
    """Median over ranks of a dataset's latency rows (T_p, T_V, T_q per batch size, ...)."""
    lats = [r for r in rows if r["kind"] == "latency" and r["dataset"] == dataset]
    if not lats:
        return None
    med = lambda key: statistics.median(r[key] for r in lats)  # noqa: E731
    batches = sorted({b for r in lats for b in r["draft_decode_s"]}, key=int)
    return {
        "target_decode_s": med("target_decode_s"),
        "target_verify_s": med("target_verify_s"),
        "target_vision_s": statistics.median((r.get("target_vision_s") or 0.0) for r in lats),
        "target_prefill_s": med("target_prefill_s"),
        "draft_decode_s": {b: statistics.median(r["draft_decode_s"][b] for r in lats
                                                if b in r["draft_decode_s"]) for b in batches},
        "gamma": lats[0].get("gamma"),
    }


@dataclass
class MethodMetrics:
    """One dataset x method cell."""

    dataset: str
    method: str
    n_views: int
    n_images: int
    n_samples: int
    tau: float  # block efficiency, bonus/recovered token included
    mean_accepted_length: float  # tau - 1
    tau_sample_mean: float  # mean over samples of each sample's tau
    acceptance_by_position: list[float]
    speedup_measured: float | None
    speedup_predicted: float | None
    identical_rate: float | None  # None when no baseline to compare with
    lossless_expected: bool  # greedy run with exact acceptance: identical_rate must be 1.0 (relaxed is lossy)
    time_split: dict[str, float] = field(default_factory=dict)  # mean seconds per sample

    def to_dict(self) -> dict:
        return asdict(self)


def _pooled_acceptance(rows: list[dict], gamma: int) -> list[float]:
    hits, tries = [0] * gamma, [0] * gamma
    for r in rows:
        for b in (r.get("stats") or {}).get("blocks", []):
            for i in range(min(int(b["n_drafted"]), gamma)):
                tries[i] += 1
                hits[i] += int(i < int(b["n_accepted"]))
    return [h / t if t else 0.0 for h, t in zip(hits, tries)]


def method_metrics(rows: list[dict], dataset: str, method: str) -> MethodMetrics | None:
    spec = [r for r in rows if r["kind"] == "spec" and r["dataset"] == dataset and r["method"] == method]
    if not spec:
        return None
    base = {r["uid"]: r for r in rows if r["kind"] == "baseline" and r["dataset"] == dataset}
    gamma = int(spec[0].get("gamma") or (spec[0].get("stats") or {}).get("gamma", 5))
    n_tok = sum(sum(int(b["n_emitted"]) for b in r["stats"]["blocks"]) for r in spec)
    n_blk = sum(len(r["stats"]["blocks"]) for r in spec)
    tau = n_tok / n_blk if n_blk else 0.0
    per_sample = [r["stats"].get("tau", 0.0) for r in spec if r["stats"]["blocks"]]
    paired = [(base[r["uid"]]["wall_s"], r["wall_s"]) for r in spec if r["uid"] in base]
    measured = (sum(b for b, _ in paired) / sum(s for _, s in paired)) if paired else None
    n_views = len(spec[0].get("views") or [method])
    lat = latency_of(rows, dataset)
    predicted = None
    stats0 = spec[0].get("stats") or {}
    chain = str(stats0.get("tree", "chain")).startswith("chain") and bool(spec[0].get("views"))
    if lat is not None and chain:  # eq. 2 is the chain's formula, for a token-level draft
        tq = lat["draft_decode_s"].get(str(n_views)) or lat["draft_decode_s"].get("1")
        if tq is not None:
            predicted = predicted_speedup(tau, gamma, tq, lat["target_decode_s"], lat["target_verify_s"])
    checked = [r["token_ids"] == base[r["uid"]]["token_ids"] for r in spec if r["uid"] in base]
    split = {k: statistics.fmean(float(r["stats"].get(k) or 0.0) for r in spec) for k in SPEC_SPLIT_KEYS}
    split["wall_s"] = statistics.fmean(r["wall_s"] for r in spec)
    return MethodMetrics(
        dataset=dataset, method=method, n_views=n_views, n_images=n_images_of(rows, dataset),
        n_samples=len(spec), tau=tau, mean_accepted_length=tau - 1.0 if n_blk else 0.0,
        tau_sample_mean=statistics.fmean(per_sample) if per_sample else 0.0,
        acceptance_by_position=_pooled_acceptance(spec, gamma),
        speedup_measured=measured, speedup_predicted=predicted,
        identical_rate=(sum(checked) / len(checked)) if checked else None,
        lossless_expected=all(expects_identical(r) for r in spec),
        time_split=split,
    )


def all_metrics(rows: list[dict]) -> list[MethodMetrics]:
    out = []
    for d in datasets_of(rows):
        for m in methods_of(rows):
            mm = method_metrics(rows, d, m)
            if mm is not None:
                out.append(mm)
    return out


def baseline_split(rows: list[dict], dataset: str) -> dict[str, float | None] | None:
    """Target-alone time split (mean seconds a sample): vision, prefill (text+images), decode."""
    base = [r for r in rows if r["kind"] == "baseline" and r["dataset"] == dataset]
    if not base:
        return None
    wall = statistics.fmean(r["wall_s"] for r in base)
    lat = latency_of(rows, dataset)
    new_tokens = statistics.fmean(len(r["token_ids"]) for r in base)
    if lat is None:  # no latency probe: only the wall time is known
        return {"vision_s": None, "prefill_s": None, "decode_s": None, "wall_s": wall,
                "new_tokens": new_tokens}
    vision, prefill = lat["target_vision_s"], lat["target_prefill_s"]
    return {"vision_s": vision, "prefill_s": max(prefill - vision, 0.0),
            "decode_s": max(wall - prefill, 0.0), "wall_s": wall, "new_tokens": new_tokens}


def groups(metrics: list[MethodMetrics]) -> dict[int | str, list[str]]:
    """Datasets grouped by number of images (Table 3: n = 1 / 2 / 5), in dataset order; a benchmark of
    :data:`GROUPED_APART` (MMSpec's categories) is a group of its own, named, after them."""
    g: dict[int | str, list[str]] = defaultdict(list)
    for m in metrics:
        key = next((name for prefix, name in GROUPED_APART.items() if m.dataset.startswith(prefix)), m.n_images)
        if m.dataset not in g[key]:
            g[key].append(m.dataset)
    return dict(sorted(g.items(), key=lambda kv: (isinstance(kv[0], str), kv[0])))


def expects_identical(row: dict) -> bool:
    """Must this spec row equal the target's greedy output token for token? Yes for greedy decoding
    with exact acceptance; not for sampling, nor for MSD's relaxed acceptance (lossy by design)."""
    return (float(row.get("temperature", 0.0) or 0.0) <= 0
            and (row.get("stats") or {}).get("acceptance", "exact") == "exact")


def lossless_violations(metrics: list[MethodMetrics]) -> list[MethodMetrics]:
    return [m for m in metrics if m.lossless_expected and m.identical_rate is not None
            and m.identical_rate < 1.0]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accepted_sets(rows: list[dict], dataset: str) -> tuple[dict[str, set], int]:
    """For each single-view method: the set of (uid, position) target tokens it got accepted.

    Positions index the baseline output; a method's positions count only up to its first
    divergence from the baseline. Returns (sets, number of baseline tokens).
    """
    base = {r["uid"]: r["token_ids"] for r in rows if r["kind"] == "baseline" and r["dataset"] == dataset}
    sets: dict[str, set] = {}
    for r in rows:
        if r["kind"] != "spec" or r["dataset"] != dataset or len(r.get("views") or [0, 0]) != 1:
            continue
        if r["uid"] not in base:
            continue
        lim = _common_prefix(r["token_ids"], base[r["uid"]])
        acc = r.get("accepted") or accepted_flags(r["stats"]["blocks"])
        s = sets.setdefault(r["method"], set())
        s.update((r["uid"], i) for i, f in enumerate(acc[:lim]) if f)
    ordered = {m: sets[m] for m in _order(sets, METHOD_ORDER)}
    return ordered, sum(len(t) for t in base.values())


def accepted_over_time(rows: list[dict], dataset: str, bins: int = 10) -> dict[str, list[int]]:
    """Fig. 11: per method, accepted-token counts in ``bins`` bins of normalised time (pos / len)."""
    out: dict[str, list[int]] = {}
    for r in rows:
        if r["kind"] != "spec" or r["dataset"] != dataset:
            continue
        acc = r.get("accepted") or accepted_flags(r["stats"]["blocks"])
        hist = out.setdefault(r["method"], [0] * bins)
        n = len(acc)
        for i, f in enumerate(acc):
            if f:
                hist[min(int(bins * i / n), bins - 1)] += 1
    return {m: out[m] for m in _order(out, METHOD_ORDER)}
