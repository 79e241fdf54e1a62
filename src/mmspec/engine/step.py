"""THE STEP: one round of speculative decoding over every active request; a request is a row.

``generate`` and ``stream`` are one request submitted and stepped to its end; ``generate_batch``,
:class:`~mmspec.engine.scheduler.BatchScheduler` and ``mmspec serve`` step many: the same
:meth:`Engine.step`, the same caches, forwards, prefill and graphs.

Between steps every row's state is on the device (:class:`~mmspec.runtime.state.BatchState`):
its committed target slots, its pending tokens (the newest is the root of its next tree), its
token budget, its sampling parameters and random stream. One step, a fixed number of tensor
operations whatever the number of rows:

1. draft: the drafter feeds every row's pending tokens and drafts every row's tree in batched
   forwards (:mod:`mmspec.drafting.trees`); a step that does not speculate (the policy's choice)
   verifies each row's root alone: a plain target step;
2. verify forward: the target scores every row's nodes in ONE forward: node i at position
   ``length + pos_offset + depth[i]``, under a mask in which it sees its row's committed slots
   and its own ancestors (:mod:`mmspec.runtime.masks`);
3. accept: ONE verification of all rows, greedy and sampling together
   (:func:`~mmspec.runtime.verify.verify_steps`), every random draw from the row's own stream
   (:mod:`mmspec.runtime.rng`); a coupled row (seeded sampling) draws the token at each output
   position from its seed's noise at that position, so its answer is the target's own seeded
   sample whatever the step's shape, depth, drafter or batch;
4. commit, on the device: the accepted path's keys/values moved into place in both caches (only
   when a tree's path is not its first branch), lengths advanced, the next pending tokens;
5. ONE host read of the packed outcomes of all rows, from which the host emits each row's tokens
   and cuts them at EOS or the row's limit.

Log-probabilities (a request's ``logprobs``, :class:`~mmspec.results.TokenLogprob`) come from the
verify forward of step 2, not from a forward of their own: emitted token j of a row is verified
(or drawn) at node ``path[j]`` of its accepted path (the root, then the accepted nodes: token j is
the child of ``path[j]`` on the path, the last one the recovered or bonus token drawn there), so
the log-softmax of the target's raw logits at those nodes is exactly what a plain decode reports
at each position. Only a step in which some row asks computes them (:attr:`StepPlan.logprobs`),
and they travel in the same packed read (:func:`path_logprobs`, :func:`unpack_logprobs`).

Nothing else crosses between host and device inside a step: no ``.item()``, no tensor made from
a host list, no host value written into a device tensor (``tests/core/test_host_free.py``
counts them).

But under a constraint (:mod:`mmspec.constrain`): a step with a constrained row (``StepPlan.constrained``)
masks its rows' drafts at each depth (:class:`~mmspec.constrain.state.DraftMask`), adds below its
trees' leaves the tokens the grammar forces there (forced tails, never drafted) and masks every
node before step 2 (:func:`~mmspec.constrain.tails.constrained_tree`; one ``masked_fill`` on the
verify logits), each with a read of the drafted tokens and one copy of the masks (xgrammar runs
on the host); it runs eagerly and is never overlapped. A step without one never calls them.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

import torch

from mmspec.constrain.state import DraftMask, RowGrammar
from mmspec.constrain.tails import FORCED_TAIL, constrained_tree
from mmspec.drafting import proposals as mf
from mmspec.drafting.tree import TreeBatch, TreeSpec
from mmspec.drafting.trees import Drafted, StepInput
from mmspec.models.rows import RowCache
from mmspec.options import RelaxedAcceptance
from mmspec.results import TokenLogprob
from mmspec.runtime import rng
from mmspec.runtime.forwards import Compiler, RowForward
from mmspec.runtime.graphs import MAX_LOGPROBS, StepRunner, bucket, canonical_flags, capacity_bucket
from mmspec.runtime.masks import rows_mask
from mmspec.runtime.pinned import PinnedRing
from mmspec.runtime.state import BatchState
from mmspec.runtime.verify import verify_steps
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.timing import BlockClock

# How far plain steps let the drafter fall behind (pending tokens) before a catch-up forward feeds
# it: one wide draft forward every 15 plain steps rather than a narrow one every other step, so a
# policy that decodes plainly while a draft does not pay runs close to plain decoding's speed
# (docs/perf.md §17); the drafted step after such a run feeds the whole buffer once.
PENDING_LAG = 16


@dataclass
class RowHost:
    """What the host keeps of one active row (the engine's row b is ``rows[b]``)."""

    max_new_tokens: int
    eos_ids: frozenset[int]
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)
    seed: int = 0  # the row's random stream (mmspec.runtime.rng) and the steps it took
    steps: int = 0
    unseen: list[int] = field(default_factory=list)  # committed tokens a model-free proposer has not been given
    drafted: list[bool] = field(default_factory=list)  # per step the drafter ran: whether this row drafted a node
    pending_len: int = 1  # pending tokens on the device (host mirror)
    logprobs_top: int | None = None  # the request asked for logprobs, with this many alternatives (None: not asked)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token of ``tokens`` where asked
    accept_avg: tuple[float, float, int] | None = None  # averaged accepted / rejected drafts per block, blocks (the policy's α)
    done: bool = False
    clocks: list[BlockClock] = field(default_factory=list)
    prefill: BlockClock | None = None  # its admission's target and draft prefills
    grammar: RowGrammar | None = None  # a constrained request's grammar state (mmspec.constrain.state)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def record_times(self) -> None:
        """The prefills' and each block's draft and verify seconds into the stats (read from
        CUDA events on a GPU: no device sync, a step launched since may still run)."""
        if self.prefill is not None:
            self.stats.prefill_target_s, self.stats.prefill_draft_s = self.prefill.durations()[0]
            self.prefill = None
        blocks = self.stats.blocks[len(self.stats.blocks) - len(self.clocks):]
        for rec, clock in zip(blocks, self.clocks):
            rec.draft_s, rec.verify_s = clock.durations()[0]
        self.clocks = []


