"""``mmspec bench run`` and ``mmspec report`` (mounted by :mod:`mmspec.cli.app`).

Owns only the mapping of flags onto :class:`~mmspec.bench.config.BenchConfig` and the printing
of a short summary; the work is in :mod:`mmspec.bench.runner` and :mod:`mmspec.bench.report`.
Under ``torchrun --nproc_per_node=N`` (or ``accelerate launch``) each process reads RANK /
WORLD_SIZE, runs its shard and writes ``results.rank{R}.jsonl``; ``report`` merges them.

Usage::

    mmspec bench run --out runs/emb                       # embedded models + world, all 8 methods
    mmspec bench run --out runs/real -n 100 \
        --target ./llava-1.5-7b-hf --draft ./lvlm68m --captioner ./florence \
        -d chartqa=data/ChartQA -d textvqa=data/textvqa:validation \
        -d spot_the_diff=data/LLaVA-NeXT-Interleave-Bench     # a hub snapshot: its in_domain config
    torchrun --nproc_per_node=2 -m mmspec bench run --out runs/emb   # shard by rank
    mmspec bench run --out runs/b -d chartqa,conversation -m M -n 16 --batch-size 1,2,4,8,16
    mmspec report runs/emb                                 # -> runs/emb/report.md + PNGs
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from mmspec.bench.config import DEFAULT_DATASETS, DEFAULT_METHODS, BenchConfig, DatasetSpec
from mmspec.cli import options
from mmspec.errors import MMSpecError

bench_app = typer.Typer(help="Benchmark drafting methods against the target alone (IbED Table 3).",
                        no_args_is_help=True, add_completion=False)


def _split_list(values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if not values:
        return default
    return tuple(x.strip() for v in values for x in v.split(",") if x.strip())


def _parse_heads(specs: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``["eagle=runs/h"]`` -> (("eagle", "runs/h"),). The directories are checked (readable, of
    the named variant, used by a method) with the other paths: :func:`mmspec.bench.preflight.check_heads`."""
    from mmspec.bench.config import HEAD_VARIANTS

    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or name not in HEAD_VARIANTS or not path.strip():
            raise MMSpecError(f"--head {spec!r}: write VARIANT=DIR with VARIANT one of {', '.join(HEAD_VARIANTS)}")
        out.append((name, path.strip()))
    return tuple(out)


def _factory(spec: str):
    mod, _, attr = spec.partition(":")
    if not attr:
        raise MMSpecError(f"--backend {spec!r}: use 'module.path:function'")
    return getattr(importlib.import_module(mod), attr)


