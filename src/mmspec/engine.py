"""THE LOOP: one step of speculative decoding over every active request; a request is a row.

``generate`` and ``stream`` are one request submitted and stepped to its end (:func:`run_loop`);
``generate_batch``, :class:`~mmspec.batch.BatchScheduler` and ``mmspec serve`` step many with
:meth:`Engine.step`, the same function. The target's forward and the draft's merged forwards
are :mod:`mmspec.forwards`'; the maths is :mod:`mmspec.verify`'.

Invariant between steps, per row (:class:`Row`): every committed token except the newest is in
the target cache; the newest committed token is *pending*: it is the root (node 0) of the row's
next tree. One step:

1. draft: every row's drafter feeds its pending tokens and drafts a tree (a chain is a tree with
   one branch); a row that does not speculate this step (the policy's choice, or one token left)
   has its root alone: a plain target step. The rows' draft forwards run batched
   (:class:`~mmspec.forwards.DraftForwards`: one forward per round over every request's rows);
2. verify forward: the target scores every row's nodes in ONE forward: node i at position
   ``past + depth[i]``, under a 4-D mask in which it sees its row's committed tokens and its own
   ancestors;
3. accept: verification BATCHED over the rows on the device (:func:`verify_rows`): the trees
   padded to the largest, ONE call for every greedy row and one per SamplingParams of the
   sampling rows (each row keeps its own temperature / top-k / top-p and relaxed threshold); every
   random draw from the row's own generator (the drafter's uniforms in step 1, then
   verification's, drawn row by row before the batched call: the order a seeded request has
   alone, so it decodes the same in any batch); the packed outcomes of ALL rows are read in ONE
   host read. A call that raises is redone row by row: the culprit fails alone;
4. commit / roll back: per row, the accepted path's keys/values moved into place in both caches
   (O(path), nothing when the path is already contiguous, as in a chain) and the rest dropped by
   setting the row's length; adaptive ensemble weights updated from the confirmed tokens;
5. emit and stop: the accepted tokens and the target's, cut at EOS or the row's token limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from mmspec.drafter import DraftSteps, TreeDrafter, drive
from mmspec.forwards import DraftForwards, SoloRows, TargetRows, TargetState
from mmspec.options import EngineOptions
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.timing import BlockClock
from mmspec.tree import DraftTree, pad_rows, pad_trees
from mmspec.verify import (
    SamplingParams,
    TreeOutcome,
    logits_to_probs,
    uniforms,
    verify_trees_greedy,
    verify_trees_sampling,
)

__all__ = ["Engine", "Row", "TargetState", "cut_at_eos", "run_loop"]


@dataclass
class Row:
    """One request's decode between steps (what the loop keeps of it)."""

    drafter: TreeDrafter  # an EnsembleDrafter or a HeadDrafter, its cache its own (or its rows of a shared one)
    options: EngineOptions
    generator: torch.Generator | None
    stats: GenerationStats
    device: torch.device  # the target's
    past: int  # tokens in the target cache (this row)
    pending: torch.Tensor  # [n] committed, not yet in the draft cache; [-1] is the next root
    pos_offset: int = 0
    feats: torch.Tensor | None = None  # [n, F] for a head: the target's feature before each pending token
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    tree: DraftTree | None = None  # this step's tree, on the target's device
    drafted: bool = False  # this step's tree came from the drafter (else: the root alone)
    error: BaseException | None = None  # this step's failure (the row fails alone)
    clocks: list[BlockClock] = field(default_factory=list)  # per block: its step's phase marks

    @classmethod
    def start(cls, state: TargetState, drafter, options: EngineOptions, generator, stats) -> Row:
        return cls(drafter=drafter, options=options, generator=generator, stats=stats, device=state.device,
                   past=state.length, pending=torch.tensor([state.pending], device=state.device),
                   pos_offset=state.pos_offset, feats=state.first_feats)

    @property
    def remaining(self) -> int:
        return self.options.max_new_tokens - len(self.tokens)

    def draft_steps(self, depth: int | None = None) -> DraftSteps:
        """Step 1 as steps (each draft forward yielded): feed the pending tokens and draft a tree
        at most ``depth`` deep (None: the row's own shape; 0: the root alone, a plain step).
        -> the tree, on the target's device."""
        limit = self.remaining if depth is None else min(self.remaining, depth + 1)
        spec = self.options.tree.for_remaining(limit)
        if spec is None:
            tree = root_only(self.pending[-1:])
        else:
            tree = yield from self.drafter.draft_steps(self.pending, spec, self.options.sampling, self.generator,
                                                       feats=self.feats)
        self.drafted = spec is not None
        return on_device(tree, self.device)

    def commit(self, out: TreeOutcome, host: list[int], logits: torch.Tensor, hidden: torch.Tensor | None,
               target: TargetRows, b: int, clock: BlockClock) -> list[int]:
        """Steps 4-5 after the host read ``host`` (this row's packed outcome): compact / roll
        back, adapt, emit. logits [N, V] (and hidden [N, F] for a head) at this row's nodes.
        -> the tokens this step emits."""
        tree = self.tree
        ids = tree.tokens  # [N]
        acc = out.unpack(host)
        n = acc.n_accepted
        path_tokens, path_fed = acc.along
        if not acc.is_first_branch:  # a branch other than the first: move its keys/values into place
            target.move(b, self.past + out.path[1:n + 1], self.past + 1)
        self.past += n + 1
        target.set_length(b, self.past)
        in_draft = self.drafter.commit(path_fed[1:], tree.fed, out.path) if self.drafted else 0
        if self.drafted and self.drafter.adaptive is not None:  # each view scored on what the target confirmed
            confirmed = torch.cat([ids[out.path[1:n + 1]], out.next_token.view(1)])  # [n + 1]
            self.drafter.adapt(tree.fed, out.path[:n + 1], confirmed, logits, self.options.sampling)

        kept = cut_at_eos((path_tokens[1:] + [acc.next_token])[:self.remaining], self.options.eos_ids)
        self.tokens.extend(kept)
        self.stats.blocks.append(BlockRecord(n_drafted=tree.size - 1, n_accepted=min(n, len(kept)),
                                             n_emitted=len(kept), depth=tree.max_depth if tree.size > 1 else 0))
        self.clocks.append(clock)
        if kept[-1] in self.options.eos_ids or len(self.tokens) >= self.options.max_new_tokens:
            self.done = True
            return kept
        nxt = out.next_token.view(1)
        if self.drafted:  # the accepted nodes the draft never saw, then the target's token
            self.pending = torch.cat([ids[out.path[1 + in_draft:n + 1]], nxt])
            if hidden is not None:  # the feature before each pending token: root and accepted nodes, as verified
                self.feats = hidden[out.path[in_draft:n + 1]]
        else:  # nothing was fed to the draft: the root stays pending, the target's token joins it
            self.pending = torch.cat([self.pending, nxt])
            if hidden is not None:
                self.feats = torch.cat([self.feats, hidden[:1]])
        return kept

    def record_times(self) -> None:
        """Each block's draft and verify seconds into its record (on a GPU: one sync, here)."""
        blocks = self.stats.blocks[len(self.stats.blocks) - len(self.clocks):]
        for rec, clock in zip(blocks, self.clocks):
            rec.draft_s, rec.verify_s = clock.durations()[0]
        self.clocks = []


