"""Many requests at once: continuous batching of speculative decodes on the one engine.

:class:`BatchScheduler` owns a batch of :class:`~mmspec.engine.Row` s, stepped by the same
:meth:`mmspec.engine.Engine.step` that ``generate`` runs for one request. Each
:meth:`BatchScheduler.step` admits queued requests (each checked by :func:`mmspec.request.prepare`
at submit; those admitted in the same step prefilled together by
:func:`mmspec.admission.prefill_together`: ONE target forward over their new rows of the shared
target cache, prefix-cache hits prefilling only their new part; each one's drafter prefilled as
``generate`` prefills it, its rows then joining the shared draft cache), then runs ONE step over every active request: their draft forwards merged
(:class:`~mmspec.forwards.DraftForwards`: each round one forward over every request's rows), the
target scoring all trees in one forward (:class:`~mmspec.forwards.RaggedRows`: every request at
its own length, padding masked), one host read for the whole batch, and each request accepting
its own number of tokens. A finished (or cancelled) request leaves at once: its row is compacted
away; what its caches hold (prompt AND answer) goes to the prefix cache, so a conversation's
next turn prefills only its new part, as with ``generate``. Each step's text per request is
:class:`~mmspec.streaming.TextDelta`'s: incremental, a multi-byte character never split.

Lossless per request, whatever else is in the batch: greedy output equals the target's own;
a seeded request draws from its own generator in the solo loop's order, so it returns what
``generate`` returns for the same request and seed alone (with ``speculate="always"``; the
other policies keep the exact distribution but draw a different sequence of uniforms).

:class:`SpeculationPolicy` ("auto") picks each step's draft depth, plain decoding included, for
the most expected accepted tokens per second at the batch size (goodput), from the step costs
it measured and the recent acceptance.

What runs batched: every view and ensemble, chains, static and dynamic trees, feature-level
heads, greedy and sampling. The target's verify forward is shared, and so are the draft
forwards: each request drafts its own tree (its own code path and draws, as steps that yield
their forwards; no threads). A decoder set up for static caches / CUDA graphs steps its batches
with fixed shapes too (:class:`~mmspec.forwards.StaticRagged`: rows and new tokens padded to
buckets, one graph per bucket pair, captured on first use; eager fallback when capture fails),
on static ragged caches the decoder keeps across batches (one scheduler at a time holds them;
:meth:`BatchScheduler.close` hands them to the next); prefills stay eager.

Exactness is per row: in float64 (the tests) a request's tokens never depend on its
neighbours; in float32 / half precision a batched matrix product may round the last bit
differently from a one-row one, so a near-tie can flip (what issue 37's half-precision audit
measures). A result's ``stats.total_s`` counts from :meth:`BatchScheduler.submit` (queueing
included: the request's latency); its blocks' ``draft_s`` and ``verify_s`` are the shared
step's phases (device events on a GPU, as for ``generate``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from mmspec.admission import prefill_together
from mmspec.engine import Engine, Row
from mmspec.errors import MMSpecError
from mmspec.forwards import DraftForwards, RaggedRows
from mmspec.models.ragged import RaggedCache, RowGroup
from mmspec.options import SPECULATE
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
    seconds of one step (draft forwards + the verify forward over B trees of depth d + the
    host's work) at that batch size and depth: measured where that depth ran (an exponential
    average), else interpolated linearly in d between the measured depths around it (the draft
    forwards grow with d, the verify forward with the node count). The full depth is tried
    first at each batch size, then plain steps, then whichever wins; a depth that loses is tried
    again every ``probe_every`` steps. Every choice is lossless by construction (a shallower
    tree, or the root alone, is verified exactly as any other); with "auto" a seeded request
    keeps the target's exact distribution but draws another sequence of uniforms than alone."""

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


