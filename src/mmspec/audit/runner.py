"""An audit run: every request to the speculative endpoint and the reference, compared, recorded.

Owns :class:`AuditConfig` (what the CLI's flags map onto), :class:`Auditor` (one request ->
one row: both answers, the first difference and its class) and :func:`run_audit` (bounded
concurrency, a JSONL file written as rows finish, resumable, and the final JSON report written
atomically). A row's ``class`` is one of :data:`mmspec.audit.compare.CLASSES`; a request that
failed at an endpoint (HTTP error, timeout) is an ``error`` row, sent again by a resumed run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from mmspec.audit.client import AuditError, Endpoint, RequestFailed
from mmspec.audit.compare import CLASSES, Reference, compared_by, judge, locate, tolerance_for
from mmspec.audit.requests import AuditRequest

ROWS, REPORT = "audit.jsonl", "report.json"
RESUME_KEYS = ("endpoint", "model", "reference", "reference_target", "dtype", "tolerance", "source")


@dataclass
class AuditConfig:
    """One audit's settings (the CLI maps its flags onto these)."""

    endpoint: str
    model: str | None = None
    reference: str | None = None  # a reference endpoint's URL; None: the local target
    reference_model: str | None = None
    reference_target: str | None = None  # a local target directory; None with no reference: the embedded one
    dtype: str = "float32"
    tolerance: float | None = None  # None: the dtype's (mmspec.bench.audit.NEAR_TIE_TOLERANCE)
    top_logprobs: int = 5
    concurrency: int = 4
    timeout: float = 300.0
    source: str = "world"  # "world:N" or the requests file, for the resume check


class Auditor:
    """Compares one request's answers: ``endpoint`` vs ``reference`` (an Endpoint) or ``local``
    (a :class:`~mmspec.audit.reference.LocalTarget`); ``tokenizer`` for text comparisons."""

    def __init__(self, config: AuditConfig, endpoint: Endpoint, reference: Endpoint | None = None,
                 local=None, tokenizer=None):
        if (reference is None) == (local is None):
            raise AuditError("give the audit one reference: a reference endpoint or a local target")
        self.config, self.endpoint, self.reference, self.local = config, endpoint, reference, local
        self.tokenizer = tokenizer if tokenizer is not None else getattr(local, "tokenizer", None)

    def audit(self, req: AuditRequest) -> dict:
        """One request -> its row; a failure of this request alone is an ``error`` row (the run goes on)."""
        t0 = time.perf_counter()
        try:
            return self._audit(req, t0)
        except Exception as e:  # noqa: BLE001 - a tokenizer's or the local target's own error, on one request
            return {"id": req.id, "class": "error", "error": f"{e.__class__.__name__}: {e}",
                    "seconds": time.perf_counter() - t0}

    def _audit(self, req: AuditRequest, t0: float) -> dict:
        row: dict = {"id": req.id}
        try:
            ours = self.endpoint.chat(req.body)
            if self.local is not None:
                ref, inputs = self.local.answer(req.body)
            else:
                r = self.reference.chat(req.body, top_logprobs=self.config.top_logprobs)
                ref, inputs = Reference(r.text, tokens=r.tokens), None
        except (RequestFailed, AuditError) as e:
            return {**row, "class": "error", "error": str(e), "seconds": time.perf_counter() - t0}
        eos = None if req.body.get("stop") else getattr(self.local, "eos_id", None)  # a stop string ends no token
        found = locate(ref, ours, self.tokenizer, eos_id=eos, eos_ids=getattr(self.local, "eos_ids", ()))
        row["chars"] = len(ours.text)  # the answer's length: an empty answer is "identical" too
        row["compared"] = compared_by(ref, ours, self.tokenizer)  # ids, tokens (each with the texts) or text alone
        if found is None:
            return {**row, "class": "identical", "seconds": time.perf_counter() - t0}
        diff = self._judge(ref, inputs, found)
        diff["reference_token"], diff["endpoint_token"] = self._show(found.own), self._show(found.ours)
        return {**row, "class": diff["class"], "difference": diff, "reference_text": ref.text,
                "endpoint_text": ours.text, "seconds": time.perf_counter() - t0}

    def _judge(self, ref: Reference, inputs, found) -> dict:
        c = self.config
        if self.local is not None:
            if found.own is None or found.ours is None or found.foreign:
                return judge(found, None, None, c.dtype, c.tolerance)
            lp_own, lp_ours = self.local.logprobs(inputs, ref, found)
            return judge(found, lp_own, lp_ours, c.dtype, c.tolerance)
        tokens = ref.tokens or []
        if found.own is None or found.position >= len(tokens):
            return judge(found, None, None, c.dtype, c.tolerance)
        at = tokens[found.position]
        lp_ours = at.alternative(found.ours)
        floor = min(at.top.values()) if at.top and lp_ours is None else None
        return judge(found, at.logprob, lp_ours, c.dtype, c.tolerance, listed_floor=floor)

    def _show(self, token):
        """A token for the report: its id and text where it is an id, else its text."""
        if isinstance(token, int) and self.tokenizer is not None:
            return {"id": token, "text": self.tokenizer.decode([token])}
        return token


