"""The docs and docstrings name only files that exist, and nothing under docs/ is code.

A path into the repository (``docs/...``, ``perf/...``, ``src/...``, ``tests/...``,
``scripts/...``) or a top-level ``*.md`` named in README.md,
DEVELOPERS.md, docs/*.md, perf/README.md or a Python file must exist. A file that left the tree is named with the commit
that has it (``e735698:scripts/train-embedded-pack.sh``, as ``git show`` takes it) or on a line
that checks that commit out. The reports under docs/results/ are records of their day and say
at their top where the files they name went; they are not checked here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a path ends where a name does; one with a shell pattern in it ({2,3}, *) names several and is not checked
PATH = re.compile(r"(?<![\w:/.-])((?:docs|scripts|perf|bench|tests|src)/[\w./-]*\w(?![\w./{*-])|(?<![\w/])[A-Z][A-Z_]+\.md)")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def missing_paths(text: str) -> list[str]:
    bad = []
    for line in text.splitlines():
        if re.search(r"git checkout [0-9a-f]{7,40}", line):
            continue
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".")
            if not (ROOT / path).exists():
                bad.append(path)
    return bad


def test_docs_and_docstrings_name_only_files_that_exist():
    files = [f for f in tracked() if f in ("README.md", "DEVELOPERS.md", "perf/README.md")
             or re.fullmatch(r"docs/[^/]+\.md", f) or (f.endswith(".py") and not f.startswith("docs/"))]
    assert "README.md" in files and "docs/embedded-models.md" in files
    checked = [f for f in files if f != "tests/core/test_docs.py"]  # this file names missing ones
    bad = {f: sorted(set(p)) for f in checked if (p := missing_paths((ROOT / f).read_text()))}
    assert not bad, f"these name files that do not exist (name the commit that has them: COMMIT:PATH): {bad}"


def test_the_check_tells_a_missing_file_from_one_in_git_history():
    assert missing_paths("see `scripts/gone.sh` and DESIGN.md") == ["scripts/gone.sh", "DESIGN.md"]
    assert missing_paths("see `e735698:scripts/gone.sh`, README.md and docs/results/README.md") == []
    assert missing_paths("git checkout e735698 && bash scripts/gone.sh") == []
    assert missing_paths("`docs/results/speed-2026-11-2{2,3}/`, `docs/results/*/README.md`") == []


def test_nothing_under_docs_is_code():
    """docs/ holds reports, JSON and plots; the code that made them is in git history, so no doc
    can break on (or pin) the package's private names."""
    code = [f for f in tracked() if f.startswith("docs/") and f.endswith((".py", ".sh", ".patch", ".ipynb"))]
    assert not code, code