class Engine:
    """One step over every row (module docstring). ``target``: the target's rows
    (:class:`~mmspec.forwards.SoloRows` or :class:`~mmspec.forwards.RaggedRows`); ``drafts``: the
    merged draft forwards of a batch (None: each row drafts on its drafter's own ``step_fn``)."""

    def __init__(self, target: TargetRows, drafts: DraftForwards | None, device: torch.device,
                 draft_lengths: Callable[[], list[int]] | None = None):
        self.target = target
        self.drafts = drafts
        self.device = device
        self.draft_lengths = draft_lengths  # with ``drafts``: every shared draft row's length now

    def step(self, rows: list[Row], depth: int | None = None) -> list[list[int] | BaseException]:
        """One step over ``rows`` (row b on the target's row b), each drafting at most ``depth``
        deep (None: its own shape; 0: plain decoding) -> per row, the tokens it emitted, or the
        exception it failed with (it alone: the others go on). A failure of the shared target
        forward is every row's."""
        clock = BlockClock(self.device)
        clock.start()
        # 1. draft: every row's steps, their forwards merged (a batch) or on the row's own drafter
        for row in rows:
            row.error, row.tree = None, None
        if self.drafts is not None:
            trees, errors = self.drafts.run([(b, r.draft_steps(depth), r.drafter) for b, r in enumerate(rows)],
                                            self.draft_lengths)
        else:
            trees, errors = {}, {}
            for b, r in enumerate(rows):
                try:
                    trees[b] = drive(r.draft_steps(depth), r.drafter.step_fn)
                except Exception as e:  # noqa: BLE001 - this row fails alone
                    errors[b] = e
        for b, r in enumerate(rows):
            if b in errors:  # verified as a root alone (the forward's shape stays), its outcome dropped
                r.error, r.tree = errors[b], root_only(r.pending[-1:])
            else:
                r.tree = trees[b]
        clock.mark()

        # 2. verify forward: every row's tree in ONE target forward
        try:
            logits, hidden = self.target.score(rows)  # [B, N_max, V], [B, N_max, F] or None
        except Exception as e:  # noqa: BLE001 - the shared forward failed: every row in it
            return [e for _ in rows]

        # 3. accept: ONE batched verification of the greedy rows (and one per SamplingParams of the
        #    sampling rows), the packed outcomes of all rows read ONCE
        outs, per_row, at = {}, {}, 0
        verified = verify_rows(rows, logits)
        host = torch.cat([v.packed.flatten() for v in verified]).tolist() if verified else []  # the one host read
        for v in verified:
            w = v.packed.shape[1]
            for g, b in enumerate(v.rows):
                outs[b], per_row[b], at = v.outcome.row(g), host[at:at + w], at + w

        # 4-5. commit / roll back, emit: per row
        emitted: list[list[int] | BaseException] = []
        for b, r in enumerate(rows):
            if r.error is not None:
                emitted.append(r.error)
                continue
            n = r.tree.size
            try:
                emitted.append(r.commit(outs[b], per_row[b], logits[b, :n], None if hidden is None else hidden[b, :n],
                                        self.target, b, clock))
            except Exception as e:  # noqa: BLE001
                r.error = e
                emitted.append(e)
        clock.mark()
        return emitted