@dataclass(frozen=True)
class StepPlan:
    """What the host decides of a step before it runs (its shape): the rows (a bucket with static
    shapes), the tree drafted (None: plain decoding), whether a plain step feeds the drafter its
    pending tokens, whether model-free proposals ride along, the attention spans, and which
    sampling filters any row uses, and the alternatives the step's log-probabilities list. One CUDA
    graph per plan; with graphs, plans come from a bounded set (the flags one of two sets, the
    alternatives the engine's widest, spans buckets) captured before traffic (:mod:`mmspec.engine.warmup`)."""

    rows: int
    spec: TreeSpec | None
    catch_up: bool  # a plain step feeds the drafter its pending tokens (they would overflow)
    keep_pending: bool  # a plain step that feeds nothing: the target's token joins the pending ones
    proposals: bool
    span: int  # target slots attended
    span_draft: int  # draft slots attended
    flags: tuple  # the sampling paths the step runs: sorted (name, on) pairs of RowSampling's flags
    logprobs: int = 0  # top alternatives per emitted token: the most any row asks, at least 1 (0: no row asks)
    feed: int = 0  # pending columns the step's inputs hold: a drafted step's feed (the engine's width, or
    # its whole lag after plain steps), a plain step's whole buffer (0: the whole buffer)
    constrained: bool = False  # some row has a grammar: its trees are masked before verification (eager, no overlap)


@dataclass
class InFlight:
    """A step launched on the device whose outcomes the host has not read yet (:meth:`Engine.launch`)."""

    plan: StepPlan
    rows: list[RowHost]  # the rows it ran over, in its row order
    failed: dict[int, BaseException]  # rows (by that order) whose model-free proposer failed
    clock: BlockClock
    packed: list | torch.Tensor  # its packed outcomes: read (CPU), or being copied to pinned memory (GPU)
    ready: torch.cuda.Event | None  # recorded after that copy (GPU)


def root_only(x: StepInput) -> TreeBatch:
    """Every row's root alone ([R, 1]): a plain target step."""
    R, dev = x.rows, x.pending.device
    zeros = torch.zeros(R, 1, dtype=torch.long, device=dev)
    return TreeBatch(tokens=x.root()[:, None], parents=zeros - 1, depth=zeros, anc=torch.ones(R, 1, 1, dtype=torch.bool, device=dev),
                     fed=zeros - 1, valid=None, max_depth=0)


def path_logprobs(logits: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor, k: int) -> torch.Tensor:
    """The target's log-probabilities along each row's accepted path, packed as int64 columns for
    the step's one host read. logits [R, N, V] (the verify forward's raw logits); path [R, D1]
    (tree nodes: emitted token j is verified or drawn at ``path[:, j]``); emitted [R, D1] (token j;
    past the row's last one, anything); k >= 1 -> [R, D1 * (1 + 2k)]: per position the emitted
    token's log-probability, the top k log-probabilities (float64 bits as int64), their k ids."""
    V = logits.shape[-1]
    x = logits.gather(1, path[..., None].expand(-1, -1, V))  # [R, D1, V]
    lp = torch.log_softmax(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=-1)
    chosen = lp.gather(-1, emitted[..., None])  # [R, D1, 1]
    top = lp.topk(k, dim=-1)  # [R, D1, k]
    bits = torch.cat([chosen, top.values], -1).to(torch.float64).view(torch.int64)  # [R, D1, 1 + k]
    return torch.cat([bits, top.indices], -1).flatten(1)


