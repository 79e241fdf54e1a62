"""What a request constrains its answer to, read from the wire: OpenAI's ``response_format`` and
``tools`` / ``tool_choice``, vLLM's ``structured_outputs`` -> one :class:`Plan`.

Owns the checks of those fields (each refusal a :class:`~mmspec.serve.schema.RequestError`
naming the JSON path of what is wrong and the fix, before any prompt work or decoding) and the
:class:`~mmspec.constrain.Constraint` each request shape becomes:

* ``response_format`` ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` -> that schema;
* ``structured_outputs`` (vLLM's extra parameter, sent in ``extra_body``): exactly one of
  ``json`` (a schema, as an object or JSON text), ``regex``, ``choice``, ``grammar`` (EBNF),
  ``json_object`` (true); ``disable_any_whitespace`` flips the whitespace default (below);
* ``tools`` with ``tool_choice``: ``"none"`` (no tools: the answer is a message), a named
  function (the answer is its arguments, constrained to its ``parameters`` schema),
  ``"required"`` (a JSON array of one or more ``{"name", "parameters"}`` calls, as vLLM's) or
  ``"auto"`` (no constraint; the model's own ``<tool_call>`` tags are parsed after, which needs
  ``mmspec serve --tool-call-parser``).

JSON is constrained to tight separators (``,`` and ``:``, no newlines) unless the request says
``structured_outputs: {"disable_any_whitespace": false}``: small models given free whitespace
fill the answer with spaces. This module knows nothing of prompts, tokenizers or decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mmspec.constrain import Constraint
from mmspec.errors import MMSpecError
from mmspec.serve.schema import RequestError

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# keywords the grammar cannot enforce: a schema with one would be answered by JSON that may break it
UNSUPPORTED = {
    "not": "negation", "if": "conditional schemas", "then": "conditional schemas", "else": "conditional schemas",
    "dependentSchemas": "dependent schemas", "dependentRequired": "dependent requirements",
    "dependencies": "dependent requirements", "contains": "array 'contains'", "minContains": "array 'contains'",
    "maxContains": "array 'contains'", "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items", "$dynamicRef": "dynamic references", "$recursiveRef": "dynamic references",
}
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems")
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
STRUCTURED_REFUSED = {
    "whitespace_pattern": "a whitespace pattern (mmspec's JSON has tight separators, or any whitespace with "
                          "disable_any_whitespace=false)",
    "structural_tag": "structural tags",
}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class Plan:
    """What a request asks of its answer's form.

    mode: "text" (a message, maybe constrained), "named" (one call of ``function``: the answer
    is its arguments), "required" (a JSON array of calls) or "auto" (a message, tool-call tags
    parsed after). tools: the tools presented to the model (OpenAI's dicts), None where none."""

    constraint: Constraint | None = None
    mode: str = "text"
    function: str | None = None
    tools: tuple[dict, ...] | None = None
    source: str | None = None  # the constraint's place in the request ("structured_outputs.regex"), for its errors

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("named", "required", "auto")


TEXT = Plan()


def plan_of(*, response_format: Any = None, structured_outputs: Any = None, tools: Any = None,
            tool_choice: Any = None, tool_call_parser: str | None = None, parallel_tool_calls: Any = None) -> Plan:
    """The request's fields -> its Plan, or RequestError naming the field's JSON path and the fix.
    ``parallel_tool_calls`` false: "required" makes exactly one call."""
    any_ws = _whitespace(structured_outputs)
    kept = _response_format(response_format, any_ws)
    vllm = _structured_outputs(structured_outputs, any_ws)
    source = ("response_format" if kept is not None else
              f"structured_outputs.{next(k for k in STRUCTURED_KINDS if structured_outputs.get(k) not in (None, False))}"
              if vllm is not None else None)
    if kept is not None and vllm is not None:
        raise RequestError("response_format and structured_outputs both constrain the answer; send one of them",
                           param="structured_outputs")
    constraint = kept or vllm
    tool_list = _tools(tools)
    choice = _tool_choice(tool_choice, tool_list)
    if choice == "none" or not tool_list:
        return Plan(constraint=constraint, source=source)
    if constraint is not None:
        field = "response_format" if kept is not None else "structured_outputs"
        raise RequestError(f"{field} and tools (tool_choice {choice if isinstance(choice, str) else 'a function'!r}) "
                           f"were given together: a tool call's arguments follow the tool's parameters, not "
                           f"{field}; send tool_choice \"none\" to constrain the message, or drop {field}",
                           param=field)
    tools_t = tuple(tool_list)
    if choice == "auto":
        if tool_call_parser is None:
            raise RequestError("tool_choice \"auto\" (the default with tools) lets the model decide whether to call "
                               "a tool, which needs a parser for its tool-call tags: start mmspec serve with "
                               "--tool-call-parser hermes (checkpoints that write <tool_call>{...}</tool_call>, as "
                               "Qwen2.5-VL does), or send tool_choice \"required\" or a named function",
                               param="tool_choice")
        return Plan(mode="auto", tools=tools_t)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tool_list]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return Plan(constraint=Constraint("json_schema", schema=schema, any_whitespace=any_ws, name="tool calls"),
                    mode="required", tools=tools_t, source="tools")
    k, tool = next((k, t) for k, t in enumerate(tool_list) if t["function"]["name"] == choice)
    return Plan(constraint=Constraint("json_schema", schema=_parameters(tool), any_whitespace=any_ws,
                                      strict=bool(tool["function"].get("strict")), name=choice),
                mode="named", function=choice, tools=(tool,), source=f"tools[{k}].function.parameters")


