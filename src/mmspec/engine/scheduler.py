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
seeded request's draws come from its own stream (:mod:`mmspec.engine.rng`), so it returns what it returns
alone (with ``speculate="always"``; the other policies keep the exact distribution).

:class:`SpeculationPolicy` ("auto") picks each step's draft depth, plain decoding included, for
the most expected accepted tokens per second at the batch size (goodput); with ``tree="auto"``,
:class:`ShapePolicy` picks the block's shape (the chain or a tree) by its measured tokens per second.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmspec.constrain.proposals import ConstrainedProposer
from mmspec.engine.admission import admit
from mmspec.errors import MMSpecError
from mmspec.options import SPECULATE
from mmspec.prefix_cache import make_entry
from mmspec.request import Request, prepare
from mmspec.results import GenerationResult
from mmspec.streaming import TextDelta
from mmspec.tree import TreeSpec


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


# ---------------------------------------------------------------------------- the policy
@dataclass
class SpeculationPolicy:
    """How deep to draft, per step. "always" (the default: every request's own shape, so a seeded
    request equals its solo ``generate``), "never" (plain target decoding steps, batched), or
    "auto", the goodput policy: per step, the draft depth d (γ of a chain, the depth a tree is
    cut to; 0 = plain decoding) that maximises the expected accepted tokens per second at the
    current batch size B,

        goodput(B, d) = B · (1 + α + α² + … + α^d) / T(B, d),

    from the recent acceptance α (per drafted position, a truncated-geometric estimate from the
    blocks' accepted and rejected drafts: an exponential average) and T(B, d), the measured
    seconds of one step at that batch size and depth: measured where that depth ran (an
    exponential average), else interpolated linearly in d between the measured depths around it.
    The full depth is tried first at each batch size, then plain steps, then whichever wins; a
    depth that loses is tried again every ``probe_every`` steps. Every choice is lossless by
    construction (a shallower tree, or the root alone, is verified exactly as any other)."""

    mode: str = "always"
    probe_every: int = 32
    smoothing: float = 0.3  # weight of the newest step in the averages
    costs: dict = field(default_factory=dict)  # (batch size, depth) -> seconds per step
    blocks: dict = field(default_factory=dict)  # batch size -> steps decided
    accepted: float = 0.0  # averaged accepted drafts per step (over rows)
    rejected: float = 0.0  # averaged rejections per step (blocks that stopped before their depth)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE:
            raise MMSpecError(f"speculate must be one of {SPECULATE}, got {self.mode!r}")

    @property
    def acceptance(self) -> float | None:
        """α, the estimated probability that a drafted token is accepted (None: nothing drafted yet)."""
        n = self.accepted + self.rejected
        return None if n <= 0 else self.accepted / n

    def cost(self, batch: int, depth: int) -> float | None:
        """T(B, d): measured, or interpolated between the measured depths around d (None: neither)."""
        if (batch, depth) in self.costs:
            return self.costs[(batch, depth)]
        known = sorted(d for b, d in self.costs if b == batch)
        lo = [d for d in known if d < depth]
        hi = [d for d in known if d > depth]
        if not lo or not hi:
            return None
        a, b = lo[-1], hi[0]
        ta, tb = self.costs[(batch, a)], self.costs[(batch, b)]
        return ta + (tb - ta) * (depth - a) / (b - a)

    def goodput(self, batch: int, depth: int) -> float | None:
        """Expected emitted tokens per second with drafts of ``depth`` at ``batch`` (None: unknown)."""
        t, alpha = self.cost(batch, depth), self.acceptance
        if t is None or (alpha is None and depth > 0):
            return None
        tokens = sum((alpha or 0.0) ** i for i in range(depth + 1))  # 1 + α + … + α^d
        return batch * tokens / max(t, 1e-9)

    def decide(self, batch: int, max_depth: int) -> int:
        """The draft depth of the next step at ``batch`` requests (0: plain decoding)."""
        if self.mode != "auto":
            return max_depth if self.mode == "always" else 0
        k = self.blocks.get(batch, 0)
        self.blocks[batch] = k + 1
        if (batch, max_depth) not in self.costs:
            return max_depth
        if (batch, 0) not in self.costs:
            return 0
        rates = {d: self.goodput(batch, d) for d in range(max_depth + 1)}
        best = max((d for d in rates if rates[d] is not None), key=lambda d: rates[d], default=max_depth)
        if k % self.probe_every == 0:  # now and then the extreme that lost, measured again
            return 0 if best != 0 else max_depth
        return best

    def record(self, batch: int, depth: int, seconds: float, accepted: int = 0, rejected: int = 0) -> None:
        """One step's measured time at (batch, depth) and its rows' accepted drafts and rejections."""
        w = self.smoothing
        old = self.costs.get((batch, depth))
        self.costs[(batch, depth)] = seconds if old is None else (1 - w) * old + w * seconds
        if depth > 0:
            self.accepted = (1 - w) * self.accepted + w * accepted
            self.rejected = (1 - w) * self.rejected + w * rejected


