"""An answer's tool calls, in OpenAI's shapes: whole (``message.tool_calls``) and streamed
(``delta.tool_calls``), for the three ways a request calls tools (:class:`~mmspec.serve.structured.Plan`):

* a named function: the answer IS the function's arguments (JSON constrained to its schema);
  streamed as they arrive (a first delta with the call's id, type and name, then argument pieces);
* "required": the answer is a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (vLLM's
  shape), each element one call (its ``parameters`` written back as the call's arguments);
  streamed whole at the end (one delta per call);
* "auto" with the Hermes parser: the model writes ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` where it calls one (Qwen2.5-VL, Hermes); the text outside the tags is the
  message's content. Streamed: content up to the first tag (text that may begin one is held
  back), the calls at the end.

A call's ``finish_reason`` is ``tool_calls`` when the answer ended by itself, ``length`` when
``max_tokens`` cut it (its arguments then are what was written: not complete JSON). Call ids are
``call_`` and 24 hex digits. This module knows nothing of HTTP or decoding.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from mmspec.serve.structured import Plan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """Hermes-style model output -> (the content outside the tags, or None; the calls). A tag
    whose JSON does not parse, or lacks a name, is left in the content as written."""
    calls, kept, at = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None), calls


def required_calls(text: str) -> list[Call] | None:
    """A "required" answer (``[{"name", "parameters"}, ...]``) -> its calls; None where it does not parse."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [Call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in items]


def held(text: str) -> int:
    """Characters at the end of ``text`` that may begin a ``<tool_call>`` tag (held back while streaming)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


@dataclass
class Message:
    """An answer as the client gets it: content (None with calls and nothing else), calls, finish_reason."""

    content: str | None
    calls: list[Call] | None
    finish_reason: str


def message_of(plan: Plan, content: str, finish_reason: str, named_id: str | None = None) -> Message:
    """A whole answer's message under ``plan``; ``named_id``: the id a streamed named call was sent with."""
    ended = finish_reason == "stop"
    if plan.mode == "named":
        return Message(None, [Call(plan.function, content, **({"id": named_id} if named_id else {}))],
                       "tool_calls" if ended else finish_reason)
    if plan.mode == "required":
        calls = required_calls(content) if ended else None
        return Message(None, calls, "tool_calls") if calls else Message(content, None, finish_reason)
    if plan.mode == "auto":
        rest, calls = parse_hermes(content)
        if calls:
            return Message(rest, calls, "tool_calls" if ended else finish_reason)
    return Message(content, None, finish_reason)


class ToolStream:
    """One streamed choice's tool-call deltas (module docstring): :meth:`feed` each new piece of
    text, :meth:`finish` once the answer is whole. Each returns delta dicts (``{"content": ...}``
    or ``{"tool_calls": [...]}``) to send in order."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # auto: characters of content already sent
        self.named_id: str | None = None

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if self.plan.mode == "named":
            return self._arguments(piece) if piece else []
        if self.plan.mode == "auto":
            cut = self.text.find(OPEN)
            upto = cut if cut >= 0 else len(self.text) - held(self.text)
            out = self.text[self.sent:upto] if upto > self.sent else ""
            self.sent = max(self.sent, upto)
            return [{"content": out}] if out else []
        return []  # required: whole at the end

    def _arguments(self, piece: str) -> list[dict]:
        """A named call's next piece of arguments (the first delta names the call)."""
        if self.named_id is None:
            self.named_id = call_id()
            return [{"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                     "function": {"name": self.plan.function, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]

    def finish(self, content: str, finish_reason: str) -> tuple[list[dict], str]:
        """The deltas left once the answer is whole (``content``: its final text), and its finish_reason."""
        if self.plan.mode == "named":
            rest = content[len(self.text):] if content.startswith(self.text) else ""
            self.text += rest
            deltas = self._arguments(rest) if rest or self.named_id is None else []
            return deltas, message_of(self.plan, content, finish_reason, self.named_id).finish_reason
        msg = message_of(self.plan, content, finish_reason)
        if msg.calls:  # (auto: content after the calls is not streamed; the calls are what the client acts on)
            return [{"tool_calls": [{"index": k, **c.body()}]} for k, c in enumerate(msg.calls)], msg.finish_reason
        rest = content[self.sent:]
        self.sent = len(content)
        return ([{"content": rest}] if rest else []), msg.finish_reason
