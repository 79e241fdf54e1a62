"""The batched pass of ``mmspec bench run --batch-size B``: B requests at a time, mmspec vs the target.

Owns the order of work and the rows of the batched comparison. For each B > 1 of the run (and
B = 1 when it is listed beside a larger one, so the curve has its first point measured the same
way), a dataset's samples (this run's, turn 2 of each conversation included) are cut into
consecutive batches of B by turn (:func:`turn_batches`: turn 1 of every sample, then turn 2, ...; the
last batch of a turn may be smaller). Each batch is decoded by the target's own
batched greedy ``generate`` (left-padded, one processor call: label ``target``) and by
``SpecDecoder.generate_batch`` for each method, on the same prompts, in the same run.

Rows (keys stay unique through the uid; every row carries ``batch_size``):

- ``batch_out``: one per request and decoder, in the sample's own dataset (an MMSpec category):
  ``uid`` = ``{sample uid}@b{B}``, ``sample_uid``,
  ``method`` (``target`` or the method), ``token_ids``, ``text``, ``latency_s``, ``stats`` (methods),
  ``identical_to_solo`` (token-for-token equal to the target's solo greedy output, the baseline
  row). A method's request unlike it is a lossless failure (audited as the solo rows are); the
  target's own batched output unlike its solo output is **reported, never hidden**: a left-padded
  batch can round differently from a solo run (``target_batch_differs`` in the summary).
- ``batch``: one per batch and decoder: ``uid`` = ``b{B}/{index}``, ``n_requests``, ``new_tokens``,
  ``wall_s``, ``tokens_per_s`` (new tokens of the whole batch / its wall time) and
  ``latency_s`` (per request: the time from the batch's start until its result is returned; a
  static batch returns every result together, so each request's latency is the batch's wall);
  ``finish_s`` (per request: when its last token was committed, ``GenerationStats.total_s`` of a
  method's request, what a streaming client of :class:`mmspec.batch.BatchScheduler` would wait;
  the batch's wall for the target, whose ``generate`` keeps finished rows to the end).

Resumable as the rest: a batch whose ``batch`` row is on disk is skipped; its ``batch_out`` rows
are written before its ``batch`` row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from mmspec.bench.datasets import BenchSample

if TYPE_CHECKING:
    from mmspec.bench.config import BenchConfig, RankInfo
    from mmspec.bench.store import RowWriter

TARGET = "target"


class RunState(Protocol):
    """What the batched pass needs of the runner's loop state (``mmspec.bench.runner`` passes its
    own; this module never imports the runner, which imports it)."""

    cfg: BenchConfig
    rank: RankInfo
    writer: RowWriter
    summary: Any  # the runner's RunSummary: skipped, written, target_batch_differs
    baselines: dict[tuple[str, str], dict]

    def backend(self) -> Any: ...  # a mmspec.bench.backend.Backend (which imports this module's cut_at_eos)

    def audit(self, row: dict, sample: BenchSample, own: list[int], ours: list[int]) -> None: ...


def cut_at_eos(token_ids: list[int], eos: int | list[int] | None) -> list[int]:
    """A batched row's new tokens up to and including its first EOS (what a solo run returns; the
    batch pads finished rows after it)."""
    stops = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    for i, t in enumerate(token_ids):
        if t in stops:
            return token_ids[: i + 1]
    return token_ids


def chunks(samples: list[Any], size: int) -> list[list[Any]]:
    """Consecutive batches of ``size`` (the last may be smaller)."""
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def batch_sizes_to_run(cfg: BenchConfig) -> list[int]:
    """The B of the batched pass: all of ``cfg.batch_sizes`` once any is above 1, else none."""
    return sorted(cfg.batch_sizes) if max(cfg.batch_sizes) > 1 else []


def run_batches(cfg: BenchConfig, dataset: str, samples: list[BenchSample], loop: RunState) -> None:
    """Decode ``samples`` B at a time for each B of the run: the target's batched generate, then
    each method's ``generate_batch``; write the rows of each batch as it finishes."""
    for size in batch_sizes_to_run(cfg):
        for index, batch in enumerate(turn_batches(samples, size)):
            for who in (TARGET, *cfg.methods):
                _one_batch(cfg, dataset, size, index, batch, who, loop)


