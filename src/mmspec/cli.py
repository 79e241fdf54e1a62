"""The ``mmspec`` command. It only maps flags onto library calls and prints results.

Commands: ``generate`` (one prompt), ``demo`` (the embedded world end to end), ``bench`` /
``report`` (:mod:`mmspec.bench`), ``train`` (:mod:`mmspec.train`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mmspec.errors import MMSpecError
from mmspec.threads import apply_threads

app = typer.Typer(help="Lossless speculative decoding for vision-language models (IbED).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")  # markdown: docstring paragraphs reflow to the terminal
console = Console()
err_console = Console(stderr=True)

# `mmspec generate` with no prompt: a world sample the embedded target answers right (checked by
# tests/test_cli.py with the world's own fact check), not test sample 0, which it gets wrong
DEFAULT_EXAMPLE = ("chartqa", "test", 10)
EMBEDDED_NOTE = ("[dim]Using the embedded tiny models: they only know mmspec's synthetic world "
                 "(charts, signs, shapes, differences, edits, little stories), not real photos.[/dim]")


def _fail(e: Exception) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", str(e)))  # literal: "[/INST]", ":x:" as written
    raise typer.Exit(code=2)


def _check_max_new_tokens(n: int) -> None:
    if n < 1:
        raise MMSpecError(f"--max-new-tokens must be >= 1, got {n}")


def _graphs_flag(text: str):
    """--cuda-graphs auto|on|off -> SpecDecoder's cuda_graphs."""
    flags = {"auto": "auto", "on": True, "off": False}
    if text.lower() not in flags:
        raise MMSpecError(f"--cuda-graphs must be auto, on or off, got {text!r}")
    return flags[text.lower()]


def _check_prompt(prompt: str | None) -> None:
    if prompt is not None and not prompt.replace("<image>", "").strip():
        raise MMSpecError(f"--prompt {prompt!r} has no text; say what to ask about the image(s), "
                          "e.g. --prompt \"What is shown?\"")


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse_weights(weights: str | None) -> list[float] | None:
    """--weights "1,0.5" -> [1.0, 0.5]; anything but comma-separated numbers is refused."""
    if not weights:
        return None
    try:
        return [float(x) for x in weights.split(",")]
    except ValueError:
        raise MMSpecError(f"--weights {weights!r} is not a comma-separated list of numbers; "
                          "give one number per view, e.g. --views MT --weights 1,0.5") from None


def _load(target, draft, captioner, captioner_prompt, dtype, device):
    """Models for generate/demo: the given checkpoints, or the embedded pack."""
    from transformers.utils import logging as hf_logging

    from mmspec.models.captioner import HFCaptioner

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the answer

    from mmspec.models.loading import (check_model_flags, check_same_vocabulary, compute_dtype, load_model,
                                       load_processor, load_tokenizer_if_any, locate, resolve_device)

    check_model_flags(target, draft, captioner, captioner_prompt)
    device = str(resolve_device(device))
    dtype = compute_dtype(dtype, device)  # auto: float32 on the CPU, the checkpoint's own on a GPU
    if target is None:
        import torch

        from mmspec.embedded import load_embedded

        e = load_embedded(dtype=torch.float32 if dtype == "auto" else dtype, device=device)  # saved in fp16
        cap = e.captioner()
        return e.target, e.draft, e.tokenizer, e.processor, cap, True
    for flag, name in (("--target", target), ("--draft", draft), ("--captioner", captioner)):
        if name is not None:
            locate(name, flag)  # local directories first; a hub id that cannot be had fails in one line
    processor = load_processor(target)
    tok = getattr(processor, "tokenizer", processor)
    check_same_vocabulary(tok, load_tokenizer_if_any(draft))  # before the weights load
    t = load_model(target, dtype=dtype, device=device)
    d = load_model(draft, dtype=dtype, device=device)
    cap = HFCaptioner.from_pretrained(captioner, prompt=captioner_prompt, dtype=dtype) if captioner else None
    if cap is not None:
        cap.model.to(device)
    return t, d, tok, processor, cap, False


