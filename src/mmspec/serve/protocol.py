"""OpenAI's request and response objects, declared once as pydantic models (as vLLM's
``entrypoints/openai/protocol.py``): one model per OpenAI object.

Requests (:class:`ChatCompletionRequest`, :class:`CompletionRequest`, their messages and content
parts) refuse what mmspec cannot honour with a :class:`~mmspec.serve.schema.RequestError` whose
message names the problem and the fix: a validator raises it (a ``ValueError``, so pydantic
carries it through its ``ValidationError``) and :func:`parse_request` hands
it on as the 400 body; a ``{where}`` in a nested model's message becomes the field's place
(``messages[0].content[1]``). Fields OpenAI has and mmspec does not implement are declared and
accepted only at the value that means "off"; any field not declared is refused by name
(``extra="forbid"``). A validated request IS the server's data model, normalised as it is
validated (the sampling fields as decoding reads them: greedy drops the filters and the seed,
OpenAI's default temperature 1; ``max_tokens`` merged with ``max_completion_tokens``): the
server reads its typed messages and fields (:attr:`_Request.chat_messages`,
:attr:`_Request.logprobs_top`, ...), never the raw dicts again. :func:`parse_messages` checks a
list of chat messages alone (``mmspec audit``'s local reference).

Responses (:class:`ChatCompletionResponse`, :class:`ChatCompletionChunk`,
:class:`CompletionResponse`, :class:`Usage`, the log-probability objects, :class:`ErrorResponse`)
are what the handlers serialise; each carries mmspec's stats under ``mmspec`` (:class:`MMSpecStats`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mmspec.errors import ArgumentError
from mmspec.prompt import IMAGE_MARKER
from mmspec.request import Decoding, decoding
from mmspec.runtime.verify import SamplingParams
from mmspec.serve.schema import (
    COMPLETION_MAX_TOKENS,
    IGNORED,
    MAX_N,
    MAX_SEED,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    RENAMED,
    ROLES,
    WHY_OFF,
    RequestError,
    json_object,
)
from mmspec.serve.structured import TEXT, Plan, plan_of


# ----------------------------------------------------------------------- field types (today's messages)
def _whole(value, info: ValidationInfo):
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise RequestError(f"{info.field_name} must be a whole number, got {value!r}", param=info.field_name)
    return value


def _number(value, info: ValidationInfo):
    """A JSON number (its range is the limit's own: :func:`mmspec.request.decoding`)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise RequestError(f"{info.field_name} must be a finite number, got {value!r}", param=info.field_name)
    return value


def _flag(value, info: ValidationInfo):
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{info.field_name} must be true or false, got {value!r}", param=info.field_name)
    return value


Whole = Annotated[int | None, BeforeValidator(_whole)]
Number = Annotated[float | None, BeforeValidator(_number)]
Flag = Annotated[bool | None, BeforeValidator(_flag)]


# ----------------------------------------------------------------------- messages and content parts
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, ref):
        return {"url": ref} if isinstance(ref, str) else ref  # vLLM (and older clients) also send the url alone


def _part(part, where: str = "{where}"):
    """A content part's shape, checked before pydantic picks its model (so the message names the fix)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where} is a text part without a text string", param=where)
    elif kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where} is an image_url part without a url; send "
                               '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}', param=where)
    else:
        raise RequestError(f"{where} has type {kind!r}; mmspec serve reads text and image_url parts only",
                           param=where)
    return part


ContentPart = TextPart | ImageURLPart  # shapes checked by ChatMessage first


class ChatMessage(BaseModel):
    """One turn: system / developer / user / assistant / tool; content a string or a list of parts.
    An assistant turn may carry the ``tool_calls`` it made (its content then may be null), a tool
    turn answers one by ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, m):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError("{where} must be an object with role and content")
        if m["role"] not in ROLES:
            raise RequestError(f"{{where}}.role {m['role']!r} is not served; use one of {', '.join(ROLES)}",
                               param="{where}.role")
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise RequestError(f"{{where}} has unknown field(s) {sorted(extra)}; a message has role, content "
                               "(and name; an assistant's tool_calls, a tool's tool_call_id)")
        if m.get("tool_calls") is not None and m["role"] != "assistant":
            raise RequestError("{where}.tool_calls: only the assistant's messages carry tool calls",
                               param="{where}.tool_calls")
        if m.get("tool_calls") is not None:
            check_tool_calls(m["tool_calls"])
            if m.get("content") is None:
                return {**m, "content": ""}
        content = m.get("content")
        if m["role"] == "tool" and not isinstance(content, str):
            raise RequestError("{where}.content: a tool message's content is the tool's result as a string",
                               param="{where}.content")
        if not isinstance(content, str) and (not isinstance(content, list) or not content):
            raise RequestError("{where}.content must be a string or a non-empty list of parts")
        for j, part in enumerate(content if isinstance(content, list) else []):
            _part(part, f"{{where}}.content[{j}]")
            if part["type"] == "image_url" and m["role"] != "user":
                raise RequestError(f"{{where}}.content[{j}]: only the user's messages carry images, not the "
                                   f"{m['role']}'s", param=f"{{where}}.content[{j}]")
        return m


