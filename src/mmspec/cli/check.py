"""``mmspec check head``: a head proves itself against its target before it is served
(:mod:`mmspec.heads.check`). Every flag and file is checked before any model loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.cli import common
from mmspec.cli.common import fail
from mmspec.errors import MMSpecError

check_app = typer.Typer(help="Check that what mmspec is given works before it is used.", no_args_is_help=True)


@check_app.command("head")
def head(
    head_dir: Path = typer.Argument(..., help="A head directory: mmspec train head's --out, or an EAGLE-1/2, "
                                    "EAGLE-3 (SafeAILab, SpecForge, SGLang) or speculators head."),
    target: str | None = typer.Option(None, help="The target model directory or hub id (default: the embedded "
                                      "target)."),
    prompts: Path | None = typer.Option(None, help="Calibration prompts: a JSONL file, one `{\"prompt\": \"USER: <image> ... ASSISTANT:\", "
                                        "\"images\": [\"a.png\"]}` per line (default: 4 of the embedded world's)."),
    max_new_tokens: int = typer.Option(24, help="Tokens per calibration prompt."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    threads: int | None = common.THREADS,
) -> None:
    """Calibrate a draft head against its target on a few prompts; warn when it barely drafts.

    Reports tau, acceptance by depth, the feature layers it reads and where they come from; when
    tau is near 1, names the likely causes (exit code 1 then)."""
    try:
        from mmspec.cli.checks import at_least, check_device, check_model_dir, check_threads, head_variant
        from mmspec.heads.check import read_prompts

        at_least("--max-new-tokens", max_new_tokens)
        check_threads(threads)
        check_device(device)
        check_model_dir(target, "--target")
        variant = head_variant(str(head_dir), target)  # any kind; against the target's config
        calib = read_prompts(prompts) if prompts is not None else None
        common.set_threads(threads)
        from mmspec.cli.generate import load_models
        from mmspec.decoder import SpecDecoder
        from mmspec.heads.check import calibrate

        t, d, tok, proc, _, _ = load_models(target, None, None, None, "auto", device, head=str(head_dir))
        dec = SpecDecoder(t, d, tok, processor=proc)
        report = calibrate(dec, calib, max_new_tokens=max_new_tokens)
        common.console.print(f"{variant} head {head_dir}")
        for line in report.lines():
            common.console.print(line, markup=False, highlight=False)
    except MMSpecError as e:
        fail(e)
    if not report.ok:
        raise typer.Exit(code=1)
