"""``mmspec train``: a typer sub-app whose commands only map flags onto the typed training configs.

Commands, one module each: ``embedded``, ``stage`` and ``answers`` (:mod:`.stages`: the embedded
pack's recipe), ``evaluate`` and ``facts`` (:mod:`.measure`: quality figures), ``head`` (a
feature-level draft head, :mod:`.head`), ``align`` (a substitute encoder, :mod:`.align`) and
``video`` (the embedded video pair, :mod:`.video`). Shared options live in :mod:`.common`.
"""

import typer

from mmspec.cli.train.align import align_command
from mmspec.cli.train.head import head
from mmspec.cli.train.measure import evaluate_cmd, facts_cmd
from mmspec.cli.train.stages import answers_cmd, embedded, stage
from mmspec.cli.train.video import video_command

train_app = typer.Typer(help="Train what mmspec drafts and measures with: the embedded pack (target, draft, "
                        "captioner) on the synthetic world, feature-level draft heads (EAGLE, EAGLE-3, MSD), "
                        "substitute encoders (align) and the video pair; and measure their answers.",
                        no_args_is_help=True)
train_app.command("embedded")(embedded)
train_app.command("stage")(stage)
train_app.command("answers")(answers_cmd)
train_app.command("evaluate")(evaluate_cmd)
train_app.command("facts")(facts_cmd)
train_app.command("head")(head)
train_app.command("align")(align_command)
train_app.command("video")(video_command)

__all__ = ["train_app"]
