"""The root ``mmspec`` typer app: every command registered here, explicitly, in ``--help`` order."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from mmspec.cli.audit import audit
from mmspec.cli.bench import bench_app, report_command
from mmspec.cli.check import check_app
from mmspec.cli.demo import demo
from mmspec.cli.export import export_app
from mmspec.cli.generate import generate
from mmspec.cli.serve import serve
from mmspec.cli.train import train_app


def _no_type(ctx) -> None:
    return None


def _plain_flags(cmd):
    """A command whose on/off flags (and --help) show no ``<bool>`` type column in ``--help``; a
    group's subcommands too, as they are looked up (instance attributes: typer's classes untouched)."""
    if cmd is None:
        return cmd
    for p in cmd.params:
        if getattr(p, "is_flag", False):
            p.display_type_rich = _no_type
    help_option = cmd.get_help_option

    def quiet_help(ctx):
        opt = help_option(ctx)
        if opt is not None:
            opt.display_type_rich = _no_type
        return opt

    cmd.get_help_option = quiet_help
    if hasattr(cmd, "commands"):  # a group (typer carries its own click)
        lookup = cmd.get_command
        cmd.get_command = lambda ctx, name: _plain_flags(lookup(ctx, name))
    return cmd


class _Group(TyperGroup):
    def get_command(self, ctx, name):
        return _plain_flags(super().get_command(ctx, name))

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.display_type_rich = _no_type
        return opt


app = typer.Typer(help="Lossless speculative decoding for vision-language models (IbED).", cls=_Group,
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
app.add_typer(check_app, name="check")
