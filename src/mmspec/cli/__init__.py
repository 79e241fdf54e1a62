"""The ``mmspec`` command line: the only package that imports typer.

One module per command (``generate``, ``demo``, ``bench`` with ``report``, ``train/`` with one
module per training command); :mod:`.common` holds what they share (consoles, the one-line error
exit, ``--threads``); :mod:`.checks` checks every option of generate, demo and bench run in one
place per command, before any model loads or file is written. Commands map flags onto the library's typed configs and print results;
the work is in the library, which never imports this package (``tests/core/test_layering.py``).
"""

from mmspec.cli.app import app

__all__ = ["app"]
