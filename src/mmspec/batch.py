"""Many requests at once: continuous batching of speculative decodes (issue 37).

:class:`BatchScheduler` owns a batch of :class:`~mmspec.batch_engine.RequestRun` s. Each
:meth:`BatchScheduler.step` admits queued requests (each prefilled ALONE, exactly as
:meth:`SpecDecoder.generate` prefills it, then its keys/values join a row of the shared target
cache), then runs ONE block over every active request: each drafts its own tree on its own
draft cache, the target scores all trees in one forward (:func:`~mmspec.batch_engine.score_batch`,
ragged rows: every request at its own length, padding masked), and each request accepts its own
number of tokens. A finished (or cancelled) request leaves at once: its row is compacted away.

Lossless per request, whatever else is in the batch: greedy output equals the target's own;
a seeded request draws from its own generator in the solo loop's order, so it returns what
``generate`` returns for the same request and seed alone (with ``speculate="always"``; the
other policies keep the exact distribution but draw a different sequence of uniforms).

:class:`SpeculationPolicy` turns drafting off where it does not pay ("auto"): from the tokens
per second the batch measured, per batch size, with and without drafting.

What runs batched: every view and ensemble, chains, static and dynamic trees, feature-level
heads, greedy and sampling. The target's verify forward is shared, and so are the draft
forwards: each request drafts its own tree (its own code path and draws) in a thread of its
own, and :class:`~mmspec.batch_engine.DraftLockstep` merges their forwards into one over a
shared draft cache. Eager only: a decoder set up for static caches / CUDA graphs prefills and
decodes its batches eagerly (its ``generate`` keeps its static caches and graphs).

Exactness is per row: in float64 (the tests) a request's tokens never depend on its
neighbours; in float32 / half precision a batched matrix product may round the last bit
differently from a one-row one, so a near-tie can flip (what issue 37's half-precision audit
measures). A result's ``stats.total_s`` counts from :meth:`BatchScheduler.submit` (queueing
included: the request's latency); its blocks' ``verify_s`` is the shared forward's time.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from mmspec import checks
from mmspec.batch_engine import DraftLockstep, RequestRun, score_batch
from mmspec.errors import MMSpecError
from mmspec.models.cache import DecodeCache
from mmspec.models.ragged import RaggedCache, RowGroup
from mmspec.options import EngineMode
from mmspec.verify import SamplingParams

SPECULATE = ("always", "never", "auto")
_REQUEST_KEYS = ("input_ids", "pixel_values", "attention_mask", "max_new_tokens", "temperature", "top_k", "top_p",
                 "seed", "images", "captions", "videos", "substitutes")


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
    """When to draft. "always" (the default: drafting is lossless and, on the embedded pack,
    faster at every batch size measured), "never" (plain target decoding steps, batched),
    "auto": per batch size, keep the measured tokens/s of drafted and of plain blocks (an
    exponential average over recent blocks, so acceptance changes are followed) and pick the
    faster; an unmeasured mode is tried once, and the losing one again every ``probe_every``
    blocks. Plain steps verify the root alone: lossless by construction."""

    mode: str = "always"
    probe_every: int = 32
    smoothing: float = 0.3  # weight of the newest block in the average
    rates: dict = field(default_factory=dict)  # (batch size, drafted) -> tokens/s
    blocks: dict = field(default_factory=dict)  # batch size -> blocks decided

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE:
            raise MMSpecError(f"speculate must be one of {SPECULATE}, got {self.mode!r}")

    def decide(self, batch: int) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        k = self.blocks.get(batch, 0)
        self.blocks[batch] = k + 1
        spec, plain = self.rates.get((batch, True)), self.rates.get((batch, False))
        if spec is None:
            return True
        if plain is None:
            return False
        best = spec >= plain
        return (not best) if k % self.probe_every == 0 else best

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-9)
        old = self.rates.get((batch, drafted))
        self.rates[(batch, drafted)] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate


# ---------------------------------------------------------------------------- requests
@dataclass
class Prepared:
    """A request checked and resolved (nothing encoded or prefilled yet)."""

    ids: torch.Tensor  # [L] on the CPU
    mm: dict
    layout: object
    max_new_tokens: int
    params: SamplingParams
    seed: int | None
    extra: dict  # images, captions, videos, substitutes


def prepare_request(dec, request: dict, defaults: dict | None = None) -> Prepared:
    """The checks of ``generate`` on one request dict (``defaults`` below it); raises MMSpecError."""
    if not isinstance(request, dict):
        raise MMSpecError(f"a request is a dict of generate()'s arguments (input_ids, pixel_values, ...), "
                          f"got {type(request).__name__}")
    kw = {**(defaults or {}), **request}
    if kw.get("input_ids") is None:
        raise MMSpecError("the request has no input_ids; pass the processor's output (input_ids, pixel_values, ...)")
    ids = checks.check_ids(kw.pop("input_ids"), kw.pop("attention_mask", None))
    checks.check_ids_in_vocab(ids, dec.target.vocab_size)
    pixel_values = kw.pop("pixel_values", None)
    max_new_tokens = checks.check_max_new_tokens(kw.pop("max_new_tokens", 128))
    params = SamplingParams(temperature=checks.check_temperature(kw.pop("temperature", 0.0)),
                            top_k=kw.pop("top_k", None), top_p=kw.pop("top_p", None))
    if dec.acceptance is not None and not params.greedy:
        raise MMSpecError("acceptance='relaxed' is defined for greedy decoding only; use temperature=0 "
                          "or the exact (lossless) acceptance for sampling")
    seed = checks.check_seed(kw.pop("seed", None))
    extra = {k: kw.pop(k, None) for k in ("images", "captions", "videos", "substitutes")}
    mm = dec._mm_inputs(pixel_values, kw)  # the rest: the family's processor outputs, unknown ones refused
    checks.check_video_inputs(dec.target, mm, extra["videos"], extra["substitutes"])
    checks.check_images_and_captions(extra["images"], extra["captions"])
    if params.greedy:
        seed = None
    elif seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    layout = dec.mm.layout(ids, mm)
    dec._check_context(ids.shape[0], max_new_tokens)
    if any(v.needs_substitute for v in dec.views):
        dec.mm.check_substitutes(layout, extra["videos"], extra["substitutes"])
    return Prepared(ids=ids, mm=mm, layout=layout, max_new_tokens=max_new_tokens, params=params, seed=seed,
                    extra=extra)


@contextlib.contextmanager
def _eager(dec):
    """The decoder's prefills on eager, per-request caches (batches run eagerly)."""
    mode = dec.mode
    dec.mode = EngineMode()
    try:
        yield
    finally:
        dec.mode = mode