@dataclass
class Verified:
    """One batched verification of step 3: its rows (indices into the step's rows), the outcome
    (row g's: ``outcome.row(g)``) and its packed form, one row each, read with the step's one
    host read."""

    rows: list[int]
    outcome: TreeOutcome  # path [G, D + 1], n_accepted [G], next_token [G]
    packed: torch.Tensor  # [G, W] long: n_accepted, next token, path, tokens and draft slots along it


def verify_rows(rows: list[Row], logits: torch.Tensor) -> list[Verified]:
    """Step 3 on the device for every row without an error: the greedy rows in ONE batched
    verification, the sampling rows in one per SamplingParams (each row's uniforms drawn first,
    from its own generator, in row order: as it would alone). logits [B, N_max, V]. When a call
    raises, its rows are verified one by one, so the culprit fails alone (``row.error``)."""
    groups: dict[SamplingParams | None, list[int]] = {}
    us: dict[int, torch.Tensor] = {}
    for b, r in enumerate(rows):
        if r.error is not None:
            continue
        params = r.options.sampling
        if not params.greedy:
            try:
                us[b] = uniforms(r.tree.size + 1, r.generator, r.device)
            except Exception as e:  # noqa: BLE001 - this row fails alone
                r.error = e
                continue
        groups.setdefault(None if params.greedy else params, []).append(b)
    done = []
    for bs in groups.values():
        try:
            done.append(Verified(bs, *_verify_alike([rows[b] for b in bs], _rows_of(logits, bs),
                                                    [us.get(b) for b in bs])))
        except Exception:  # noqa: BLE001 - one by one: the culprit fails alone, the others go on
            for b in bs:
                try:
                    done.append(Verified([b], *_verify_alike([rows[b]], logits[b:b + 1], [us.get(b)])))
                except Exception as e:  # noqa: BLE001
                    rows[b].error = e
    return done