def check_tool_calls(calls) -> None:
    """An assistant turn's ``tool_calls`` as OpenAI returns them (what the next request sends back)."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments", ""), str)
        for c in calls)
    if not ok:
        raise RequestError('{where}.tool_calls must be a list of {"id": ..., "type": "function", "function": '
                           '{"name": ..., "arguments": "<JSON text>"}}, as the answer gave them',
                           param="{where}.tool_calls")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Flag = False
    continuous_usage_stats: Flag = None


# ----------------------------------------------------------------------- requests
class _Request(BaseModel):
    """The fields chat and text completions share (OpenAI's, plus vLLM's top_k)."""

    model_config = ConfigDict(extra="forbid")
    OFF: ClassVar[dict[str, tuple]] = {}  # field -> the values that mean "off" (the only ones accepted)
    completion: ClassVar[bool] = False  # /v1/completions (a raw prompt, not chat-framed)
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # max_tokens left out (None: the server's, capped by the context)

    model: Any = None
    max_tokens: Whole = None
    temperature: Number = None
    top_p: Number = None
    top_k: Whole = None
    seed: Whole = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    n: Whole = 1
    stop: Any = None
    # sent by habit; they change nothing in the answer
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    # OpenAI's, not implemented: accepted only "off" (WHY_OFF says why)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    # the answer's form (mmspec.serve.structured): OpenAI's response_format, vLLM's structured_outputs
    response_format: Any = None
    structured_outputs: Any = None
    _plan: Plan = PrivateAttr(default=TEXT)
    _decoding: Decoding | None = PrivateAttr(default=None)

    @classmethod
    def supported(cls) -> list[str]:
        return sorted(set(cls.model_fields) - IGNORED - set(cls.OFF))

    @model_validator(mode="before")
    @classmethod
    def _off_and_model(cls, data, info: ValidationInfo):
        if not isinstance(data, dict):
            return data
        renamed = sorted(set(data) & set(RENAMED) - set(cls.model_fields))
        if renamed:
            raise RequestError(f"{renamed[0]} is vLLM's old name (removed in vLLM 0.12), not served: send "
                               f"{RENAMED[renamed[0]]} instead (see docs/serve.md)", param=renamed[0])
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise RequestError(f"unknown argument(s) {', '.join(map(repr, unknown))}; mmspec serve takes "
                               f"{', '.join(cls.supported())} (see docs/serve.md): drop the others", param=unknown[0])
        for name, allowed in cls.OFF.items():
            if name in data and data[name] not in allowed:
                raise RequestError(f"{name}={data[name]!r} is not supported: {WHY_OFF[name]}; drop {name}", param=name)
        served, model = (info.context or {}).get("served_model"), data.get("model")
        if served is not None and model is not None and model != served:
            raise RequestError(f"the model {str(model)[:100]!r} does not exist here; this server serves {served!r} "
                               "(GET /v1/models): pass model=" + repr(served), param="model", status=404,
                               code="model_not_found")
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop")
        if len(stops) > MAX_STOP:
            raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP}", param="stop")
        return stops

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, opts):
        if opts is not None and (not isinstance(opts, dict) or set(opts) - set(StreamOptions.model_fields)):
            raise RequestError(f"stream_options must be an object with include_usage (true/false), got {opts!r}",
                               param="stream_options")
        return opts

    @model_validator(mode="after")
    def _ranges(self):
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise RequestError(f"seed must be in [0, 2**63 - 1], got {self.seed}", param="seed")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be from 1 to {MAX_N} (choices per request), got {self.n}; send several "
                               "requests for more", param="n")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true; drop it or set stream=true",
                               param="stream_options")
        # the limits every request has (max_tokens, temperature, top_k, top_p, seed) are checked where
        # generate()'s are, in mmspec.request.decoding: the one place; here they are named as the client sent them
        name, limit = self._max_tokens()
        temperature = 1.0 if self.temperature is None else float(self.temperature)  # OpenAI's and vLLM's default
        top_k = None if self.top_k in (None, 0, -1) else self.top_k  # vLLM: 0 and -1 mean no top-k
        try:
            asked = decoding(max_new_tokens=limit, temperature=temperature, top_k=top_k, top_p=self.top_p,
                             seed=self.seed, names={"max_new_tokens": name}, sized_later=True)
        except ArgumentError as e:
            raise RequestError(str(e), param=e.argument) from None
        # checked: now the sampling fields as decoding reads them (greedy ignores the filters and the seed, as OpenAI)
        self.temperature = temperature
        greedy = self.temperature == 0
        self.top_k = None if greedy else top_k
        self.top_p = None if self.top_p in (None, 1.0) or greedy else float(self.top_p)
        self.seed = None if greedy else self.seed
        self.max_tokens = limit if limit is not None else self.DEFAULT_MAX_TOKENS
        self.stream, self.stop = bool(self.stream), self.stop or []
        self._decoding = replace(asked, max_new_tokens=self.max_tokens, seed=self.seed,
                                 params=SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p))
        return self

    def _max_tokens(self) -> tuple[str, int | None]:
        """(the field that sets the answer's token limit, its value as sent)."""
        return "max_tokens", self.max_tokens

    @property
    def decoding(self) -> Decoding:
        """What the request asks of its decoding, checked (:func:`mmspec.request.decoding`):
        ``max_new_tokens`` None where the server's default applies (sized against the context)."""
        return replace(self._decoding, logprobs=self.logprobs_top)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plan(self) -> Plan:
        """What the answer's form is (a constraint, tool calls): :func:`mmspec.serve.structured.plan_of`."""
        return self._plan

    def make_plan(self, tool_call_parser: str | None = None) -> Plan:
        """Read the answer's form from the request (RequestError where it is bad); kept as :attr:`plan`."""
        self._plan = plan_of(response_format=self.response_format, structured_outputs=self.structured_outputs,
                             tools=getattr(self, "tools", None), tool_choice=getattr(self, "tool_choice", None),
                             tool_call_parser=tool_call_parser, parallel_tool_calls=self.parallel_tool_calls)
        return self._plan

    @property
    def include_usage(self) -> bool:
        """stream_options.include_usage: a last chunk with the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def chat_messages(self) -> list[ChatMessage]:
        """The conversation the prompt is made of (a completion's prompt: one user message)."""
        raise NotImplementedError

    @property
    def raw_text(self) -> str | None:
        """/v1/completions: the prompt's text as sent, not chat-framed (image parts as markers); None: chat."""
        return None

    @property
    def logprobs_top(self) -> int | None:
        """None: no log-probabilities asked for; else the alternatives wanted per token (0 or more)."""
        raise NotImplementedError


_OFF_CHAT = {
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "repetition_penalty": (1, None),
    "logit_bias": ({}, None), "functions": ([], None), "function_call": ("none", None),
    "modalities": (["text"], None),
}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    OFF: ClassVar[dict[str, tuple]] = _OFF_CHAT
    messages: list[ChatMessage] | None = None
    max_completion_tokens: Whole = None
    logprobs: Flag = False
    top_logprobs: Whole = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, messages):
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                               param="messages")
        return messages

    @model_validator(mode="after")
    def _chat(self):
        if self.messages is None:
            self._non_empty(None)
        if self.messages[-1].role not in ("user", "tool"):
            raise RequestError(f"the last message is the {self.messages[-1].role}'s; end messages with the user's "
                               "turn (or a tool's result): the server answers it",
                               param=f"messages[{len(self.messages) - 1}]")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
        if top and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true; set it, or drop top_logprobs", param="top_logprobs")
        return self

    def _max_tokens(self) -> tuple[str, int | None]:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise RequestError(f"max_tokens={a} and max_completion_tokens={b} disagree; pass one of them",
                               param="max_tokens")
        return ("max_tokens", a) if a is not None else ("max_completion_tokens", b)

    @property
    def chat_messages(self) -> list[ChatMessage]:
        return self.messages

    @property
    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    """``POST /v1/completions``: a raw prompt (mmspec's extension: or text and image_url parts)."""

    OFF: ClassVar[dict[str, tuple]] = {**_OFF_CHAT, "echo": (False, None), "suffix": (None, ""), "best_of": (1, None),
                                       "tools": ([], None), "tool_choice": ("none", None)}
    completion: ClassVar[bool] = True
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = COMPLETION_MAX_TOKENS  # OpenAI's
    prompt: Any = None
    logprobs: Whole = None  # here: the number of alternatives per token
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; send the text to continue", param="prompt")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, dict) for p in prompt):
            for j, part in enumerate(prompt):
                _part(part, f"prompt[{j}]")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, int)) for p in prompt):
            raise RequestError("prompt: a batch of prompts (or token ids) is not served; send one prompt string per "
                               "request (n= gives several samples of one)", param="prompt")
        raise RequestError("prompt must be a string, or a list of text and image_url parts (mmspec's extension: "
                           '[{"type": "text", "text": "..."}, {"type": "image_url", "image_url": {"url": ...}}])',
                           param="prompt")

    @model_validator(mode="after")
    def _completion(self):
        if self.prompt is None:
            self._prompt(None)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS} (the alternatives per token), got "
                               f"{self.logprobs}", param="logprobs")
        parts = [{"type": "text", "text": self.prompt}] if isinstance(self.prompt, str) else self.prompt
        self._turn = ChatMessage.model_validate({"role": "user", "content": parts})
        return self

    _turn: ChatMessage | None = PrivateAttr(default=None)  # the prompt as one user message (its parts typed)

    @property
    def chat_messages(self) -> list[ChatMessage]:
        return [self._turn]

    @property
    def raw_text(self) -> str | None:
        return self.prompt if isinstance(self.prompt, str) else marked_text(self._turn)

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs


