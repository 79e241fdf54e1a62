"""`mmspec generate --json-schema FILE / --regex R / --choice A,B,C`: every bad flag refused in one
line before any model loads (a missing file, JSON that does not parse, a schema the grammar
cannot enforce, flags together, an empty choice), and the Constraint each flag makes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mmspec import MMSpecError
from mmspec.cli import app
from mmspec.cli.checks import check_constraint
from mmspec.constrain import Constraint

runner = CliRunner()


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model would load: every flag check must come first."""
    import mmspec.cli.generate as gen

    def load(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(gen, "load_models", load)


def refused(args, phrase):
    r = runner.invoke(app, ["generate", "--prompt", "What is it?", *map(str, args)], env={"COLUMNS": "250"})
    out = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and phrase in out and "Traceback" not in out, r.output


def test_bad_constraint_flags_are_refused_before_any_model_loads(tmp_path, no_loading):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "int"}}}))
    refused(["--json-schema", tmp_path / "nope.json"], "--json-schema '")
    refused(["--json-schema", tmp_path / "nope.json"], "not found; pass a .json file")
    refused(["--json-schema", tmp_path], "is a directory")
    refused(["--json-schema", bad], "is not valid JSON")
    refused(["--json-schema", wrong], "--json-schema wrong.json.properties.n.type 'int' is not a JSON-schema type")
    refused(["--regex", "a+", "--choice", "a,b"], "--regex and --choice were given together")
    refused(["--choice", ","], "lists no strings")
    refused(["--choice", "a,,b"], "has an empty choice")
    refused(["--regex", "a" * 70000], "--regex: the regex is longer than 65536 characters")


def test_each_flag_makes_its_constraint(tmp_path):
    schema = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
    path = tmp_path / "chart.json"
    path.write_text(json.dumps(schema))
    assert check_constraint(path, None, None) == Constraint("json_schema", schema=schema)
    assert check_constraint(path, None, None).any_whitespace is False  # tight separators, as the server's default
    assert check_constraint(None, r"\d+", None) == Constraint("regex", pattern=r"\d+")
    assert check_constraint(None, None, "yes, no") == Constraint("choice", choices=("yes", "no"))
    assert check_constraint(None, None, None) is None
    with pytest.raises(MMSpecError, match="--json-schema and --regex"):
        check_constraint(path, "a", None)