def _stats_table(title: str, res, baseline_s: float | None = None, identical: bool | None = None) -> Table:
    st = res.stats
    tab = Table(title=title, show_header=False, title_justify="left")
    tab.add_row("tokens", str(st.n_tokens))
    tab.add_row("blocks", str(st.n_blocks))
    tab.add_row("tokens per block", " ".join(map(str, st.tokens_per_block)))
    tab.add_row("block efficiency tau (incl. bonus/recovered)", f"{st.tau:.2f}")
    tab.add_row("mean accepted length (tau - 1)", f"{st.mean_accepted_length:.2f}")
    tab.add_row("acceptance by draft position", " ".join(f"{a:.2f}" for a in st.acceptance_by_position()))
    tab.add_row("time: vision / caption / prefill (target, draft)",
                f"{st.vision_s*1e3:.1f} / {st.caption_s*1e3:.1f} / {st.prefill_target_s*1e3:.1f}, "
                f"{st.prefill_draft_s*1e3:.1f} ms")
    tab.add_row("time: drafting / verification / total",
                f"{st.draft_s*1e3:.1f} / {st.verify_s*1e3:.1f} / {st.total_s*1e3:.1f} ms")
    if baseline_s is not None:
        tab.add_row("target alone (generate)", f"{baseline_s*1e3:.1f} ms -> speed-up {baseline_s/st.total_s:.2f}x")
    if identical is not None:
        tab.add_row("identical to target.generate", "[green]yes[/green]" if identical else "[red]NO[/red]")
    return tab


