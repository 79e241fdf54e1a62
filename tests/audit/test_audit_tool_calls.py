"""Answers given as tool calls, and requests that constrain their answer, as the audit reads
them: a tool-call answer's text, the local reference's constraint and tools, and the EOS of an
answer that ended as tool calls."""

from __future__ import annotations

import pytest

from mmspec.audit.client import Reply, Token
from mmspec.audit.compare import Reference, locate


def _content(entries):
    """``logprobs.content`` as mmspec serve writes it: each entry with its ``token_id``."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "token_id": i, "top_logprobs": []}
                        for t, i, lp, _ in entries]}


def test_tool_call_answers_are_read_as_the_models_text():
    """A named function's answer is its arguments, as written; several calls are read from the
    tokens' strings (the server re-writes a "required" array as calls)."""
    from mmspec.audit.client import _calls_text

    one = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]
    assert _calls_text(one, None) == '{"a":1}'
    two = one + [{"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    lp = _content([("[{", 5, -0.1, []), ('"name"', 6, -0.1, []), (":", 7, -0.1, [])])
    assert _calls_text(two, lp) == '[{"name":'


def test_local_reference_reads_the_requests_constraint_and_tools():
    from mmspec.audit.client import AuditError
    from mmspec.audit.reference import LocalTarget

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    plan = LocalTarget.plan({"messages": [], "tools": [tool], "tool_choice": "required"})
    assert plan.constraint.schema["type"] == "array" and plan.tools == (tool,)
    assert LocalTarget.plan({"structured_outputs": {"choice": ["a", "b"]}}).constraint.choices == ("a", "b")
    assert LocalTarget.plan({"tools": [tool]}).mode == "auto"  # auto: unconstrained, as a hermes server
    with pytest.raises(AuditError, match="structured_outputs.choice must be a non-empty list"):
        LocalTarget.plan({"structured_outputs": {"choice": []}})


def test_an_answer_given_as_tool_calls_ended_by_itself():
    """Its tokens lack the EOS (mmspec leaves it out of the logprobs), as a stopped answer's: it is
    given the reference's EOS, while a cut one ("length") differs there."""
    own = [11, 12, 13, 2]
    without = [Token(f"t{i}", -0.1, token_id=i) for i in own[:-1]]
    assert locate(Reference("x", ids=own), Reply("x", "tool_calls", without), eos_id=2) is None
    found = locate(Reference("x", ids=own), Reply("x", "length", without), eos_id=2)
    assert (found.position, found.own, found.ours) == (3, 2, None)
