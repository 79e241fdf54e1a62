"""Graphs ready before traffic: every step plan an engine may run, captured at start-up.

An engine that runs its steps as CUDA graphs (``graphs`` "cuda", or "emulate" on the CPU)
captures one graph per :class:`~mmspec.engine.step.StepPlan`. Captured lazily, a row crossing a
span bucket, a new mix of sampling parameters, a new ``logprobs`` width or a depth the policy had
not chosen yet would capture in the middle of live traffic (milliseconds to seconds, every row
waiting). In graph mode the engine's plans come from a bounded set instead (:meth:`Engine._plan
<mmspec.engine.step.Engine._plan>`): the sampling flags one of two sets
(:func:`~mmspec.runtime.graphs.canonical_flags`), the log-probabilities the engine's widest
(``max_logprobs``) whenever any row asks, the spans capacity buckets. :func:`plan_set` lists that
set for a maximum batch, the step shapes a policy may choose (:func:`step_shapes`) and the
buffers' capacity, and :func:`warm_up` captures each plan for every row bucket up to the maximum
batch, before any request: the buffers sized first (their reallocation would drop every graph),
nothing replayed, every state a capture's runs write restored (the engine's ``_keep``).

Left to first use: model-free proposals (their staged inputs' shapes vary with what the lookup
finds), and anything past the warmed capacity (a longer request grows the buffers, which drops
the graphs: warm for the longest context served).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mmspec.drafting.tree import TreeSpec
from mmspec.engine.step import Engine, StepPlan
from mmspec.runtime.graphs import MIN_CAPACITY, bucket, canonical_flags
from mmspec.runtime.pinned import STAGING
from mmspec.runtime.verify import SamplingParams, flags

_NAMES = dict.fromkeys(flags([SamplingParams()]), False)
GREEDY_FLAGS = tuple(sorted(canonical_flags(_NAMES).items()))  # the two flag sets of a graph-mode plan
GENERAL_FLAGS = tuple(sorted(canonical_flags({**_NAMES, "any_sampling": True}).items()))


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: graphs captured by it, the engine's graphs in all, plans listed, seconds."""

    captured: int
    graphs: int
    plans: int
    seconds: float

    def line(self) -> str:
        return f"{self.captured} CUDA graphs captured in {self.seconds:.1f} s before traffic ({self.graphs} in all)"


def step_shapes(policy, spec: TreeSpec) -> list[TreeSpec | None]:
    """The step shapes a :class:`~mmspec.engine.policy.SpeculationPolicy` may choose for the
    decoder's ``spec`` (None: plain decoding): every action for "auto", each shape whole for
    "always", plain decoding for "never"."""
    if policy.mode == "never":
        return [None]
    actions = policy.actions(spec) if policy.mode == "auto" else policy.whole(spec)
    return list(dict.fromkeys(policy.spec_of(a, spec) for a in actions))


def _spans(capacity: int) -> list[int]:
    """The attention spans a static engine may use over ``capacity`` slots: its capacity buckets."""
    out, s = [], MIN_CAPACITY
    while s < capacity:
        out.append(s)
        s *= 2
    return out + [capacity]


def plan_set(engine: Engine, max_rows: int, shapes: list[TreeSpec | None], draft_later: bool = True) -> list[StepPlan]:
    """Every plan ``engine`` (in graph mode, its buffers sized) may run over at most ``max_rows``
    rows with these step shapes (``draft_later``: plain steps keep or feed pending tokens for a
    later draft, as the engine does unless the policy is "never"), without model-free proposals."""
    drafting = engine.drafting
    spans = _spans(engine.cache.capacity)
    spans_d = _spans(drafting.rows.cache.capacity) if drafting is not None else [0]
    widths = (0, engine.logprobs_width)
    out = []
    # a drafted step feeds the engine's width, or its whole lag after plain steps (policy "auto")
    feeds = [engine.width] + ([engine.lag] if draft_later and engine.lag > engine.width and None in shapes else [])
    for R in sorted({bucket(r) for r in range(1, max_rows + 1)}):
        for spec in shapes:
            if spec is not None:
                kinds = [(False, False, spans_d, f) for f in feeds]
            elif drafting is None or not draft_later:
                kinds = [(False, False, [0], 0)]
            else:  # a plain step either feeds the drafter its pending tokens or keeps the target's
                kinds = [(True, False, spans_d, 0), (False, True, [0], 0)]
            for catch_up, keep, span_ds, feed in kinds:
                for span in spans:
                    for span_d in span_ds:
                        for fl in (GREEDY_FLAGS, GENERAL_FLAGS):
                            for k in widths:
                                out.append(StepPlan(rows=R, spec=spec, catch_up=catch_up, keep_pending=keep,
                                                    proposals=False, span=span, span_draft=span_d, flags=fl,
                                                    logprobs=k, feed=feed))
    return out


def graph_count(engine: Engine) -> int:
    """Whole-step graphs the engine holds now."""
    return sum(len(r.graphs) for r in engine.step_graphs_by_plan.values())


def captures(engine: Engine) -> int:
    """Captures the engine's runners attempted so far (a test's count of captures after warm-up)."""
    return sum(r.captures for r in engine.step_graphs_by_plan.values())


def warm_up(engine: Engine, max_rows: int, shapes: list[TreeSpec | None], capacity: int,
            draft_capacity: int | None = None, draft_later: bool = True) -> WarmUp:
    """Capture every plan of :func:`plan_set` on ``engine`` before traffic: buffers for
    ``max_rows`` rows of ``capacity`` target slots (``draft_capacity`` draft slots) allocated first,
    then one graph per plan, nothing replayed. An engine without graphs (eager) does nothing."""
    if not engine.step_graphs or engine.graphs_failed:
        return WarmUp(0, graph_count(engine), 0, 0.0)
    t0 = time.perf_counter()
    rows = engine.rows_for(max_rows)
    engine.ensure(rows, capacity)
    drafting = engine.drafting
    whole = [s for s in shapes if s is not None]
    if drafting is not None:
        drafting.ensure(rows, capacity if draft_capacity is None else draft_capacity)
        drafting.begin(rows, 1 + engine.spec.n_generated)  # per-step buffers at their largest (never regrown)
    _allocate(engine, rows, whole[-1] if whole else None)
    if engine.device.type == "cuda":  # the pinned memory steps and admissions use, allocated now
        engine.outcomes.reserve(rows * engine.packed_width(engine.logprobs_width))
        STAGING.reserve()
    before = graph_count(engine)
    plans = plan_set(engine, max_rows, shapes, draft_later)
    for plan in plans:
        engine._runner(plan).prepare(rows=engine.state.live[:plan.rows])  # the input a replay is given
        if engine.graphs_failed:
            break
    return WarmUp(graph_count(engine) - before, graph_count(engine), len(plans), time.perf_counter() - t0)


def _allocate(engine: Engine, rows: int, spec: TreeSpec | None) -> None:
    """The caches' buffers exist before any capture (a cache allocates at its first forward: inside
    a capture, that would move the graphs' addresses): one eager step over ``rows`` rows, every
    state it writes restored."""
    restore = engine._keep()
    try:
        drafting = engine.drafting
        plan = StepPlan(rows=rows, spec=spec, catch_up=spec is None and drafting is not None, keep_pending=False,
                        proposals=False, span=_spans(engine.cache.capacity)[0],
                        span_draft=0 if drafting is None else _spans(drafting.rows.cache.capacity)[0],
                        flags=GREEDY_FLAGS)
        engine._device(plan, None)
    finally:
        restore()