# ----------------------------------------------------------------------- response_format
def _response_format(rf: Any, any_ws: bool) -> Constraint | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise RequestError('response_format must be an object with a type: {"type": "json_object"} or {"type": '
                           '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', param="response_format")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise RequestError(f"response_format has unknown field(s) {sorted(extra)}; it takes type (and json_schema)",
                           param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(Constraint("json_object", any_whitespace=any_ws), "response_format")
    if kind != "json_schema":
        raise RequestError(f"response_format.type {kind!r} is not served; use text, json_object or json_schema "
                           "(vLLM's other constraints go in structured_outputs)", param="response_format.type")
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise RequestError(f'{where} must be an object {{"name": ..., "schema": {{...}}, "strict": true}}',
                           param=where)
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise RequestError(f"{where} has unknown field(s) {sorted(extra)}; it takes name, schema, strict and "
                           "description", param=where)
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME.match(name)):
        raise RequestError(f"{where}.name must be 1-64 letters, digits, _ or -, got {name!r}", param=f"{where}.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}.strict must be true or false, got {strict!r}", param=f"{where}.strict")
    if "schema" not in js:
        raise RequestError(f"{where} has no schema; send the JSON schema the answer must follow as {where}.schema",
                           param=f"{where}.schema")
    schema = check_schema(js["schema"], f"{where}.schema")
    return _checked(Constraint("json_schema", schema=schema, any_whitespace=any_ws, strict=bool(strict), name=name),
                    f"{where}.schema")


# ----------------------------------------------------------------------- vLLM's structured_outputs
def _whitespace(so: Any) -> bool:
    """any_whitespace of the request's JSON: False (tight) unless disable_any_whitespace is false."""
    if not isinstance(so, dict) or so.get("disable_any_whitespace") is None:
        return False
    flag = so["disable_any_whitespace"]
    if not isinstance(flag, bool):
        raise RequestError(f"structured_outputs.disable_any_whitespace must be true or false, got {flag!r}",
                           param="structured_outputs.disable_any_whitespace")
    return not flag


