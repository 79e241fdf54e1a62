"""``mmspec train evaluate | facts``: the quality figures of trained models.

``evaluate`` reads a benchmark run of the pack (:mod:`mmspec.train.evaluate`); ``facts`` measures a
model's fact recall and questions answered right without one.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.bench.datasets import SINGLE_IMAGE  # the fact-recall goal's families; `facts` defaults to them
from mmspec.cli import options
from mmspec.cli.common import set_threads
from mmspec.cli.train.common import require_model_dir


def evaluate_cmd(
    results: Path = typer.Option(..., help="a `mmspec bench run` results dir on the embedded world"),
    captions_per_family: int = typer.Option(50, help="test samples per family for the caption check (0: skip)"),
    out: Path | None = typer.Option(None, help="write the figures as JSON here"),
    method: list[str] | None = typer.Option(None, "--method", help="also the fact recall of this method's "
                                               "answers (e.g. a lossy +relaxed one) next to the target's; repeatable"),
) -> None:
    """Quality of the embedded pack on the test split, from a benchmark run.

    Fact recall of the target's answers, the captioner's fact rate, and multimodal vs text-only
    block efficiency."""
    import json

    from mmspec.train.evaluate import answer_fact_recall, caption_fact_rate, view_block_efficiency

    report: dict = {"answer_fact_recall": answer_fact_recall(results),
                    "block_efficiency_M_vs_T": view_block_efficiency(results)}
    if captions_per_family > 0:
        from mmspec.embedded import load_embedded

        pack = load_embedded()
        cap = pack.captioner()
        report["caption_fact_rate"] = caption_fact_rate(cap, captions_per_family)
    def tau_and_captions(family: str) -> str:
        tau = report["block_efficiency_M_vs_T"].get(family, {})
        cap_rate = report.get("caption_fact_rate", {}).get(family, {}).get("rate")
        return (f"  tau M {tau.get('M', float('nan')):.2f}  T {tau.get('T', float('nan')):.2f}"
                + (f"  captions {cap_rate:.1%}" if cap_rate is not None else ""))

    _echo_fact_table(report["answer_fact_recall"], tau_and_captions)
    for m in method or []:
        report.setdefault("method_fact_recall", {})[m] = answer_fact_recall(results, m)
        typer.echo(f"\n{m} (its answers, not the target's):")
        _echo_fact_table(report["method_fact_recall"][m], lambda family: "")
    if out is not None:
        out.write_text(json.dumps({"provenance": _provenance(results), **report}, indent=2))


def _provenance(results: Path | None = None) -> dict:
    """What made a figure file: this command, when and where, and the benchmark runs it read (if any)."""
    from mmspec.bench.store import read_run_meta
    from mmspec.provenance import stamp

    out = stamp()
    if results is not None:
        out["results"] = str(results)
        out["bench_runs"] = [{k: m.get(k) for k in ("command", "date", "rank", "world_size", "machine")}
                             for m in read_run_meta(results)]
    return out


def facts_cmd(
    model: Path | None = typer.Option(None, help="HF LLaVA dir (default: the shipped target)"),
    n: int = typer.Option(100, help="test samples per family (the split's first N, as the benchmark takes them)"),
    family: list[str] = typer.Option(list(SINGLE_IMAGE), help="world family (repeatable)"),
    view: str = typer.Option("multimodal", help="multimodal | caption (each image replaced by its "
                             "ground-truth caption: can the LM copy the facts from text?)"),
    max_new_tokens: int = typer.Option(128),
    device: str = options.device(),
    threads: int | None = options.THREADS,
    out: Path | None = typer.Option(None, help="write the figures as JSON here"),
) -> None:
    """Fact recall of a target's greedy answers on the test split, without a benchmark run.

    Per family and kind of fact. The caption view separates the LM from the vision tower."""
    import json

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path
    from mmspec.models.loading import read_sidecar
    from mmspec.train.data import Encoder
    from mmspec.train.evaluate import model_fact_recall
    from mmspec.world import FAMILIES

    if n < 1:
        raise typer.BadParameter("need at least 1 sample per family", param_hint="--n")
    if max_new_tokens < 1:
        raise typer.BadParameter(f"need at least 1 new token; got {max_new_tokens}", param_hint="--max-new-tokens")
    if view not in ("multimodal", "caption"):
        raise typer.BadParameter(f"unknown view {view!r}; use multimodal or caption", param_hint="--view")
    unknown = [f for f in family if f not in FAMILIES]
    if unknown:
        raise typer.BadParameter(f"unknown world famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                                 f"choose from {', '.join(FAMILIES)}", param_hint="--family")
    if out is not None and not out.parent.is_dir():
        raise typer.BadParameter(f"{out.parent} does not exist; create it or write elsewhere", param_hint="--out")
    path = model or default_path() / "target"
    require_model_dir(path, "--model")
    set_threads(threads)
    families = list(dict.fromkeys(family))
    tokens_per_image = read_sidecar(path).get("pooled_tokens") or 64  # a pooled draft reads N tokens per image
    llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().to(device)
    processor = AutoProcessor.from_pretrained(path)
    report = model_fact_recall(llava, Encoder(processor.tokenizer), processor.image_processor, families, n,
                               view=view, max_new_tokens=max_new_tokens, device=device,
                               tokens_per_image=tokens_per_image)
    typer.echo(f"{path}: fact recall, {view} view, first {n} test samples per family, greedy")
    _echo_fact_table(report)
    if out is not None:
        out.write_text(json.dumps({"model": str(path), "view": view, "n_per_family": n, "provenance": _provenance(),
                                   "tokens_per_image": tokens_per_image, "families": report}, indent=2))


def _echo_fact_table(report: dict, extra=None) -> None:
    """One line per family (recall, facts, ``extra(family)``), then its questions answered right
    (single-image families), by kind of fact and verdicts."""
    for fam, r in report.items():
        typer.echo(f"{fam:15s} facts {r['recall']:.1%} of {r['facts']}" + (extra(fam) if extra else ""))
        if "questions" in r:
            q = r["questions"]
            typer.echo(f"                questions answered right {q['right']:.1%} of {q['questions']}: "
                       + ", ".join(f"{k} {v['right']:.0%} of {v['questions']}" for k, v in q["by_asked"].items()))
        typer.echo("                " + ", ".join(f"{k} {v['recall']:.0%}" for k, v in r["by_fact"].items()))
        for truth, said in r.get("verdicts", {}).items():
            typer.echo(f"                {sum(said.values())} {truth}-questions end on: "
                       + ", ".join(f"{k} {c}" for k, c in said.items()))
