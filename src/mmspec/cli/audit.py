"""``mmspec audit``: is an OpenAI-compatible endpoint lossless? (:mod:`mmspec.audit`, docs/audit.md)

Checks every flag and both endpoints (``GET /v1/models``) before any model loads, sends each
request to the endpoint and the reference, shows a progress bar and then a table, writes
``--out``'s JSONL as rows finish and its JSON report at the end, and exits 1 when any difference
is a bug (or could not be classified, or a request failed), 0 when every answer is identical or
a near-tie, 2 on a bad flag or an endpoint it cannot use.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import typer

from mmspec.cli import common, options
from mmspec.cli.common import console, err_console, fail
from mmspec.errors import MMSpecError

DTYPES = ("float32", "bfloat16", "float16")


def audit(
    endpoint: str = typer.Option(..., help="The speculative endpoint's base URL (http://host:8000 or .../v1)."),
    model: str | None = typer.Option(None, help="Its model name (default: the first of its /v1/models)."),
    api_key: str | None = typer.Option(None, envvar="MMSPEC_API_KEY",
                                       help="Sent as Authorization: Bearer to the endpoint (and the reference)."),
    reference: str | None = typer.Option(None, help="A reference endpoint serving the same target without "
                                         "speculation (default: the target itself, locally, through transformers)."),
    reference_model: str | None = typer.Option(None, help="The reference endpoint's model (default: its first)."),
    reference_api_key: str | None = typer.Option(None, help="The reference endpoint's key (default: --api-key)."),
    reference_target: str | None = typer.Option(None, help="A local target directory as the reference (default: "
                                                "the embedded target, when no --reference is given)."),
    tokenizer: str | None = typer.Option(None, help="The target's tokenizer directory, to compare answers given "
                                         "as text only when both references are endpoints."),
    requests: Path | None = typer.Option(None, help="A JSONL file of chat requests, one per line (default: the "
                                         "embedded world's multimodal samples)."),
    n: int = typer.Option(100, "-n", "--num-requests", help="Requests to send (the first N of the file or world)."),
    max_tokens: int = typer.Option(128, help="max_tokens of each request that gives none."),
    dtype: str = typer.Option("float32", help="The dtype both endpoints compute in (and the local reference "
                              "loads in): it sets the near-tie tolerance."),
    tolerance: float | None = typer.Option(None, help="Near-tie bound on p(reference's token) - p(endpoint's "
                                           "token) (default: the dtype's epsilon; float32: 0)."),
    top_logprobs: int = typer.Option(5, help="Alternatives asked of a reference endpoint per position (<= 20)."),
    concurrency: int = typer.Option(4, help="Requests in flight at once."),
    timeout: float = typer.Option(300.0, help="Seconds one request may take."),
    out: Path | None = typer.Option(None, help="Directory for audit.jsonl (rows as they finish; a rerun resumes) "
                                    "and report.json."),
    device: str = options.device("cpu", "The local reference's device: "),
    threads: int | None = options.THREADS,
):
    """Check that an OpenAI-compatible endpoint answers exactly as its target (docs/audit.md).

    Sends the same greedy chat requests to `--endpoint` and to a reference, compares the answers
    token by token, and classifies each first difference from the reference's log-probabilities
    there: a **near-tie** (within the dtype's rounding) or a **bug**. Exit status 1 on any bug."""
    from mmspec.audit import AuditConfig, Auditor, Endpoint, read_jsonl, world_requests
    from mmspec.audit.runner import check_out

    endpoints: list = []
    try:
        _check(n, max_tokens, dtype, tolerance, top_logprobs, concurrency, timeout, reference, reference_target)
        common.set_threads(threads)
        spec = Endpoint(endpoint, model, api_key, timeout)
        endpoints.append(spec)
        spec.check()
        ref_ep = None
        if reference is not None:
            ref_ep = Endpoint(reference, reference_model, reference_api_key or api_key, timeout)
            endpoints.append(ref_ep)
            ref_ep.check()
        reqs = read_jsonl(requests, max_tokens, limit=n) if requests else world_requests(n, max_tokens)
        config = AuditConfig(endpoint=spec.base, model=spec.model, reference=ref_ep.base if ref_ep else None,
                             reference_model=ref_ep.model if ref_ep else None, reference_target=reference_target,
                             dtype=dtype, tolerance=tolerance, top_logprobs=top_logprobs,
                             concurrency=concurrency, timeout=timeout,
                             source=str(requests) if requests else f"world:{n}:{max_tokens}")
        check_out(out, config)
        local, tok = None, None
        if ref_ep is None:
            from mmspec.audit.reference import LocalTarget

            local = LocalTarget(reference_target, dtype=dtype, device=device)
        elif tokenizer is not None:
            from mmspec.models.loading import load_tokenizer

            tok = load_tokenizer(tokenizer)
        auditor = Auditor(config, spec, reference=ref_ep, local=local, tokenizer=tok)
        report = _run(auditor, reqs, out)
    except MMSpecError as e:
        fail(e)
    except KeyboardInterrupt:
        where = f"{out / 'audit.jsonl'}; run the same command again to resume from there" if out else \
            "nothing was kept (no --out)"
        err_console.print(f"interrupted: the finished requests are in {where}")
        raise typer.Exit(code=130) from None
    finally:
        for e in endpoints:
            e.close()
    _table(report, out)
    if report["bugs"] or report["unclassified"] or report["errors"]:
        raise typer.Exit(code=1)


def _check(n, max_tokens, dtype, tolerance, top_logprobs, concurrency, timeout, reference, reference_target):
    from mmspec.cli.checks import at_least

    at_least("--num-requests", n)
    at_least("--max-tokens", max_tokens)
    at_least("--concurrency", concurrency)
    if dtype not in DTYPES:
        raise MMSpecError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tolerance is not None and not (math.isfinite(tolerance) and 0 <= tolerance <= 1):
        raise MMSpecError(f"--tolerance bounds a difference of two probabilities: give a number in [0, 1], "
                          f"got {tolerance}")
    if not 0 <= top_logprobs <= 20:
        raise MMSpecError(f"--top-logprobs must be from 0 to 20 (OpenAI's bound), got {top_logprobs}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise MMSpecError(f"--timeout must be a number of seconds > 0, got {timeout}")
    if reference is not None and reference_target is not None:
        raise MMSpecError("--reference and --reference-target are two references; pass one (an endpoint without "
                          "speculation, or a local target directory)")
    if reference_target is not None and not os.path.isdir(reference_target):
        raise MMSpecError(f"--reference-target {reference_target!r} is not a directory; pass the target's model "
                          "directory (save_pretrained's), or leave it out for the embedded target")


def _run(auditor, reqs, out):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mmspec.audit import run_audit

    counts: dict[str, int] = {}
    with Progress(TextColumn("auditing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err_console, transient=True) as bar:
        task = bar.add_task("", total=len(reqs))

        def on_row(row):
            counts[row["class"]] = counts.get(row["class"], 0) + 1
            bar.update(task, advance=1, description=" ".join(f"{k} {v}" for k, v in sorted(counts.items())))

        return run_audit(auditor, reqs, out, on_row=on_row)


def _table(report: dict, out: Path | None) -> None:
    from rich.table import Table

    s = report["settings"]
    t = Table(title=f"mmspec audit: {s['endpoint']} vs {s['reference'] or s['reference_target'] or 'the embedded target'}"
              f" ({s['dtype']}, tolerance {s['tolerance']:.3g})")
    for col in ("requests", "identical", "near-ties", "bugs", "unclassified", "errors", "seconds"):
        t.add_column(col, justify="right")
    t.add_row(*(str(report[k]) for k in ("requests", "identical", "near_ties", "bugs", "unclassified", "errors")),
              f"{report['seconds']:.1f}")
    console.print(t)
    if report["differences"]:
        d = Table(title="first differences")
        for col in ("id", "class", "position", "reference token", "endpoint token", "logprobs", "margin"):
            d.add_column(col)
        for r in report["differences"][:30]:
            x = r["difference"]
            lps = f"{_num(x.get('reference_logprob'))} / {_num(x.get('endpoint_token_logprob'))}"
            d.add_row(r["id"], r["class"], str(x["position"]), _tok(x["reference_token"]), _tok(x["endpoint_token"]),
                      lps, _num(x.get("margin")))
        console.print(d)
    for r in report["failed"][:10]:
        err_console.print(f"failed {r['id']}: {r['error']}")
    if out is not None:
        console.print(f"report: {out / 'report.json'} (rows: {out / 'audit.jsonl'})")


def _tok(t) -> str:
    if isinstance(t, dict):
        return f"{t['text']!r} ({t['id']})"
    return "(end)" if t is None else repr(t)


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"
