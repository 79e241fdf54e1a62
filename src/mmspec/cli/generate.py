"""``mmspec generate``: one prompt, answered with speculative decoding, with its block statistics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from mmspec.cli import common
from mmspec.cli.common import check_max_new_tokens, check_prompt, fail, graphs_flag, parse_weights
from mmspec.errors import MMSpecError

# `mmspec generate` with no prompt: a world sample the embedded target answers right (checked by
# tests/test_cli.py with the world's own fact check), not test sample 0, which it gets wrong
DEFAULT_EXAMPLE = ("chartqa", "test", 10)
EMBEDDED_NOTE = ("[dim]Using the embedded tiny models: they only know mmspec's synthetic world "
                 "(charts, signs, shapes, differences, edits, little stories), not real photos.[/dim]")


def load_models(target, draft, captioner, captioner_prompt, dtype, device):
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


def stats_table(title: str, res, baseline_s: float | None = None, identical: bool | None = None) -> Table:
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


def baseline(target, inputs, max_new_tokens):
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), time.perf_counter() - t0


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

        check_max_new_tokens(max_new_tokens)
        tree_kw = dict(tree=tree, tree_depth=tree_depth, tree_topk=tree_topk, tree_budget=tree_budget,
                       tree_children=tree_children, stop_below=stop_below, cuda_graphs=graphs_flag(cuda_graphs))
        if isinstance(gamma, bool) or gamma < 1:
            raise MMSpecError(f"--gamma must be a whole number >= 1, got {gamma}")
        parse_tree(tree, gamma=gamma, device_type=device.split(":")[0], depth=tree_depth, topk=tree_topk,
                   budget=tree_budget, children=tree_children, stop_below=stop_below)  # refused before loading models
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # refused before loading models
        w = parse_weights(weights)
        check_prompt(prompt)
        common.set_threads(threads)
        if prompt is None and image:  # prompt checks first: before loading any model
            raise MMSpecError("--image was given without --prompt; say what to ask about the image(s)")
        if prompt is None and target is not None:
            raise MMSpecError("pass --prompt (and --image for each image)")
        images = load_images(image) if image else []  # an unreadable image fails before loading too
        t, d, tok, proc, cap, embedded = load_models(target, draft, captioner, captioner_prompt, dtype, device)
        if embedded:
            common.console.print(EMBEDDED_NOTE)
        if prompt is None:
            from mmspec.world import make_sample

            sample = make_sample(*DEFAULT_EXAMPLE)
            prompt_text, images = sample.prompt, sample.images
            common.console.print("[dim]No prompt given: a bundled chart-QA example from the synthetic world.[/dim]")
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
            ref, base_s = baseline(t, inputs, max_new_tokens)
            identical = ref == res.token_ids
        common.console.print(f"[bold]Prompt:[/bold] {escape(prompt_text)}")  # user text: "[/INST]" is not markup
        common.console.print(f"[bold]Answer:[/bold] {escape(res.text)}")
        common.console.print(stats_table(f"{dec.method}: {dec.tree.label}, {dec.engine} engine", res, base_s, identical))
        if identical is False:
            raise MMSpecError("the speculative output differs from target.generate; please report this")
    except MMSpecError as e:
        fail(e)
