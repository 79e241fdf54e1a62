"""The forwards of one engine step (:mod:`mmspec.engine`), for one request or many.

The target's side, :class:`TargetRows`: the engine asks for ONE forward over every row's tree
(``score``) and then moves each row's accepted path into place and sets its length (``move``,
``set_length``; tensor operations on that row, no copy of the others).

- :class:`SoloRows`: one request on a cache of its own (:class:`TargetState`): ``generate`` and
  ``stream``, with the decoder's static caches and CUDA-graph replays when it has them.
- :class:`RaggedRows`: many requests on one :class:`~mmspec.models.ragged.RaggedCache`
  (``generate_batch``, :class:`~mmspec.batch.BatchScheduler`, ``mmspec serve``). Every tree is
  padded to the largest; node i of row b sits at position ``lengths[b] + pos_offset_b +
  depth_b[i]`` and sees row b's committed slots and its own ancestors; a padding node sees only
  itself (its output is never read).

The draft's side, :class:`DraftForwards`: every request's drafter runs as steps (a generator
that yields each forward it needs: :data:`mmspec.drafter.DraftSteps`); the steps of all
requests advance in lockstep and each round's forwards run as ONE forward of the draft model
(or head) over a shared RaggedCache, each request's rows (one per view of its ensemble, or its
head's) at their own lengths. No threads: drafting stays each request's own code and draws,
only where its forwards run changes. Rows whose drafter is not drafting in a round take part as
padding (they see only themselves and write past their slots).

Static shapes (a decoder with static caches or CUDA graphs): both sides run their step forwards
through :class:`StaticRagged`, the batch's counterpart of ``generate``'s static caches: rows
padded to a bucket (1, 2, 4, 8, ...; free rows of the static cache take the padding places),
new tokens padded to a bucket, the mask spanning the whole capacity, and one
:class:`~mmspec.graphs.StepRunner` capturing a graph per ``(row bucket, token bucket)`` (and per
input set: a head's features), the way vLLM and SGLang capture batch sizes. Prefills stay eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec.graphs import StepRunner, bucket
from mmspec.models.cache import DecodeCache, set_cache_length
from mmspec.models.ragged import RaggedCache
from mmspec.tree import pad_trees, tree_attention_mask

# target_step(ids [1, N], pos [1, N], mask) -> logits [1, N, V], or (logits, hidden [1, N, F])
StepFn = Callable[..., object]


@dataclass
class TargetState:
    """The target's side of one decode as the decoder prefilled it (SGLang's eagle worker passes
    ``EagleVerifyInput``; this is its counterpart here)."""

    cache: object  # a DecodeCache (or a DynamicCache: chains only) holding the prompt less its last token
    step: StepFn  # the block forward on that cache: eager, or a CUDA-graph replay
    length: int  # positions in the cache
    pending: int  # the prompt's last token: committed, not yet in any cache (the first block's root)
    device: torch.device
    pos_offset: int = 0  # a token's position minus its cache slot after the prompt (multimodal-RoPE delta; else 0)
    first_feats: torch.Tensor | None = None  # [1, F] for a head: the target's feature before ``pending``

    @property
    def static(self) -> bool:
        """Fixed shapes: masks span the whole preallocated buffer."""
        return isinstance(self.cache, DecodeCache) and self.cache.static


class TargetRows:
    """The target's cache as the engine's rows see it (module docstring)."""

    def score(self, rows: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE forward over every row's tree (``row.tree``, ``row.past``, ``row.pos_offset``)
        -> logits [B, N_max, V] and, for a head, hidden [B, N_max, F] (else None)."""
        raise NotImplementedError

    def move(self, b: int, src: torch.Tensor, dst: int) -> None:
        """Row b's positions ``src`` [m] (device long) to ``dst .. dst + m - 1``."""
        raise NotImplementedError

    def set_length(self, b: int, length: int) -> None:
        """Row b keeps its first ``length`` positions (O(1))."""
        raise NotImplementedError


class SoloRows(TargetRows):
    """One request on its own cache: the decoder's (static, or CUDA-graph replays)."""

    def __init__(self, state: TargetState, hidden_wanted: bool):
        self.state = state
        self.hidden_wanted = hidden_wanted

    def score(self, rows):
        (row,) = rows
        st, tree, past = self.state, row.tree, row.past
        position_ids = (past + st.pos_offset + tree.depth)[None]  # [1, N]
        if st.static:
            mask = tree_attention_mask(tree.anc, past, st.cache.max_len)  # [1, 1, N, capacity]
        elif tree.is_chain:
            mask = torch.ones(1, past + tree.size, dtype=torch.long, device=st.device)  # causal: SDPA's fast path
        else:
            mask = tree_attention_mask(tree.anc, past, past + tree.size)  # [1, 1, N, past + N]
        out = st.step(ids=tree.tokens[None], pos=position_ids, mask=mask)
        return (out[0], out[1]) if self.hidden_wanted else (out, None)

    def move(self, b, src, dst):
        self.state.cache.move(src, dst)

    def set_length(self, b, length):
        set_cache_length(self.state.cache, length)


