"""One HTTP request's choices: its ``n`` jobs on the worker, their answers, and what the client gets.

Owns :class:`Run`: it submits a request's ``n`` choices (the same prompt; seeds ``seed, seed +
1, ...``) to the :class:`~mmspec.serve.worker.Worker`, reads their updates from one queue,
and either collects the whole answers or streams them as server-sent events (each chunk names
its choice's ``index``). A choice that fails fails the request (the others are cancelled); a
client that goes away cancels them all. With ``logprobs``, each choice's come with its tokens
(the engine reads them from the verify forward that emitted each: :mod:`mmspec.engine.step`) and
are sent in its whole answer, or streamed, each chunk with those of the tokens whose text it
completes (OpenAI's and vLLM's way: a block's tokens once the text held back for a stop string
is released; the rest, up to the stop string's cut, with the last chunk). Chat completions and (legacy) completions differ only in their shapes
(:mod:`.responses`).
"""

from __future__ import annotations

import asyncio
import json
import time

from mmspec.serve import protocol as P
from mmspec.serve import responses as R
from mmspec.serve.guard import redact_paths
from mmspec.serve.service import Body, Prepared, Service
from mmspec.serve.structured import TEXT
from mmspec.serve.toolcalls import ToolStream
from mmspec.serve.worker import Job, Update

POLL_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there


