"""The speculative decoding loop of :mod:`mmspec.engine`, one block at a time, for many requests
whose target verify forwards are shared.

:class:`RequestRun` is one request's side of :func:`mmspec.engine.run_loop` cut at the block
boundary: it drafts its block on its own drafter (:meth:`RequestRun.draft_block`), and after the
batch's shared verify forward decides what it accepts (:meth:`RequestRun.finish_block`). Every
random draw comes from the request's own generator, in the solo loop's order (the drafter's
uniforms, then the verification's), so a seeded request decodes exactly as it would alone.

:func:`score_batch` is the shared forward: every active request's tree nodes, padded to the
largest tree, in ONE target forward on a :class:`~mmspec.models.ragged.RaggedCache`. Node i of
row b sits at position ``lengths[b] + pos_offset_b + depth_b[i]`` and sees row b's committed
slots and its own ancestors; a padding node sees only itself (its output is never read).

A block that does not speculate (:class:`mmspec.batch.SpeculationPolicy`) verifies the root
alone: a plain target decoding step (greedy argmax, or a draw from p with the request's
generator), lossless by construction; the pending tokens then wait for the next drafted block.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from mmspec.engine import TargetState, _cut_at_eos, _on, _root_only, _verify
from mmspec.models.ragged import RaggedCache
from mmspec.options import EngineOptions
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.tree import DraftTree


@dataclass
class RequestRun:
    """One request's decode state between blocks (the locals of ``run_loop``)."""

    drafter: object  # a TreeDrafter (EnsembleDrafter or HeadDrafter), its cache its own
    options: EngineOptions
    generator: torch.Generator | None
    stats: GenerationStats
    device: torch.device
    past: int  # tokens in the target cache (this request's row)
    pending: torch.Tensor  # [n] committed, not yet in the draft cache; [-1] is the next root
    pos_offset: int = 0
    feats: torch.Tensor | None = None  # [n, F] for a head: the target's feature before each pending token
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    tree: DraftTree | None = None  # this block's tree, on the target's device
    drafted: bool = False  # this block's tree came from the drafter (else: the root alone)
    draft_s: float = 0.0

    @classmethod
    def start(cls, state: TargetState, drafter, options: EngineOptions, generator, stats) -> RequestRun:
        return cls(drafter=drafter, options=options, generator=generator, stats=stats, device=state.device,
                   past=state.length, pending=torch.tensor([state.pending], device=state.device),
                   pos_offset=state.pos_offset, feats=state.first_feats)

    @property
    def remaining(self) -> int:
        return self.options.max_new_tokens - len(self.tokens)

    def draft_block(self, speculate: bool) -> DraftTree:
        """Step 1 of a block: feed the pending tokens and draft (or the root alone)."""
        t0 = time.perf_counter()
        spec = self.options.tree.for_remaining(self.remaining) if speculate else None
        if spec is None:
            tree = _root_only(self.pending[-1:])
        else:
            tree = self.drafter.draft(self.pending, spec, self.options.sampling, self.generator, feats=self.feats)
        self.drafted = spec is not None
        self.tree = _on(tree, self.device)
        self.draft_s = time.perf_counter() - t0
        return self.tree

    def finish_block(self, logits: torch.Tensor, hidden: torch.Tensor | None, cache: RaggedCache, row: int,
                     verify_s: float) -> list[int]:
        """Steps 2-5 after the shared forward: logits [N, V] (and hidden [N, F] for a head) at this
        request's N nodes -> the tokens this block emits. Moves the accepted path in ``row``."""
        tree = self.tree
        ids = tree.tokens  # [N]
        out = _verify(tree, ids, logits, self.options, self.past, self.generator)
        acc = out.unpack(out.packed(ids, tree.fed).tolist())  # the block's one host read
        n = acc.n_accepted
        path_tokens, path_fed = acc.along
        if not acc.is_first_branch:
            cache.move_row(row, self.past + out.path[1:n + 1], self.past + 1)
        self.past += n + 1
        cache.set_row_length(row, self.past)
        in_draft = self.drafter.commit(path_fed[1:], tree.fed, out.path) if self.drafted else 0

        remaining = self.remaining
        kept = _cut_at_eos((path_tokens[1:] + [acc.next_token])[:remaining], self.options.eos_ids)
        self.tokens.extend(kept)
        self.stats.blocks.append(BlockRecord(n_drafted=tree.size - 1, n_accepted=min(n, len(kept)),
                                             n_emitted=len(kept), depth=tree.max_depth if tree.size > 1 else 0,
                                             draft_s=self.draft_s, verify_s=verify_s))
        if kept[-1] in self.options.eos_ids or len(self.tokens) >= self.options.max_new_tokens:
            self.done = True
            return kept
        nxt = out.next_token.view(1)
        if self.drafted:  # as run_loop: the accepted nodes the draft never saw, then the target's token
            self.pending = torch.cat([ids[out.path[1 + in_draft:n + 1]], nxt])
            if hidden is not None:
                self.feats = hidden[out.path[in_draft:n + 1]]
        else:  # nothing was fed to the draft: the root stays pending, the target's token joins it
            self.pending = torch.cat([self.pending, nxt])
            if hidden is not None:
                self.feats = torch.cat([self.feats, hidden[:1]])
        return kept