def _structured_outputs(so: Any, any_ws: bool) -> Constraint | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise RequestError('structured_outputs must be an object with one of json, regex, choice, grammar or '
                           'json_object, like {"choice": ["yes", "no"]}', param="structured_outputs")
    for key, what in STRUCTURED_REFUSED.items():
        if so.get(key) not in (None, ""):
            raise RequestError(f"structured_outputs.{key}: {what} are not supported by mmspec serve; drop {key}",
                               param=f"structured_outputs.{key}")
    unknown = sorted(set(so) - set(STRUCTURED_KINDS) - set(STRUCTURED_FLAGS) - set(STRUCTURED_REFUSED))
    if unknown:
        raise RequestError(f"structured_outputs has unknown field(s) {unknown}; it takes one of "
                           f"{', '.join(STRUCTURED_KINDS)} and {', '.join(STRUCTURED_FLAGS)}", param="structured_outputs")
    for flag in STRUCTURED_FLAGS:
        if so.get(flag) is not None and not isinstance(so[flag], bool):
            raise RequestError(f"structured_outputs.{flag} must be true or false, got {so[flag]!r}",
                               param=f"structured_outputs.{flag}")
    if so.get("disable_additional_properties"):
        raise RequestError("structured_outputs.disable_additional_properties is a guidance-backend option; mmspec's "
                           "grammar follows the schema's own additionalProperties: set it there and drop this flag",
                           param="structured_outputs.disable_additional_properties")
    given = [k for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise RequestError(f"structured_outputs has {' and '.join(given)}; give one kind of constraint",
                           param="structured_outputs")
    if not given:
        return None
    key = given[0]
    where = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RequestError(f"{where} is a string that is not JSON ({e}); send the schema as an object",
                                   param=where) from None
        return _checked(Constraint("json_schema", schema=check_schema(value, where), any_whitespace=any_ws), where)
    if key == "json_object":
        if value is not True:
            raise RequestError(f"{where} must be true, got {value!r}", param=where)
        return _checked(Constraint("json_object", any_whitespace=any_ws), where)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise RequestError(f"{where} must be a non-empty regular expression string, got {value!r}", param=where)
        return _checked(Constraint("regex", pattern=value), where)
    if key == "choice":
        if not isinstance(value, list) or not value:
            raise RequestError(f"{where} must be a non-empty list of strings (the answer is exactly one of them), "
                               f"got {value!r}"[:300], param=where)
        for i, c in enumerate(value):
            if not isinstance(c, str) or not c:
                raise RequestError(f"{where}[{i}] must be a non-empty string, got {c!r}", param=f"{where}[{i}]")
        return _checked(Constraint("choice", choices=tuple(value)), where)
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{where} must be a non-empty EBNF grammar string (xgrammar's GBNF, with a root rule)",
                           param=where)
    return _checked(Constraint("grammar", grammar=value), where)


def _checked(c: Constraint, where: str) -> Constraint:
    """The constraint's own structural checks (sizes, emptiness), worded for the request's field."""
    try:
        c.check()
    except MMSpecError as e:
        raise RequestError(f"{where}: {e}", param=where) from None
    return c


# ----------------------------------------------------------------------- JSON schemas
def check_schema(schema: Any, where: str) -> dict:
    """A JSON schema the grammar can enforce, or RequestError naming the path of the first problem:
    not an object, a ``type`` that is no JSON-schema type, a keyword the grammar cannot enforce
    (:data:`UNSUPPORTED`), a ``$ref`` outside the schema."""
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON schema object (like {{\"type\": \"object\", \"properties\": "
                           f"{{...}}}}), got a {type(schema).__name__}", param=where)
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, bool):  # true / false are schemas too
            continue
        if not isinstance(node, dict):
            raise RequestError(f"{at} must be a JSON schema object, got {json.dumps(node)[:80]}", param=at)
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        bad = [k for k in kinds if k not in JSON_TYPES]
        if bad or (isinstance(kind, list) and not kind):
            raise RequestError(f"{at}.type {kind!r} is not a JSON-schema type; use one of {', '.join(JSON_TYPES)}",
                               param=f"{at}.type")
        for key, what in UNSUPPORTED.items():
            if key in node:
                raise RequestError(f"{at}.{key}: {what} ('{key}') are not supported by mmspec's grammar, which could "
                                   f"not enforce them; rewrite the schema without {key!r}", param=f"{at}.{key}")
        if node.get("uniqueItems") is True:
            raise RequestError(f"{at}.uniqueItems: unique array items are not supported by mmspec's grammar; drop "
                               "uniqueItems (or use an enum per position)", param=f"{at}.uniqueItems")
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise RequestError(f"{at}.$ref {ref!r}: only references inside the schema (#/$defs/...) are supported",
                               param=f"{at}.$ref")
        for key in SUBSCHEMA_MAPS:
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    raise RequestError(f"{at}.{key} must be an object of schemas", param=f"{at}.{key}")
                stack.extend((v, f"{at}.{key}.{k}") for k, v in sub.items())
        for key in SUBSCHEMA_LISTS:
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list) or not sub:
                    raise RequestError(f"{at}.{key} must be a non-empty list of schemas", param=f"{at}.{key}")
                stack.extend((v, f"{at}.{key}[{i}]") for i, v in enumerate(sub))
        for key in SUBSCHEMA_ONE:
            if key in node:
                stack.append((node[key], f"{at}.{key}"))
        req = node.get("required")
        if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
            raise RequestError(f"{at}.required must be a list of property names", param=f"{at}.required")
    return schema


# ----------------------------------------------------------------------- tools
def _tools(tools: Any) -> list[dict]:
    """``tools``: a list of ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                           '{...}}} objects', param="tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f'{at} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                               f'{{...}}}}}} (mmspec serve calls functions only)', param=at)
        if set(t) - {"type", "function"}:
            raise RequestError(f"{at} has unknown field(s) {sorted(set(t) - {'type', 'function'})}", param=at)
        f = t["function"]
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise RequestError(f"{at}.function has unknown field(s) {sorted(extra)}; a function has name, "
                               "description, parameters and strict", param=f"{at}.function")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RequestError(f"{at}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                               param=f"{at}.function.name")
        if name in seen:
            raise RequestError(f"{at}.function.name {name!r} is given twice; give every tool its own name",
                               param=f"{at}.function.name")
        seen.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise RequestError(f"{at}.function.description must be a string", param=f"{at}.function.description")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise RequestError(f"{at}.function.strict must be true or false", param=f"{at}.function.strict")
        if f.get("parameters") is not None:
            params = check_schema(f["parameters"], f"{at}.function.parameters")
            _checked(Constraint("json_schema", schema=params), f"{at}.function.parameters")
    return tools


def _parameters(tool: dict) -> dict:
    """A tool's arguments schema (a function without parameters takes an empty object, as OpenAI's)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _tool_choice(choice: Any, tools: list[dict]) -> str:
    """``tool_choice`` -> "none", "auto", "required" or a function's name."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(f"tool_choice {choice!r} is not one of {', '.join(TOOL_CHOICES)} or "
                               '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if choice != "none" and not tools:
            raise RequestError(f"tool_choice {choice!r} needs tools; send the tools, or drop tool_choice",
                               param="tool_choice")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict) \
            or not isinstance(choice["function"].get("name"), str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
    name = choice["function"]["name"]
    if name not in names:
        given = f"the tools given are {', '.join(map(repr, names))}" if names else "no tools were given"
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools: {given}; name "
                           "one of them, or add it to tools", param="tool_choice.function.name")
    return name
