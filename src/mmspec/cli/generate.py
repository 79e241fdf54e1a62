"""``mmspec generate``: one prompt, answered with speculative decoding, with its block statistics."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from mmspec.cli import common, options
from mmspec.cli.common import fail
from mmspec.cli.options import ModelFlags, RuntimeFlags, ShapeFlags, ViewFlags, takes
from mmspec.errors import MMSpecError

# `mmspec generate` with no prompt: a world sample the embedded target answers right (checked by
# tests/cli/test_cli.py with the world's own fact check), not test sample 0, which it gets wrong
DEFAULT_EXAMPLE = ("chartqa", "test", 10)
WORLD_WORDING = ("the embedded models answer well only in the world's wording, the image first: 'USER: <image> "
                 "For the following question, provide a detailed explanation of your reasoning leading to the "
                 "answer. Which label has the highest value in the chart? ASSISTANT:' (README, \"Try it in "
                 "Python\"); other wording gets nonsense at a low tau")
EMBEDDED_NOTE = ("[dim]Using the embedded tiny models: they only know mmspec's synthetic world "
                 "(charts, signs, shapes, differences, edits, little stories), not real photos.[/dim]")


def load_models(target, draft, captioner, captioner_prompt, dtype, device, head=None):
    """Models for generate/demo: the given checkpoints, or the embedded pack. With ``head`` (a
    head directory, checked already) the draft is that directory: SpecDecoder loads the head
    against the target."""
    from transformers.utils import logging as hf_logging

    from mmspec.models.captioner import HFCaptioner

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the answer

    from mmspec.models.loading import (
        check_same_vocabulary,
        compute_dtype,
        load_model,
        load_processor,
        load_tokenizer_if_any,
        resolve_device,
    )

    device = str(resolve_device(device))
    dtype = compute_dtype(dtype, device)  # auto: float32 on the CPU, the checkpoint's own on a GPU
    if target is None:
        import torch

        from mmspec.embedded import load_embedded

        e = load_embedded(dtype=torch.float32 if dtype == "auto" else dtype, device=device)  # saved in fp16
        cap = e.captioner()
        return e.target, (str(head) if head else draft if is_model_free(draft) else e.draft), e.tokenizer, e.processor, \
            cap, True
    processor = load_processor(target)
    tok = getattr(processor, "tokenizer", processor)
    if head is None and not is_model_free(draft):
        check_same_vocabulary(tok, load_tokenizer_if_any(draft))  # before the weights load
    t = load_model(target, dtype=dtype, device=device)
    d = str(head) if head is not None else draft if is_model_free(draft) else load_model(draft, dtype=dtype,
                                                                                           device=device)
    cap = HFCaptioner.from_pretrained(captioner, prompt=captioner_prompt, dtype=dtype) if captioner else None
    if cap is not None:
        cap.model.to(device)
    return t, d, tok, processor, cap, False


def is_model_free(draft) -> bool:
    """``--draft lookup`` / ``--draft suffix``: drafting with no model (:mod:`mmspec.drafting.lookup`)."""
    from mmspec.checks import model_free_name

    return model_free_name(draft) is not None


def build_decoder(o, target, draft, tokenizer, processor, captioner, **extra):
    """The SpecDecoder that ``o`` (checked GenerateOptions) describes, over :func:`load_models`'
    models (``generate`` and ``serve``); ``extra``: more SpecDecoder keywords (serve's prefix_cache_mb)."""
    from mmspec.decoder import SpecDecoder
    from mmspec.drafting.views import parse_views

    draft_proc = None
    if o.draft_reads_own_images:  # a draft of another family reads the PIL images its own way
        from mmspec.models.loading import load_processor

        draft_proc = load_processor(o.draft)
    reads_captions = any(v.kind == "caption" for v in parse_views(o.view_list))  # a head: views are M only
    return SpecDecoder(target, draft, tokenizer, views=o.view_list, weights=o.weight_list,
                       captioner=captioner if reads_captions else None, gamma=o.gamma, processor=processor,
                       draft_processor=draft_proc, tree=o.tree, tree_depth=o.tree_depth, tree_topk=o.tree_topk,
                       tree_budget=o.tree_budget, tree_children=o.tree_children, stop_below=o.stop_below,
                       cuda_graphs=o.graphs, compile=o.compile, model_free=o.model_free, lookup_options=o.lookup_dict, **extra)


def check_loaded_head(o, dec) -> None:
    """``--check-head`` (on by default): a head drafting for ``dec`` runs a short calibration
    (:func:`mmspec.heads.check.calibrate`) and says what it measured; near τ 1, why."""
    if o.head is None or not o.check_head:
        return
    from mmspec.heads.check import calibrate

    try:
        report = calibrate(dec)  # the world's questions, framed by the target's own chat template
    except MMSpecError as e:  # a processor or template that cannot take the world's pictures and questions
        common.err_console.print(f"head check skipped ({e}); run mmspec check head DIR --target T --prompts FILE "
                                 "with prompts of your own", markup=False, highlight=False)
        return
    for line in report.lines():
        (common.err_console if report.warnings else common.console).print(
            line if report.warnings else f"[dim]{escape(line)}[/dim]", markup=not report.warnings, highlight=False)


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
    if st.shapes:  # tree auto: the shapes this answer's steps drafted, and the measured figures they were chosen by
        tab.add_row("block shapes drafted (steps)", ", ".join(f"{k}: {v}" for k, v in st.shapes.items()))
        for b, r in (st.shape_rates or {}).items():
            tab.add_row(f"measured at batch {b}: tokens/s", ", ".join(
                f"{k} {v['tokens_per_s']:.0f}" for k, v in r["shapes"].items()) + f" -> {r['choice']}")
    setup = max(st.compile_s, st.capture_s)  # one-off: compile_s lies within capture_s where the step is captured
    if setup > 0:
        tab.add_row("time: compiling / CUDA-graph capture (first calls of each shape, within total)",
                    f"{st.compile_s*1e3:.1f} / {st.capture_s*1e3:.1f} ms")
    if baseline_s is not None:
        speedup = f"{baseline_s*1e3:.1f} ms -> speed-up {baseline_s/st.total_s:.2f}x"
        if setup > 0:  # a served or second call of the same shapes pays none of it
            speedup = (f"{baseline_s*1e3:.1f} ms -> speed-up {baseline_s/max(st.total_s - setup, 1e-9):.2f}x "
                       f"without the {setup*1e3:.1f} ms of compiling/capture ({baseline_s/st.total_s:.2f}x with it)")
        tab.add_row("target alone (generate)", speedup)
    if identical is not None:
        tab.add_row("identical to target.generate", "[green]yes[/green]" if identical else "[red]NO[/red]")
    return tab


def baseline(target, inputs, max_new_tokens, **constrained):
    """The target's own greedy decoding (``constrained``: generate()'s logits_processor of a constraint)."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **constrained)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), time.perf_counter() - t0


@takes
def generate(
    *,
    prompt: str | None = typer.Option(None, help="Prompt text; `<image>` / `<video>` mark where each image / "
                                         "video goes (one each in front if missing). Framed by the target's chat "
                                         "template where it has one, else as `USER: ... ASSISTANT:`."),
    image: list[Path] = typer.Option([], "--image", "-i", help="Image file; repeat for several images, in slot order."),
    video: list[Path] = typer.Option([], "--video", help="A video for the video families (LLaVA-OneVision, "
                                     "Video-LLaVA, Qwen2-VL, Qwen2.5-VL): a directory of its frames (PNG/JPEG, "
                                     "name order) or a video file (needs PyAV: pip install av). Repeatable."),
    frames: int = typer.Option(8, help="Frames taken from each --video, evenly spaced."),
    models: ModelFlags,
    views: ViewFlags,
    shape: ShapeFlags,
    max_new_tokens: int = options.max_new_tokens(128),
    temperature: float = typer.Option(0.0, help="0 = greedy (exactly the target's greedy output)."),
    top_k: int | None = typer.Option(None, help="Sampling only (--temperature > 0): keep the k likeliest tokens."),
    top_p: float | None = typer.Option(None, help="Sampling only (--temperature > 0): nucleus filter."),
    seed: int | None = typer.Option(None, help="Seed for sampling: same seed, same output, whatever the drafting (the target's own seeded sample)."),
    compare: bool = typer.Option(True, help="Also run target.generate and report speed-up and identity (greedy)."),
    json_schema: Path | None = typer.Option(None, help="Constrain the answer to this JSON schema (a .json file); "
                                            "tight separators (docs/serve.md, Structured outputs)."),
    regex: str | None = typer.Option(None, help="Constrain the answer to this regular expression."),
    choice: str | None = typer.Option(None, help="Constrain the answer to one of these comma-separated strings."),
    runtime: RuntimeFlags,
    check_head: bool = options.CHECK_HEAD,
):
    """Answer one prompt with speculative decoding and print the block statistics.

    The draft is a model (`--draft DIR`, drafting views `--views`) or a trained feature-level
    head (`--head DIR`, or `--draft HEAD_DIR`). Other families (LLaVA-NeXT, OneVision,
    Video-LLaVA, Qwen2-VL, Qwen2.5-VL) get the processor's whole output; `--video` gives
    the video families a clip."""
    from mmspec.cli.checks import GenerateOptions, check_generate

    try:
        opts = check_generate(GenerateOptions(
            prompt=prompt, image=list(image), video=list(video), frames=frames, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, check_head=check_head,
            json_schema=json_schema, regex=regex, choice=choice,
            **models.fields(), **views.fields(), **shape.fields(), **runtime.fields()))  # every option, before any model loads
        _run(opts, compare)
    except MMSpecError as e:
        fail(e)


def _run(o, compare: bool) -> None:
    """Load, decode and print; ``o`` is the checked GenerateOptions."""
    from mmspec.inputs import chat_prompt, load_images, load_video, processor_inputs, to_target

    common.set_threads(o.threads, say=True)
    images = load_images(o.image) if o.image else []  # an unreadable image fails before loading too
    clips = [load_video(v, o.frames) for v in o.video]
    t, d, tok, proc, cap, embedded = load_models(o.target, o.draft, o.captioner, o.captioner_prompt, o.dtype,
                                                 o.device, head=o.head)
    if embedded:
        common.console.print(EMBEDDED_NOTE)
    if o.prompt is None:
        from mmspec.world import make_sample

        sample = make_sample(*DEFAULT_EXAMPLE)
        prompt_text, images = sample.prompt, sample.images
        common.console.print("[dim]No prompt given: a bundled chart-QA example from the synthetic world.[/dim]")
    else:
        prompt_text = chat_prompt(proc, o.prompt, len(images), len(clips))
    dec = build_decoder(o, t, d, tok, proc, cap)
    check_loaded_head(o, dec)
    inputs = to_target(processor_inputs(proc, prompt_text, images, clips), o.device, t.dtype)  # the whole output
    constrained = {"constraint": o.constraint} if o.constraint is not None else {}  # --json-schema/--regex/--choice
    res = dec.generate(**inputs, max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_k=o.top_k,
                       top_p=o.top_p, seed=o.seed, images=images if not clips else None, videos=clips or None,
                       **constrained)
    base_s = identical = None
    if compare and o.temperature == 0:
        masked = {}
        if o.constraint is not None:  # the reference: the target's own decoding under the same constraint
            from mmspec.audit.constrained import constrained_kwargs

            masked = constrained_kwargs(t, tok, dec.eos_ids, o.constraint)
        ref, base_s = baseline(t, inputs, o.max_new_tokens, **masked)
        identical = ref == res.token_ids
    common.console.print(f"[bold]Prompt:[/bold] {escape(prompt_text)}")  # user text: "[/INST]" is not markup
    common.console.print(f"[bold]Answer:[/bold] {escape(res.text)}")
    common.console.print(stats_table(f"{dec.method}: {dec.tree_label}, {dec.engine} engine", res, base_s, identical))
    if identical is False:
        raise MMSpecError("the speculative output differs from target.generate; please report this")
