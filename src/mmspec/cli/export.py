"""``mmspec export head``: a head trained here, written in the format SGLang, vLLM or SafeAILab's
EAGLE serve (:func:`mmspec.heads.formats.export_head`). Flags are checked before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.cli.common import console, fail
from mmspec.errors import MMSpecError

export_app = typer.Typer(help="Write what mmspec made in another project's format.", no_args_is_help=True)


@export_app.command("head")
def head(
    head_dir: Path = typer.Argument(..., help="A head directory (mmspec train head's --out, or an EAGLE head)."),
    format: str = typer.Option("eagle3", "--format", help="eagle3 (SGLang, vLLM, SpecForge) or eagle "
                               "(EAGLE-1/2: SafeAILab's EaModel, SGLang's EAGLE)."),
    out: Path = typer.Option(..., help="A new (or empty) directory to write; never overwritten."),
    target: Path | None = typer.Option(None, help="The target model directory: needed by --format eagle "
                                          "(the head file carries its token embedding) and to read an EAGLE head."),
) -> None:
    """Export a draft head as an EAGLE-3 or EAGLE-1/2 checkpoint (config.json + weights).

    Serve an eagle3 export with SGLang (`--speculative-algorithm EAGLE3 --speculative-draft-model-path OUT`)
    or vLLM (`speculative_config={"method": "eagle3", "model": OUT}`); docs/head-formats.md."""
    from mmspec.heads.formats import FORMATS, detect_format, export_head

    try:
        if format not in FORMATS:
            raise MMSpecError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise MMSpecError(f"--out '{out}' exists and is not empty; export into a new directory")
        kind = detect_format(head_dir)
        if kind is None:
            raise MMSpecError(f"'{head_dir}' is not a head directory (mmspec, EAGLE or EAGLE-3); pass the --out of "
                              "mmspec train head")
        if target is None and (format == "eagle" or kind != "mmspec"):
            why = "--format eagle writes the target's token embedding" if format == "eagle" else \
                "an EAGLE head is read against its target"
            raise MMSpecError(f"{why}: pass --target DIR")
        from mmspec.heads.directory import load_head

        model = None
        if target is not None:
            from mmspec.models.loading import load_model

            model = load_model(str(target), dtype="float32")
        written = export_head(load_head(head_dir, model), out, format, target=model)
        console.print(f"wrote {format} head to {written}")
    except MMSpecError as e:
        fail(e)
