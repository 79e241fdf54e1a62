"""The package's layering, checked on every import the source names (function bodies included,
relative imports resolved):

- the decoding core (engine, verify, tree, drafter, decoder, multimodal, graphs, views, stats,
  ``models/``, ``heads/model.py``, ``heads/drafter.py``) imports nothing from ``mmspec.cli``,
  ``mmspec.train``, ``mmspec.bench`` or ``mmspec.world``;
- nothing outside ``mmspec/cli/`` imports typer or ``mmspec.cli`` (``__main__.py``, the
  ``python -m mmspec`` entry point, only runs the CLI);
- the decoder side (``models/``, ``embedded.py``) never imports the training code, and ``bench``
  never imports ``train`` (``train`` may use ``bench``);
- no import circles among mmspec's modules (:func:`circles`), but for the ones in
  :data:`CIRCLES_BEING_REMOVED`.

How the circle check counts imports: every import a module names is an edge, at module level, in a
function body or under ``if TYPE_CHECKING:``. An import deferred into a function only hides a
circle from the interpreter: the two modules still need each other, cannot be read or moved
apart (every circle issue #42 names was hidden that way). Edges go to the module named:
``from pkg import sub`` (``sub`` a module) is an edge to ``pkg.sub`` alone, ``from pkg import
name`` to ``pkg/__init__.py``; the parent packages Python runs first on the way to a module are
no edge (a package that imports its submodules makes no circle with them unless one of them
imports a name from the package itself)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mmspec"
CORE = ["engine", "drafting", "runtime", "decoder.py", "multimodal.py", "stats.py", "models",
        "heads/model.py", "request.py", "results.py", "batch.py"]
UPPER = ("mmspec.cli", "mmspec.train", "mmspec.bench", "mmspec.world")

# Circles tolerated for a while (none now: batch <-> decoder and heads/formats <-> heads/model went with
# issue 42's one engine and issue 45's heads/directory.py); nothing may join this list.
CIRCLES_BEING_REMOVED: list[set[str]] = []


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
    assert {SRC / "engine" / "step.py", SRC / "runtime" / "verify.py", SRC / "decoder.py", SRC / "models" / "base.py"} <= set(files)
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
    text = "from ..cli import app\nfrom . import llava\nfrom .rows import RowCache\n"
    assert imported(SRC / "models" / "base.py", text) >= {"mmspec.cli", "mmspec.models.llava", "mmspec.models.rows"}


def module_of(path: Path) -> str:
    """``src/mmspec/bench/runner.py`` -> ``mmspec.bench.runner``; a package's ``__init__.py`` is the package."""
    parts = ["mmspec", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_edges(path: Path, modules: set[str], text: str | None = None) -> set[str]:
    """The mmspec modules ``path`` imports (every import: module level, function bodies,
    ``TYPE_CHECKING``), each the module named (see the module docstring), ``text`` standing in
    for the file's own text."""
    own = module_of(path)
    package = own.split(".") if path.name == "__init__.py" else own.split(".")[:-1]
    named = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            subs = [a.name for a in node.names if f"{base}.{a.name}" in modules]
            named.update(f"{base}.{s}" for s in subs)
            if len(subs) < len(node.names):
                named.add(base)
    out = set()
    for name in named:
        while name and name not in modules:  # ``import mmspec.x.y`` where y is a name, not a module
            name = name.rpartition(".")[0]
        if name and name != own:
            out.add(name)
    return out


def import_graph(texts: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """mmspec module -> the mmspec modules it imports; ``texts`` stands in for some files' text
    (a path not under src/mmspec adds that module)."""
    texts = texts or {}
    files = {module_of(f): f for f in [*SRC.rglob("*.py"), *texts]}
    return {m: module_edges(f, set(files), texts.get(f)) for m, f in files.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``graph``: its strongly connected components of two modules or more
    (Tarjan's algorithm; a component holds every module that is on a circle with another)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = set()
            while True:
                d = stack.pop()
                on_stack.discard(d)
                component.add(d)
                if d == m:
                    break
            if len(component) > 1:
                found.append(component)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def new_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` that are not one of :data:`CIRCLES_BEING_REMOVED` (a circle that
    grew past one of them is new)."""
    return [sorted(c) for c in circles(graph) if c not in CIRCLES_BEING_REMOVED]


def test_no_new_import_circles():
    graph = import_graph()
    assert {"mmspec.bench.runner", "mmspec.embedded", "mmspec.models.base", "mmspec.train.recipe"} <= set(graph)
    bad = new_circles(graph)
    assert not bad, ("import circles among mmspec's modules (every import counts, function bodies and "
                     f"TYPE_CHECKING included; see tests/core/test_layering.py): {bad}")


@pytest.mark.parametrize("where", ["module", "function", "type_checking"])
def test_the_circle_check_catches_a_planted_circle(where):
    """``mmspec.bench.store`` (which the runner imports) made to import the runner back: caught at
    module level, in a function body and under TYPE_CHECKING alike."""
    store = SRC / "bench" / "store.py"
    line = {"module": "from mmspec.bench.runner import run_bench\n",
            "function": "def f():\n    from mmspec.bench.runner import run_bench\n",
            "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runner import RunSummary\n"}[where]
    graph = import_graph({store: store.read_text() + "\n" + line})
    assert "mmspec.bench.runner" in graph["mmspec.bench.store"]
    assert any({"mmspec.bench.runner", "mmspec.bench.store"} <= set(c) for c in new_circles(graph))


def test_circle_edges_name_the_module_not_its_package():
    """``from mmspec.cli import common`` is an edge to ``mmspec.cli.common``, not ``mmspec.cli``
    (whose ``__init__`` imports the commands); a name from a package is an edge to the package."""
    demo = SRC / "cli" / "demo.py"
    modules = set(import_graph())
    text = "from mmspec.cli import common\nfrom . import checks\nfrom mmspec.world import FAMILIES\nimport mmspec.models.base\n"
    assert module_edges(demo, modules, text) == {"mmspec.cli.common", "mmspec.cli.checks", "mmspec.world",
                                                 "mmspec.models.base"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_family_registry_is_full_whichever_module_is_imported_first():
    """``models/base.py`` imports no family; ``models/__init__.py`` does, and Python runs it before
    any ``mmspec.models.*`` module, so a fresh process that imports only ``base`` finds them all."""
    code = "import json, mmspec.models.base as b; print(json.dumps(sorted(b.ADAPTERS)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert {"causal_lm", "llava", "llava_next", "llava_onevision", "qwen2_vl", "video_llava"} <= set(json.loads(out.stdout))


def test_the_drafters_never_import_the_engine():
    """engine/ imports drafting/ (a step drafts), never the reverse: what both need (the rows' state,
    forwards, graphs, masks, randomness) sits below both, in mmspec.runtime."""
    bad = {}
    for path in sorted((SRC / "drafting").glob("*.py")) + sorted((SRC / "runtime").glob("*.py")):
        names = sorted(n for n in imported(path) if n == "mmspec.engine" or n.startswith("mmspec.engine."))
        if names:
            bad[str(path.relative_to(SRC))] = names
    assert not bad, f"drafting/ and runtime/ import the engine: {bad}"
