"""``mmspec check head``: a head proves itself against its target before it is served
(:mod:`mmspec.heads.check`), in the chain or tree it will draft (``--gamma``, ``--tree``: the
block shape as ``generate`` and ``serve`` take it). Every flag and file is checked before any
model loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.cli import common, options
from mmspec.cli.common import fail
from mmspec.cli.options import ShapeFlags, takes
from mmspec.errors import MMSpecError

check_app = typer.Typer(help="Check that what mmspec is given works before it is used.", no_args_is_help=True)


@check_app.command("head")
@takes
def head(
    head_dir: Path = typer.Argument(..., help="A head directory: mmspec train head's --out, or an EAGLE-1/2, "
                                    "EAGLE-3 (SafeAILab, SpecForge, SGLang) or speculators head."),
    *,
    target: str | None = typer.Option(None, help="The target model directory or hub id (default: the embedded "
                                      "target).", rich_help_panel=options.MODELS),
    prompts: Path | None = typer.Option(None, help="Calibration prompts: a JSONL file, one `{\"prompt\": \"USER: <image> ... ASSISTANT:\", "
                                        "\"images\": [\"a.png\"]}` per line (default: 4 of the embedded world's)."),
    max_new_tokens: int = options.max_new_tokens(24, "calibration prompt"),
    shape: ShapeFlags,
    device: str = options.device(),
    threads: int | None = options.THREADS,
) -> None:
    """Calibrate a draft head against its target on a few prompts; warn when it barely drafts.

    Reports tau, acceptance by depth, the feature layers it reads and where they come from, the
    training it records, and a diagnosis (drafts, under-trained, under-trained in depth, or
    broken), measured in the block shape given (as the server will draft it); when tau is near 1,
    names the likely causes (exit code 1 then)."""
    try:
        from mmspec.cli.checks import GenerateOptions, at_least, check_decoder, head_variant
        from mmspec.heads.check import read_prompts

        at_least("--max-new-tokens", max_new_tokens)
        variant = head_variant(str(head_dir), target)  # any kind; against the target's config
        o = check_decoder(GenerateOptions(target=target, head=str(head_dir), device=device, threads=threads,
                                          **shape.fields()))
        calib = read_prompts(prompts) if prompts is not None else None
        common.set_threads(threads)
        from mmspec.cli.generate import build_decoder, load_models
        from mmspec.heads.check import calibrate

        t, d, tok, proc, _, _ = load_models(o.target, None, None, None, "auto", o.device, head=o.head)
        report = calibrate(build_decoder(o, t, d, tok, proc, None), calib, max_new_tokens=max_new_tokens)
        common.console.print(f"{variant} head {head_dir}")
        for line in report.lines():
            common.console.print(line, markup=False, highlight=False)
    except MMSpecError as e:
        fail(e)
    if not report.ok:
        raise typer.Exit(code=1)