# ---------------------------------------------------------------------------- requests
@dataclass
class _Active:
    rid: int
    row: Row
    req: Request
    pre: object  # the decoder's Prefilled: the prompt's keys and encoded images, for the prefix cache
    t_start: float
    delta: TextDelta


class BatchScheduler:
    """Continuous batching over one :class:`~mmspec.decoder.SpecDecoder` (module docstring).

    Driven by ONE thread (not thread-safe). ``speculate``: "always", "never", "auto" or a
    :class:`SpeculationPolicy`."""

    def __init__(self, decoder, *, max_batch: int = 16, speculate="always"):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise MMSpecError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.policy = speculate if isinstance(speculate, SpeculationPolicy) else SpeculationPolicy(speculate)
        static, graphs = decoder.static, decoder.graph_mode

        def forwards(role: str, make):  # static shapes: the decoder keeps them (and their graphs) across batches
            return decoder.static_pool.lease(role, self, make) if static else make()

        target = forwards("batch-target", lambda: RaggedRows(
            decoder.target, RaggedCache(_n_layers(decoder.target_model), static=static), decoder.hidden_layers, graphs))
        self.cache = target.cache  # row b: _active[b]'s target cache
        # the draft forwards are shared too: every view of every request (or its head) a row here
        if decoder.head is not None:
            drafts = forwards("batch-head", lambda: DraftForwards.for_head(
                decoder.head, RaggedCache(decoder.head.decoder.config.num_hidden_layers, static=static), graphs))
        elif decoder.draft_model is None:  # lookup / suffix alone (mmspec.lookup): no draft model, no draft rows
            drafts = None
        else:
            drafts = forwards("batch-draft", lambda: DraftForwards.for_tokens(
                decoder.draft, RaggedCache(_n_layers(decoder.draft_model), static=static), graphs))
        self.draft_cache = None if drafts is None else drafts.cache
        for cache in (self.cache, self.draft_cache):  # a leased cache may come back with rows of a failed batch
            if cache is not None:
                cache.clear()
        self.engine = Engine(target, drafts, decoder.target.device, draft_lengths=self._draft_lengths)
        self._draft_rows: dict[int, list[int]] = {}  # rid -> its rows of draft_cache
        self._row_owner: list[int] = []  # draft_cache row -> rid
        self._queue: deque = deque()  # (rid, Request, t_submit)
        self._active: list[_Active] = []  # row b of the cache is _active[b]
        self._next_rid = 0

    # ------------------------------------------------------------------ the API
    def submit(self, request: dict | Request, **defaults) -> int:
        """Check the request now (MMSpecError), queue it; returns its id. A :class:`~mmspec.request.Request`
        already checked by :func:`~mmspec.request.prepare` (``mmspec serve``'s) is queued as it is."""
        if not isinstance(request, dict | Request):
            raise MMSpecError(f"a request is a dict of generate()'s arguments (input_ids, pixel_values, ...), "
                              f"got {type(request).__name__}")
        if isinstance(request, Request) and defaults:
            raise MMSpecError(f"{sorted(defaults)} given with a prepared Request; set them when preparing it")
        req = request if isinstance(request, Request) else prepare(self.decoder, request, defaults)
        rid = self._next_rid
        self._next_rid += 1
        self._queue.append((rid, req, time.perf_counter()))
        return rid

    def has_work(self) -> bool:
        return bool(self._queue or self._active)

    def close(self) -> None:
        """Done with this scheduler (it must not step again): the static forwards it leased from
        the decoder (buffers and CUDA graphs) go to the next scheduler, as a server's renewal wants."""
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
    def step(self) -> list[StepEvent]:
        """Admit queued requests (prefill), then run ONE engine step over every active request."""
        events: list[StepEvent] = []
        self._admit(events)
        if not self._active:
            return events
        t0 = time.perf_counter()
        depth = self.policy.decide(len(self._active), self.decoder.tree.max_depth)
        outcomes = self.engine.step([a.row for a in self._active], depth)
        accepted = rejected = 0
        finished: list[int] = []
        for b, (a, kept) in enumerate(zip(self._active, outcomes)):
            if isinstance(kept, BaseException):  # this request fails alone
                events.append(StepEvent(a.rid, [], "", True, None, error=_message(kept)))
                finished.append(b)
                continue
            rec = a.row.stats.blocks[-1]
            accepted += rec.n_accepted
            rejected += rec.n_drafted > 0 and rec.n_accepted < rec.depth and len(kept) == rec.n_accepted + 1
            text = a.delta.push(kept)
            result = None
            if a.row.done:
                text += a.delta.finish()
                result = self._finish(b, a)
            events.append(StepEvent(a.rid, kept, text, a.row.done, result))
            if a.row.done:
                finished.append(b)
        self.policy.record(len(self._active), depth, time.perf_counter() - t0, accepted, rejected)
        for b in sorted(finished, reverse=True):
            self._remove(b)
        return events

    # ------------------------------------------------------------------ internals
    def _admit(self, events: list[StepEvent]) -> None:
        """Admit what the free rows allow: the requests prefill together
        (:func:`mmspec.admission.prefill_together`: ONE target forward for the group), then each
        one's rows join the shared caches; a request that fails, fails alone."""
        group = []
        while self._queue and len(self._active) + len(group) < self.max_batch:
            group.append(self._queue.popleft())
        if not group:
            return
        dec = self.decoder
        admitted = prefill_together(dec, self.cache, [req for _, req, _ in group])
        new = []
        for (rid, req, t_submit), ad in zip(group, admitted):
            if ad.error is None:
                try:
                    row = Row.start(ad.pre.state, ad.pre.drafter, dec.options_for(req),
                                    req.generator(dec.target.device), ad.stats)
                    self._join_draft(rid, row.drafter)
                    new.append(_Active(rid, row, req, ad.pre, t_submit, TextDelta(dec.tokenizer)))
                    continue
                except Exception as e:  # noqa: BLE001 - reported on the request, the others go on
                    ad.error = e
            self._leave_draft(rid)
            events.append(StepEvent(rid, [], "", True, None, error=_message(ad.error)))
        owners = [a for a, ad in zip(_iter_ok(new, admitted), admitted) if ad.row is not None]
        first = self.cache.active - len(owners)
        for row in range(self.cache.active - 1, first - 1, -1):  # failed rows go; the last moves in
            if owners[row - first] is None:
                moved = self.cache.remove(row)
                if moved is not None:
                    owners[row - first] = owners[moved - first]
                owners.pop()
        self._active.extend(owners)  # row b of the cache is _active[b]
        for a in owners:  # the prompt, for a later request that extends it
            self._remember(self._active.index(a), a)

    def _join_draft(self, rid: int, drafter) -> None:
        """The drafter's prefilled rows join the shared draft cache; its forwards are merged there."""
        if self.draft_cache is None:  # a model-free drafter has no rows
            return
        if not getattr(drafter.cache.layers[0], "is_initialized", False):
            raise MMSpecError("a head drafts nothing from a 2-token prompt, so it cannot join a batch; decode this "
                              "request with generate() or give the prompt more tokens")
        rows = self.draft_cache.join(drafter.cache, drafter.length, drafter.capacity + self.decoder.tree.n_nodes + 1)
        self._draft_rows[rid] = rows
        self._row_owner.extend([rid] * len(rows))
        drafter.cache = RowGroup(self.draft_cache, lambda rid=rid: self._draft_rows[rid], drafter.length)

    def _leave_draft(self, rid: int) -> None:
        rows = self._draft_rows.get(rid)
        while rows:
            row = max(rows)
            rows.remove(row)
            moved = self.draft_cache.remove(row)
            if moved is not None:  # the last row now lives at `row`
                owner = self._row_owner[moved]
                self._draft_rows[owner][self._draft_rows[owner].index(moved)] = row
                self._row_owner[row] = owner
            self._row_owner.pop()
        self._draft_rows.pop(rid, None)

    def _draft_lengths(self) -> list[int]:
        drafters = {a.rid: a.row.drafter for a in self._active}
        return [drafters[rid].length if rid in drafters else 0 for rid in self._row_owner]

    def _remove(self, b: int) -> None:
        self._leave_draft(self._active[b].rid)
        moved = self.cache.remove(b)
        if moved is not None:
            self._active[b] = self._active[moved]
        self._active.pop()
        if not self._active:  # idle: the shared caches' memory goes back
            for cache in (self.cache, self.draft_cache):
                if cache is not None and not cache.active:
                    cache.release()

    def _finish(self, b: int, a: _Active) -> GenerationResult:
        """The request's result; its prompt and answer kept for the conversation's next turn."""
        row, st = a.row, a.row.stats
        row.record_times()
        self._remember(b, a)
        st.total_s = time.perf_counter() - a.t_start
        finish = getattr(row.drafter, "finish", None)  # suffix decoding: the request joins the decoder's store
        if finish is not None:
            finish(list(row.tokens))
        if getattr(row.drafter, "adaptive", None) is not None:  # the weights' trajectory, read once
            st.view_weights, st.final_weights = row.drafter.adaptive.trajectory()
        text = self.decoder.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return GenerationResult(token_ids=list(row.tokens), text=text, stats=st, seed=a.req.seed)

    def _remember(self, b: int, a: _Active) -> None:
        """What row b's caches hold (prompt + answer, as far as committed) into the prefix cache,
        as ``generate`` leaves it (:func:`mmspec.prefix_cache.entry_after_decode`)."""
        keys = a.pre.keys
        if keys is None:
            return
        row, drafter = a.row, a.row.drafter
        seq_len = keys.target.shape[0] + len(row.tokens)
        target = self.cache.snapshot(b, 0, min(row.past, seq_len))
        if target is None:
            return
        if self.draft_cache is None:  # a model-free drafter (lookup / suffix): the target's rows alone
            self.decoder.prefix_cache.store(make_entry(keys, a.pre.encoded, row.tokens, target))
            return
        rows = self._draft_rows[a.rid]
        if self.decoder.head is not None:
            head = self.draft_cache.snapshot(rows[0], 0, drafter.committed)
            entry = make_entry(keys, a.pre.encoded, row.tokens, target, head=head) if head is not None else None
        else:
            width = max(k.shape[0] - 1 for k in keys.rows)  # the drafter's prompt slots (rows less their pending token)
            kvs = []
            for r, rk in zip(rows, keys.rows):
                pad = width - (rk.shape[0] - 1)
                kvs.append(self.draft_cache.snapshot(r, pad, drafter.committed - pad))
            entry = make_entry(keys, a.pre.encoded, row.tokens, target, rows=None if None in kvs else kvs)
        if entry is not None:
            self.decoder.prefix_cache.store(entry)


def _iter_ok(new: list, admitted: list):
    """Per admitted request, its _Active (None: it failed)."""
    it = iter(new)
    for ad in admitted:
        yield next(it) if ad.error is None else None


def _n_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, MMSpecError) else f"{type(e).__name__}: {e}"


def generate_batch(dec, requests: list[dict], *, max_batch: int = 16, speculate="always", **defaults) -> list:
    """:meth:`SpecDecoder.generate_batch`: every request checked first ("request N: ..."), then
    decoded with continuous batching; results in input order."""
    if not isinstance(requests, (list, tuple)):
        raise MMSpecError(f"requests must be a list of dicts (one per prompt), got {type(requests).__name__}")
    if speculate == "auto":  # the decoder's own policy: what it measured in earlier calls carries over
        speculate = dec.speculation_policy
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=speculate)
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
    return [results[r] for r in rids]