def _baseline(target, inputs, max_new_tokens):
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), time.perf_counter() - t0


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, help="Prompt text; `<image>` marks each image (added in front if missing)."),
    image: List[Path] = typer.Option([], "--image", "-i", help="Image file; repeat for several images, in slot order."),
    target: Optional[str] = typer.Option(None, help="Target VLM: local directory or hub id (default: embedded)."),
    draft: Optional[str] = typer.Option(None, help="Draft model: local directory or hub id."),
    captioner: Optional[str] = typer.Option(None, help="Captioner (HF image-to-text) for the caption view."),
    captioner_prompt: Optional[str] = typer.Option(None, help="Task prompt for the captioner, e.g. `<CAPTION>` for Florence-2 (default: the one an `mmspec train` captioner records)."),
    views: str = typer.Option("M", help="Drafting views: letters M,T,C,P or names, comma-separated (pooled:36); "
                              "several = the in-batch ensemble (e.g. MT, MTC). M is the fastest measured "
                              "with the embedded pair (docs/perf.md)."),
    weights: Optional[str] = typer.Option(None, help="Ensemble weights, comma-separated, one per view (default equal)."),
    gamma: int = typer.Option(5, help="Draft tokens per block (the chain's length)."),
    tree: Optional[str] = typer.Option(None, help="Block shape: chain (default), dynamic (EAGLE-2 token tree with "
                                       "the device's measured defaults), or a static tree as JSON child-rank paths, "
                                       "e.g. '[[0],[1],[0,0]]'."),
    tree_depth: Optional[int] = typer.Option(None, help="Dynamic tree: expansion steps."),
    tree_topk: Optional[int] = typer.Option(None, help="Dynamic tree: children per node and nodes expanded per depth."),
    tree_budget: Optional[int] = typer.Option(None, help="Dynamic tree: nodes verified per block (root excluded)."),
    tree_children: str = typer.Option("mixture", help="Tree children from the views' mixture, or 'views': each "
                                      "view's own top tokens."),
    stop_below: Optional[float] = typer.Option(None, help="Chains: stop drafting a block when the draft's "
                                               "probability of its proposal falls below this (lossless)."),
    cuda_graphs: str = typer.Option("auto", help="auto (on for a CUDA device), on, off."),
    max_new_tokens: int = typer.Option(128),
    temperature: float = typer.Option(0.0, help="0 = greedy (exactly the target's greedy output)."),
    top_k: Optional[int] = typer.Option(None),
    top_p: Optional[float] = typer.Option(None),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (same seed, same output)."),
    compare: bool = typer.Option(True, help="Also run target.generate and report speed-up and identity (greedy)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16 (auto: float32 on the CPU, where "
                              "half precision is several times slower; the checkpoint's own on a GPU)."),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:1, ..."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for torch (default: torch's choice); give "
                                          "each of several runs side by side a share of the cores."),
):
    """Answer one prompt with speculative decoding and print the block statistics."""
    try:
        from mmspec.decoder import SpecDecoder
        from mmspec.inputs import frame_prompt, load_images, processor_inputs
        from mmspec.tree import parse_tree
        from mmspec.verify import SamplingParams

        _check_max_new_tokens(max_new_tokens)
        tree_kw = dict(tree=tree, tree_depth=tree_depth, tree_topk=tree_topk, tree_budget=tree_budget,
                       tree_children=tree_children, stop_below=stop_below, cuda_graphs=_graphs_flag(cuda_graphs))
        if isinstance(gamma, bool) or gamma < 1:
            raise MMSpecError(f"--gamma must be a whole number >= 1, got {gamma}")
        parse_tree(tree, gamma=gamma, device_type=device.split(":")[0], depth=tree_depth, topk=tree_topk,
                   budget=tree_budget, children=tree_children, stop_below=stop_below)  # refused before loading models
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # refused before loading models
        w = _parse_weights(weights)
        _check_prompt(prompt)
        apply_threads(threads)
        if prompt is None and image:  # prompt checks first: before loading any model
            raise MMSpecError("--image was given without --prompt; say what to ask about the image(s)")
        if prompt is None and target is not None:
            raise MMSpecError("pass --prompt (and --image for each image)")
        images = load_images(image) if image else []  # an unreadable image fails before loading too
        t, d, tok, proc, cap, embedded = _load(target, draft, captioner, captioner_prompt, dtype, device)
        if embedded:
            console.print(EMBEDDED_NOTE)
        if prompt is None:
            from mmspec.world import make_sample

            sample = make_sample(*DEFAULT_EXAMPLE)
            prompt_text, images = sample.prompt, sample.images
            console.print("[dim]No prompt given: a bundled chart-QA example from the synthetic world.[/dim]")
        else:
            prompt_text = frame_prompt(prompt, len(images))
        view_list = [v for v in views.split(",") if v]
        dec = SpecDecoder(t, d, tok, views=view_list, weights=w, captioner=cap, gamma=gamma, processor=proc, **tree_kw)
        inputs = {k: v.to(device) for k, v in processor_inputs(proc, prompt_text, images).items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(t.dtype)
        res = dec.generate(inputs["input_ids"], inputs.get("pixel_values"), inputs.get("attention_mask"),
                           max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, images=images)
        base_s = identical = None
        if compare and temperature == 0:
            ref, base_s = _baseline(t, inputs, max_new_tokens)
            identical = ref == res.token_ids
        console.print(f"[bold]Prompt:[/bold] {escape(prompt_text)}")  # user text: "[/INST]" is not markup
        console.print(f"[bold]Answer:[/bold] {escape(res.text)}")
        console.print(_stats_table(f"{dec.method}: {dec.tree.label}, {dec.engine} engine", res, base_s, identical))
        if identical is False:
            raise MMSpecError("the speculative output differs from target.generate; please report this")
    except MMSpecError as e:
        _fail(e)


@app.command()
def demo(
    methods: str = typer.Option("M,T,C,P,MT,MTC,MTCP,M+tree", help="Drafting methods to compare, comma-separated "
                                "(+tree: a dynamic token tree, e.g. M+tree, MTC+tree@16)."),
    families: str = typer.Option("chartqa,textvqa,spot_the_diff,pororosv", help="World families (1, 2 and 5 images)."),
    max_new_tokens: int = typer.Option(64),
    gamma: int = typer.Option(5),
    repeats: int = typer.Option(3, help="Runs of the target alone and of each method per family, interleaved; "
                                "the speed-up is the ratio of their medians."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for torch (default: torch's choice)."),
):
    """Run every drafting method on a few synthetic-world samples with the embedded models.

    Prints, per method, whether the output is identical to the target's, the block efficiency
    and the speed-up over the target alone (medians of `--repeats` interleaved runs)."""
    try:
        from mmspec.bench.config import parse_method
        from mmspec.decoder import SpecDecoder
        from mmspec.inputs import processor_inputs
        from mmspec.views import parse_views
        from mmspec.world import FAMILIES, make_sample

        _check_max_new_tokens(max_new_tokens)
        if repeats < 1:
            raise MMSpecError(f"--repeats must be >= 1, got {repeats}")
        fams, meths = _names(families), _names(methods)  # every name checked before any model runs
        unknown = [f for f in fams if f not in FAMILIES]
        if unknown or not fams:
            raise MMSpecError(f"--families: unknown family {', '.join(map(repr, unknown)) or '(none given)'}; "
                              f"use some of {', '.join(FAMILIES)}")
        if not meths:
            raise MMSpecError("--methods is empty; give drafting methods such as M,T,MT")
        for m in meths:
            try:
                views_m, kw_m = parse_method(m)
                if "head" in kw_m:
                    raise MMSpecError(f"{m!r} drafts with a trained head; the demo compares the pack's views "
                                      "(use mmspec bench run -m for head methods)")
                parse_views(views_m)
            except MMSpecError as e:
                raise MMSpecError(f"--methods: {e}") from None
        apply_threads(threads)
        t, d, tok, proc, cap, _ = _load(None, None, None, None, "auto", "cpu")
        console.print(EMBEDDED_NOTE)
        decs = {m: SpecDecoder(t, d, tok, views=parse_method(m)[0], captioner=cap, gamma=gamma, processor=proc,
                               **parse_method(m)[1]) for m in meths}
        tab = Table(title=f"mmspec demo (embedded models, CPU, gamma={gamma}, greedy, {max_new_tokens} new tokens)")
        for col in ["family", "images", "method", "tau", "accepted len", f"speed-up (median of {repeats})", "identical"]:
            tab.add_column(col)
        mismatches = []
        for fam in fams:
            s = make_sample(fam, "test", 0)
            inputs = processor_inputs(proc, s.prompt, s.images)
            base_s: list[float] = []
            runs: dict[str, list] = {m: [] for m in decs}
            for _ in range(repeats):  # interleaved: a burst of load hits the target and the methods alike
                ref, secs = _baseline(t, inputs, max_new_tokens)
                base_s.append(secs)
                for m, dec in decs.items():
                    runs[m].append(dec.generate(inputs["input_ids"], inputs.get("pixel_values"),
                                                inputs.get("attention_mask"), max_new_tokens=max_new_tokens,
                                                images=s.images))
            console.print(f"[bold]{fam}[/bold] — {escape(s.question or s.prompt[:80])}\n"
                          f"  target: {escape(tok.decode(ref, skip_special_tokens=True))}")
            for m, results in runs.items():
                st = results[0].stats
                same = all(r.token_ids == ref for r in results)
                if not same:
                    mismatches.append(f"{fam}/{m}")
                speedup = statistics.median(base_s) / statistics.median(r.stats.total_s for r in results)
                tab.add_row(fam, str(len(s.images)), m, f"{st.tau:.2f}", f"{st.mean_accepted_length:.2f}",
                            f"{speedup:.2f}x", "[green]yes[/green]" if same else "[red]NO[/red]")
        console.print(tab)
        console.print(f"[dim]tau = tokens per block incl. the bonus/recovered token; speed-up = median time of the "
                      f"target alone / median time of the method over {repeats} interleaved run(s) of one sample "
                      "on this machine: other load on it moves the figure (see `mmspec bench` for medians over "
                      "100 samples).[/dim]")
        if mismatches:
            raise MMSpecError(f"output differs from target.generate for {', '.join(mismatches)}; "
                              "greedy speculative decoding must be exact, please report this")
    except MMSpecError as e:
        _fail(e)


def _mount() -> None:
    from mmspec.bench.cli import bench_app, report_command
    from mmspec.train.cli import train_app

    app.add_typer(bench_app, name="bench")
    app.command("report", help="Render report.md + plots from a bench results directory.")(report_command)
    app.add_typer(train_app, name="train")


_mount()

if __name__ == "__main__":  # pragma: no cover
    app()