def _verify_alike(rows: list[Row], logits: torch.Tensor,
                  us: list[torch.Tensor | None]) -> tuple[TreeOutcome, torch.Tensor]:
    """ONE batched verification of rows verified alike (all greedy, or all sampling with one
    SamplingParams): logits [G, N, V] (row g's first ``tree.size`` nodes are its own), us: each
    row's uniforms [size + 1] (None when greedy). -> the outcome and its packed form [G, W]."""
    params = rows[0].options.sampling
    logits = logits[:, :max(r.tree.size for r in rows)]  # [G, N, V]
    if params.greedy:
        t = pad_trees([r.tree for r in rows])
        out = verify_trees_greedy(t.tokens, t.parents, t.depth, t.anc, t.valid, logits, t.max_depth,
                                  relaxed=_thresholds(rows, logits.device))
    else:
        p = logits_to_probs(logits, params)  # [G, N, V]
        t = pad_trees([r.tree for r in rows], q_dtype=p.dtype)
        out = verify_trees_sampling(t.tokens, t.parents, t.depth, t.anc, t.valid, p, t.q, t.sampled, pad_rows(us),
                                    t.max_depth)
    return out, out.packed(t.tokens, t.fed)


def _thresholds(rows: list[Row], dev: torch.device) -> torch.Tensor | None:
    """Each row's relaxed threshold (LOSSY) as [G] float32 on the device, inf where exact; None
    when every row is exact. Filled on the device: no host->device copy."""
    thr = [r.options.acceptance.threshold(r.past) for r in rows]
    if all(x is None for x in thr):
        return None
    out = torch.full((len(rows),), math.inf, dtype=torch.float32, device=dev)
    for g, x in enumerate(thr):
        if x is not None:
            out[g] = x
    return out


def _rows_of(x: torch.Tensor, bs: list[int]) -> torch.Tensor:
    """x's rows ``bs`` (ascending): a view when they are consecutive, else one copy (no index
    copied from the host)."""
    if bs[-1] - bs[0] == len(bs) - 1:
        return x[bs[0]:bs[-1] + 1]
    return torch.stack([x[b] for b in bs])


def run_loop(target: TargetState, drafter: TreeDrafter, options: EngineOptions,
             generator: torch.Generator | None, stats: GenerationStats,
             on_block: Callable[[list[int]], None] | None = None) -> list[int]:
    """One request stepped to its end (EOS or ``options.max_new_tokens``) by :meth:`Engine.step`
    on its own cache; returns the new tokens and appends one :class:`BlockRecord` per block to
    ``stats``. ``on_block``: called with each block's emitted tokens (host ints, already read: no
    extra sync), e.g. to stream. A failure is raised."""
    row = Row.start(target, drafter, options, generator, stats)
    engine = Engine(SoloRows(target, bool(drafter.needs_hidden)), None, target.device)
    try:
        while not row.done:
            (kept,) = engine.step([row])
            if isinstance(kept, BaseException):
                raise kept
            if on_block is not None:
                on_block(kept)
    finally:
        row.record_times()
    return row.tokens


def on_device(tree: DraftTree, dev: torch.device) -> DraftTree:
    """The tree with its tensors on the target's device (itself when they are there already)."""
    if tree.tokens.device == dev:
        return tree

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return replace(tree, tokens=move(tree.tokens), parents=move(tree.parents), depth=move(tree.depth),
                   anc=move(tree.anc), fed=move(tree.fed), q=move(tree.q), sampled=move(tree.sampled))


def root_only(root: torch.Tensor) -> DraftTree:
    """A tree of the root alone ([1] long): the block verifies nothing drafted (a plain step)."""
    dev = root.device
    return DraftTree(tokens=root, parents=torch.full((1,), -1, dtype=torch.long, device=dev),
                     depth=torch.zeros(1, dtype=torch.long, device=dev), anc=torch.ones(1, 1, dtype=torch.bool, device=dev),
                     fed=torch.full((1,), -1, dtype=torch.long, device=dev), max_depth=0, is_chain=True)


def cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
