"""Answers in OpenAI's shapes (the models of :mod:`.protocol`): the chat completion, its stream
chunks, and mmspec's own stats.

Owns :class:`Answer` (one request's tokens, their log-probabilities where asked, and text as its
blocks arrive, cut at a stop string:
the text before the first stop string is what the client gets, and text that might still
become a stop string is held back while streaming), the response bodies, and the ``mmspec``
key each response carries (:class:`~mmspec.serve.protocol.MMSpecStats`): tokens per block, blocks, tau (tokens per block including the
bonus/recovered token), mean accepted length (tau - 1), acceptance by draft position, prompt
tokens reused from a cached conversation, and the sampling seed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from mmspec.serve import protocol as P
from mmspec.serve.structured import TEXT, Plan
from mmspec.serve.toolcalls import message_of


@dataclass
class Answer:
    """One request's answer so far."""

    stops: list[str]
    eos_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token of token_ids, where the request asked
    tokens_per_block: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded, uncut
    sent: int = 0  # characters of ``text`` already handed to the client
    stopped: bool = False  # a stop string was found: the answer ends before it
    result: object = None  # the GenerationResult, once finished
    first_token_at: float | None = None  # perf_counter() when the first token arrived (time to first token)

    def add(self, token_ids: list[int], text: str, logprobs: list | None = None) -> str:
        """One block's tokens, text and (where asked) the tokens' log-probabilities -> the text the
        client may have now."""
        if self.stopped:
            return ""
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids += token_ids
        self.logprobs += logprobs or []
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


def new_id(prefix: str = "chatcmpl-") -> str:
    return prefix + uuid.uuid4().hex


def usage(prompt_tokens: int, answers) -> P.Usage:
    """OpenAI's usage of one answer or of a request's choices (the prompt counted once)."""
    n = sum(len(a.token_ids) for a in (answers if isinstance(answers, list) else [answers]))
    return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)


def mmspec_stats(answer: Answer, seed: int | None, latency_s: float) -> P.MMSpecStats:
    """mmspec's own numbers for one answer (from the GenerationResult where the request finished)."""
    st = getattr(answer.result, "stats", None)
    # a cut answer (stop string, no result): the blocks it got, the empty ones of its admission left out
    per_block = st.tokens_per_block if st is not None else [n for n in answer.tokens_per_block if n]
    tau = sum(per_block) / len(per_block) if per_block else 0.0
    out = P.MMSpecStats(tokens_per_block=per_block, blocks=len(per_block), tau=round(tau, 4),
                        mean_accepted_length=round(tau - 1, 4) if per_block else 0.0, seed=seed,
                        latency_s=round(latency_s, 4))
    if st is not None:
        out.acceptance_by_position = [round(a, 4) for a in st.acceptance_by_position()]
        out.prompt_tokens_reused = getattr(st, "prompt_tokens_reused", 0)
    return out


def chat_choice(index: int, answer: Answer, logprobs: P.ChatLogprobs | None = None,
                plan: Plan = TEXT) -> P.ChatCompletionChoice:
    """A whole answer's choice; under a plan that calls tools, its ``tool_calls`` (:mod:`.toolcalls`)."""
    msg = message_of(plan, answer.content, answer.finish_reason)
    calls = [c.body() for c in msg.calls] if msg.calls else None
    return P.ChatCompletionChoice(index=index, message=P.ChatCompletionMessage(content=msg.content, tool_calls=calls),
                                  finish_reason=msg.finish_reason, logprobs=logprobs)


def text_choice(index: int, text: str, finish_reason: str | None = None,
                logprobs: P.CompletionLogprobs | None = None) -> P.CompletionChoice:
    return P.CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)


def delta_choice(index: int, delta: P.DeltaMessage, finish_reason: str | None = None,
                 logprobs: P.ChatLogprobs | None = None) -> P.ChatCompletionChunkChoice:
    return P.ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)


def completion(cid: str, model: str, choices: list, prompt_tokens: int, answers: list[Answer],
               stats: P.MMSpecStats, text: bool = False) -> dict:
    """The whole response's body: ``chat.completion``, or ``text_completion`` (``text``: /v1/completions)."""
    kind = P.CompletionResponse if text else P.ChatCompletionResponse
    return kind(id=cid, model=model, choices=choices, usage=usage(prompt_tokens, answers), mmspec=stats).body()


def chunk(cid: str, model: str, choices: list, text: bool = False, **extra) -> dict:
    """One stream chunk's body (``extra``: its usage and mmspec's stats, where it carries them)."""
    kind = P.CompletionResponse if text else P.ChatCompletionChunk
    return kind(id=cid, model=model, choices=choices, **extra).body()


def usage_chunk(cid: str, model: str, usage_: P.Usage, stats: P.MMSpecStats, text: bool = False) -> dict:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage (and mmspec's stats)."""
    return chunk(cid, model, [], text=text, usage=usage_, mmspec=stats)


def failure_type(status: int) -> str:
    """OpenAI's error type of an HTTP status: a client's mistake (4xx) is an invalid request (404: not
    found), the server's own failure (5xx) a server error (503: unavailable)."""
    named = {404: "not_found_error", 503: "service_unavailable"}
    return named.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


# ----------------------------------------------------------------------- log-probabilities
def content_token_ids(answer: Answer, tokenizer) -> list[int]:
    """The answer's tokens that make up its content: an EOS left out, and past a stop string's cut
    only the tokens that begin before it."""
    ids = list(answer.token_ids)
    while ids and ids[-1] in answer.eos_ids:
        ids.pop()
    if answer.stopped:
        n = len(answer.content)
        for k in range(len(ids) + 1):
            if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= n:
                return ids[:k]
    return ids


def _pieces(tokenizer, scored) -> dict[int, str]:
    """Each distinct token of ``scored`` (its tokens and their alternatives) decoded once: id -> text."""
    return {i: tokenizer.decode([i]) for i in {t.token_id for t in scored} | {i for t in scored for i, _ in t.top}}


def answer_logprobs(answer: Answer, tokenizer) -> list:
    """The :class:`~mmspec.results.TokenLogprob` of the answer's content tokens
    (:func:`content_token_ids`: a prefix of its tokens), as the engine read them."""
    return answer.logprobs[:len(content_token_ids(answer, tokenizer))]


def chat_logprobs(scored, tokenizer) -> P.ChatLogprobs:
    """Chat completions' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs, token_id}]}``."""
    piece = _pieces(tokenizer, scored)

    def entry(token_id: int, lp: float) -> dict:
        s = piece[token_id]
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "token_id": token_id}

    return P.ChatLogprobs(content=[P.TokenLogprob(**entry(t.token_id, t.logprob),
                                                  top_logprobs=[P.TopLogprob(**entry(i, v)) for i, v in t.top])
                                   for t in scored])


def text_logprobs(scored, tokenizer) -> P.CompletionLogprobs:
    """Completions' (legacy) ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    piece = _pieces(tokenizer, scored)
    tokens = [piece[t.token_id] for t in scored]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    tops = [{piece[i]: v for i, v in t.top} for t in scored] if any(t.top for t in scored) else None
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=[t.logprob for t in scored], top_logprobs=tops,
                                text_offset=offsets, token_ids=[t.token_id for t in scored])


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return P.ErrorResponse(error=P.ErrorInfo(message=message, type=type, param=param, code=code)).body()