class RaggedRows(TargetRows):
    """Many requests, row b of ``cache`` the b-th row the engine steps."""

    def __init__(self, adapter, cache: RaggedCache, hidden_layers: tuple[int, ...], graphs: str | None = None):
        self.adapter = adapter
        self.cache = cache
        self.hidden_layers = hidden_layers
        # a static cache: fixed-shape forwards, eager ("static"), emulated or captured as CUDA graphs
        self.static = None if not cache.static else StaticRagged(
            cache, lambda ids, pos, mask: adapter.forward(cache=cache, attention_mask=mask, position_ids=pos,
                                                          input_ids=ids, hidden=hidden_layers),
            graphs or "eager", "target")

    def score(self, rows):
        dev = rows[0].device
        B = len(rows)
        t = pad_trees([r.tree for r in rows])  # [B, n]: each row's tree, padding nodes depth -1, no ancestors
        n_max = t.size
        lengths = self.cache.lengths  # row b's committed slots (the cache's rows are the step's rows)
        if self.static is not None:  # padded to the buckets, the mask over the whole capacity
            R, N = bucket(B), bucket(n_max)
            span = self.static.prepare(R, max(lengths) + N)
        else:
            R, N, span = B, n_max, max(lengths) + n_max
        past, base = torch.tensor([lengths, [p + r.pos_offset for p, r in zip(lengths, rows)]],
                                  device=dev)  # [B] each: one host-to-device copy
        node = torch.zeros(B, N, dtype=torch.bool, device=dev)  # a real node (not padding)
        node[:, :n_max] = True if t.valid is None else t.valid
        ids = torch.zeros(R, N, dtype=torch.long, device=dev)
        ids[:B, :n_max] = t.tokens
        pos = torch.zeros(R, N, dtype=torch.long, device=dev)  # node i at past + offset + depth (padding: depth 0)
        pos[:B, :n_max] = t.depth.clamp_min(0)
        pos[:B] += base[:, None]
        eye = torch.eye(N, dtype=torch.bool, device=dev)
        tree = torch.zeros(B, N, N, dtype=torch.bool, device=dev)  # [B, N, N]: its ancestors; padding: itself only
        tree[:, :n_max, :n_max] = t.anc
        tree |= eye & ~node[:, :, None]
        mask = torch.zeros(R, 1, N, span, dtype=torch.bool, device=dev)
        mask[:B, 0] = (torch.arange(span, device=dev) < past[:, None, None]) & node[:, :, None]  # committed slots
        slots = (past[:, None, None] + torch.arange(N, device=dev)).expand(B, N, N)  # node j's slot
        mask[:B, 0].scatter_(-1, slots, tree)
        mask[B:, 0, :, :N] = eye  # padding rows (free rows of a static cache) write at slot 0, see themselves only
        if self.static is not None:
            out = self.static(ids=ids, pos=pos, mask=mask)
        else:
            self.cache.begin_forward()
            out = self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=pos, input_ids=ids,
                                       hidden=self.hidden_layers)
        if self.hidden_layers:
            return out[0][:B, :n_max], out[1][:B, :n_max]
        return out[:B, :n_max], None

    def move(self, b, src, dst):
        self.cache.move_row(b, src, dst)

    def set_length(self, b, length):
        self.cache.set_row_length(b, length)


class StaticRagged:
    """Fixed-shape step forwards over a static :class:`~mmspec.models.ragged.RaggedCache`
    (module docstring): ``prepare(rows, span)`` makes room for a forward over a bucket of
    ``rows`` rows writing up to slot ``span - 1`` (growing the buffer drops the graphs captured
    on the old one) and returns the mask's width (the capacity); ``self(**inputs)`` runs
    ``fn(**inputs)`` over those rows, eagerly or as the replay of the graph of its shapes. The
    outputs of a replay are overwritten by the next call: read them first."""

    def __init__(self, cache: RaggedCache, fn, mode: str, name: str):
        self.cache = cache
        self.runner = StepRunner(fn, None, mode=mode, name=f"batched {name}")
        self.generation = cache.generation

    def prepare(self, rows: int, span: int) -> int:
        self.cache.ensure(rows, span)
        if self.cache.generation != self.generation:  # a new buffer: the old graphs point at freed memory
            self.runner.reset()
            self.generation = self.cache.generation
        return self.cache.capacity

    def __call__(self, **inputs: torch.Tensor):
        rows = inputs["pos"].shape[0]  # every input is [rows, n, ...]
        self.cache.begin_forward(rows=rows)  # the write slots into their fixed buffer (outside any graph)
        return self.runner(**inputs)

    @property
    def shapes(self) -> set:
        """The input shapes captured so far (one graph each)."""
        return set(self.runner.graphs)


