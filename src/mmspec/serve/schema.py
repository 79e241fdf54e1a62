"""The OpenAI completions request body before the models see it: its bytes read and refused where
no model should see them.

Owns :class:`RequestError` (an HTTP status and an OpenAI-style error body whose message names the
problem and the fix), the limits, and :func:`json_object` (bytes -> a checked JSON object;
:func:`mmspec.serve.protocol.parse_request` validates it). The body is decoded and its strings
checked first (UTF-8, JSON depth, NUL characters, lone surrogates: no pydantic model sees them),
then validated by the models of :mod:`.protocol`, which are the server's data model from there on
(what each field does and what is refused is declared there); a pydantic ``ValidationError``
becomes a 400 :class:`RequestError` naming the field (`mmspec.serve.protocol.refusal_of`), never
FastAPI's 422.

Like OpenAI and vLLM, a request without ``temperature`` samples at 1.0.
"""

from __future__ import annotations

import json

from mmspec.errors import MMSpecError

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}  # sent by habit; they change nothing in the answer
# why the fields mmspec does not implement are accepted only at the value that means "off"
WHY_OFF = {
    "frequency_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "presence_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "repetition_penalty": "penalties change the target's distribution, and mmspec's output is exactly the target's",
    "echo": "mmspec serve returns the completion only (no echo of the prompt or its log-probabilities)",
    "suffix": "mmspec serve does not insert text (no suffix)",
    "best_of": "best_of ranks samples by their log-probabilities, which changes the target's distribution; ask for "
               "n samples and pick among them yourself",
    "logit_bias": "a logit bias changes the target's distribution, and mmspec's output is exactly the target's",
    "tools": "the legacy completions endpoint takes no tools; send them to /v1/chat/completions",
    "tool_choice": "the legacy completions endpoint takes no tools; send them to /v1/chat/completions",
    "functions": "functions is OpenAI's deprecated form of tools; send tools=[{\"type\": \"function\", "
                 "\"function\": {...}}]",
    "function_call": "function_call is OpenAI's deprecated form of tool_choice; send tool_choice",
    "modalities": "mmspec serve answers in text only",
}
ROLES = ("system", "developer", "user", "assistant", "tool")
# vLLM's request fields before 0.12 (removed there): refused with the name that replaced them
RENAMED = {
    "guided_json": 'structured_outputs: {"json": SCHEMA}', "guided_regex": 'structured_outputs: {"regex": "..."}',
    "guided_choice": 'structured_outputs: {"choice": [...]}', "guided_grammar": 'structured_outputs: {"grammar": "..."}',
    "guided_whitespace_pattern": 'structured_outputs: {"disable_any_whitespace": true/false}',
    "guided_decoding_backend": "nothing (mmspec's backend is xgrammar)",
}
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


def json_object(body: bytes) -> dict:
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
