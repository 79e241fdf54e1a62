"""The package's layering: the decoder side (``models/``, ``embedded.py``) never imports the
training code, and ``bench`` never imports ``train`` (``train`` may use ``bench``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mmspec"


def imported(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (function bodies included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part, forbidden", [("models", "mmspec.train"), ("embedded.py", "mmspec.train"),
                                             ("bench", "mmspec.train")])
def test_layers_do_not_import_upwards(part, forbidden):
    files = sorted((SRC / part).rglob("*.py")) if (SRC / part).is_dir() else [SRC / part]
    assert files
    bad = {f.relative_to(SRC).as_posix(): sorted(m for m in imported(f)
                                                 if m == forbidden or m.startswith(forbidden + "."))
           for f in files}
    assert not {f: m for f, m in bad.items() if m}, bad


def test_the_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from mmspec.train.checkpoint import save_checkpoint\n")
    assert "mmspec.train.checkpoint" in imported(f)