def unpack_logprobs(cols: list[int], tokens: list[int], k: int, top: int) -> list[TokenLogprob]:
    """One row's :func:`path_logprobs` columns from the host read -> a :class:`TokenLogprob` per
    emitted token (``top`` <= k alternatives each)."""
    per, out = 1 + 2 * k, []
    for j, t in enumerate(tokens):
        c = cols[j * per:(j + 1) * per]
        lp = struct.unpack(f"{1 + k}d", struct.pack(f"{1 + k}q", *c[:1 + k]))  # the float64 bits back
        out.append(TokenLogprob(t, lp[0], tuple(zip(c[1 + k:1 + k + top], lp[1:1 + top]))))
    return out


class Engine:
    """The step over a batch's rows (module docstring). ``drafting``: the draft model's or head's
    :class:`~mmspec.drafting.trees.Drafting` (None: model-free or plain decoding only);
    ``hidden_layers``: the target layers a head reads; ``static``: shapes padded to buckets
    (row counts and attention spans), ``graphs``: a :data:`~mmspec.runtime.graphs.MODES` entry;
    ``compile``: the target's and the drafter's forwards through ``torch.compile``
    (:class:`~mmspec.runtime.forwards.Compiler`; static shapes), captured by the step's graph."""

    def __init__(self, target, n_layers: int, spec: TreeSpec, drafting=None, *, hidden_layers: tuple[int, ...] = (),
                 relaxed: RelaxedAcceptance | None = None, static: bool = False, graphs: str = "eager",
                 feat_dim: int | None = None, feat_dtype: torch.dtype = torch.float32, pool=None,
                 proposals_beside: bool = False, compile: bool = False, max_logprobs: int = MAX_LOGPROBS):
        self.target = target
        self.max_logprobs = max_logprobs  # the most alternatives per token a row may ask (graph mode computes these)
        self.spec = spec
        self.drafting = drafting
        self.hidden_layers = hidden_layers
        self.relaxed = relaxed
        self.static = static
        self.device = target.device
        # pending tokens a row may hold (P): after a drafted step, at most the last accepted node a
        # draft model did not feed and the target's token (a head: every accepted node), plus room
        # for one plain step's token before the drafter must catch up
        # (model-free branches beside a draft are never fed: every accepted node of one is pending)
        short = drafting is None or (drafting.keeps_path and not proposals_beside)
        self.width = (2 if short else spec.max_depth + 1) + 1  # pending tokens a drafted step feeds
        # the pending buffer (P, ``lag``): plain steps let the drafter lag this far behind before a
        # catch-up forward feeds it (one wide forward every ``lag - 1`` plain steps, not a narrow
        # one every other step), and a constrained step's forced tails (never fed to a drafter;
        # with a chain that stopped where the grammar forces the rest, its depth more) come back
        # pending; a drafted step after such a run, or a constrained one, feeds the whole buffer
        self.tail = FORCED_TAIL
        self.lag = max(self.width + self.tail + spec.max_depth, PENDING_LAG) if drafting is not None else self.width
        self.state = BatchState(self.device, self.lag, feat_dim, feat_dtype=feat_dtype)
        self.cache = RowCache(n_layers)
        cache = self.cache
        self.forward = RowForward(lambda mask, ids, pos: target.forward(
            cache=cache, attention_mask=mask, position_ids=pos, input_ids=ids, hidden=hidden_layers),
            cache, "target")  # inside the step's graph, with fixed shapes
        self.compiler = Compiler() if compile else None
        if self.compiler is not None:
            for fwd in [self.forward, getattr(drafting, "forward", None)]:
                if fwd is not None:
                    fwd.fn = self.compiler.wrap(fwd.fn, fwd.name)
        self.graphs = graphs  # "eager", or the whole step captured per plan ("cuda"; "emulate" on the CPU)
        self.step_graphs = graphs != "eager"
        self.graphs_failed: str | None = None
        self.pool = pool
        self._step_runners: dict = {}
        self._graphs_generation = None
        self.rows: list[RowHost] = []  # joined by add_row, left by remove
        self._constrained = 0  # rows decoding under a grammar (kept by add_row / remove: no scan a step)
        self._inflight: deque[InFlight] = deque()  # launched, not read yet (oldest first)
        self.outcomes = PinnedRing(2)  # where a GPU step's packed outcomes land: one launched, one being read
        self.draft_later = True  # False: rows never draft again (plain decoding only): nothing to catch up

    # ------------------------------------------------------------------ rows
    @property
    def active(self) -> int:
        return self.state.active

    @property
    def step_graphs_by_plan(self) -> dict:
        """The whole-step graphs captured so far: plan -> its runner (``.graphs``, ``.failed``)."""
        return dict(self._step_runners)

    @property
    def generation(self) -> tuple:
        """Changes whenever a buffer a step's graph reads or writes is reallocated."""
        ids = tuple(id(t) for t in self.state._tensors())
        caches = [self.cache] + ([self.drafting.rows.cache] if self.drafting is not None else [])
        extra = tuple(id(t) for t in (self.drafting.step_state() if self.drafting is not None else []))
        return ids + extra + tuple(c.generation for c in caches)

    @property
    def capture_s(self) -> float:
        """Seconds spent capturing CUDA graphs so far."""
        return sum(r.capture_s for r in self._step_runners.values())

    @property
    def compile_s(self) -> float:
        """Seconds of the compiled forwards' first calls per shape (compiling), so far; inside
        :attr:`capture_s` where the step is captured."""
        return 0.0 if self.compiler is None else self.compiler.compile_s

    def step_rows(self) -> int:
        """R: the rows a step runs over (the active ones, padded to a bucket with static shapes)."""
        B = self.state.active
        return bucket(B) if self.static else B

    def rows_for(self, requests: int) -> int:
        """Rows a step over ``requests`` requests runs over (a bucket of them, static)."""
        return bucket(requests) if self.static else requests

    def ensure(self, requests: int, capacity: int) -> None:
        """Room for ``requests`` rows of ``capacity`` target slots (a bucket of each, static)."""
        rows = self.rows_for(requests)
        self.state.ensure(rows)
        self.cache.ensure(rows, capacity_bucket(capacity) if self.static else capacity)

    def release(self) -> None:
        """No rows left: the caches' memory goes back (a static engine keeps its buffers, and so
        the graphs captured on them)."""
        if self.state.active or self.static:
            return
        for cache in [self.cache] + ([self.drafting.rows.cache] if self.drafting is not None else []):
            cache.store.kv = None
            cache.store.want = (0, 0)

    def add_row(self, row: RowHost) -> None:
        """A row admitted (its device state already written by ``state.admit``): its host record."""
        self.rows.append(row)
        self._constrained += row.grammar is not None

    def remove(self, b: int) -> int | None:
        """Row b leaves (finished or cancelled): the last row moves into its place. -> the index
        that moved (None: b was the last)."""
        self._constrained -= self.rows[b].grammar is not None
        last = self.state.active - 1
        moved = self.state.remove(b)
        self.cache.copy_row(b, last)
        if self.drafting is not None:
            self.drafting.remove(b, last)
        self.rows[b] = self.rows[last]
        self.rows.pop()
        return moved

    # ------------------------------------------------------------------ the step
    def _input(self, R: int, depth: int, span: int = 0, flags: dict | None = None, feed: int = 0,
               tail: int = 0) -> StepInput:
        """The step's view of the batch: ``feed`` pending columns (0: the whole buffer); ``tail``:
        nodes a constrained step may add below the deepest drafted one (its coupled rows' noise
        reaches them)."""
        st = self.state
        P = feed or st.width  # the pending columns fed (a drafted step's width, or the whole buffer)
        rs = st.sampling(R, flags)
        drawn = rs.any_sampling and not rs.all_coupled  # a row samples by rejection: the step's uniforms
        u = rng.uniforms(st.seed[:R], st.step[:R], rng.DRAFT, max(depth, 1)) if drawn else None
        noise = None
        if rs.any_coupled:  # the coupled rows' noise at the output positions of depths 1 .. depth + 1
            position = (st.length[:R] - st.origin[:R])[:, None] + torch.arange(depth + 1 + tail, device=self.device)
            noise = rng.gumbel(st.seed[:R], position, self.target.vocab_size)  # [R, depth + 1, V]
        return StepInput(rows=R, pending=st.pending[:R, :P], pending_len=st.pending_len[:R], remaining=st.remaining[:R],
                         sampling=rs, u=u, feats=None if st.feat_dim is None else st.pending_feats[:R, :P], span=span,
                         noise=noise)

    def step(self, depth: int | TreeSpec | None = None, proposers: list | None = None) -> list[list[int] | BaseException]:
        """One step over every active row, each drafting at most ``depth`` deep (None: the
        decoder's whole tree; 0: plain decoding; a TreeSpec: that shape, within the engine's
        ``spec``: ``tree="auto"``'s choice) -> the tokens each row emitted, or the exception
        a row failed with alone (its model-free proposer's). ``proposers``: each row's model-free
        proposer (:mod:`mmspec.drafting.lookup`), searched on the host first. A failure of the step's
        shared work is raised: it is every row's. :meth:`launch` then :meth:`finish`."""
        return self.finish(self.launch(depth, proposers))

    def launch(self, depth: int | TreeSpec | None = None, proposers: list | None = None) -> InFlight:
        """Plan a step and start it on the device; its outcomes are read by :meth:`finish`.

        Overlap: one step may be launched while the one before it is in flight (a GPU runs it
        while the host reads and emits the earlier one's tokens). The host plans it from what it
        knows, the last step it read, and bounds for the step in flight (how far its rows'
        lengths and pending tokens can grow); a row that finishes in the step in flight runs one
        more step whose tokens :meth:`finish` drops. Model-free proposals are searched in the
        tokens of the last step, so they never ride a step launched over one in flight."""
        if len(self._inflight) > 1 or ((proposers is not None or self.constrained) and self._inflight):
            raise RuntimeError("Engine.launch: finish the step in flight first (at most one step ahead, "
                               "and none under model-free proposals or constraints)")
        st, B = self.state, self.state.active
        plan, props, failed = self._plan(depth, proposers)
        clock = BlockClock(self.device)
        clock.start()
        if self.step_graphs and not self.graphs_failed and not plan.constrained:  # the whole step, one replay of its plan's graph
            packed = self._runner(plan)(**(props or {"rows": st.live[:plan.rows]}))
            clock.mark()
        else:
            packed = self._device(plan, clock, **(props or {}))
        if self.device.type == "cuda":  # 5. the packed outcomes into pinned memory, read when they are ready
            host = self.outcomes.take(tuple(packed[:B].shape), packed.dtype)  # a pinned slot, reused
            host.copy_(packed[:B], non_blocking=True)  # before a later replay overwrites the graph's output
            ready = torch.cuda.Event()
            ready.record()
        else:  # the CPU has run the step already: its one read now
            host, ready = packed[:B].tolist(), None
        clock.mark()
        step = InFlight(plan, list(self.rows), failed, clock, host, ready)
        self._inflight.append(step)
        return step

    def finish(self, step: InFlight) -> list[list[int] | BaseException | None]:
        """Read a launched step's outcomes (the step's ONE host read) and emit its rows' tokens:
        -> per row it ran over (``step.rows``, in order), the tokens it emitted, the exception it
        failed with alone, or None for a row that left or finished while the step was in flight."""
        if not self._inflight or self._inflight[0] is not step:
            raise RuntimeError("Engine.finish: steps are finished in the order they were launched")
        self._inflight.popleft()
        if step.ready is not None:
            step.ready.synchronize()
            host = step.packed.tolist()
        else:
            host = step.packed
        plan, rows = step.plan, self.rows
        index = {id(r): b for b, r in enumerate(rows)}  # rows may have moved or left since the launch
        drafted = plan.spec is not None and self.drafting is not None
        fed = drafted or plan.catch_up  # the drafter took the rows' pending tokens: its mirrors advance
        k = plan.logprobs
        d1 = (len(host[0]) - 4) // (2 + 2 * k if k else 1) if host else 0  # path positions: a token column each (+ 1 + 2k)
        depth = 0 if plan.spec is None else plan.spec.max_depth
        lengths, failed, clock = self.state.lengths, step.failed, step.clock
        emitted: list = []
        advance = [0] * len(rows) if fed else None
        for i, (row, h) in enumerate(zip(step.rows, host)):  # per row: only what cannot be done for all at once
            b = index.get(id(row))
            if b is None or row.done:  # its tokens past its end are dropped
                emitted.append(None)
                continue
            n_acc, nxt, kept_m, nv = h[0], h[1], h[2], h[3]
            if fed:
                advance[b] = row.pending_len + kept_m
            row.pending_len = n_acc - kept_m + 1 if drafted else row.pending_len + 1 if plan.keep_pending else 1
            lengths[b] += n_acc + 1
            if drafted:
                row.drafted.append(nv > 1)
            tokens = h[5:5 + n_acc]  # the accepted drafts (path positions 1 .. n_acc), then the target's token
            tokens.append(nxt)
            scored = None if row.logprobs_top is None else unpack_logprobs(h[4 + d1:], tokens, k, row.logprobs_top)
            kept = self._emit(row, tokens, n_acc, nv, depth, clock, scored)
            if row.grammar is not None:  # the matcher advances by what the row emitted
                row.grammar.accept(kept)
                row.stats.forced_tokens, row.stats.grammar_s = row.grammar.forced, row.grammar.host_s
                row.stats.tail_tokens = row.grammar.tail
            emitted.append(failed.get(i, kept) if failed else kept)
        if advance is not None and any(advance):
            self.drafting.advance(advance)
        return emitted

    @property
    def constrained(self) -> bool:
        """Some active row decodes under a constraint (its grammar masks its trees)."""
        return self._constrained > 0

    @property
    def in_flight(self) -> int:
        """Steps launched whose outcomes the host has not read yet."""
        return len(self._inflight)

    def _plan(self, depth: int | TreeSpec | None, proposers: list | None) -> tuple[StepPlan, dict | None, dict]:
        """What the host decides before a step (its shape), and the model-free proposals it
        searches and stages; -> (the plan, the staged proposal tensors or None, rows failed)."""
        st, R = self.state, self.step_rows()
        if isinstance(depth, TreeSpec):  # a shape chosen for this step (no deeper, no larger than self.spec)
            spec = depth
        else:
            spec = self.spec if depth is None else (self.spec.for_remaining(depth + 1) if depth > 0 else None)
        props = None
        failed: dict[int, BaseException] = {}
        if spec is not None and proposers is not None:  # model-free proposals, searched on the host
            staged = mf.propose([(p, r.unseen) for p, r in zip(proposers, self.rows)], spec, R,
                                self.target.vocab_size, self.device, [not p.greedy for p in st.params],
                                [r.seed for r in self.rows], [r.steps for r in self.rows], failed)
            props = {k: v for k, v in vars(staged).items() if v is not None}
            for r in self.rows:
                r.unseen = []
        ahead = self._inflight[-1].plan if self._inflight else None  # launched, not read yet: bounded
        bound = self._pending_bound(ahead)
        catch_up = spec is None and self.drafting is not None and self.draft_later and bound + 1 > self.lag
        feed = 0  # a drafted step feeds the engine's width, or the whole buffer after plain steps or under a grammar
        if spec is not None:
            feed = self.lag if (self.constrained or bound > self.width) else self.width
        n_nodes = 1  # the root, then the drafted nodes and a model-free proposal's (and a constrained step's forced tails)
        if spec is not None:
            n_nodes += (spec.n_nodes - 1 if self.drafting is not None else 0) + (spec.n_nodes - 1 if props else 0)
            n_nodes += self.tail if self.constrained else 0
        grown = 0 if ahead is None else 1 + (ahead.spec.max_depth if ahead.spec is not None else 0)
        need = max(st.lengths, default=0) + grown + n_nodes
        span = min(capacity_bucket(need) if self.static else need, self.cache.capacity)  # a bound may overshoot
        span_d = 0
        if self.drafting is not None and (spec is not None or catch_up):
            fed = ahead is not None and (ahead.catch_up or (ahead.spec is not None))
            ahead_fed = (ahead.feed or self.lag) + self.spec.max_depth if fed else 0
            span_d = self.drafting.span_for(spec, feed or self.lag, ahead_fed)
            self.drafting.begin(R, 1 + (spec.n_generated if spec is not None else 0))
        drafting_adapts = spec is not None and getattr(self.drafting, "adaptive", None) is not None
        if drafting_adapts:  # the weights this step drafts with, kept for the request's stats
            self.drafting.adaptive.record(R)
        asked = [r.logprobs_top for r in self.rows if r.logprobs_top is not None]
        flags, k = st.flags, max(1, *asked) if asked else 0
        if self.step_graphs and not self.graphs_failed:  # a bounded set of graphs (engine/warmup.py): two flag sets, one width
            flags, k = canonical_flags(flags), max(k, self.logprobs_width) if asked else 0
        keep = spec is None and self.drafting is not None and self.draft_later and not catch_up
        plan = StepPlan(rows=R, spec=spec, catch_up=catch_up, keep_pending=keep, proposals=props is not None, span=span,
                        span_draft=span_d, flags=tuple(sorted(flags.items())), logprobs=k, feed=feed,
                        constrained=self.constrained)
        return plan, props, failed

    def packed_width(self, logprobs: int) -> int:
        """Columns of a step's packed outcomes (:meth:`_device`) with ``logprobs`` alternatives."""
        d1 = self.spec.max_depth + 1
        return 4 + d1 + (d1 * (1 + 2 * logprobs) if logprobs else 0)

    @property
    def logprobs_width(self) -> int:
        """The alternatives a step computes per token in graph mode whenever a row asks for any:
        the most the engine serves (``max_logprobs``, within the vocabulary); a row asking fewer
        reads its first ones on the host."""
        return max(1, min(self.max_logprobs, self.target.vocab_size))

    def fed_a_lag(self, plan: StepPlan) -> bool:
        """A drafted step that fed the drafter a run of plain steps' tokens (the whole buffer): its
        time is not its action's cost (the policy does not learn from it). A constrained step feeds
        the whole buffer for its forced tails every step: that is its action's cost."""
        return plan.spec is not None and not plan.constrained and plan.feed > self.width

    def _pending_bound(self, ahead: StepPlan | None) -> int:
        """The most pending tokens a row may hold once the step in flight (``ahead``) is done
        (rows admitted after its launch hold one)."""
        exact = max((r.pending_len for r in self.rows), default=1)  # as of the last step read
        if ahead is None:
            return exact
        if ahead.spec is not None and self.drafting is not None:
            return self.width - 1  # a drafted step leaves at most this many (the engine's width)
        return exact + 1 if ahead.keep_pending else 1

    def _runner(self, plan: StepPlan) -> StepRunner:
        """The whole step of ``plan`` as a CUDA graph (captured on first use, replayed after)."""
        if self.generation != self._graphs_generation:  # reallocated buffers: the old graphs are stale
            for r in self._step_runners.values():
                r.reset()
            self._step_runners.clear()
            self._graphs_generation = self.generation
        runner = self._step_runners.get(plan)
        if runner is None:
            runner = StepRunner(lambda **props: self._device(plan, None, **props), mode=self.graphs,
                                name="step", pool=self.pool, keep=self._keep)
            runner.on_failure = self._graphs_gave_up
            self._step_runners[plan] = runner
        return runner

    def _graphs_gave_up(self, why: str) -> None:
        self.graphs_failed = why  # one warning: every later step runs eagerly

    def _keep(self):
        """Snapshot the state a step writes (a capture's warm-up runs write it); -> restore."""
        saved = [(t, t.clone()) for t in self._step_state()]

        def restore() -> None:
            for t, c in saved:
                t.copy_(c)
        return restore

    def _step_state(self) -> list[torch.Tensor]:
        st = self.state
        out = [st.length, st.pending, st.pending_len, st.remaining, st.step]
        if st.feat_dim is not None:
            out.append(st.pending_feats)
        if self.drafting is not None:
            out += self.drafting.step_state()
        return out

    def _device(self, plan: StepPlan, clock: BlockClock | None, **props: torch.Tensor) -> torch.Tensor:
        """Steps 1-4 on the device, every row at once, and the packed outcomes [R, W] (what the
        host reads). Reads no host value but ``plan``'s: a CUDA graph can capture it."""
        st, R, spec = self.state, plan.rows, plan.spec
        tail = self.tail if plan.constrained and spec is not None else 0  # forced tails' room
        x = self._input(R, self.spec.max_depth, plan.span_draft, dict(plan.flags), plan.feed, tail)
        if plan.constrained:  # constrained rows draft only what their grammars allow
            x.grammar = DraftMask([r.grammar for r in self.rows], R, self.device)
        drafted: Drafted | None = None
        p = mf.Proposals(**props) if plan.proposals else None
        if spec is not None and self.drafting is not None:  # 1. draft
            drafted = self.drafting.draft(x, spec)
            tree, is_chain = drafted.tree, spec.is_chain
            if p is not None:
                tree = drafted.tree = mf.merged(tree, p)
                drafted.fed, is_chain = tree.fed, False
        elif p is not None:  # drafting with no model
            tree, is_chain = mf.alone(x.root(), p, spec.max_depth), False
        else:
            tree, is_chain = root_only(x), True
            if plan.catch_up:
                self.drafting.catch_up(x, st.live[:R])
        allowed = None
        if plan.constrained:  # forced tails below the leaves, every node's grammar mask: ONE read of the trees
            tree, allowed = constrained_tree([r.grammar for r in self.rows], tree, tail, is_chain)
            if drafted is not None:
                drafted.tree, drafted.fed = tree, tree.fed
        if spec is not None:  # a row never drafts past its token limit (nodes marked, not left out)
            limit = tree.depth < x.remaining.clamp_min(1)[:, None]  # a root stays valid
            tree.valid = limit if tree.valid is None else tree.valid & limit
        if clock is not None:
            clock.mark()

        logits, hidden = self._verify_forward(tree, R, plan.span)  # 2. ONE target forward, [R, N, V]
        raw = logits  # log-probabilities are reported from the raw logits
        if allowed is not None:  # every constrained row's nodes masked by its grammar along their paths: ONE op
            logits = logits.masked_fill(~allowed, float("-inf"))
        rs = x.sampling
        N = tree.tokens.shape[1]
        drawn = rs.any_sampling and not rs.all_coupled
        u = rng.uniforms(st.seed[:R], st.step[:R], rng.VERIFY, N + 1) if drawn else None
        out = verify_steps(tree, logits, rs, u, self._thresholds(R), x.noise)  # 3. ONE verification

        # 4. commit on the device
        path, n = out.path, out.n_accepted  # [R, D + 1], [R]
        n_valid = tree.valid.sum(1) if tree.valid is not None else torch.full_like(n, N)
        if drafted is not None:
            if getattr(self.drafting, "adaptive", None) is not None:  # each view scored on what the target confirmed
                self.drafting.adapt(x, drafted, path, n, out.next_token, logits, st.live[:R] & (n_valid > 1))
            m = self.drafting.commit(x, drafted, path, n, is_chain, st.live[:R])
        else:
            m = torch.zeros_like(n)
        if not is_chain:
            D = path.shape[1] - 1
            length = st.length[:R]
            self.cache.move_paths(torch.arange(R, device=self.device), length[:, None] + path[:, 1:],
                                  length[:, None] + 1 + torch.arange(D, device=self.device))
        live = st.live[:R]
        step_len = (n + 1) * live  # a free row of the bucket does not advance
        st.length[:R] += step_len
        st.remaining[:R] -= step_len
        st.step[:R] += live
        tok_path = tree.tokens.gather(1, path)  # [R, D + 1]
        self._next_pending(x, tok_path, path, n, m, out.next_token, hidden, plan.keep_pending)
        packed = [n[:, None], out.next_token[:, None], m[:, None], n_valid[:, None], tok_path]
        if plan.logprobs:  # emitted token j: tok_path[j + 1] before the row's n-th, then the next token
            nxt = out.next_token[:, None]
            j = torch.arange(path.shape[1], device=self.device)
            emitted = torch.where(j == n[:, None], nxt, torch.cat([tok_path[:, 1:], nxt], 1))  # [R, D + 1]
            packed.append(path_logprobs(raw, path, emitted, plan.logprobs))
        return torch.cat(packed, 1)

    @staticmethod
    def _emit(row: RowHost, tokens: list[int], n_acc: int, n_valid: int, depth: int, clock,
              scored: list[TokenLogprob] | None) -> list[int]:
        """Row ``row``'s tokens of a step, cut at its limit and at its first EOS, into its record
        (``depth``: the step's deepest draft position; 0: a plain step)."""
        room = row.max_new_tokens - len(row.tokens)
        kept = tokens if len(tokens) <= room else tokens[:room]
        eos = row.eos_ids
        if eos and not eos.isdisjoint(kept):
            kept = kept[:next(i for i, t in enumerate(kept) if t in eos) + 1]
        n = len(kept)
        row.steps += 1
        row.unseen.extend(kept)
        row.tokens.extend(kept)
        if scored is not None:
            row.logprobs.extend(scored[:n])
        row.stats.blocks.append(BlockRecord(n_valid - 1, min(n_acc, n), n, depth=min(depth, room - 1) if depth else 0))
        row.clocks.append(clock)
        if n and (n >= room or kept[-1] in eos):
            row.done = True
        return kept

    def _next_pending(self, x: StepInput, tok_path, path, n, m, next_token, hidden, plain_keep: bool) -> None:
        """Each row's pending tokens for the next step: the accepted nodes the drafter did not
        keep, then the target's token (a plain step that fed nothing: the old pending + it)."""
        st, R, P = self.state, x.rows, self.lag
        j = torch.arange(P, device=self.device)[None]  # [1, P]
        if plain_keep:  # nothing was fed to the draft: the target's token joins the pending ones
            at = x.pending_len[:, None]  # [R, 1]
            st.pending[:R] = torch.where(j == at, next_token[:, None], st.pending[:R])
            if hidden is not None:
                f = st.pending_feats[:R]
                st.pending_feats[:R] = torch.where((j == at)[..., None], hidden[:, :1], f)
            st.pending_len[:R] += st.live[:R]
            return
        left = n - m if self.drafting is not None else torch.zeros_like(n)  # accepted nodes the drafter has not seen
        D1 = tok_path.shape[1]
        src = (m[:, None] + 1 + j).clamp(max=D1 - 1)  # [R, P]
        vals = tok_path.gather(1, src)
        st.pending[:R] = torch.where(j == left[:, None], next_token[:, None], vals)
        st.pending_len[:R] = torch.where(st.live[:R], left + 1, 1)
        if hidden is not None:  # the target's feature before each pending token
            at = path.gather(1, (m[:, None] + j).clamp(max=D1 - 1))  # [R, P] tree nodes
            st.pending_feats[:R] = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1])).to(st.feat_dtype)

    def _verify_forward(self, tree: TreeBatch, R: int, span: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        st = self.state
        length = st.length[:R]
        pos = (length + st.pos_offset[:R])[:, None] + tree.depth.clamp_min(0)  # [R, N]
        mask = rows_mask(length, span, tree.anc)
        out = self.forward(write=length, mask=mask, ids=tree.tokens, pos=pos)
        return (out[0], out[1]) if self.hidden_layers else (out, None)

    def _thresholds(self, R: int) -> torch.Tensor | None:
        """Each row's relaxed threshold (LOSSY) [R]: the vision one within the window after its
        prompt's last image, else the text one; None with the exact acceptance."""
        rel = self.relaxed
        if rel is None:
            return None
        st = self.state
        near = (st.length[:R] - st.last_image[:R]) <= rel.window
        return torch.where(near, rel.vision, rel.text).to(torch.float32)
