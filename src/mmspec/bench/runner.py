"""The resumable benchmark loop: datasets x (baseline + methods) -> one JSONL row each.

Owns the order of work and the row format. For each dataset (this rank's shard of its samples):
one ``latency`` row (first sample), then per sample a ``baseline`` row (target alone) followed
by one ``spec`` row per method. Every argument is checked first (:mod:`mmspec.bench.preflight`),
so a refused run creates nothing. Every row is fsync'ed as soon as it is finished; on a re-run,
rows already on disk are skipped (never recomputed) and models are not even loaded when nothing
is left to do. An interrupted run (Ctrl-C) raises :class:`BenchInterrupted`, which carries what
was kept. A results directory refuses to be resumed with settings that change the numbers
(gamma, max_new_tokens, temperature, seed, models): use a new ``--out`` for those.

Row kinds (all carry ``kind``, ``dataset``, ``uid``, ``method``, ``rank``):
- ``baseline``: ``token_ids``, ``text``, ``wall_s``, ``input_len``, ``n_images``, ``reference``.
- ``spec``: as baseline plus ``views``, ``gamma``, ``stats`` (``GenerationStats.to_dict()``),
  ``accepted`` (per output position: 1 = accepted draft token, 0 = token from the target) and
  ``identical`` (token-for-token equal to this sample's baseline).
- ``latency``: the :func:`mmspec.bench.latency.measure_latency` dict for the dataset.

A conversation (the world's ``conversation`` family, an MMSpec sample) adds ``turn`` (1, 2, ...) to its
rows; its turn k + 1 is built after turn k's baseline, from the target's own turn-k answer (uid
``{uid}/t{k+1}``), so a resumed run rebuilds every later turn from the rows on disk. MMSpec's samples
are rows of their category (dataset ``mmspec/{category}``), each category with its latency row. A greedy
spec row unlike the baseline gets ``audit`` (first differing position, the target's margin there:
:mod:`mmspec.bench.audit`), ``audit_class`` ("near-tie" or "bug") and ``dtype``. With
``--batch-size`` B > 1, :mod:`mmspec.bench.batched` then decodes the dataset's samples B at a time
(``batch_out`` rows per request, ``batch`` timing rows per batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mmspec.bench.backend import Backend, HFBackend, load_models, pick_device
from mmspec.bench.config import IBED_NEW_TOKENS, PROTOCOL_NEW_TOKENS, RESULT_KEYS, BenchConfig, RankInfo, method_views
from mmspec.bench.datasets import BenchSample, load_dataset
from mmspec.bench.metrics import accepted_flags, expects_identical
from mmspec.bench.preflight import preflight
from mmspec.bench.store import RowWriter, append_run_meta, read_run_meta, results_path
from mmspec.errors import MMSpecError
from mmspec.provenance import command_line, machine_info, now


@dataclass
class RunSummary:
    """What one rank's run did. ``written`` and ``skipped`` count rows of every kind (latency
    rows too), so ``rows_on_disk`` = rows there before + ``written``."""

    rank: int
    written: int = 0
    skipped: int = 0
    latency_written: int = 0
    rows_on_disk: int = 0
    load_skips: dict[str, dict[str, int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    lossless_failures: list[str] = field(default_factory=list)  # greedy outputs != target's (not near-ties)
    near_ties: list[str] = field(default_factory=list)  # half-precision differences the audit calls near-ties
    target_batch_differs: list[str] = field(default_factory=list)  # the target's batched output != its solo one
    path: str = ""


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGINT from a launcher) during a run; ``summary`` says what is on disk."""

    def __init__(self, summary: RunSummary) -> None:
        super().__init__(f"interrupted with {summary.rows_on_disk} rows in {summary.path}")
        self.summary = summary


def _check_fingerprint(cfg: BenchConfig) -> None:
    import json

    def norm(v):  # tuples read back from JSON as lists
        return json.dumps(v, sort_keys=True, default=str)

    for meta in read_run_meta(cfg.out_dir):
        fp = meta.get("fingerprint")
        if fp and fp != cfg.fingerprint():
            old = meta.get("config", {})
            protocol = {name: n for name, n in PROTOCOL_NEW_TOKENS.items() if old.get("max_new_tokens") is None
                        and any(str(d).split("=")[0] == name for d in old.get("datasets") or [])}
            old = {**old, "split": old.get("split") or "test",  # unset = test, as in result_values()
                   "max_new_tokens": old.get("max_new_tokens") or IBED_NEW_TOKENS}  # unset = IbED's, likewise
            now_values = {**cfg.result_values(), "heads": [list(h) for h in cfg.heads]}
            old_values = {**{k: old.get(k) for k in RESULT_KEYS}, "heads": [list(h) for h in old.get("heads") or []],
                          "protocol_new_tokens": protocol or None}
            now_values.setdefault("protocol_new_tokens", None)
            diff = [f"{k}: {old_values[k]!r} there, {now_values[k]!r} now"
                    for k in (*RESULT_KEYS, "heads", "protocol_new_tokens") if norm(old_values[k]) != norm(now_values[k])]
            raise MMSpecError(
                f"{cfg.out_dir} holds results made with different settings ({'; '.join(diff) or 'the fingerprint'}); "
                "resuming would mix them. Use a new --out directory, or the original settings."
            )