# ---------------------------------------------------------------------------------- the run
def _settings(config: AuditConfig) -> dict:
    s = asdict(config)
    s["tolerance"] = tolerance_for(config.dtype, config.tolerance)
    return s


def check_out(out: Path | None, config: AuditConfig) -> None:
    """Refuse an ``--out`` that is a file or holds an audit of other settings, before anything loads."""
    if out is None:
        return
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AuditError(f"--out {str(out)!r} is a file, not a directory; pass a directory for the report")
    _finished(out / ROWS, _settings(config))


def _finished(path: Path, settings: dict) -> dict[str, dict]:
    """The rows a earlier run of the same settings finished (errors excluded: they are sent again)."""
    if not path.exists():
        return {}
    rows: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted write: that request is sent again
            if "settings" in obj:
                old = {k: obj["settings"].get(k) for k in RESUME_KEYS}
                new = {k: settings.get(k) for k in RESUME_KEYS}
                if old != new:
                    diff = {k: (old[k], new[k]) for k in RESUME_KEYS if old[k] != new[k]}
                    raise AuditError(f"{path} holds an audit made with other settings ({diff}: there, now); "
                                     "pass another --out, or delete it to start over")
            elif obj.get("class") in CLASSES and obj["class"] != "error":
                rows[obj["id"]] = obj
    return rows


def summarize(rows: list[dict], settings: dict, seconds: float) -> dict:
    """The JSON report: counts by class and every difference and error."""
    count = {c: sum(r["class"] == c for r in rows) for c in CLASSES}
    return {"settings": settings, "requests": len(rows), "identical": count["identical"],
            "near_ties": count["near-tie"], "bugs": count["bug"], "unclassified": count["unclassified"],
            "errors": count["error"], "seconds": seconds,
            "differences": [r for r in rows if r["class"] in ("near-tie", "bug", "unclassified")],
            "failed": [{"id": r["id"], "error": r["error"]} for r in rows if r["class"] == "error"]}


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_audit(auditor: Auditor, requests: list[AuditRequest], out: Path | None = None,
              on_row: Callable[[dict], None] | None = None) -> dict:
    """Audit every request (``config.concurrency`` at a time); with ``out``, rows go to
    ``out/audit.jsonl`` as they finish (a rerun skips the finished ones) and the report to
    ``out/report.json``. Returns the report."""
    settings = _settings(auditor.config)
    t0 = time.perf_counter()
    done: dict[str, dict] = {}
    f = None
    if out is not None:
        out = Path(out)
        check_out(out, auditor.config)
        out.mkdir(parents=True, exist_ok=True)
        done = _finished(out / ROWS, settings)
        fresh = not (out / ROWS).exists()
        f = open(out / ROWS, "a", encoding="utf-8")
        if fresh:
            f.write(json.dumps({"settings": settings}) + "\n")
            f.flush()
    rows = [done[r.id] for r in requests if r.id in done]
    for r in rows:
        if on_row:
            on_row(r)
    todo = [r for r in requests if r.id not in done]
    pool = ThreadPoolExecutor(max_workers=max(1, auditor.config.concurrency))
    try:
        futures = [pool.submit(auditor.audit, r) for r in todo]
        for fut in as_completed(futures):
            row = fut.result()
            rows.append(row)
            if f is not None:
                f.write(json.dumps(row) + "\n")
                f.flush()
            if on_row:
                on_row(row)
    finally:  # Ctrl-C: the requests not started are dropped; the finished rows are on disk
        pool.shutdown(wait=False, cancel_futures=True)
        if f is not None:
            f.close()
    order = {r.id: i for i, r in enumerate(requests)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    report = summarize(rows, settings, time.perf_counter() - t0)
    if out is not None:
        write_atomic(out / REPORT, report)
    return report