class DraftForwards:
    """Many drafters' steps in lockstep, each round's forwards merged into ONE forward of the
    draft model (or head) over a shared RaggedCache (module docstring). A drafter's cache is a
    :class:`~mmspec.models.ragged.RowGroup` of that cache (``cache.rows()``: its rows now)."""

    def __init__(self, forward, cache: RaggedCache, graphs: str | None = None):
        self.forward = forward  # (cache, inputs {name: [R, n, ...]}, pos [R, n], mask) -> [R, n, ...]
        self.cache = cache
        self.static = None if not cache.static else StaticRagged(
            cache, lambda pos, mask, **x: forward(cache, x, pos, mask), graphs or "eager", "draft")

    @classmethod
    def for_tokens(cls, adapter, cache: RaggedCache, graphs: str | None = None) -> DraftForwards:
        """Token-level drafters: their steps yield ``ids=, pos=, mask=``, the draft model's forward."""
        return cls(lambda c, x, pos, mask: adapter.forward(cache=c, attention_mask=mask, position_ids=pos,
                                                           input_ids=x["ids"]), cache, graphs)

    @classmethod
    def for_head(cls, head, cache: RaggedCache, graphs: str | None = None) -> DraftForwards:
        """Feature-level heads: their steps yield ``feats=, embeds=, pos=, mask=``, the head's forward."""
        return cls(lambda c, x, pos, mask: head(x["feats"], x["embeds"], cache=c, position_ids=pos,
                                                attention_mask=mask), cache, graphs)

    def run(self, jobs: list[tuple[int, object, object]], lengths: Callable[[], list[int]]
            ) -> tuple[dict[int, object], dict[int, BaseException]]:
        """Run ``jobs`` [(key, steps, drafter)] to their ends, merging their forwards; ``lengths()``
        gives every active row's current draft length (padding rows write there).
        -> (what each job's steps returned, errors) by key; a job's failure ends it alone."""
        results: dict[int, object] = {}
        errors: dict[int, BaseException] = {}
        waiting: dict[int, tuple] = {}  # key -> (rows, write slot, inputs, pos, mask)
        gens = {key: (steps, drafter) for key, steps, drafter in jobs}

        def advance(key: int, value) -> None:
            steps, drafter = gens[key]
            try:
                call = next(steps) if value is None else steps.send(value)
            except StopIteration as done:
                results[key] = done.value
                return
            except Exception as e:  # noqa: BLE001 - reported for this request alone
                errors[key] = e
                return
            pos, mask = call.pop("pos"), call.pop("mask")
            waiting[key] = (drafter.cache.rows(), drafter.length - pos.shape[-1], call, pos, mask)

        for key in gens:
            advance(key, None)
        while waiting:
            batch = dict(sorted(waiting.items()))
            waiting.clear()
            try:
                outs = self._forward(batch, lengths())
            except Exception as e:  # noqa: BLE001 - the merged forward failed: every job in it
                for key in batch:
                    errors[key] = e
                    gens[key][0].close()
                continue
            for key, out in outs.items():
                advance(key, out)
        return results, errors

    def _forward(self, batch: dict, lengths: list[int]) -> dict:
        """The merged forward: every active row, the waiting ones with their inputs, the others as
        padding. -> each waiting job's outputs [B_r, n_r, ...]."""
        first = next(iter(batch.values()))
        dev = first[3].device
        n_max = max(v[3].shape[-1] for v in batch.values())
        active = len(lengths)
        write = list(lengths)
        for rows, w, *_ in batch.values():
            for r in rows:
                write[r] = w
        self.cache.set_lengths(write)
        if self.static is not None:  # padded to the buckets (free rows write at slot 0), the mask over the capacity
            R, N = bucket(active), bucket(n_max)
            span = self.static.prepare(R, max(write) + N)
            write += [0] * (R - active)
        else:
            R, N, span = active, n_max, max(write) + n_max
        inputs = {name: torch.zeros(R, N, *t.shape[2:], dtype=t.dtype, device=dev) for name, t in first[2].items()}
        pos = torch.zeros(R, N, dtype=torch.long, device=dev)
        mask = torch.zeros(R, 1, N, span, dtype=torch.bool, device=dev)
        eye = torch.eye(N, dtype=torch.bool, device=dev)
        for r in range(R):  # padding: every query sees itself only
            mask[r, 0, :, write[r]:write[r] + N] = eye
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
        if self.static is not None:
            out = self.static(pos=pos, mask=mask, **inputs)
        else:
            self.cache.begin_forward()
            out = self.forward(self.cache, inputs, pos, mask)
        # each job's rows gathered out (a copy: a replay's outputs are overwritten by the next round)
        return {k: out[torch.tensor(v[0], device=dev), :v[3].shape[-1]] for k, v in batch.items()}
