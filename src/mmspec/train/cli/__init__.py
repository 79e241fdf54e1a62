"""``mmspec train``: a typer sub-app whose commands only map flags onto the typed configs.

Commands: ``embedded`` (the whole pack), ``stage`` (one stage of the recipe), ``head`` (a feature-level
draft head, :mod:`mmspec.heads.cli`), ``answers`` (a
target's greedy answers for draft distillation) and ``grow`` (more LM layers) in
:mod:`.stages`; ``read`` (reading pre-training of the vision tower) and ``copy`` (copy practice
for the LM) in :mod:`.practice`; ``evaluate``, ``facts`` and ``probe`` (quality figures) in
:mod:`.measure`. The app and the options they share live in :mod:`.app`.
"""

from mmspec.train.cli.app import train_app

# each module registers its commands on train_app as it is imported; `--help` lists them in this order
from mmspec.train.cli import stages  # noqa: E402,F401  isort: skip
from mmspec.train.cli import practice  # noqa: E402,F401  isort: skip
from mmspec.train.cli import measure  # noqa: E402,F401  isort: skip

__all__ = ["train_app"]

from mmspec.heads.cli import head as _head  # noqa: E402  isort: skip

train_app.command("head")(_head)

from mmspec.align import align_command as _align  # noqa: E402  isort: skip

train_app.command("align")(_align)