@dataclass
class ShapePolicy:
    """Which block shape each step drafts with ``tree="auto"`` (:func:`mmspec.tree.auto_shapes`: the
    chain and trees, smallest first): the shape s with the most measured tokens per second at the
    current batch size B,

        rate(B, s) = tokens(B, s) / T(B, s),

    tokens(B, s) the tokens a step drafting s emitted over its rows (accepted drafts and each row's
    token from the target), T(B, s) its seconds, each an exponential average over the steps that
    drafted s whole (a step that captured a graph or compiled is not timed). Explore, then commit:
    at each batch size every shape first runs ``explore`` timed steps, round robin; then the best
    runs, and every ``probe_every`` steps the shape run longest ago runs once more, so the choice
    follows a changing acceptance or load. A tree pays where its extra accepted tokens outweigh what
    its wider drafting and verify cost on the device at hand, which no default can know. Lossless
    whatever it picks: every shape is verified exactly."""

    shapes: tuple[TreeSpec, ...]
    explore: int = 2
    probe_every: int = 16
    smoothing: float = 0.1  # weight of the newest step in the averages
    tokens: dict = field(default_factory=dict)  # (batch size, shape index) -> tokens per step
    seconds: dict = field(default_factory=dict)  # (batch size, shape index) -> seconds per step
    timed: dict = field(default_factory=dict)  # (batch size, shape index) -> steps timed
    steps: dict = field(default_factory=dict)  # batch size -> steps decided
    last: dict = field(default_factory=dict)  # (batch size, shape index) -> the step it last ran at

    def __post_init__(self) -> None:
        if len(self.shapes) < 2:
            raise MMSpecError(f"a shape policy chooses among two shapes or more, got {len(self.shapes)}")

    def rate(self, batch: int, i: int) -> float | None:
        """Measured tokens per second of shape ``i`` at ``batch`` (None: not timed yet)."""
        t = self.seconds.get((batch, i))
        return None if t is None else self.tokens[(batch, i)] / max(t, 1e-9)

    def best(self, batch: int) -> int | None:
        rates = {i: self.rate(batch, i) for i in range(len(self.shapes))}
        known = [i for i in rates if rates[i] is not None]
        return max(known, key=lambda i: rates[i]) if known else None

    def decide(self, batch: int) -> int:
        """The index of the shape the next step at ``batch`` requests drafts."""
        k = self.steps.get(batch, 0)
        self.steps[batch] = k + 1
        n = len(self.shapes)
        short = [i for i in range(n) if self.timed.get((batch, i), 0) < self.explore]
        if short:  # exploring: the shape timed least, the smallest first
            pick = min(short, key=lambda i: (self.timed.get((batch, i), 0), i))
        else:
            pick = self.best(batch)
            if k % self.probe_every == 0:  # now and then the shape run longest ago, timed again
                pick = min((i for i in range(n) if i != pick), key=lambda i: self.last.get((batch, i), -1))
        self.last[(batch, pick)] = k
        return pick

    def record(self, batch: int, i: int, seconds: float, tokens: int) -> None:
        """One step that drafted shape ``i`` whole at ``batch``: its seconds and the tokens it emitted."""
        w, key = self.smoothing, (batch, i)
        if key in self.seconds:
            self.seconds[key] = (1 - w) * self.seconds[key] + w * seconds
            self.tokens[key] = (1 - w) * self.tokens[key] + w * tokens
        else:
            self.seconds[key], self.tokens[key] = seconds, float(tokens)
        self.timed[key] = self.timed.get(key, 0) + 1

    def report(self) -> dict:
        """Per batch size: the shape chosen now and each shape's measured figures (JSON-ready)."""
        out = {}
        for b in sorted({b for b, _ in self.seconds}):
            best = self.best(b)
            out[str(b)] = {"choice": self.shapes[best].label, "shapes": {
                self.shapes[i].label: {"tokens_per_step": self.tokens[(b, i)], "step_ms": self.seconds[(b, i)] * 1e3,
                                       "tokens_per_s": self.rate(b, i), "timed": self.timed[(b, i)]}
                for i in range(len(self.shapes)) if (b, i) in self.seconds}}
        return out