def start_request(dec, prep: Prepared):
    """Encode and prefill one request alone, as ``generate`` does -> (RequestRun, its solo target
    cache, its length, the room its row needs)."""
    from mmspec.decoder import _generator

    stats = dec._new_stats()
    with _eager(dec):  # reuses what the prefix cache holds of this prompt; prefills only the rest
        pre = dec.prefill_request(prep.ids, prep.mm, prep.layout, prep.max_new_tokens, stats, **prep.extra)
        state, drafter = pre.state, pre.drafter
        dec.remember(pre, [], copy=True)  # the prompt, for a later turn that extends it (the batch keeps writing)
    if not isinstance(state.cache, DecodeCache):
        raise MMSpecError("batched decoding needs a target whose layers are all full attention "
                          "(its rows are preallocated); decode this model's prompts one by one with generate()")
    img = (prep.ids == dec.target.image_token_id).nonzero()
    options = dec.options.for_call(prep.max_new_tokens, prep.params, int(img[-1, 0]) if img.numel() else None)
    generator = None if prep.seed is None else _generator(prep.seed, dec.target.device)
    run = RequestRun.start(state, drafter, options, generator, stats)
    return run, state.cache, state.length, prep.ids.shape[0] + dec._room(prep.max_new_tokens)


@dataclass
class _Active:
    rid: int
    run: RequestRun
    seed: int | None
    t_start: float
    text: str = ""


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
        self.cache = RaggedCache(_n_layers(decoder.target_model))  # row b: _active[b]'s target cache
        # the draft forwards are shared too: every view of every request (or its head) a row here
        if decoder.head is not None:
            self.draft_cache = RaggedCache(decoder.head.decoder.config.num_hidden_layers)
            self.lockstep = DraftLockstep.for_head(decoder.head, self.draft_cache)
        elif decoder.draft_model is None:  # lookup / suffix alone (mmspec.lookup): no draft model, no draft rows
            self.draft_cache = self.lockstep = None
        else:
            self.draft_cache = RaggedCache(_n_layers(decoder.draft_model))
            self.lockstep = DraftLockstep.for_tokens(decoder.draft, self.draft_cache)
        self._draft_rows: dict[int, list[int]] = {}  # rid -> its rows of draft_cache
        self._row_owner: list[int] = []  # draft_cache row -> rid
        self._queue: deque = deque()  # (rid, Prepared, t_submit)
        self._active: list[_Active] = []  # row b of the cache is _active[b]
        self._next_rid = 0

    # ------------------------------------------------------------------ the API
    def submit(self, request: dict, **defaults) -> int:
        """Check the request now (MMSpecError), queue it; returns its id."""
        prep = prepare_request(self.decoder, request, defaults)
        rid = self._next_rid
        self._next_rid += 1
        self._queue.append((rid, prep, time.perf_counter()))
        return rid

    def has_work(self) -> bool:
        return bool(self._queue or self._active)

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
        """Admit queued requests (prefill), then run ONE block over every active request."""
        events: list[StepEvent] = []
        self._admit(events)
        if not self._active:
            return events
        dec = self.decoder
        t0 = time.perf_counter()
        speculate = self.policy.decide(len(self._active))
        if speculate and self.lockstep is not None:  # each request drafts its own tree, forwards merged
            errors = self.lockstep.run([(a.rid, lambda a=a: a.run.draft_block(True)) for a in self._active],
                                       self._draft_lengths)
        else:  # no drafting: the roots alone (or drafting with no model: on the host, one by one)
            errors = {}
            for a in self._active:
                try:
                    a.run.draft_block(speculate)
                except Exception as e:  # noqa: BLE001 - one request's failure must not end the others
                    errors[a.rid] = e
        for b in reversed(range(len(self._active))):
            a = self._active[b]
            if a.rid in errors:
                events.append(StepEvent(a.rid, [], "", True, None, error=_message(errors[a.rid])))
                self._remove(b)
        if not self._active:
            return events
        runs = [a.run for a in self._active]
        t1 = time.perf_counter()
        try:
            logits, hidden = score_batch(dec.target, self.cache, runs, dec._hidden_layers)
        except Exception as e:  # noqa: BLE001 - the shared forward failed: every request in it ends, the scheduler goes on
            for b in reversed(range(len(self._active))):
                events.append(StepEvent(self._active[b].rid, [], "", True, None, error=_message(e)))
                self._remove(b)
            return events
        verify_s = time.perf_counter() - t1
        emitted = 0
        finished: list[int] = []
        for b, a in enumerate(self._active):
            n = a.run.tree.size
            try:
                kept = a.run.finish_block(logits[b, :n], None if hidden is None else hidden[b, :n], self.cache, b,
                                          verify_s)
            except Exception as e:  # noqa: BLE001
                events.append(StepEvent(a.rid, [], "", True, None, error=_message(e)))
                finished.append(b)
                continue
            emitted += len(kept)
            text = dec.tokenizer.decode(a.run.tokens, skip_special_tokens=True)
            delta = text.removeprefix(a.text)
            a.text = text
            result = self._result(a) if a.run.done else None
            events.append(StepEvent(a.rid, kept, delta, a.run.done, result))
            if a.run.done:
                finished.append(b)
        self.policy.record(len(self._active), speculate, emitted, time.perf_counter() - t0)
        for b in sorted(finished, reverse=True):
            self._remove(b)
        return events

    # ------------------------------------------------------------------ internals
    def _admit(self, events: list[StepEvent]) -> None:
        while self._queue and len(self._active) < self.max_batch:
            rid, prep, t_submit = self._queue.popleft()
            try:
                run, solo, length, room = start_request(self.decoder, prep)
                self._join_draft(rid, run.drafter)
                self.cache.join(solo, length, room)
            except Exception as e:  # noqa: BLE001 - reported on the request, the others go on
                self._leave_draft(rid)
                events.append(StepEvent(rid, [], "", True, None, error=_message(e)))
                continue
            self._active.append(_Active(rid, run, prep.seed, t_submit))

    def _join_draft(self, rid: int, drafter) -> None:
        """The drafter's prefilled rows join the shared draft cache; its forwards go through the lockstep."""
        if self.lockstep is None:  # a model-free drafter has no rows
            return
        if not getattr(drafter.cache.layers[0], "is_initialized", False):
            raise MMSpecError("a head drafts nothing from a 2-token prompt, so it cannot join a batch; decode this "
                              "request with generate() or give the prompt more tokens")
        rows = self.draft_cache.join(drafter.cache, drafter.length, drafter.capacity + self.decoder.tree.n_nodes + 1)
        self._draft_rows[rid] = rows
        self._row_owner.extend([rid] * len(rows))
        def get_rows(rid=rid):
            return self._draft_rows[rid]  # rows move as others leave

        drafter.cache = RowGroup(self.draft_cache, get_rows, drafter.length)
        drafter.step_fn = self.lockstep.step_fn(rid, get_rows, drafter)

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
        drafters = {a.rid: a.run.drafter for a in self._active}
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

    def _result(self, a: _Active):
        from mmspec.decoder import GenerationResult

        st = a.run.stats
        st.total_s = time.perf_counter() - a.t_start
        finish = getattr(a.run.drafter, "finish", None)  # suffix decoding: the request joins the decoder's store
        if finish is not None:
            finish(list(a.run.tokens))
        if getattr(a.run.drafter, "adaptive", None) is not None:  # the weights' trajectory, read once
            st.view_weights, st.final_weights = a.run.drafter.adaptive.trajectory()
        return GenerationResult(token_ids=list(a.run.tokens), text=a.text, stats=st, seed=a.seed)


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