def _progress(enabled: bool, total: int, rank: RankInfo):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn(f"[rank {rank.rank}] {{task.description}}"), BarColumn(),
                    MofNCompleteColumn(), TimeRemainingColumn(), disable=not enabled)
    return prog


def _spec_row(sample: BenchSample, method: str, gen, baseline: dict | None, cfg: BenchConfig,
              rank: int) -> dict:
    blocks = (gen.stats or {}).get("blocks", [])
    return {
        "kind": "spec", "dataset": sample.dataset, "uid": sample.uid, "method": method,
        "views": list((gen.stats or {}).get("views") or method_views(method)), "gamma": cfg.gamma, "temperature": cfg.temperature,
        "n_images": sample.n_images, "input_len": gen.input_len, "token_ids": gen.token_ids,
        "text": gen.text, "wall_s": gen.wall_s, "stats": gen.stats,
        "accepted": accepted_flags(blocks),
        "identical": None if baseline is None else gen.token_ids == baseline["token_ids"],
        "rank": rank, **_turn(sample),
    }


def _turn(sample: BenchSample) -> dict:
    """``{"turn": k}`` for a conversation's rows (MMSpec's included), nothing for one-turn data sets."""
    return {"turn": sample.turn} if sample.multi_turn else {}


def run_bench(cfg: BenchConfig, backend: Backend | None = None, rank: RankInfo | None = None,
              backend_factory: Callable[[BenchConfig, RankInfo], Backend] | None = None,
              command: str | None = None) -> RunSummary:
    """Run (or resume) the benchmark for this rank. Returns what was written and skipped."""
    rank = rank or RankInfo.from_env()
    preflight(cfg, rank, default_backend=backend is None and backend_factory is None)
    _check_fingerprint(cfg)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary(rank.rank, path=str(results_path(cfg.out_dir, rank.rank)))
    writer = RowWriter(results_path(cfg.out_dir, rank.rank))
    summary.warnings += writer.warnings
    try:
        _run(cfg, rank, writer, summary, backend, backend_factory, command)
    except KeyboardInterrupt as e:
        summary.rows_on_disk = len(writer.rows)
        raise BenchInterrupted(summary) from e
    summary.rows_on_disk = len(writer.rows)
    return summary