# ---------------------------------------------------------------------------- requests
@dataclass
class _Launched:
    """An engine step launched, not yet read: what its reading needs."""

    step: object  # the engine's InFlight
    actives: list  # the requests in it, in its row order
    depth: int  # the speculation policy's depth
    t0: float  # when it was planned (the policies' step time runs from here)
    shape: object  # what the engine was asked for: the depth, or tree="auto"'s TreeSpec
    pick: int | None  # tree="auto": the candidate shape's index
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
    and a finishing request would pay one extra step). With the decoder's ``tree="auto"`` its
    :class:`ShapePolicy` picks each step's shape. ``clock``: what the policies' step times are read
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
        self.policy = speculate if isinstance(speculate, SpeculationPolicy) else SpeculationPolicy(speculate)
        self.shapes: ShapePolicy | None = decoder.shape_policy  # tree="auto"; None: the decoder's one shape
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
        B = len(self._active)
        depth = self.policy.decide(B, self.decoder.tree.max_depth)
        shape: int | TreeSpec = depth
        pick = None
        if self.shapes is not None and depth > 0:  # tree="auto": the shape, cut where the policy cut the depth
            pick = self.shapes.decide(B)
            shape = self.shapes.shapes[pick].for_remaining(depth + 1)
        setup = self.engine.capture_s + self.engine.compile_s
        proposers = [a.proposer for a in self._active]
        try:
            step = self.engine.launch(shape, proposers if any(p is not None for p in proposers) else None)
        except Exception as e:  # noqa: BLE001 - the shared step failed: every request in it
            events = [StepEvent(a.rid, [], "", True, None, error=_message(e), exception=e) for a in self._active]
            while self._active:
                self._remove(len(self._active) - 1)
            return events
        self._flight.append(_Launched(step, list(self._active), depth, t0, shape, pick, setup))
        return []

    def _collect(self) -> list[StepEvent]:
        """Read the oldest launched step and turn its rows' tokens into events; finished requests leave."""
        launched = self._flight.popleft()
        actives, depth, shape, pick = launched.actives, launched.depth, launched.shape, launched.pick
        outcomes = self.engine.finish(launched.step)
        where = {id(a): b for b, a in enumerate(self._active)}
        events: list[StepEvent] = []
        accepted = rejected = 0
        finished: list[int] = []
        for a, kept in zip(actives, outcomes):
            if kept is None:  # left (cancelled, failed or finished) while the step was in flight
                continue
            b = where[id(a)]
            if isinstance(kept, BaseException):  # this request fails alone
                events.append(StepEvent(a.rid, [], "", True, None, error=_message(kept), exception=kept))
                finished.append(b)
                continue
            row = self.engine.rows[b]
            if pick is not None:
                row.stats.shapes[shape.label] = row.stats.shapes.get(shape.label, 0) + 1
            rec = row.stats.blocks[-1]
            accepted += rec.n_accepted
            rejected += rec.n_drafted > 0 and rec.n_accepted < rec.drafted_depth and len(kept) == rec.n_accepted + 1
            text = a.delta.push(kept) if self.stream_text else ""
            result = None
            if row.done:
                text += a.delta.finish() if self.stream_text else ""
                result = self._finish(b, a)
            lps = None if row.logprobs_top is None else row.logprobs[len(row.logprobs) - len(kept):]
            events.append(StepEvent(a.rid, kept, text, row.done, result, logprobs=lps))
            if row.done:
                finished.append(b)
        seconds = self.clock() - launched.t0
        self.policy.record(len(actives), depth, seconds, accepted, rejected)
        if pick is not None:
            if shape is self.shapes.shapes[pick] and self.engine.capture_s + self.engine.compile_s == launched.setup:
                self.shapes.record(len(actives), pick, seconds,
                                   sum(len(k) for k in outcomes if isinstance(k, list)))
            for ev in events:
                if ev.result is not None:  # a request that ended: the figures its shapes were chosen by
                    ev.result.stats.shape_rates = self.shapes.report()
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
