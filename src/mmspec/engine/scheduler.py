"""Many requests at once: continuous batching on the one engine, and ``generate`` as a batch of one.

:class:`BatchScheduler` owns an :class:`~mmspec.engine.step.Engine` and the requests on it.
Each :meth:`BatchScheduler.step` admits queued requests (checked at submit by
:func:`mmspec.request.prepare`; prefilled together straight into their rows by
:func:`mmspec.engine.admission.admit`), runs ONE engine step over every active request, then
turns each row's tokens into events: the text delta (:class:`~mmspec.streaming.TextDelta`, a
multi-byte character never split), the result when a request ends. A finished (or cancelled)
request leaves at once (its row compacted away); what its caches hold, prompt and answer, goes to
the prefix cache, so a conversation's next turn prefills only its new part.

Lossless per request, whatever else is in the batch: greedy output equals the target's own; a
seeded request's draws come from its own stream (:mod:`mmspec.runtime.rng`), so it returns what it returns
alone (with ``speculate="always"``; the other policies keep the exact distribution).

One :class:`~mmspec.engine.policy.SpeculationPolicy` decides each step's draft depth and block
shape ("auto": plain decoding included; ``tree="auto"``: among the candidate shapes) for the most
expected tokens per second, from a step-cost model shared by every batch size and each row's own
acceptance (:mod:`mmspec.engine.policy`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec.constrain.proposals import ConstrainedProposer
from mmspec.drafting.tree import TreeSpec
from mmspec.engine.admission import admit
from mmspec.engine.policy import Action, SpeculationPolicy
from mmspec.errors import MMSpecError
from mmspec.prefix_cache import make_entry
from mmspec.request import Request, prepare
from mmspec.results import GenerationResult
from mmspec.streaming import TextDelta


@dataclass
class StepEvent:
    rid: int  # the id submit() returned
    new_token_ids: list[int]  # tokens this block committed for the request (may be empty)
    text: str  # the decoded text delta of those tokens
    finished: bool
    result: object | None  # GenerationResult when finished (stats included)
    error: str | None = None  # set when the request failed alone (others go on)
    exception: BaseException | None = None  # the failure itself (generate raises it)
    logprobs: list | None = None  # a TokenLogprob per new token, where the request asked (logprobs=K)


# ---------------------------------------------------------------------------- requests
@dataclass
class _Launched:
    """An engine step launched, not yet read: what its reading needs."""

    step: object  # the engine's InFlight
    actives: list  # the requests in it, in its row order
    action: Action  # the speculation policy's choice
    t0: float  # when it was planned (the policy's step time runs from here)
    shape: TreeSpec | None  # what the engine was asked for (None: plain decoding)
    setup: float  # the engine's capture + compile seconds before it (a step that captured is not timed)


@dataclass
class _Active:
    rid: int
    req: Request
    prompt: object  # the decoder's EncodedRequest: the prompt's keys and encoded images, for the prefix cache
    t_start: float
    delta: TextDelta
    proposer: object | None = None  # a model-free drafter's proposer (lookup / suffix)


class BatchScheduler:
    """Continuous batching over one :class:`~mmspec.decoder.SpecDecoder` (module docstring).

    Driven by ONE thread (not thread-safe). ``speculate``: "always", "never", "auto" or a
    :class:`SpeculationPolicy`. ``stream_text``: each event carries its text delta (a server's
    stream); without it a step decodes no text (``generate``, ``generate_batch``: the result's
    text is decoded once, when a request ends). ``overlap``: launch each step before reading the
    one before it, so the host's emitting, detokenizing and admitting run while the device
    computes (None: on a GPU; the CPU runs a step as it is launched, so there is nothing to hide
    and a finishing request would pay one extra step). With the decoder's ``tree="auto"`` the
    policy also picks each step's shape (:meth:`SpecDecoder.policy_for`). ``clock``: what the policies' step times are read
    from (tests give a fake one)."""

    def __init__(self, decoder, *, max_batch: int = 16, speculate="always", stream_text: bool = True,
                 overlap: bool | None = None, clock: Callable[[], float] = time.perf_counter):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise MMSpecError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        if overlap is not None and not isinstance(overlap, bool):
            raise MMSpecError(f"overlap must be True, False or None (None: on a GPU), got {overlap!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.stream_text = stream_text
        self.policy = speculate if isinstance(speculate, SpeculationPolicy) else decoder.policy_for(speculate)
        self.clock = clock
        self.engine = decoder.engine_for(self)
        self.engine.draft_later = self.policy.mode != "never"
        while self.engine.active:  # a leased engine may come back with rows of a failed batch
            self.engine.remove(self.engine.active - 1)
        self.overlap = self.engine.device.type == "cuda" if overlap is None else overlap
        self._flight: deque = deque()  # launched engine steps: (InFlight, the requests in it, depth, t_launch)
        self._queue: deque = deque()  # (rid, Request, t_submit)
        self._active: list[_Active] = []  # row b of the engine is _active[b]
        self._next_rid = 0

    # ------------------------------------------------------------------ the API
    def submit(self, request: dict | Request, **defaults) -> int:
        """Check the request now (MMSpecError), queue it; returns its id. A :class:`~mmspec.request.Request`
        already checked by :func:`~mmspec.request.prepare` (``mmspec serve``'s) is queued as it is."""
        if isinstance(request, Request):
            if defaults:
                raise MMSpecError(f"{sorted(defaults)} given with a prepared Request; set them when preparing it")
            req = request
        elif not isinstance(request, dict):
            raise MMSpecError(f"a request is a dict of generate()'s arguments (input_ids, pixel_values, ...), "
                              f"got {type(request).__name__}")
        else:
            req = prepare(self.decoder, request, defaults)
        rid = self._next_rid
        self._next_rid += 1
        self._queue.append((rid, req, time.perf_counter()))
        return rid

    def has_work(self) -> bool:
        return bool(self._queue or self._active or self._flight)

    def close(self) -> None:
        """Done with this scheduler (it must not step again): the static engine it leased from
        the decoder (buffers and CUDA graphs) goes to the next scheduler."""
        if self._active or self._queue:
            raise MMSpecError(f"close() with {len(self._active)} active and {len(self._queue)} queued requests; "
                              "cancel or finish them first")
        self.decoder.static_pool.give_back(self)

    @torch.inference_mode()
    def cancel(self, rid: int) -> None:
        """Drop a queued or active request (its rows freed); unknown or finished ids are ignored."""
        self._queue = deque(q for q in self._queue if q[0] != rid)
        for b, a in enumerate(self._active):
            if a.rid == rid:
                self._remove(b)
                return

    @torch.inference_mode()
    def admit(self) -> list[StepEvent]:
        """Admit what the free rows allow (their prefills, together) without stepping; -> the
        events of requests that failed to."""
        events: list[StepEvent] = []
        self._admit(events)
        return events

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit queued requests (prefill), then run ONE engine step over every active request.

        With ``overlap`` the step is launched before the previous one's outcomes are read: the
        events returned are the previous step's, emitted while the device runs this one."""
        events = self.admit()
        if self._flight and any(a.proposer is not None or a.req.grammar is not None for a in self._active):
            events += self._collect()  # model-free proposals are searched, grammars advanced, in the last step's tokens
        if self._active:
            events += self._launch()
        while self._flight and (len(self._flight) > 1 or not (self.overlap and self._active)):
            events += self._collect()  # overlap keeps one step in flight while requests remain
        return events

    def _launch(self) -> list[StepEvent]:
        """Plan and launch one engine step over every active request (a failure fails them all)."""
        t0 = self.clock()
        action = self.policy.decide(len(self._active), self.decoder.tree, self.engine.rows)
        shape = self.policy.spec_of(action, self.decoder.tree)
        setup = self.engine.capture_s + self.engine.compile_s
        proposers = [a.proposer for a in self._active]
        try:
            step = self.engine.launch(0 if shape is None else shape,
                                      proposers if any(p is not None for p in proposers) else None)
        except Exception as e:  # noqa: BLE001 - the shared step failed: every request in it
            events = [StepEvent(a.rid, [], "", True, None, error=_message(e), exception=e) for a in self._active]
            while self._active:
                self._remove(len(self._active) - 1)
            return events
        self._flight.append(_Launched(step, list(self._active), action, t0, shape, setup))
        return []

    def _collect(self) -> list[StepEvent]:
        """Read the oldest launched step and turn its rows' tokens into events; finished requests leave."""
        launched = self._flight.popleft()
        actives, shape = launched.actives, launched.shape
        outcomes = self.engine.finish(launched.step)
        where = {id(a): b for b, a in enumerate(self._active)}
        rows, stream = self.engine.rows, self.stream_text
        events: list[StepEvent] = []
        blocks = []  # per row: what the policy learns its acceptance from
        finished: list[int] = []
        label = shape.label if self.policy.shapes is not None and shape is not None else None
        for a, kept in zip(actives, outcomes):  # per row: its tokens, text and event (nothing else)
            if kept is None:  # left (cancelled, failed or finished) while the step was in flight
                continue
            b = where[id(a)]
            if isinstance(kept, BaseException):  # this request fails alone
                events.append(StepEvent(a.rid, [], "", True, None, error=_message(kept), exception=kept))
                finished.append(b)
                continue
            row = rows[b]
            st = row.stats
            if label is not None:
                st.shapes[label] = st.shapes.get(label, 0) + 1
            rec = st.blocks[-1]
            if rec.n_drafted > 0:
                depth, acc = rec.drafted_depth, rec.n_accepted
                blocks.append((row, acc, depth, int(acc < depth and len(kept) == acc + 1), len(kept)))
            text = a.delta.push(kept) if stream and kept else ""
            result = None
            if row.done:
                text += a.delta.finish() if stream else ""
                result = self._finish(b, a)
                finished.append(b)
            lps = None if row.logprobs_top is None else row.logprobs[len(row.logprobs) - len(kept):]
            events.append(StepEvent(a.rid, kept, text, row.done, result, logprobs=lps))
        timed = self.engine.capture_s + self.engine.compile_s == launched.setup  # a step that captured is not timed
        timed = timed and not self.engine.fed_a_lag(launched.step.plan)  # nor one that caught the drafter up
        self.policy.record(len(actives), launched.action, self.clock() - launched.t0 if timed else None, blocks)
        if self.policy.shapes is not None:
            for ev in events:
                if ev.result is not None:  # a request that ended: the figures its shapes were chosen by
                    ev.result.stats.shape_rates = self.policy.report()
        for b in sorted(finished, reverse=True):
            self._remove(b)
        return events

    # ------------------------------------------------------------------ internals
    def _admit(self, events: list[StepEvent]) -> None:
        """Admit what the free rows allow; a request that fails, fails alone."""
        group = []
        while self._queue and len(self._active) + len(group) < self.max_batch:
            group.append(self._queue.popleft())
        if not group:
            return
        dec = self.decoder
        admitted = admit(dec, self.engine, [req for _, req, _ in group])
        for (rid, req, t_submit), ad in zip(group, admitted):
            if ad.error is not None:
                events.append(StepEvent(rid, [], "", True, None, error=_message(ad.error), exception=ad.error))
                continue
            proposer = dec.proposer_for_request(ad.prompt, not req.params.greedy)
            grammar = self.engine.rows[ad.row].grammar
            if grammar is not None and (proposer is not None or self.engine.drafting is None):
                proposer = ConstrainedProposer(proposer, grammar)  # forced tokens ride free; illegal paths cut
            a = _Active(rid, req, ad.prompt, t_submit, TextDelta(dec.tokenizer), proposer=proposer)
            self._active.append(a)  # row ad.row of the engine
        if self.max_batch > 1:  # the prompt, for a request in the same batch that extends it (generate: none)
            for b in range(len(self._active) - sum(1 for ad in admitted if ad.error is None), len(self._active)):
                self._remember(b, self._active[b])

    def _remove(self, b: int) -> None:
        self.engine.remove(b)
        last = len(self._active) - 1
        self._active[b] = self._active[last]
        self._active.pop()
        if not self._active:  # idle: the caches' memory goes back (a static engine keeps them)
            self.engine.release()

    def _finish(self, b: int, a: _Active) -> GenerationResult:
        """The request's result; its prompt and answer kept for the conversation's next turn."""
        row = self.engine.rows[b]
        st = row.stats
        row.record_times()
        self._remember(b, a)
        st.total_s = time.perf_counter() - a.t_start
        if a.proposer is not None:  # suffix decoding: the request joins the decoder's store
            a.proposer.finish(list(row.tokens))
        adaptive = getattr(self.engine.drafting, "adaptive", None)
        if adaptive is not None:  # the weights' trajectory, read once
            st.view_weights, st.final_weights = adaptive.trajectory(b, row.drafted)
        text = self.decoder.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return GenerationResult(token_ids=list(row.tokens), text=text, stats=st, seed=a.req.seed,
                                logprobs=None if row.logprobs_top is None else list(row.logprobs))

    def _remember(self, b: int, a: _Active) -> None:
        """What row b's caches hold (prompt + answer, as far as committed) into the prefix cache."""
        keys = a.prompt.keys
        if keys is None:
            return
        row = self.engine.rows[b]
        seq_len = keys.target.shape[0] + len(row.tokens)
        target = self.engine.cache.snapshot(b, 0, min(self.engine.state.lengths[b], seq_len))
        if target is None:
            return
        drafting = self.engine.drafting
        if drafting is None:  # a model-free drafter (lookup / suffix): the target's rows alone
            entry = make_entry(keys, a.prompt.encoded, row.tokens, target)
        elif self.decoder.head is not None:
            head = drafting.snapshot(b)
            entry = make_entry(keys, a.prompt.encoded, row.tokens, target, head=head) if head is not None else None
        else:
            kvs = drafting.snapshot(b)
            entry = make_entry(keys, a.prompt.encoded, row.tokens, target, rows=None if None in kvs else kvs)
        if entry is not None:
            self.decoder.prefix_cache.store(entry)


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, MMSpecError) else f"{type(e).__name__}: {e}"


def generate_batch(dec, requests: list[dict], *, max_batch: int = 16, speculate="always", overlap: bool | None = None,
                   **defaults) -> list:
    """:meth:`SpecDecoder.generate_batch`: every request checked first ("request N: ..."), then
    decoded with continuous batching; results in input order."""
    if not isinstance(requests, (list, tuple)):
        raise MMSpecError(f"requests must be a list of dicts (one per prompt), got {type(requests).__name__}")
    if speculate == "auto":  # the decoder's own policy: what it measured in earlier calls carries over
        speculate = dec.speculation_policy
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=speculate, stream_text=False, overlap=overlap)
    rids = []
    for i, req in enumerate(requests):
        try:
            rids.append(sched.submit(req, **defaults))
        except MMSpecError as e:
            raise MMSpecError(f"request {i}: {e}") from None
    results: dict[int, object] = {}
    while sched.has_work():
        for ev in sched.step():
            if ev.error is not None:
                raise MMSpecError(f"request {rids.index(ev.rid)}: {ev.error}")
            if ev.finished:
                results[ev.rid] = ev.result
    sched.close()
    return [results[r] for r in rids]
