"""``mmspec train``: a typer sub-app whose commands only map flags onto the typed configs.

Commands: ``embedded`` (the whole pack), ``stage`` (one stage of the recipe) and ``answers`` (a
target's greedy answers for draft distillation) in :mod:`.stages`; ``evaluate`` and ``facts``
(quality figures) in :mod:`.measure`; ``head`` (a feature-level draft head, :mod:`mmspec.heads.cli`)
and ``align`` (a substitute encoder, :mod:`mmspec.align`). The app and the options they share live
in :mod:`.app`.
"""

from mmspec.train.cli.app import train_app

# each module registers its commands on train_app as it is imported; `--help` lists them in this order
from mmspec.train.cli import stages  # noqa: E402,F401  isort: skip
from mmspec.train.cli import measure  # noqa: E402,F401  isort: skip

__all__ = ["train_app"]

from mmspec.heads.cli import head as _head  # noqa: E402  isort: skip

train_app.command("head")(_head)

from mmspec.align import align_command as _align  # noqa: E402  isort: skip

train_app.command("align")(_align)

from mmspec.train.video import video_command as _video  # noqa: E402  isort: skip

train_app.command("video")(_video)