# ----------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MMSpecStats(BaseModel):
    """mmspec's own numbers for one answer (the ``mmspec`` key; with n > 1, every choice's under ``choices``)."""

    tokens_per_block: list[int]
    blocks: int
    tau: float  # tokens per block, the bonus/recovered token included
    mean_accepted_length: float  # tau - 1
    seed: int | None
    latency_s: float
    acceptance_by_position: list[float] | None = None
    prompt_tokens_reused: int | None = None
    choices: list[MMSpecStats] | None = None

    def body(self) -> dict:
        return self.model_dump(exclude_unset=True)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    token_id: int  # vLLM's extension: the token's id


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """Completions' (legacy) log-probabilities."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]
    token_ids: list[int]


class ChatCompletionMessage(BaseModel):
    """The answer: its content, or (``tool_calls``: ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` each) the tools it calls; ``tool_calls`` is left out of the body where none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class CompletionChoice(BaseModel):
    """A text completion's choice, whole or (``finish_reason`` None) a streamed piece of it."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # streamed calls: {"index", and "id", "type", "function" {"name", "arguments"}}


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


def _now() -> int:
    return int(time.time())


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str

    def body(self) -> dict:
        """The JSON body: ``usage`` and ``mmspec`` only where given (a stream's chunks mostly have neither)."""
        out = self.model_dump(exclude={"usage", "mmspec"})
        if getattr(self, "usage", None) is not None:
            out["usage"] = self.usage.model_dump()
        if getattr(self, "mmspec", None) is not None:
            out["mmspec"] = self.mmspec.body()
        return out


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: Usage
    mmspec: MMSpecStats

    def body(self) -> dict:
        out = super().body()  # a message without tool calls has no tool_calls key (as OpenAI's)
        for c in out["choices"]:
            if c["message"].get("tool_calls") is None:
                c["message"].pop("tool_calls", None)
        return out


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None  # the last chunk, with stream_options.include_usage
    mmspec: MMSpecStats | None = None

    def body(self) -> dict:
        out = super().body()  # a delta has only the keys it carries: {"role", "content"}, {"content"} or {}
        out["choices"] = [{**c, "delta": {k: v for k, v in c["delta"].items() if v is not None}} for c in out["choices"]]
        return out


class CompletionResponse(_Response):
    """A text completion, whole or (no usage) one streamed chunk: OpenAI names both ``text_completion``."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    mmspec: MMSpecStats | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    def body(self) -> dict:
        return self.model_dump()


def parse_request(body: bytes, served_model: str, completion: bool = False,
                  tool_call_parser: str | None = None) -> ChatCompletionRequest | CompletionRequest:
    """``body`` (the raw HTTP body) -> the validated request, the server's data model from here on;
    RequestError for anything mmspec cannot serve as asked. ``completion``: a ``/v1/completions``
    body (``prompt`` instead of ``messages``). The JSON is read and its strings checked (depth, NUL,
    surrogates) before the pydantic models see it; then the answer's form (:attr:`_Request.plan`:
    ``response_format``, ``structured_outputs``, ``tools``; ``tool_call_parser``: the server's
    ``--tool-call-parser``, which ``tool_choice`` "auto" needs)."""
    data = json_object(body)
    model = CompletionRequest if completion else ChatCompletionRequest
    try:
        req = model.model_validate(data, context={"served_model": served_model})
    except ValidationError as e:
        raise refusal_of(e) from None
    req.make_plan(tool_call_parser)
    return req


class _Messages(BaseModel):
    messages: list[ChatMessage]


def parse_messages(messages) -> list[ChatMessage]:
    """A list of chat messages (dicts, as a JSONL line holds them) -> typed ones, or the
    RequestError a server would answer (``messages[0].content[1] ...``)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                           param="messages")
    try:
        return _Messages.model_validate({"messages": messages}).messages
    except ValidationError as e:
        raise refusal_of(e) from None


def marked_text(message: ChatMessage) -> str:
    """A message's text with an ``<image>`` marker per image part where it is; when the text
    writes markers itself, the parts only fill them (in order)."""
    content = message.content
    if isinstance(content, str):
        return content
    texts = [p.text for p in content if p.type == "text"]
    if any(IMAGE_MARKER in t for t in texts):
        return " ".join(t.strip() for t in texts)
    pieces = [IMAGE_MARKER if p.type == "image_url" else p.text.strip() for p in content]
    return " ".join(p for p in pieces if p)


def refusal_of(e) -> RequestError:
    """A pydantic ValidationError -> the RequestError it carries (a validator's, its ``{where}``
    made the field's place), or a 400 naming the field: never FastAPI's 422."""
    errors = e.errors(include_url=False)
    first = max(errors, key=lambda err: len(err["loc"]))  # of a union's branches, the one that got furthest
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in first["loc"] if _field(k)).lstrip(".")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, RequestError):
        if "{where}" in str(cause):
            param = (cause.param or "{where}").replace("{where}", where)
            return RequestError(str(cause).replace("{where}", where), param=param or None, status=cause.status,
                                type=cause.type, code=cause.code)
        return cause
    got = f", got {first['input']!r}"[:200] if first["type"] != "missing" else ""
    return RequestError(f"{where or 'the request body'}: {first['msg']}{got}; see docs/serve.md for the fields "
                        "mmspec serve takes", param=where or None)


def _field(loc) -> bool:
    """A place in pydantic's error location that is a field or an index, not a union branch's
    name (``str``, ``list[...]``, ``TextPart``)."""
    return isinstance(loc, int) or (loc.isidentifier() and loc.islower() and loc not in ("str", "int", "float", "bool"))
