"""README's "Try it in Python" runs as pasted on the embedded pack: its code blocks, in order,
in one namespace (what a newcomer pasting them one after another gets)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Try it in Python")
    return text[start:text.index("\n## ", start + 1)]


def test_the_section_exists_and_states_the_worlds_wording():
    sec = " ".join(_section().split())
    assert "load_embedded" in sec and "generate_batch" in sec and "stream" in sec and "build_head" in sec
    assert "the image first" in sec and "ASSISTANT:" in sec


@pytest.mark.slow
def test_try_it_in_python_runs_as_pasted(capsys):
    blocks = re.findall(r"```python\n(.*?)```", _section(), re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md (Try it in Python)", "exec"), namespace)  # noqa: S102 - the docs' own code
    out = capsys.readouterr().out
    assert "tau" in out and "prompt tokens reused" in out and "head check: tau" in out
    assert namespace["turn2"].stats.prompt_tokens_reused > 0
