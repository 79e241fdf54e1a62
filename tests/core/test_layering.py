"""The package's layering, checked on every import the source names (function bodies included,
relative imports resolved):

- the decoding core (engine, verify, tree, drafter, decoder, multimodal, graphs, views, stats,
  ``models/``, ``heads/model.py``, ``heads/drafter.py``) imports nothing from ``mmspec.cli``,
  ``mmspec.train``, ``mmspec.bench`` or ``mmspec.world``;
- nothing outside ``mmspec/cli/`` imports typer or ``mmspec.cli`` (``__main__.py``, the
  ``python -m mmspec`` entry point, only runs the CLI);
- the decoder side (``models/``, ``embedded.py``) never imports the training code, and ``bench``
  never imports ``train`` (``train`` may use ``bench``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mmspec"
CORE = ["engine.py", "verify.py", "tree.py", "drafter.py", "decoder.py", "multimodal.py", "graphs.py", "views.py",
        "stats.py", "models", "heads/model.py", "heads/drafter.py", "forwards.py", "request.py", "results.py", "batch.py"]
UPPER = ("mmspec.cli", "mmspec.train", "mmspec.bench", "mmspec.world")


def imported(path: Path, text: str | None = None) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (function bodies included;
    ``from . import x`` and ``from .m import x`` resolved against the file's package); ``text``
    stands in for the file's own text."""
    package = ["mmspec", *path.resolve().relative_to(SRC).parent.parts] if path.resolve().is_relative_to(SRC) else []
    names = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = package[:len(package) - node.level + 1] if node.level <= len(package) else []
                base = ".".join(parts + ([node.module] if node.module else []))
                if not node.module:  # from . import x: x may be a module
                    names.update(f"{base}.{a.name}" for a in node.names)
            if base:
                names.add(base)
    return names


def files_of(part: str) -> list[Path]:
    p = SRC / part
    return sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []


def violations(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {f.relative_to(SRC).as_posix(): sorted(m for m in imported(f)
                                                 if any(m == x or m.startswith(x + ".") for x in forbidden))
           for f in files}
    return {f: m for f, m in bad.items() if m}


@pytest.mark.parametrize("part, forbidden", [("models", "mmspec.train"), ("embedded.py", "mmspec.train"),
                                             ("bench", "mmspec.train")])
def test_layers_do_not_import_upwards(part, forbidden):
    files = files_of(part)
    assert files
    assert not violations(files, (forbidden,))


def test_the_decoding_core_imports_no_upper_layer():
    files = [f for part in CORE for f in files_of(part)]
    assert {SRC / "engine.py", SRC / "verify.py", SRC / "decoder.py", SRC / "models" / "base.py"} <= set(files)
    bad = violations(files, UPPER)
    assert not bad, f"the decoding core imports from {', '.join(UPPER)}: {bad}"


def test_only_the_cli_imports_typer_or_the_cli():
    files = [f for f in SRC.rglob("*.py") if f.relative_to(SRC).parts[0] != "cli" and f.name != "__main__.py"]
    assert SRC / "decoder.py" in files and not any(f.is_relative_to(SRC / "cli") for f in files)
    bad = violations(files, ("typer", "mmspec.cli"))
    assert not bad, f"library modules import the command line (typer, mmspec.cli): {bad}"


def test_the_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from mmspec.train.checkpoint import save_checkpoint\n")
    assert "mmspec.train.checkpoint" in imported(f)


def test_the_check_resolves_relative_imports():
    text = "from ..cli import app\nfrom . import llava\nfrom .cache import DecodeCache\n"
    assert imported(SRC / "models" / "base.py", text) >= {"mmspec.cli", "mmspec.models.llava", "mmspec.models.cache"}