def _run(cfg: BenchConfig, rank: RankInfo, writer: RowWriter, summary: RunSummary, backend: Backend | None,
         backend_factory: Callable[[BenchConfig, RankInfo], Backend] | None, command: str | None) -> None:
    """The loop of :func:`run_bench`, writing through ``writer`` and counting into ``summary``."""
    loop = _Loop(cfg, rank, writer, summary, backend, backend_factory, command)
    per_sample = 1 + len(cfg.methods)
    total = len(cfg.datasets) * -(-cfg.n_samples // rank.world_size) * per_sample
    with writer, _progress(cfg.progress, total, rank) as prog:
        loop.prog, loop.task = prog, prog.add_task("bench", total=total)
        for spec in cfg.datasets:
            samples, report = load_dataset(spec.name, spec.path, cfg.n_samples, spec.split or cfg.split)
            if report.skipped:
                summary.load_skips[spec.name] = dict(report.skipped)
                summary.warnings += report.errors  # each skipped row: FILE:LINE, its id, the fix
            prog.update(loop.task, description=spec.name)
            done: list[BenchSample] = []  # this shard's samples, every later turn of each conversation included
            seen: set[str] = set()  # datasets with a sample here (MMSpec's categories: a latency row each)
            for sample in rank.shard(samples):
                loop.sample(sample, first=sample.dataset not in seen)
                seen.add(sample.dataset)
                done.append(sample)
                while sample.has_next:  # the next turn, asked after the target's own answer
                    base = loop.baselines.get((sample.dataset, sample.uid))
                    if base is None:
                        break
                    sample = sample.next_turn(base["text"])
                    loop.sample(sample, first=False)
                    done.append(sample)
            if any(b > 1 for b in cfg.batch_sizes):
                from mmspec.bench.batched import run_batches

                run_batches(cfg, spec.name, done, loop)


class _Loop:
    """The state of one rank's run: the writer, the baselines so far, the backend (built on first
    need) and whether this invocation's metadata is recorded yet."""

    def __init__(self, cfg: BenchConfig, rank: RankInfo, writer: RowWriter, summary: RunSummary,
                 backend: Backend | None, factory: Callable[[BenchConfig, RankInfo], Backend] | None,
                 command: str | None) -> None:
        self.cfg, self.rank, self.writer, self.summary = cfg, rank, writer, summary
        self._backend, self._factory, self._command = backend, factory, command
        self.baselines = {(r["dataset"], r["uid"]): r for r in writer.rows if r["kind"] == "baseline"}
        self.lat_done = {r["dataset"] for r in writer.rows if r["kind"] == "latency"}
        self.meta_written = False
        self.prog = self.task = None

    def backend(self) -> Backend:
        """The backend, built (and this invocation recorded in ``run.rank{R}.json``) on first need."""
        if self._backend is None:
            self._backend = (self._factory or default_backend)(self.cfg, self.rank)
        if not self.meta_written:
            append_run_meta(self.cfg.out_dir, self.rank.rank, _meta(self.cfg, self.rank, self._backend, self._command))
            self.meta_written = True
        return self._backend

    def sample(self, sample: BenchSample, first: bool) -> None:
        """The latency row (first sample of a dataset), the baseline row and one spec row per method."""
        cfg, writer, summary, name = self.cfg, self.writer, self.summary, sample.dataset
        todo = [("baseline", "")] + [("spec", m) for m in cfg.methods]
        need_lat = cfg.latency and first and name not in self.lat_done
        if cfg.latency and first and not need_lat:
            summary.skipped += 1  # its latency row is on disk
        if need_lat:
            lat = self.backend().latency(sample)
            if lat is not None:
                writer.append({"kind": "latency", "dataset": name, "uid": f"rank{self.rank.rank}", "method": "",
                               "n_images": sample.n_images, "rank": self.rank.rank, **lat})
                summary.written += 1
                summary.latency_written += 1
            self.lat_done.add(name)
        for kind, method in todo:
            if (kind, name, sample.uid, method) in writer:
                summary.skipped += 1
            elif kind == "baseline":
                g = self.backend().baseline(sample)
                row = {"kind": "baseline", "dataset": name, "uid": sample.uid, "method": "",
                       "n_images": sample.n_images, "input_len": g.input_len, "token_ids": g.token_ids,
                       "text": g.text, "wall_s": g.wall_s, "reference": sample.reference, "prompt": sample.prompt,
                       "rank": self.rank.rank, **_turn(sample)}
                writer.append(row)
                self.baselines[(name, sample.uid)] = row
                summary.written += 1
            else:
                g = self.backend().spec(sample, method)
                base = self.baselines.get((name, sample.uid))
                row = _spec_row(sample, method, g, base, cfg, self.rank.rank)
                if row["identical"] is False and expects_identical(row):
                    self.audit(row, sample, base["token_ids"], g.token_ids)
                writer.append(row)
                summary.written += 1
            self.prog.advance(self.task)

    def audit(self, row: dict, sample: BenchSample, own: list[int], ours: list[int]) -> None:
        """Add the audit of a greedy output unlike the target's own (:mod:`mmspec.bench.audit`) to
        ``row`` and count it: a near-tie in half precision, or a lossless failure."""
        from mmspec.bench.audit import classify

        fn = getattr(self.backend(), "audit", None)
        row["audit"] = fn(sample, own, ours) if fn is not None else None
        row["audit_class"] = classify(row["audit"], self.cfg.dtype)
        row["dtype"] = self.cfg.dtype
        label = f"{row['dataset']}/{row['uid']}/{row.get('audit_label') or row['method']}"
        if row["audit_class"] == "near-tie":
            self.summary.near_ties.append(label)
        else:
            self.summary.lossless_failures.append(label)


def default_backend(cfg: BenchConfig, rank: RankInfo) -> Backend:
    device = pick_device(cfg, rank)  # a device this machine lacks fails before any model loads
    return HFBackend(load_models(cfg), cfg, device)


def _meta(cfg: BenchConfig, rank: RankInfo, backend: Backend, command: str | None) -> dict:
    desc = backend.describe()
    return {
        "command": command or command_line(),
        "date": now(),
        "rank": rank.rank, "world_size": rank.world_size,
        "machine": machine_info(desc.get("device")), "models": desc,
        "config": cfg.to_dict(), "fingerprint": cfg.fingerprint(),
    }
