"""The OpenAI chat-completions request body: parsed, type-checked and refused where mmspec cannot
honour it, before anything touches a model.

Owns :class:`ChatRequest` (the fields mmspec serves), :class:`RequestError` (an HTTP status and
an OpenAI-style error body whose message names the problem and the fix) and :func:`parse_request`
(bytes -> ChatRequest). What each field does:

* ``messages``: system / developer / user / assistant turns; content a string or a list of
  ``text`` and ``image_url`` parts (checked here for shape only; :mod:`.messages` reads them);
* ``max_tokens`` / ``max_completion_tokens`` (>= 1; the context bound is checked once the prompt
  is tokenized), ``temperature`` (0 = greedy: exactly the target's greedy output), ``top_p``,
  ``top_k`` (vLLM's extension), ``seed``, ``stop`` (up to 4 strings: the answer is cut before
  the first one, as OpenAI does), ``stream`` and ``stream_options.include_usage``;
* ``n`` must be 1; penalties, logprobs, logit_bias, tools and non-text response formats are
  refused with a 400 that says so (they would change the target's distribution or need data
  mmspec does not produce); fields OpenAI clients send by habit (``user``, ``metadata``,
  ``store``, ...) are accepted and ignored; any other field is refused by name.

Like OpenAI and vLLM, a request without ``temperature`` samples at 1.0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from mmspec.errors import MMSpecError

SUPPORTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
             "stream", "stream_options", "n", "stop", "logprobs", "top_logprobs"}
# POST /v1/completions: a raw prompt instead of messages; logprobs is the number of alternatives there
COMPLETION_SUPPORTED = SUPPORTED - {"messages", "max_completion_tokens", "top_logprobs"} | {"prompt"}
COMPLETION_OFF_ONLY = {"echo": (False, None), "suffix": (None, ""), "best_of": (1, None)}
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}  # sent by habit; they change nothing in the answer
# fields mmspec does not implement: accepted only at the value that means "off"
OFF_ONLY = {
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "repetition_penalty": (1, None),
    "logit_bias": ({}, None), "tools": ([], None),
    "tool_choice": ("none", None), "functions": ([], None), "function_call": ("none", None),
    "response_format": ({"type": "text"}, None), "modalities": (["text"], None),
}
WHY_OFF = {
    "frequency_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "presence_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "repetition_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "echo": "mmspec serve returns the completion only (no echo of the prompt or its log-probabilities)",
    "suffix": "mmspec serve does not insert text (no suffix)",
    "best_of": "best_of ranks samples by their log-probabilities, which changes the target's distribution; ask for "
               "n samples and pick among them yourself",
    "logit_bias": "a logit bias changes the target's distribution, and mmspec's output is exactly the target's",
    "tools": "mmspec serve has no tool calling",
    "tool_choice": "mmspec serve has no tool calling",
    "functions": "mmspec serve has no function calling",
    "function_call": "mmspec serve has no function calling",
    "response_format": "mmspec serve answers in plain text only (no JSON mode or schemas)",
    "modalities": "mmspec serve answers in text only",
}
ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4
MAX_SEED = 2**63 - 1
MAX_DEPTH = 32  # JSON nesting levels (a chat request needs about 6)


class RequestError(MMSpecError):
    """A request the server refuses: ``status`` (400 unless said), the OpenAI error ``type`` and
    the offending ``param``; the message names the problem and the fix."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """The fields of one chat-completions request that mmspec serves."""

    messages: list[dict]
    model: str | None = None
    max_tokens: int | None = None  # None: the server's default, capped by the room left in the context
    temperature: float = 1.0
    top_p: float | None = None  # None: no nucleus filter
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    stop: list[str] = field(default_factory=list)
    n: int = 1  # choices: samples of the same prompt (seeds seed, seed + 1, ...)
    logprobs: bool = False  # the target's log-probability of each answer token
    top_logprobs: int = 0  # ... and of its likeliest alternatives there
    prompt: str | None = None  # /v1/completions: the raw prompt (not chat-framed); messages then hold its parts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def parse_request(body: bytes, served_model: str, completion: bool = False) -> ChatRequest:
    """``body`` (the raw HTTP body) -> ChatRequest; RequestError for anything mmspec cannot serve as asked.
    ``completion``: a ``/v1/completions`` body (``prompt`` instead of ``messages``)."""
    data = _json_object(body)
    supported = COMPLETION_SUPPORTED if completion else SUPPORTED
    off_only = {**OFF_ONLY, **COMPLETION_OFF_ONLY} if completion else OFF_ONLY
    unknown = sorted(set(data) - supported - IGNORED - set(off_only))
    if unknown:
        raise RequestError(f"unknown argument(s) {', '.join(map(repr, unknown))}; mmspec serve takes "
                           f"{', '.join(sorted(supported))} (see docs/serve.md): drop the others", param=unknown[0])
    for name, allowed in off_only.items():
        if name in data and data[name] not in allowed:
            raise RequestError(f"{name}={data[name]!r} is not supported: {WHY_OFF[name]}; drop {name}", param=name)
    model = data.get("model")
    if model is not None and model != served_model:
        raise RequestError(f"the model {str(model)[:100]!r} does not exist here; this server serves {served_model!r} "
                           "(GET /v1/models): pass model=" + repr(served_model), param="model", status=404,
                           code="model_not_found")
    if completion:
        prompt, parts = _prompt(data.get("prompt"))
        req = ChatRequest(messages=[{"role": "user", "content": parts}], model=model, prompt=prompt)
        req.max_tokens = _max_tokens(data) or COMPLETION_MAX_TOKENS
        top = _integer(data, "logprobs", None)
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS} (the alternatives per token), got {top}",
                               param="logprobs")
        req.logprobs, req.top_logprobs = top is not None, top or 0
    else:
        req = ChatRequest(messages=_messages(data.get("messages")), model=model)
        req.max_tokens = _max_tokens(data)
        req.logprobs = _boolean(data, "logprobs", False)
        top = _integer(data, "top_logprobs", None)
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
        if top and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true; set it, or drop top_logprobs", param="top_logprobs")
        req.top_logprobs = top or 0
    req.temperature = _number(data, "temperature", 1.0, low=0.0)
    top_p = _number(data, "top_p", None, low=0.0)
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = _integer(data, "top_k", None)
    req.top_k = None if top_k in (None, 0, -1) or req.greedy else top_k  # vLLM: 0 and -1 mean no top-k
    if req.top_k is not None and req.top_k < 1:
        raise RequestError(f"top_k must be >= 1 (or -1 for none), got {top_k}", param="top_k")
    req.top_p = None if top_p in (None, 1.0) or req.greedy else top_p  # greedy ignores the filters, as OpenAI
    seed = _integer(data, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed must be in [0, 2**63 - 1], got {seed}", param="seed")
    req.seed = None if req.greedy else seed  # greedy needs no seed: the output is the same
    req.n = _integer(data, "n", 1)
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be from 1 to {MAX_N} (choices per request), got {req.n}; send several requests "
                           "for more", param="n")
    req.stop = _stop(data.get("stop"))
    req.stream = _boolean(data, "stream", False)
    opts = data.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise RequestError("stream_options is only allowed with stream=true; drop it or set stream=true",
                               param="stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise RequestError(f"stream_options must be an object with include_usage (true/false), got {opts!r}",
                               param="stream_options")
        req.include_usage = _boolean(opts, "include_usage", False)
    return req


def _json_object(body: bytes) -> dict:
    def no_constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset "
                           f"{e.start}); send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text, parse_constant=no_constant)
    except RecursionError:  # the C parser recurses once per level
        raise _too_deep() from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object such as "
                           '{"model": ..., "messages": [{"role": "user", "content": "Hi"}]} with '
                           "Content-Type: application/json") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got a {type(data).__name__}; send "
                           '{"model": ..., "messages": [...]}')
    _check_strings(data)
    return data


def _too_deep() -> RequestError:
    return RequestError(f"the request body nests JSON deeper than {MAX_DEPTH} levels; a chat request needs about "
                        "6 (messages, a message, its content parts, an image_url): flatten it")


def _check_strings(data: dict) -> None:
    """Bound the nesting (no recursion: a walk with its own stack) and refuse, by name, strings
    no tokenizer or file system should see: NUL characters and lone UTF-16 surrogates (JSON's
    \\u0000 and \\ud800 escapes are valid JSON but no valid text)."""
    stack = [(data, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, where, depth))
                stack.append((v, f"{where}.{k}" if where else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            if "\x00" in value:
                raise RequestError(f"{where or 'a key'} contains a NUL character (\\u0000), which no text or file "
                                   "name may hold; remove it", param=where or None)
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{where or 'a key'} contains a lone surrogate ({value[e.start]!r} at character "
                                   f"{e.start}), which is no valid Unicode text; send the text's real "
                                   "characters (a surrogate pair encodes one character)", param=where or None) from None


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                           param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"{where} must be an object with role and content", param=where)
        if m["role"] not in ROLES:
            raise RequestError(f"{where}.role {m['role']!r} is not served; use one of {', '.join(ROLES)} "
                               "(mmspec serve has no tool calling)", param=f"{where}.role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"{where} has unknown field(s) {sorted(extra)}; a message has role, content "
                               "(and name)", param=where)
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise RequestError(f"{where}.content must be a string or a non-empty list of parts", param=where)
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]", m["role"])
    if messages[-1]["role"] != "user":
        raise RequestError(f"the last message is the {messages[-1]['role']}'s; end messages with the user's turn "
                           "(the server answers it)", param=f"messages[{len(messages) - 1}]")
    return messages


def _prompt(prompt) -> tuple[str, list[dict]]:
    """/v1/completions' prompt: a string (or a list of one), or mmspec's extension, a list of
    ``text`` and ``image_url`` parts as in chat messages (an image goes where its part is, or into
    the ``<image>`` markers the text writes). -> (the text, the parts)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty; send the text to continue", param="prompt")
        return prompt, [{"type": "text", "text": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, dict) for p in prompt):
        for j, part in enumerate(prompt):
            _check_part(part, f"prompt[{j}]", "user")
        return "", prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, int)) for p in prompt):
        raise RequestError("prompt: a batch of prompts (or token ids) is not served; send one prompt string per "
                           "request (n= gives several samples of one)", param="prompt")
    raise RequestError("prompt must be a string, or a list of text and image_url parts (mmspec's extension: "
                       '[{"type": "text", "text": "..."}, {"type": "image_url", "image_url": {"url": ...}}])',
                       param="prompt")


