"""What a request may constrain its answer to: the constraint as the user states it.

A :class:`Constraint` is plain data (no tokenizer, no compiled grammar): the server and the CLI
build one from a request, :mod:`mmspec.constrain.compile` turns it into a grammar for one
tokenizer (compiled once, cached), and the engine masks every drafted and verified token with it.
Cheap structural checks live here (:meth:`Constraint.check`), so a bad constraint is refused
before any compilation or decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from mmspec.errors import MMSpecError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 64 * 1024  # a schema (as JSON), regex or grammar longer than this is refused
MAX_CHOICES = 1024  # a choice among more strings than this is refused


@dataclass(frozen=True)
class Constraint:
    """One request's constraint.

    kind: ``json_schema`` (``schema`` a JSON-schema dict), ``json_object`` (any JSON object),
    ``regex`` (``pattern``), ``choice`` (``choices``: the answer is exactly one of them) or
    ``grammar`` (``grammar``: EBNF in xgrammar's GBNF dialect).
    any_whitespace: False (the default) lets JSON use only tight separators (``","``, ``":"``,
    no newlines or indentation): small models otherwise fill an answer with spaces
    (vLLM's ``disable_any_whitespace`` is the same knob, inverted).
    strict: OpenAI's ``json_schema.strict`` (schemas are always enforced; kept for echoing).
    """

    kind: Kind
    schema: dict[str, Any] | None = None
    pattern: str | None = None
    choices: tuple[str, ...] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    strict: bool = False
    name: str | None = field(default=None, compare=False)  # a schema's or tool's name, for messages

    def check(self) -> None:
        """Structural checks, no compilation: raises MMSpecError naming the problem and the fix."""
        if self.kind not in KINDS:
            raise MMSpecError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema":
            if not isinstance(self.schema, dict):
                raise MMSpecError("a json_schema constraint needs its schema as a JSON object (a dict)")
            if len(json.dumps(self.schema)) > MAX_SPEC_CHARS:
                raise MMSpecError(f"the JSON schema is longer than {MAX_SPEC_CHARS} characters; send a smaller schema")
        elif self.kind == "regex":
            if not isinstance(self.pattern, str) or not self.pattern:
                raise MMSpecError("a regex constraint needs a non-empty pattern string")
            if len(self.pattern) > MAX_SPEC_CHARS:
                raise MMSpecError(f"the regex is longer than {MAX_SPEC_CHARS} characters; send a shorter pattern")
        elif self.kind == "choice":
            if not self.choices:
                raise MMSpecError("a choice constraint needs at least one string to choose from; the list is empty")
            if len(self.choices) > MAX_CHOICES:
                raise MMSpecError(f"a choice among {len(self.choices)} strings; at most {MAX_CHOICES} are accepted")
            bad = [i for i, c in enumerate(self.choices) if not isinstance(c, str) or not c]
            if bad:
                raise MMSpecError(f"choice {bad[0]} is not a non-empty string; every choice must be one")
            if sum(len(c) for c in self.choices) > MAX_SPEC_CHARS:
                raise MMSpecError(f"the choices are longer than {MAX_SPEC_CHARS} characters in all")
        elif self.kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise MMSpecError("a grammar constraint needs a non-empty EBNF grammar string")
            if len(self.grammar) > MAX_SPEC_CHARS:
                raise MMSpecError(f"the grammar is longer than {MAX_SPEC_CHARS} characters; send a smaller one")
