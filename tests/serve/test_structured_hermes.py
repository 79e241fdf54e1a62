"""The Hermes tool-call parser (``--tool-call-parser hermes``) and the tool-call stream, on
hand-written model outputs: what Qwen2.5-VL and Hermes checkpoints write when they call tools."""

from __future__ import annotations

import json

import pytest

from mmspec.serve.structured import Plan
from mmspec.serve.toolcalls import ToolStream, held, message_of, parse_hermes, required_calls


def calls(text):
    content, found = parse_hermes(text)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


@pytest.mark.parametrize("text, content, found", [
    # Qwen2.5's own form: newlines inside the tags
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    # text before, two calls, text between
    ('I will check both.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"x": [1, 2]}}</tool_call>', "I will check both.", [("a", {}), ("b", {"x": [1, 2]})]),
    # arguments already a JSON string
    ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("f", {"k": 1})]),
    # an answer cut before its closing tag (max_tokens after the JSON)
    ('<tool_call>{"name": "f", "arguments": {"k": 1}}', None, [("f", {"k": 1})]),
    # no tags: a plain answer
    ("It is sunny.", "It is sunny.", []),
    # a tag whose JSON does not parse, or has no name, stays in the content as written
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # unicode kept as written
    ('<tool_call>{"name": "say", "arguments": {"text": "héllo 日本"}}</tool_call>', None, [("say", {"text": "héllo 日本"})]),
])
def test_hermes_parses_the_tags_a_checkpoint_writes(text, content, found):
    assert calls(text) == (content, found)


def test_every_call_gets_its_own_openai_id():
    _, found = parse_hermes('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "a"}</tool_call>')
    ids = [c.id for c in found]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert found[0].body() == {"id": ids[0], "type": "function", "function": {"name": "a", "arguments": "{}"}}


def test_required_answers_parse_or_fall_back_to_content():
    assert [(c.name, c.arguments) for c in required_calls('[{"name":"a","parameters":{"x":1}}]')] == [("a", '{"x": 1}')]
    assert required_calls('[{"name":"a","par') is None and required_calls("[]") is None
    plan = Plan(mode="required")
    msg = message_of(plan, '[{"name":"a","par', "length")
    assert (msg.content, msg.calls, msg.finish_reason) == ('[{"name":"a","par', None, "length")


def test_held_back_text_is_only_a_possible_tag_start():
    assert [held(t) for t in ("abc", "abc<", "abc<tool", "abc<tool_call", "a<b", "<tool_call>")] == [0, 1, 5, 10, 0, 0]


@pytest.mark.parametrize("pieces", [
    ["Sure", ". <", "tool_c", 'all>{"name": "f", "arguments": {"a": 1}}</tool', "_call>"],
    ["Sure. ", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'],
    list('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'),
])
def test_auto_streams_content_up_to_the_tag_then_the_call(pieces):
    ts = ToolStream(Plan(mode="auto"))
    deltas = [d for p in pieces for d in ts.feed(p)]
    rest, finish = ts.finish("".join(pieces), "stop")
    deltas += rest
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    (call,) = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"a": 1}
    assert finish == "tool_calls"


def test_a_named_call_streams_argument_pieces_under_one_id():
    ts = ToolStream(Plan(mode="named", function="f"))
    deltas = ts.feed('{"a"') + ts.feed(":1}")
    rest, finish = ts.finish('{"a":1}', "stop")
    assert rest == [] and finish == "tool_calls"
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_") and "id" not in deltas[1]["tool_calls"][0]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"a":1}'
    empty = ToolStream(Plan(mode="named", function="f"))
    rest, finish = empty.finish("", "length")  # nothing written: the call is still named, cut by max_tokens
    assert rest[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and finish == "length"
