"""The benchmark side's optional packages (matplotlib, pyarrow, datasets), imported on first use.

Owns the one-line refusal when one is missing. The decoding library installs without them;
``mmspec report``'s plots and reading real benchmark files (parquet, ``datasets.save_to_disk``)
need them: ``pip install 'mmspec[bench]'``. Nothing here is imported by ``import mmspec``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mmspec.errors import MMSpecError


def require(module: str, what: str, extra: str = "bench") -> ModuleType:
    """``import module``, or MMSpecError "<what> needs <package>: pip install 'mmspec[<extra>]'"
    when its package is not installed (another import error inside an installed package is
    raised as it is)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        package = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != package:
            raise
        raise MMSpecError(f"{what} needs {package}: pip install 'mmspec[{extra}]'") from None
