"""Structured outputs and tools through the ``openai`` package, against the app in one process
(tiny models from configs; a scheduler double that answers a scripted text): the Constraint each
request shape hands the engine (OpenAI's response_format and tools, vLLM's structured_outputs in
extra_body), the tools presented in the prompt, tool calls returned whole and streamed as OpenAI
streams them (ids, names, arguments, finish_reason "tool_calls"), with n, logprobs and seeds,
and the 400s before any decoding."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers.servers import ThreadServer  # noqa: E402
from mmspec import MMSpecError  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}


@dataclass
class Event:
    rid: int
    new_token_ids: list
    text: str
    finished: bool
    result: object = None
    error: str | None = None
    logprobs: list | None = None


class ScriptedScheduler:
    """Answers every request with ``self.reply`` in pieces of ``self.piece`` characters, one piece a
    step, then EOS (or, past max_new_tokens pieces, stops there: "length")."""

    def __init__(self, eos: int):
        self.eos, self.active, self.next_rid = eos, {}, 0
        self.reply, self.piece = "", 4
        self.requests: list = []

    def submit(self, request, **defaults):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        text = self.reply
        self.active[rid] = [[text[k:k + self.piece] for k in range(0, len(text), self.piece)], request.max_new_tokens]
        self.requests.append(request)
        return rid

    def step(self):
        events = []
        for rid, (pieces, room) in list(self.active.items()):
            piece = pieces.pop(0) if pieces else ""
            self.active[rid][1] = room - 1
            done = not pieces or room - 1 <= 0
            ids = [9] + ([self.eos] if not pieces else [])
            if done:
                del self.active[rid]
            events.append(Event(rid, ids, piece, done))
        return events

    def cancel(self, rid):
        self.active.pop(rid, None)

    def has_work(self):
        return bool(self.active)


@pytest.fixture(scope="module")
def server(decoder):
    """(openai client, scheduler, what the engine was handed: (constraint, prompt ids) per request)."""
    import mmspec.serve.service as service_module
    from mmspec.serve.app import create_app
    from mmspec.serve.service import ServeConfig, Service

    dec, proc = decoder
    handed: list = []
    prompts: list = []
    real, real_build = service_module.make_request, service_module.build_prompt

    def make(d, inputs, asked, *, constraint=None, **kw):  # what the server hands the engine, recorded; the core's
        handed.append((constraint, prompts[-1]))  # own checks after
        if constraint is not None and constraint.pattern == "(":  # as the core's compilation refuses it
            raise MMSpecError("the regex constraint cannot be compiled: Regex parsing error at position 2: The "
                              "parenthesis is not closed.; fix it")
        return real(d, inputs, asked, **kw)

    def build(*a, **kw):  # the prompt text (the tiny word-level tokenizer reads only its own words)
        prompts.append(real_build(*a, **kw))
        return prompts[-1]

    service_module.make_request, service_module.build_prompt = make, build
    sched = ScriptedScheduler(eos=sorted(dec.eos_ids)[0])
    service = Service(dec, proc, ServeConfig(model_name="m", tool_call_parser="hermes"), scheduler=sched)
    served = ThreadServer(create_app(service))  # on a free loopback port, started
    url = served.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        yield client, sched, handed, dec.tokenizer
    finally:
        served.stop()
        service_module.make_request, service_module.build_prompt = real, real_build


def chat(client, **kw):
    kw = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 64, "temperature": 0, **kw}
    return client.chat.completions.create(model="m", **kw)


def test_response_format_json_schema_and_object_reach_the_engine(server):
    client, sched, handed, _ = server
    sched.reply = '{"label":"w5"}'
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                                             "strict": True}})
    c = handed[-1][0]
    assert (c.kind, c.schema, c.strict, c.any_whitespace) == ("json_schema", SCHEMA, True, False)
    assert json.loads(r.choices[0].message.content) == {"label": "w5"} and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    chat(client, response_format={"type": "json_object"})
    assert handed[-1][0].kind == "json_object"


def test_vllm_structured_outputs_in_extra_body(server):
    client, sched, handed, _ = server
    sched.reply = "yes"
    for extra, kind in (({"choice": ["yes", "no"]}, "choice"), ({"regex": "y.s"}, "regex"),
                        ({"json": SCHEMA, "disable_any_whitespace": False}, "json_schema"),
                        ({"grammar": 'root ::= "yes"'}, "grammar")):
        r = chat(client, extra_body={"structured_outputs": extra})
        assert handed[-1][0].kind == kind and r.choices[0].message.content == "yes"
    assert handed[-1][0].grammar == 'root ::= "yes"'
    assert handed[-2][0].any_whitespace is True  # disable_any_whitespace false: free whitespace
    # the legacy completions endpoint too
    r = client.completions.create(model="m", prompt="w5 w6", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert handed[-1][0].choices == ("yes", "no") and r.choices[0].text == "yes"


def test_a_named_function_is_answered_as_its_tool_call(server):
    client, sched, handed, _ = server
    sched.reply = '{"city":"Paris"}'
    r = chat(client, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert handed[-1][0].schema == WEATHER["function"]["parameters"]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_required_returns_every_call_of_the_array(server):
    client, sched, handed, _ = server
    sched.reply = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    r = chat(client, tools=[WEATHER, CLOCK], tool_choice="required")
    assert handed[-1][0].schema["type"] == "array"
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and r.choices[0].finish_reason == "tool_calls"


def test_auto_parses_hermes_tags_and_leaves_plain_answers_alone(server):
    client, sched, handed, _ = server
    sched.reply = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    r = chat(client, tools=[WEATHER])
    assert handed[-1][0] is None  # auto: no constraint
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me look."
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Rome"}
    sched.reply = "It is sunny."
    r = chat(client, tools=[WEATHER], tool_choice="auto")
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_the_tools_are_presented_in_the_prompt(server, decoder):
    client, sched, handed, tok = server
    sched.reply = "{}"
    chat(client, tools=[WEATHER], tool_choice="required")
    prompt = handed[-1][1]
    assert "get_weather" in prompt and "<tools>" in prompt and "w5 w6" in prompt
    assert prompt.index("<tools>") < prompt.index("w5 w6")  # a system text in front (this template has no tools)
    chat(client, tools=[WEATHER], tool_choice="none")  # none: a plain message, tools not shown
    prompt = handed[-1][1]
    assert "get_weather" not in prompt and handed[-1][0] is None


def test_a_template_that_takes_tools_gets_them(decoder):
    from mmspec.serve.messages import build_prompt
    from mmspec.serve.protocol import parse_messages

    _, proc = decoder

    class Templated:
        chat_template = "{% for t in tools %}TOOL {{ t.function.name }}{% endfor %}"

        def __init__(self):
            self.seen = None

        def apply_chat_template(self, messages, tools=None, **kw):
            self.seen = tools
            return "TOOLS " + ",".join(t["function"]["name"] for t in tools or []) + " | " + messages[-1]["content"][0]["text"]

    p = Templated()
    text = build_prompt(p, proc.tokenizer, parse_messages([{"role": "user", "content": "hi"}]), tools=(WEATHER,))
    assert text == "TOOLS get_weather | hi" and p.seen == [WEATHER]


def test_a_conversation_with_tool_results_is_framed(server):
    client, sched, handed, tok = server
    sched.reply = "It is sunny in Paris."
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat(client, messages=msgs, tools=[WEATHER])
    prompt = handed[-1][1]
    assert "<tool_response>" in prompt and "sunny" in prompt and '"city": "Paris"' in prompt
    assert r.choices[0].message.content == "It is sunny in Paris."


def stream_of(client, **kw):
    chunks = list(chat(client, stream=True, **kw))
    return chunks, [c for c in chunks if c.choices]


def test_a_named_call_streams_its_arguments_as_openai_does(server):
    client, sched, _, _ = server
    sched.reply, sched.piece = '{"city":"Paris"}', 3
    chunks, with_choices = stream_of(client, tools=[WEATHER],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0].delta for c in with_choices if c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert len(deltas) > 2 and all(d.tool_calls[0].id is None for d in deltas[1:])  # arguments piece by piece
    args = "".join(d.tool_calls[0].function.arguments for d in deltas)
    assert json.loads(args) == {"city": "Paris"}
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in with_choices)


def test_required_and_auto_stream_their_calls(server):
    client, sched, _, _ = server
    sched.reply, sched.piece = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo"}}]', 5
    _, with_choices = stream_of(client, tools=[WEATHER, CLOCK], tool_choice="required")
    calls = [tc for c in with_choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_time", {}), (1, "get_weather", {"city": "Oslo"})]
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    sched.reply, sched.piece = 'Checking. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', 2
    _, with_choices = stream_of(client, tools=[CLOCK])
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert content == "Checking. "  # nothing of the tag leaks into the content, even piece by piece
    calls = [tc for c in with_choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_time"]
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    sched.reply = "No <b>tags</b> here."  # a "<" that does not open a tag is sent, once it is clear
    _, with_choices = stream_of(client, tools=[CLOCK])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "No <b>tags</b> here."
    assert with_choices[-1].choices[0].finish_reason == "stop"


def test_n_seeds_logprobs_and_usage_work_with_tools(server):
    client, sched, handed, _ = server
    sched.reply, sched.piece = '{"city":"Lima"}', 4
    before = len(sched.requests)
    r = chat(client, n=3, temperature=0.8, seed=11, logprobs=True, top_logprobs=2, tools=[WEATHER],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(r.choices) == 3 and {c.finish_reason for c in r.choices} == {"tool_calls"}
    assert [s.seed for s in sched.requests[before:]] == [11, 12, 13]  # choice i: seed + i, each constrained
    assert all(json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Lima"} for c in r.choices)
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3
    assert all(c.logprobs is not None for c in r.choices)
    chunks = list(chat(client, stream=True, n=2, stream_options={"include_usage": True}, tools=[WEATHER],
                       tool_choice="required"))
    assert chunks[-1].usage is not None and {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_a_constraint_cut_by_max_tokens_ends_with_length(server):
    client, sched, _, _ = server
    sched.reply, sched.piece = '{"city":"Paris"}', 2
    r = chat(client, max_tokens=3, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "length"  # never claimed complete
    r = chat(client, max_tokens=3, tools=[WEATHER, CLOCK], tool_choice="required")
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kw, phrase", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema.type 'strng' is not a JSON-schema type"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice must be a non-empty list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nosuch"}}}, "not among the tools"),
    ({"extra_body": {"guided_regex": "a+"}}, "vLLM's old name"),
])
def test_bad_constraints_are_400s_through_the_client(server, kw, phrase):
    client, sched, handed, _ = server
    n = len(handed)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert phrase in e.value.body["message"], e.value.body
    assert len(handed) == n  # refused before the engine was handed anything


def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(server):
    client, sched, handed, _ = server
    n = len(sched.requests)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"structured_outputs": {"regex": "("}})
    assert e.value.body["message"].startswith("structured_outputs.regex: the regex constraint cannot be compiled")
    assert e.value.body["param"] == "structured_outputs.regex" and len(sched.requests) == n  # never scheduled
    sched.reply = "ok"
    assert chat(client).choices[0].message.content == "ok"  # the server goes on


def test_auto_without_a_parser_names_the_option(decoder):
    from mmspec.serve.protocol import parse_request
    from mmspec.serve.schema import RequestError

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}).encode()
    with pytest.raises(RequestError, match="--tool-call-parser hermes"):
        parse_request(body, "m", tool_call_parser=None)


def test_the_openai_clients_parse_helper_with_a_pydantic_model(server):
    """client.chat.completions.parse(response_format=Model): the schema the client makes from a
    pydantic model (strict, titles, additionalProperties false) is taken, and its answer parsed."""
    from pydantic import BaseModel

    class Reading(BaseModel):
        label: str
        value: int

    client, sched, handed, _ = server
    sched.reply = '{"label":"w5","value":7}'
    r = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=32,
                                      temperature=0, response_format=Reading)
    assert r.choices[0].message.parsed == Reading(label="w5", value=7)
    c = handed[-1][0]
    assert c.kind == "json_schema" and c.strict and set(c.schema["properties"]) == {"label", "value"}


def test_the_openai_clients_stream_helper_assembles_the_streamed_call(server):
    """client.chat.completions.stream with a pydantic function tool: the streamed deltas assemble
    into the call, its arguments parsed by the client."""
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    client, sched, _, _ = server
    sched.reply, sched.piece = '{"city":"Paris"}', 3
    tool = openai.pydantic_function_tool(GetWeather)
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=32,
                                        temperature=0, tools=[tool],
                                        tool_choice={"type": "function", "function": {"name": "GetWeather"}}) as s:
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and call.function.parsed_arguments == GetWeather(city="Paris")
    assert final.choices[0].finish_reason == "tool_calls"
