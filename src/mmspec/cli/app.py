"""The root ``mmspec`` typer app: every command registered here, explicitly, in ``--help`` order."""

from __future__ import annotations

import typer

from mmspec.cli.audit import audit
from mmspec.cli.bench import bench_app, report_command
from mmspec.cli.demo import demo
from mmspec.cli.export import export_app
from mmspec.cli.generate import generate
from mmspec.cli.serve import serve
from mmspec.cli.train import train_app

app = typer.Typer(help="Lossless speculative decoding for vision-language models (IbED).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")  # markdown: docstring paragraphs reflow to the terminal

app.command()(generate)
app.command()(demo)
app.command()(serve)
app.command()(audit)
app.add_typer(bench_app, name="bench")
app.command("report", help="Render report.md + plots from a bench results directory.")(report_command)
app.add_typer(train_app, name="train")
app.add_typer(export_app, name="export")
