"""Answers in OpenAI's shapes: the chat completion, its stream chunks, and mmspec's own stats.

Owns :class:`Answer` (one request's tokens and text as its blocks arrive, cut at a stop string:
the text before the first stop string is what the client gets, and text that might still
become a stop string is held back while streaming), the response bodies, and the ``mmspec``
key each response carries: tokens per block, blocks, tau (tokens per block including the
bonus/recovered token), mean accepted length (tau - 1), acceptance by draft position, prompt
tokens reused from a cached conversation, and the sampling seed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Answer:
    """One request's answer so far."""

    stops: list[str]
    eos_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    tokens_per_block: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded, uncut
    sent: int = 0  # characters of ``text`` already handed to the client
    stopped: bool = False  # a stop string was found: the answer ends before it
    result: object = None  # the GenerationResult, once finished
    first_token_at: float | None = None  # perf_counter() when the first token arrived (time to first token)

    def add(self, token_ids: list[int], text: str) -> str:
        """One block's tokens and text -> the text the client may have now."""
        if self.stopped:
            return ""
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids += token_ids
        self.tokens_per_block.append(len(token_ids))
        self.text += text
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.text) - self._held())

    def finish(self, result) -> str:
        """The request finished: the rest of the text (the result's own decoding where no stop cut it)."""
        self.result = result
        if not self.stopped and result is not None:
            if result.text.startswith(self.text[: self.sent]):
                self.text = result.text  # the final decoding is the authority on the whole text
            cut = self._stop_at()
            if cut is not None:
                self.stopped = True
                return self._release(cut)
        return self._release(len(self.text))

    @property
    def content(self) -> str:
        return self.text[: self._stop_at()] if self.stopped else self.text

    @property
    def finish_reason(self) -> str:
        if self.stopped or (self.token_ids and self.token_ids[-1] in self.eos_ids):
            return "stop"
        return "length"

    def _stop_at(self) -> int | None:
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Characters at the end of the text that begin a stop string (held back while streaming)."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _release(self, upto: int) -> str:
        out = self.text[self.sent: max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return out


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, answer: Answer) -> dict:
    n = len(answer.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def mmspec_stats(answer: Answer, seed: int | None, latency_s: float) -> dict:
    """mmspec's own numbers for one answer (from the GenerationResult where the request finished)."""
    st = getattr(answer.result, "stats", None)
    # a cut answer (stop string, no result): the blocks it got, the empty ones of its admission left out
    per_block = st.tokens_per_block if st is not None else [n for n in answer.tokens_per_block if n]
    tau = sum(per_block) / len(per_block) if per_block else 0.0
    out = {"tokens_per_block": per_block, "blocks": len(per_block), "tau": round(tau, 4),
           "mean_accepted_length": round(tau - 1, 4) if per_block else 0.0, "seed": seed,
           "latency_s": round(latency_s, 4)}
    if st is not None:
        out["acceptance_by_position"] = [round(a, 4) for a in st.acceptance_by_position()]
        out["prompt_tokens_reused"] = getattr(st, "prompt_tokens_reused", 0)
    return out


def completion(cid: str, model: str, answer: Answer, prompt_tokens: int, stats: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.content},
                         "finish_reason": answer.finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, answer), "mmspec": stats}


def chunk(cid: str, model: str, delta: dict, finish_reason: str | None = None, **extra) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}


def usage_chunk(cid: str, model: str, usage_: dict, stats: dict) -> dict:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage (and mmspec's stats)."""
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_, "mmspec": stats}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