def turn_batches(samples: list[BenchSample], size: int) -> list[list[BenchSample]]:
    """Batches of ``size`` by turn: turn 1 of every sample, B at a time, then turn 2 of those that have
    one, and so on (a turn's prompt holds the answers to the turns before, so a batch never mixes turns;
    the last batch of a turn may be smaller)."""
    return [b for turn in sorted({s.turn for s in samples})
            for b in chunks([s for s in samples if s.turn == turn], size)]


def _one_batch(cfg: BenchConfig, dataset: str, size: int, index: int, batch: list[BenchSample], who: str,
               loop: RunState) -> None:
    from mmspec.bench.metrics import accepted_flags

    writer, summary, rank = loop.writer, loop.summary, loop.rank.rank
    key = ("batch", dataset, f"b{size}/{index}", who)
    if key in writer:
        summary.skipped += 1
        return
    backend = loop.backend()
    begin = getattr(backend, "begin_pass", None)  # optional: a backend keeping a cache per pass
    if begin is not None:
        begin(size)
    gens, wall = backend.target_batch(batch) if who == TARGET else backend.spec_batch(batch, who)
    rows = []
    for sample, g in zip(batch, gens):
        solo = loop.baselines.get((sample.dataset, sample.uid))
        same = None if solo is None else g.token_ids == solo["token_ids"]
        row = {"kind": "batch_out", "dataset": sample.dataset, "uid": f"{sample.uid}@b{size}", "sample_uid": sample.uid,
               "method": who, "batch_size": size, "batch_index": index, "n_images": sample.n_images,
               "input_len": g.input_len, "token_ids": g.token_ids, "text": g.text, "latency_s": wall,
               "identical_to_solo": same, "temperature": cfg.temperature, "rank": rank,
               "audit_label": f"{who}@b{size}"}
        if g.stats is not None:
            row["stats"] = g.stats
            row["accepted"] = accepted_flags(g.stats.get("blocks", []))
        if sample.multi_turn:
            row["turn"] = sample.turn
        if same is False:
            if who == TARGET:
                summary.target_batch_differs.append(f"{sample.dataset}/{sample.uid}@b{size}")
                _audit_only(row, sample, solo["token_ids"], g.token_ids, loop)
            elif (g.stats or {}).get("acceptance", "exact") == "exact":
                loop.audit(row, sample, solo["token_ids"], g.token_ids)
        rows.append(row)
    writer.extend(rows)
    new_tokens = sum(len(g.token_ids) for g in gens)
    writer.append({"kind": "batch", "dataset": dataset, "uid": f"b{size}/{index}", "method": who,
                   "batch_size": size, "batch_index": index, "n_requests": len(batch), "new_tokens": new_tokens,
                   "wall_s": wall, "tokens_per_s": new_tokens / wall if wall > 0 else None,
                   "latency_s": [wall] * len(batch), "rank": rank,
                   "finish_s": [float(g.stats["total_s"]) if g.stats and g.stats.get("total_s") else wall for g in gens]})
    summary.written += len(rows) + 1


def _audit_only(row: dict, sample: BenchSample, own: list[int], ours: list[int], loop: RunState) -> None:
    """The target's batched output unlike its solo one: the same audit, not counted as mmspec's."""
    from mmspec.bench.audit import classify

    fn = getattr(loop.backend(), "audit", None)
    row["audit"] = fn(sample, own, ours) if fn is not None else None
    row["audit_class"] = classify(row["audit"], loop.cfg.dtype)
    row["dtype"] = loop.cfg.dtype