@bench_app.command("run")
def run_command(
    out: Path = typer.Option(Path("bench_results"), "--out", "-o", help="Results directory (resumable)."),
    method: list[str] | None = options.methods(None, "--method", "-m"),
    dataset: list[str] | None = typer.Option(None, "--dataset", "-d", help="NAME (embedded world) or NAME=PATH[:SPLIT] (real benchmark, or mmspec=PATH[:testmini|test]: MMSpec's split, multi-turn; a parquet file, a directory of parquet files such as a hub snapshot, of which only SPLIT's files are read, or a save_to_disk dir; SPLIT defaults to the benchmark's own: chartqa test, textvqa and vqav2 validation, hallusionbench image, the interleave tasks test; relative image paths in it are read from its directory, then the working directory). Repeat or comma-separate. Default: the 8 IbED families, embedded."),
    n_samples: int = typer.Option(100, "--n-samples", "-n", help="Samples per dataset."),
    gamma: int = typer.Option(5, help="Draft tokens per block."),
    max_new_tokens: int | None = options.max_new_tokens(None, "answer (a turn; default: each data set's protocol, IbED 128, MMSpec 1024)"),
    temperature: float = typer.Option(0.0, help="0 = greedy (lossless: outputs must equal the target's)."),
    seed: int = typer.Option(0),
    target: str | None = typer.Option(None, help="Target checkpoint dir or hub id (default: embedded)."),
    draft: str | None = typer.Option(None, help="Draft checkpoint dir or hub id."),
    captioner: str | None = typer.Option(None, help="Captioner checkpoint (needed by C methods)."),
    captioner_prompt: str | None = typer.Option(None, help="Prompt for the captioner (default: the one an `mmspec train` captioner records)."),
    pool_tokens: int | None = typer.Option(None, help="Tokens per image of the P (pooled) view, e.g. 144."),
    head: list[str] | None = options.heads("-m eagle,eagle3+tree --head eagle=DIR --head eagle3=DIR2"),
    split: str | None = typer.Option(None, help="Split of every dataset that names none (NAME=PATH:SPLIT). Default: the embedded world's test; a real benchmark's own split (see --dataset)."),
    device: str | None = options.device(None, "Default: cuda:LOCAL_RANK if available, else cpu; "),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16 | float64 (the embedded models too)."),
    latency: bool = typer.Option(True, "--latency/--no-latency", help="Measure T_p, T_q(b=1..8), T_V(γ) per dataset."),
    latency_repeats: int = typer.Option(5, help="Repeats per latency probe (median)."),
    batch_size: str = typer.Option("1", "--batch-size", "-b", help="Requests decoded together: 1 (default) = one "
                                   "prompt at a time, as always; B > 1 adds a batched pass: the samples B at a time through "
                                   "SpecDecoder.generate_batch and the target's own batched greedy generate, side by side "
                                   "(throughput, per-request p50/p90 latency). A sweep: --batch-size 1,2,4,8,16."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars (--no-progress: none, "
                                  "transformers' weight-loading bars included: for logs)."),
    threads: int | None = typer.Option(None, help="CPU threads for torch in this process (default: the cores "
                                          "the machine leaves idle, from its load, divided by the processes "
                                          "torchrun started on this machine). "
                                          "Two runs side by side: give each a share, e.g. --threads 1 on 2 cores."),
    backend: str | None = typer.Option(None, hidden=True, help="module:function building a custom backend (tests)."),
) -> None:
    """Run (or resume) the benchmark: one JSONL row per (sample, method) plus a baseline per sample."""
    from mmspec.bench.runner import BenchInterrupted, run_bench
    from mmspec.provenance import command_line
    from mmspec.threads import apply_threads

    try:
        from mmspec.bench.config import parse_batch_sizes, split_methods
        from mmspec.cli.checks import check_threads

        check_threads(threads)
        cfg = BenchConfig(
            out_dir=out, methods=split_methods(method) if method else DEFAULT_METHODS,
            datasets=tuple(DatasetSpec.parse(d) for d in _split_list(dataset, DEFAULT_DATASETS)),
            n_samples=n_samples, gamma=gamma, max_new_tokens=max_new_tokens,
            temperature=temperature, seed=seed, target=target, draft=draft, captioner=captioner,
            captioner_prompt=captioner_prompt, pool_tokens=pool_tokens, split=split, device=device, dtype=dtype,
            heads=_parse_heads(head), latency=latency, latency_repeats=latency_repeats, progress=progress,
            batch_sizes=parse_batch_sizes(batch_size),
        )
        cfg.extra["threads"] = apply_threads(threads)  # after every check: nothing is set for a refused run
        if not progress:  # transformers' "Loading weights" bars too
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        summary = run_bench(cfg, backend_factory=_factory(backend) if backend else None,
                            command=command_line())
    except MMSpecError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    except BenchInterrupted as e:
        s = e.summary
        typer.secho(f"interrupted: rank {s.rank} keeps {s.rows_on_disk} finished rows in {s.path} ({s.written} "
                    "written by this run); run the same command again to resume from there (finished rows are "
                    "not recomputed)", fg="yellow", err=True)
        raise typer.Exit(130) from None
    for w in summary.warnings:
        typer.secho(f"warning: {w}", fg="yellow", err=True)
    for name, skips in summary.load_skips.items():
        typer.secho(f"{name}: skipped rows: {skips}", fg="yellow", err=True)
    if summary.lossless_failures:
        typer.secho(f"LOSSLESSNESS VIOLATED: {len(summary.lossless_failures)} greedy output(s) differ "
                    f"from the target's: {', '.join(summary.lossless_failures[:10])}",
                    fg="red", bold=True, err=True)
    if summary.near_ties:
        typer.secho(f"{len(summary.near_ties)} half-precision output(s) differ from the "
                    "target's at a near-tie (the audit in the report gives each margin)", fg="yellow", err=True)
    if summary.target_batch_differs:
        typer.secho(f"the target's own batched generate differs from its solo output for "
                    f"{len(summary.target_batch_differs)} request(s): {', '.join(summary.target_batch_differs[:5])} "
                    "(left padding rounds differently; see the report)", fg="yellow", err=True)
    typer.echo(f"rank {summary.rank}: wrote {summary.written} rows ({summary.latency_written} of them latency), "
               f"{summary.skipped} already done -> {summary.path} ({summary.rows_on_disk} rows)")


@bench_app.command("report")
def report_command(
    results_dir: Path = typer.Argument(..., help="The --out directory of `mmspec bench run`."),
) -> None:
    """Merge all rank files of RESULTS_DIR and write report.md, metrics.json and PNG plots."""
    from mmspec.bench.report import render_report
    from mmspec.provenance import command_line

    try:
        path = render_report(results_dir, command=command_line())
    except MMSpecError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")
    text = path.read_text()
    if "LOSSLESSNESS VIOLATED" in text or "LOSSLESSNESS BUGS" in text:
        typer.secho("LOSSLESSNESS VIOLATED: some greedy outputs differ from the target's; see the "
                    "report.", fg="red", bold=True, err=True)


if __name__ == "__main__":  # `python -m mmspec.cli.bench run ...`
    bench_app()