def _check_part(part, where: str, role: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where} is a text part without a text string", param=where)
    elif kind == "image_url":
        if role != "user":
            raise RequestError(f"{where}: only the user's messages carry images, not the {role}'s", param=where)
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where} is an image_url part without a url; send "
                               '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}', param=where)
    else:
        raise RequestError(f"{where} has type {kind!r}; mmspec serve reads text and image_url parts only",
                           param=where)


def _max_tokens(data: dict) -> int | None:
    a, b = _integer(data, "max_tokens", None), _integer(data, "max_completion_tokens", None)
    if a is not None and b is not None and a != b:
        raise RequestError(f"max_tokens={a} and max_completion_tokens={b} disagree; pass one of them",
                           param="max_tokens")
    value = a if a is not None else b
    name = "max_tokens" if a is not None else "max_completion_tokens"
    if value is not None and value < 1:
        raise RequestError(f"{name} must be >= 1, got {value}; ask for at least one token, or leave it out "
                           "for the server's default", param=name)
    return value


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP}", param="stop")
    return stops


def _number(data: dict, name: str, default, low: float):
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise RequestError(f"{name} must be a finite number >= {low:g}, got {value!r}", param=name)
    return float(value)


def _integer(data: dict, name: str, default):
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be a whole number, got {value!r}", param=name)
    return value


def _boolean(data: dict, name: str, default: bool) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value