def score_batch(adapter, cache: RaggedCache, runs: list[RequestRun], hidden_layers: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ONE target forward over every run's tree (run b on row b of ``cache``).

    -> logits [B, N_max, V] and, when ``hidden_layers`` is set (heads), hidden [B, N_max, F]."""
    dev = runs[0].device
    B = len(runs)
    sizes = [r.tree.size for r in runs]
    n_max = max(sizes)
    lengths = cache.lengths
    span = max(lengths) + n_max
    ids = torch.zeros(B, n_max, dtype=torch.long, device=dev)
    pos = torch.zeros(B, n_max, dtype=torch.long, device=dev)
    mask = torch.zeros(B, 1, n_max, span, dtype=torch.bool, device=dev)
    eye = torch.eye(n_max, dtype=torch.bool, device=dev)
    for b, r in enumerate(runs):
        t, n, past = r.tree, sizes[b], lengths[b]
        ids[b, :n] = t.tokens
        pos[b, :n] = past + r.pos_offset + t.depth
        pos[b, n:] = past + r.pos_offset
        mask[b, 0, :n, :past] = True
        mask[b, 0, :n, past:past + n] = t.anc
        mask[b, 0, n:, past:past + n_max] = eye[n:]  # padding nodes see themselves only
    cache.begin_forward()
    out = adapter.forward(cache=cache, attention_mask=mask, position_ids=pos, input_ids=ids, hidden=hidden_layers)
    return (out[0], out[1]) if hidden_layers else (out, None)


class DraftLockstep:
    """Every request's drafting of a block in its own thread, their draft forwards merged into
    ONE forward of the draft model over a shared :class:`RaggedCache` (token-level drafters).

    A drafter's ``step_fn`` (its forward hook, :class:`~mmspec.drafter.TreeDrafter`) submits its
    rows' tokens, positions and mask and waits; when every request still drafting has submitted,
    the main thread runs the merged forward (rows of requests that are done or not drafting
    this round take part as padding: they see only themselves and write past their slots) and
    hands each its logits. Drafting stays each request's own code and draws: only where its
    forward runs changes. A request's failure ends its thread alone."""

    def __init__(self, forward, cache: RaggedCache):
        self.forward = forward  # (cache, inputs {name: [R, n, ...]}, pos [R, n], mask) -> [R, n, ...]
        self.cache = cache
        self.cond = threading.Condition()
        self.submitted: dict[int, tuple] = {}
        self.results: dict[int, torch.Tensor] = {}
        self.live: set[int] = set()

    @classmethod
    def for_tokens(cls, adapter, cache: RaggedCache) -> DraftLockstep:
        """Token-level drafters: ``step_fn(ids=, pos=, mask=)``, the draft model's forward."""
        return cls(lambda c, x, pos, mask: adapter.forward(cache=c, attention_mask=mask, position_ids=pos,
                                                           input_ids=x["ids"]), cache)

    @classmethod
    def for_head(cls, head, cache: RaggedCache) -> DraftLockstep:
        """Feature-level heads: ``step_fn(feats=, embeds=, pos=, mask=)``, the head's forward."""
        return cls(lambda c, x, pos, mask: head(x["feats"], x["embeds"], cache=c, position_ids=pos,
                                                attention_mask=mask), cache)

    def step_fn(self, key: int, rows, drafter):
        """The drafter's forward, as it calls it: (its inputs [B_r, n, ...], pos [B_r, n], mask) -> outputs."""
        def fn(pos: torch.Tensor, mask: torch.Tensor, **inputs) -> torch.Tensor:
            with self.cond:
                write = drafter.length - pos.shape[-1]  # the drafter claimed the slots already
                self.submitted[key] = (rows(), write, inputs, pos, mask)
                self.cond.notify_all()
                self.cond.wait_for(lambda: key in self.results)
                out = self.results.pop(key)
            if isinstance(out, BaseException):
                raise _Failed(out)
            return out
        return fn

    def run(self, jobs: list[tuple[int, object]], lengths) -> dict[int, BaseException]:
        """Run ``jobs`` [(key, fn)] to completion, merging their forwards; ``lengths()`` gives
        every active row's current draft length (padding rows write there). -> errors by key."""
        errors: dict[int, BaseException] = {}
        self.live = {k for k, _ in jobs}

        def work(key, fn):
            with torch.inference_mode():
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported for this request alone
                    errors[key] = e
                finally:
                    with self.cond:
                        self.live.discard(key)
                        self.cond.notify_all()

        threads = [threading.Thread(target=work, args=job, daemon=True) for job in jobs]
        for t in threads:
            t.start()
        with self.cond:
            while True:
                self.cond.wait_for(lambda: self.live <= set(self.submitted))
                if not self.live:
                    break
                batch = {k: self.submitted.pop(k) for k in sorted(self.live)}
                try:
                    outs = self._forward(batch, lengths())
                except BaseException as e:  # noqa: BLE001 - the merged forward failed: all of them
                    outs = {k: e for k in batch}
                for k, out in outs.items():
                    self.results[k] = out
                self.cond.notify_all()
        for t in threads:
            t.join()
        for k, e in list(errors.items()):
            if isinstance(e, _Failed):
                errors[k] = e.cause
        return errors

    def _forward(self, batch: dict, lengths: list[int]) -> dict:
        """The merged forward: every active row, the submitted ones with their inputs, the
        others as padding. -> each submission's outputs [B_r, n_r, ...]."""
        first = next(iter(batch.values()))
        dev = first[3].device
        n_max = max(v[3].shape[-1] for v in batch.values())
        R = len(lengths)
        write = list(lengths)
        for rows, w, *_ in batch.values():
            for r in rows:
                write[r] = w
        span = max(write) + n_max
        inputs = {name: torch.zeros(R, n_max, *t.shape[2:], dtype=t.dtype, device=dev) for name, t in first[2].items()}
        pos = torch.zeros(R, n_max, dtype=torch.long, device=dev)
        mask = torch.zeros(R, 1, n_max, span, dtype=torch.bool, device=dev)
        eye = torch.eye(n_max, dtype=torch.bool, device=dev)
        for r in range(R):  # padding: every query sees itself only
            mask[r, 0, :, write[r]:write[r] + n_max] = eye
        for rows, w, x, p, m in batch.values():
            n = p.shape[-1]
            idx = torch.tensor(rows, device=dev)
            for name, t in x.items():
                inputs[name][idx, :n] = t
            pos[idx, :n] = p
            pos[idx, n:] = p[:, -1:]
            if m.dim() == 2:  # all ones: causal over every filled slot
                m = torch.ones(n, w + n, dtype=torch.bool, device=dev).tril(w)[None, None].expand(len(rows), 1, n, w + n)
            mask[idx, :, :n, :] = False
            mask[idx, :, :n, :m.shape[-1]] = m
        self.cache.set_lengths(write)
        self.cache.begin_forward()
        out = self.forward(self.cache, inputs, pos, mask)
        return {k: out[torch.tensor(v[0], device=dev), :v[3].shape[-1]] for k, v in batch.items()}


class _Failed(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause
