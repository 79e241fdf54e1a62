"""Structured outputs and tools, read from the wire (no model, no server): the Constraint each
request shape becomes (OpenAI's response_format and tools, vLLM's structured_outputs), and every
bad shape a 400 naming its JSON path and the fix before any decoding."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from mmspec.constrain import Constraint  # noqa: E402
from mmspec.constrain.spec import MAX_SPEC_CHARS  # noqa: E402
from mmspec.serve.protocol import parse_request  # noqa: E402
from mmspec.serve.schema import RequestError  # noqa: E402

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                           "value": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["label", "value"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def parse(completion: bool = False, parser: str | None = None, **kw):
    base = {"prompt": "hi"} if completion else {"messages": [{"role": "user", "content": "hi"}]}
    return parse_request(json.dumps({"model": "m", **base, **kw}).encode(), "m", completion, parser)


def refused(phrase: str, param: str | None = None, **kw) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(**kw)
    assert phrase in str(e.value), str(e.value)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param, e.value.param
    return e.value


# ----------------------------------------------------------------------- the constraint of each shape
def test_plain_requests_have_no_constraint():
    for kw in ({}, {"response_format": {"type": "text"}}, {"tools": [WEATHER], "tool_choice": "none"},
               {"tools": []}):
        plan = parse(**kw).plan
        assert plan.constraint is None and plan.mode == "text" and plan.tools is None, kw


def test_response_format_json_object_and_json_schema():
    c = parse(response_format={"type": "json_object"}).plan.constraint
    assert c == Constraint("json_object") and c.any_whitespace is False  # tight separators by default
    c = parse(response_format={"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA,
                                                                      "strict": True}}).plan.constraint
    assert (c.kind, c.schema, c.strict, c.name, c.any_whitespace) == ("json_schema", SCHEMA, True, "reading", False)
    # the legacy completions endpoint takes it too (as vLLM's)
    assert parse(completion=True, response_format={"type": "json_object"}).plan.constraint.kind == "json_object"


def test_vllm_structured_outputs_each_kind():
    assert parse(structured_outputs={"json": SCHEMA}).plan.constraint == Constraint("json_schema", schema=SCHEMA)
    assert parse(structured_outputs={"json": json.dumps(SCHEMA)}).plan.constraint.schema == SCHEMA  # JSON text too
    assert parse(structured_outputs={"regex": r"\d{3}"}).plan.constraint == Constraint("regex", pattern=r"\d{3}")
    assert parse(structured_outputs={"choice": ["yes", "no"]}).plan.constraint == \
        Constraint("choice", choices=("yes", "no"))
    assert parse(structured_outputs={"grammar": 'root ::= "a" | "b"'}).plan.constraint.kind == "grammar"
    assert parse(structured_outputs={"json_object": True}).plan.constraint.kind == "json_object"
    assert parse(completion=True, structured_outputs={"choice": ["a"]}).plan.constraint.choices == ("a",)


def test_disable_any_whitespace_flips_the_tight_default():
    loose = parse(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False}).plan.constraint
    assert loose.any_whitespace is True
    assert parse(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}).plan.constraint.any_whitespace \
        is False
    # alone beside response_format or tools: it only sets the whitespace
    c = parse(response_format={"type": "json_object"}, structured_outputs={"disable_any_whitespace": False})
    assert c.plan.constraint.any_whitespace is True
    c = parse(tools=[WEATHER], tool_choice="required", structured_outputs={"disable_any_whitespace": False})
    assert c.plan.constraint.any_whitespace is True


def test_a_named_tool_constrains_the_arguments_to_its_parameters():
    plan = parse(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}}).plan
    assert plan.mode == "named" and plan.function == "get_weather"
    assert plan.constraint.schema == WEATHER["function"]["parameters"] and plan.tools == (WEATHER,)
    plan = parse(tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}).plan
    assert plan.constraint.schema == {"type": "object", "properties": {}}  # no parameters: an empty object


def test_required_is_an_array_of_calls_of_the_tools_given():
    plan = parse(tools=[WEATHER, CLOCK], tool_choice="required").plan
    s = plan.constraint.schema
    assert plan.mode == "required" and plan.tools == (WEATHER, CLOCK)
    assert s["type"] == "array" and s["minItems"] == 1
    names = [branch["properties"]["name"]["enum"] for branch in s["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert s["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert "maxItems" not in s
    one = parse(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).plan.constraint.schema
    assert one["maxItems"] == 1  # parallel_tool_calls false: exactly one call


def test_auto_needs_a_tool_call_parser():
    e = refused("--tool-call-parser hermes", "tool_choice", tools=[WEATHER])  # auto is the default with tools
    assert "auto" in str(e)
    plan = parse(parser="hermes", tools=[WEATHER]).plan
    assert plan.mode == "auto" and plan.constraint is None and plan.tools == (WEATHER,)


def test_conversations_with_tool_calls_and_results_are_accepted():
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = parse(messages=msgs, tools=[WEATHER], tool_choice="none")
    assert [m.role for m in r.chat_messages] == ["user", "assistant", "tool"]


# ----------------------------------------------------------------------- bad input: a 400 naming the path
@pytest.mark.parametrize("kw, phrase, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "must be a JSON schema object", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "'strng' is not a JSON-schema type", "response_format.json_schema.schema.properties.a.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "negation ('not') are not supported", "response_format.json_schema.schema.properties.a.not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}},
     "unique array items", "response_format.json_schema.schema.uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "https://example.com/s.json"}}}}, "only references inside the schema", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "has no schema", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "1-64 letters", None),
    ({"response_format": {"type": "structural_tag"}}, "'structural_tag' is not served", "response_format.type"),
    ({"response_format": "json"}, "must be an object with a type", "response_format"),
    ({"structured_outputs": {"choice": []}}, "non-empty list of strings", "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1] must be a non-empty string", None),
    ({"structured_outputs": {"regex": ""}}, "non-empty regular expression", "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "  "}}, "non-empty EBNF grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "is a string that is not JSON", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "regex and choice; give one kind", None),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "whitespace pattern", None),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural tags", None),
    ({"structured_outputs": {"backend": "outlines"}}, "unknown field(s) ['backend']", None),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}, "must be true or false", None),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "send one of them", None),
    ({"guided_json": {"type": "object"}}, 'send structured_outputs: {"json": SCHEMA}', "guided_json"),
    ({"guided_choice": ["a"]}, "vLLM's old name (removed in vLLM 0.12)", "guided_choice"),
    # sizes
    ({"structured_outputs": {"regex": "a" * (MAX_SPEC_CHARS + 1)}}, "longer than", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(1100)]}}, "at most 1024", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * MAX_SPEC_CHARS}}}}, "longer than 65536 characters",
     "response_format.json_schema.schema"),
    # tools
    ({"tools": {"type": "function"}}, "tools must be a list", "tools"),
    ({"tools": [{"type": "retrieval"}]}, "calls functions only", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name must be", None),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "given twice", "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}], "tool_choice": "none"},
     "must be a JSON schema object", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}]},
     "is not a JSON-schema type", "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "unknown field(s) ['args']", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nosuch"}}},
     "'nosuch', which is not among the tools: the tools given are 'get_weather'", "tool_choice.function.name"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "not one of none, auto, required", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format and tools", "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "structured_outputs and tools", "structured_outputs"),
    ({"functions": [{"name": "f"}]}, "deprecated form of tools", "functions"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]},
                   {"role": "tool", "content": "r"}]}, "messages[1].tool_calls must be a list", None),
    ({"messages": [{"role": "tool", "content": [{"type": "text", "text": "r"}]}]}, "the tool's result as a string",
     None),
])
def test_bad_constraints_and_tools_are_400s_naming_the_path(kw, phrase, param):
    refused(phrase, param, **kw)


def test_completions_take_no_tools():
    with pytest.raises(RequestError, match="legacy completions endpoint takes no tools"):
        parse(completion=True, tools=[WEATHER], tool_choice="required")


def test_the_plan_knows_where_its_constraint_came_from():
    """So an error of its compilation (at prepare) names the request's field."""
    assert parse(structured_outputs={"regex": "a"}).plan.source == "structured_outputs.regex"
    assert parse(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}).plan.source == \
        "structured_outputs.json"
    assert parse(response_format={"type": "json_object"}).plan.source == "response_format"
    assert parse(tools=[CLOCK, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).plan \
        .source == "tools[1].function.parameters"
    assert parse(tools=[WEATHER], tool_choice="required").plan.source == "tools"
    assert parse().plan.source is None