class Run:
    """The ``n`` choices of one request (module docstring)."""

    def __init__(self, service: Service, req: Body, prepared: Prepared, t0: float):
        self.service, self.req, self.prepared, self.t0 = service, req, prepared, t0
        self.completion = req.completion  # /v1/completions: text completions' shapes
        self.name = service.config.model_name
        self.cid = R.new_id("cmpl-" if self.completion else "chatcmpl-")
        self.queue: asyncio.Queue = asyncio.Queue()
        mailbox = service.mailbox(asyncio.get_running_loop())

        def sink(i):
            def put(update: Update) -> None:  # worker thread: one wake-up of the loop per step, not per update
                mailbox.put(self.queue, (i, update))
            return put

        eos = frozenset(service.decoder.eos_ids)
        self.jobs = [Job(request=r, sink=sink(i)) for i, r in enumerate(service.requests(prepared, req.n))]
        self.answers = [R.Answer(stops=req.stop, eos_ids=eos) for _ in self.jobs]
        self.done = [False] * len(self.jobs)
        # tool calls (mmspec.serve.toolcalls): the answer's form, and each streamed choice's tool-call deltas
        self.plan = TEXT if self.completion else req.plan
        self.tool_streams = [ToolStream(self.plan) for _ in self.jobs] if self.plan.calls_tools else None
        self._early: list = []  # updates that came while admissions were awaited
        # streamed logprobs, per choice: (tokens, characters of text) after each block, entries and characters sent
        self._marks: list[list[tuple[int, int]]] = [[] for _ in self.jobs]
        self._lp_sent = [0] * len(self.jobs)
        self._lp_chars = [0] * len(self.jobs)

    # ------------------------------------------------------------------ submit
    async def submit(self) -> Update | None:
        """Hand every choice to the worker; None once all are admitted, else the first refusal
        (the choices admitted meanwhile are cancelled)."""
        for job in self.jobs:
            self.service.worker.submit(job)
        admitted: set[int] = set()
        while len(admitted) < len(self.jobs):
            i, up = await self.queue.get()
            if up.kind == "admitted":
                admitted.add(i)
            elif up.kind == "event":
                self._early.append((i, up))
            else:
                self.cancel()
                return up
        return None

    def cancel(self) -> None:
        for job, done in zip(self.jobs, self.done):
            if not done:
                self.service.worker.cancel(job)

    async def _next(self, timeout: float | None = None):
        if self._early:
            return self._early.pop(0)
        return await asyncio.wait_for(self.queue.get(), timeout)

    def _add(self, i: int, up: Update) -> str:
        """One block's tokens for choice ``i`` -> the text the client may have now; marks it done."""
        answer, ev = self.answers[i], up.event
        piece = answer.add(ev.new_token_ids, ev.text, ev.logprobs)
        self._marks[i].append((len(answer.token_ids), len(answer.text)))
        if ev.finished:
            piece += answer.finish(ev.result)
        if ev.finished or answer.stopped:
            if not ev.finished:
                self.service.worker.cancel(self.jobs[i])  # cut at a stop string: free the rows
            self.done[i] = True
            if self.service.metrics is not None:
                first = i == 0  # the request's own numbers once: its prompt, where its time went
                job = self.jobs[0]
                timings = {**self.prepared.timings, "queue": (job.taken_at or job.submitted_at) - job.submitted_at}
                self.service.metrics.answered(answer.finish_reason, self.prepared.prompt_tokens if first else 0,
                                              len(answer.token_ids), self.t0, answer.first_token_at, answer.result,
                                              timings=timings if first else None)
        return piece

    # ------------------------------------------------------------------ whole answers
    async def collect(self, request) -> Update | None:
        """Wait for every choice (None), or the update that ended the request; a client gone cancels."""
        checked = time.perf_counter()
        try:
            while not all(self.done):
                try:
                    i, up = await self._next(POLL_S)
                except TimeoutError:
                    i, up = None, None
                if time.perf_counter() - checked >= POLL_S:
                    checked = time.perf_counter()
                    if await request.is_disconnected():
                        self.cancel()
                        return Update("failed", message="the client disconnected", status=499)
                if up is None or self.done[i]:
                    continue
                if up.kind != "event":
                    self.cancel()
                    return up
                self._add(i, up)
            return None
        except asyncio.CancelledError:
            self.cancel()
            raise

    async def body(self) -> dict:
        choices = []
        for i, answer in enumerate(self.answers):
            lp = self._logprobs(answer)
            choices.append(R.text_choice(i, answer.content, answer.finish_reason, lp) if self.completion
                           else R.chat_choice(i, answer, lp, self.plan))
        return R.completion(self.cid, self.name, choices, self.prepared.prompt_tokens, self.answers, self._stats(),
                            text=self.completion)

    # ------------------------------------------------------------------ streaming
    async def stream(self):
        """The server-sent events of the answers; a client that goes away cancels the jobs."""
        finished = False
        try:
            if not self.completion:
                for i in range(len(self.jobs)):
                    role = R.delta_choice(i, P.DeltaMessage(role="assistant", content=""))
                    yield self._sse(R.chunk(self.cid, self.name, [role]))
            while not all(self.done):
                i, up = await self._next()
                if self.done[i]:
                    continue
                if up.kind != "event":  # it failed after admission: say why, inside the stream
                    finished = True
                    self.cancel()
                    if self.service.metrics is not None:
                        self.service.metrics.refused(up.status)
                    yield self._sse(R.error_body(redact_paths(up.message), R.failure_type(up.status)))
                    break
                piece = self._add(i, up)
                if self.tool_streams is not None:  # tool calls: their own deltas (mmspec.serve.toolcalls)
                    for payload in self._tool_chunks(i, piece):
                        yield self._sse(payload)
                    continue
                if piece:
                    yield self._sse(self._chunk(i, piece, logprobs=self._streamed_logprobs(i)))
                if self.done[i]:
                    lp = self._streamed_logprobs(i, last=True)
                    yield self._sse(self._chunk(i, "", self.answers[i].finish_reason, lp, mmspec=self._stats(i)))
            else:
                finished = True
                if self.req.include_usage:
                    usage = R.usage(self.prepared.prompt_tokens, self.answers)
                    yield self._sse(R.usage_chunk(self.cid, self.name, usage, self._stats(), text=self.completion))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream (the generator was closed or cancelled)
                if self.service.metrics is not None:
                    self.service.metrics.refused(499)
                self.cancel()

    def _chunk(self, i: int, piece: str, finish_reason: str | None = None, logprobs=None, **extra) -> dict:
        if self.completion:
            choice = R.text_choice(i, piece, finish_reason, logprobs)
        else:
            choice = R.delta_choice(i, P.DeltaMessage(content=piece or None), finish_reason, logprobs)
        return R.chunk(self.cid, self.name, [choice], text=self.completion, **extra)

    def _tool_chunks(self, i: int, piece: str) -> list[dict]:
        """Choice ``i``'s chunks for a new piece of its text under a plan that calls tools; once it
        is done, the calls left and the last chunk (finish_reason, log-probabilities, stats)."""
        ts, answer = self.tool_streams[i], self.answers[i]
        deltas = ts.feed(piece)
        finish = None
        if self.done[i]:
            rest, finish = ts.finish(answer.content, answer.finish_reason)
            deltas += rest
        out = [R.chunk(self.cid, self.name, [R.delta_choice(i, P.DeltaMessage(**d))]) for d in deltas]
        if finish is not None:
            last = R.delta_choice(i, P.DeltaMessage(), finish, self._logprobs(answer))
            out.append(R.chunk(self.cid, self.name, [last], mmspec=self._stats(i)))
        return out

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------------ numbers
    def _stats(self, i: int | None = None) -> P.MMSpecStats:
        """mmspec's numbers: choice ``i``'s, or (None) the first choice's with every choice's under "choices"."""
        latency = time.perf_counter() - self.t0
        seed = lambda k: self.jobs[k].request.seed  # noqa: E731
        if i is not None:
            return R.mmspec_stats(self.answers[i], seed(i), latency)
        out = R.mmspec_stats(self.answers[0], seed(0), latency)
        if len(self.answers) > 1:
            out.choices = [R.mmspec_stats(a, seed(k), latency) for k, a in enumerate(self.answers)]
        return out

    def _logprobs(self, answer: R.Answer, scored: list | None = None):
        if self.req.logprobs_top is None:
            return None
        tok = self.service.tokenizer
        scored = R.answer_logprobs(answer, tok) if scored is None else scored
        return R.text_logprobs(scored, tok) if self.completion else R.chat_logprobs(scored, tok)

    def _streamed_logprobs(self, i: int, last: bool = False):
        """Choice ``i``'s log-probabilities not sent yet of the tokens whose blocks' text the client
        now has (``last``: all the rest of its content tokens); None where there are none."""
        if self.req.logprobs_top is None:
            return None
        answer = self.answers[i]
        content = R.answer_logprobs(answer, self.service.tokenizer)  # no EOS, nothing past a stop string's cut
        n = len(content) if last else min(len(content), max(
            (tokens for tokens, chars in self._marks[i] if chars <= answer.sent), default=0))
        scored = content[self._lp_sent[i]:n]
        if not scored:
            return None
        self._lp_sent[i] = n
        lp = self._logprobs(answer, scored)
        if self.completion:  # the legacy text_offset counts from the answer's start, across chunks
            lp.text_offset = [o + self._lp_chars[i] for o in lp.text_offset]
            self._lp_chars[i] += sum(len(t) for t in lp.tokens)
        return lp
