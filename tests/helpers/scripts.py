"""The repository's speed scripts (top-level ``perf/``), imported
by path for the tests that call their functions on tiny models.

A script is registered as ``_mmspec_<folder>_<name>``, the name perf/speed.py's ``sibling()``
gives the scripts it loads, so each is imported once. A script that imports a helper beside it by
plain name (``from draftstep import ...``, as running ``python perf/speed.py`` allows) gets that
sibling loaded by path first under its plain name, so nothing edits ``sys.path``. A scripts folder
that is a package is imported as one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def scripts_dir() -> Path:
    """The folder of the speed scripts, ``perf/``."""
    if any((ROOT / "perf").glob("*.py")):
        return ROOT / "perf"
    raise FileNotFoundError(f"no perf/ folder of scripts under {ROOT}")


def load_script(name: str) -> ModuleType:
    """The script ``<scripts_dir>/<name>.py`` as a module (imported once, then reused)."""
    folder = scripts_dir()
    if (folder / "__init__.py").is_file():
        if folder.name not in sys.modules:
            _exec(folder / "__init__.py", folder.name, package=folder)
        return importlib.import_module(f"{folder.name}.{name}")
    return _load_plain(folder / f"{name}.py", f"_mmspec_{folder.name}_{name}", set())


def _load_plain(path: Path, mod_name: str, loading: set[str]) -> ModuleType:
    """``path`` as module ``mod_name`` (the name the scripts give each other: perf/speed.py's
    ``sibling()`` uses ``_mmspec_perf_<name>``), after the siblings it imports by plain name."""
    mod = sys.modules.get(mod_name)
    if mod is not None and getattr(mod, "__file__", None) == str(path):
        return mod
    loading.add(path.stem)
    for sibling in sorted(_siblings(path) - loading):
        _load_plain(path.parent / f"{sibling}.py", sibling, loading)
    return _exec(path, mod_name)


def _siblings(path: Path) -> set[str]:
    """The scripts beside ``path`` that it imports (function bodies included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if (path.parent / f"{n}.py").is_file()}


def _exec(path: Path, name: str, package: Path | None = None) -> ModuleType:
    locations = [str(package)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module through sys.modules
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
