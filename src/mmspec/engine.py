"""The speculative decoding loop. Owns the target KV cache's use, the randomness and the block
records; the drafter owns the draft cache.

Invariant between blocks: every committed token except the newest is in the target cache; the
newest committed token is *pending*: it is the root (node 0) of the next block's tree. A block:

1. the drafter feeds its pending tokens and drafts a tree (a chain is a tree with one branch);
2. the target scores every node in ONE forward: node i at position ``past + depth[i]``, under a
   4-D mask in which it sees the committed tokens and its own ancestors;
3. verification (greedy or sampling, :mod:`mmspec.verify`) picks the accepted path and the
   target's next token, on the device; the packed outcome is read once (the block's only host
   sync, besides the opt-in dynamic draft length);
4. the accepted path's keys/values are moved into place in both caches (O(path), nothing when
   the path is already contiguous, as in a chain) and the rest is dropped by moving the cursor;
5. the accepted tokens and the target's are emitted, cut at EOS or the token limit.

The decoder hands over typed objects (:class:`TargetState`, :class:`~mmspec.options.EngineOptions`)
and reads back the tokens and the block records; verification comes back as a
:class:`~mmspec.verify.TreeOutcome`, read on the host as an :class:`~mmspec.verify.AcceptedPath`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mmspec.drafter import TreeDrafter
from mmspec.models.cache import DecodeCache, set_cache_length
from mmspec.options import EngineOptions
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.timing import BlockClock
from mmspec.tree import DraftTree, tree_attention_mask
from mmspec.verify import TreeOutcome, logits_to_probs, uniforms, verify_tree_greedy, verify_tree_sampling

# target_step(ids [1, N], pos [1, N], mask) -> logits [1, N, V], or (logits, hidden [1, N, F])
StepFn = Callable[..., object]


@dataclass
class TargetState:
    """The target's side of a decode as the decoder prefilled it, handed to :func:`run_loop`
    (SGLang's eagle worker passes ``EagleVerifyInput``; this is its counterpart here)."""

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


def run_loop(target: TargetState, drafter: TreeDrafter, options: EngineOptions,
             generator: torch.Generator | None, stats: GenerationStats,
             on_block: Callable[[list[int]], None] | None = None) -> list[int]:
    """Draft, verify, accept, compact, until EOS or ``options.max_new_tokens``; returns the new
    tokens and appends one :class:`BlockRecord` per block to ``stats``. ``on_block``: called
    with each block's emitted tokens (host ints, already read: no extra sync), e.g. to stream.

    For a drafter that reads the target's hidden states (``drafter.needs_hidden``: heads),
    ``target.step`` returns (logits, hidden) and the features before the next block's pending
    tokens are read from the verify forward's hidden states.
    """
    dev = target.device
    clock = BlockClock(dev)
    params = options.sampling
    tokens: list[int] = []  # new tokens emitted so far
    past = target.length  # tokens in the target cache
    pending = torch.tensor([target.pending], device=dev)  # committed, not yet in the draft cache; [-1] is the root
    feats = target.first_feats  # [n_pending, F]: the target's feature before each pending token (heads only)
    records: list[BlockRecord] = []
    while len(tokens) < options.max_new_tokens:
        remaining = options.max_new_tokens - len(tokens)
        block_spec = options.tree.for_remaining(remaining)
        clock.start()
        # 1. draft: feed the pending tokens, draft the block's tree (one token left: the root alone)
        if block_spec is None:
            tree = _root_only(pending[-1:])
        else:
            tree = drafter.draft(pending, block_spec, params, generator, feats=feats)
        clock.mark()

        # 2. verify: the target scores every node in ONE forward; the outcome stays on the device
        on_target = _on(tree, dev)
        ids = on_target.tokens[None]  # [1, N]
        logits, hidden = _score(target, on_target, ids, past, bool(drafter.needs_hidden))  # [N, V], [N, F] or None
        out = _verify(on_target, ids[0], logits, options, past, generator)

        # 3. accept: the packed outcome, read once (the block's one host sync)
        acc = out.unpack(out.packed(ids[0], on_target.fed).tolist())
        n = acc.n_accepted
        path_tokens, path_fed = acc.along

        # 4. compact / roll back: the accepted path's keys/values into place, the rest dropped
        if not acc.is_first_branch:  # a branch other than the first: move its keys/values into place
            target.cache.move(past + out.path[1:n + 1], past + 1)
        set_cache_length(target.cache, past + n + 1)
        past += n + 1
        in_draft = drafter.commit(path_fed[1:], tree.fed, out.path) if block_spec is not None else 0
        clock.mark()

        # 5. emit and stop: the accepted tokens and the target's, cut at EOS and the limit
        kept = _cut_at_eos((path_tokens[1:] + [acc.next_token])[:remaining], options.eos_ids)
        tokens.extend(kept)
        if on_block is not None:
            on_block(kept)
        records.append(BlockRecord(n_drafted=tree.size - 1, n_accepted=min(n, len(kept)), n_emitted=len(kept),
                                   depth=tree.max_depth if tree.size > 1 else 0))
        if kept[-1] in options.eos_ids:
            break
        # the next block's pending tokens: the accepted nodes the draft never saw, then the target's token
        pending = torch.cat([ids[0][out.path[1 + in_draft:n + 1]], out.next_token.view(1)])
        if hidden is not None:  # the feature before each pending token: root and accepted nodes, as verified
            feats = hidden[out.path[in_draft:n + 1]]
    for rec, (draft_s, verify_s) in zip(records, clock.durations()):
        rec.draft_s, rec.verify_s = draft_s, verify_s
    stats.blocks.extend(records)
    return tokens


def _score(target: TargetState, tree: DraftTree, ids: torch.Tensor, past: int, hidden_wanted: bool):
    """The target's forward over the tree's N nodes at ``past``: node i at position ``past +
    depth[i]`` (+ the offset), seeing the committed tokens and its own ancestors.
    -> logits [N, V] and, for a head, the hidden states [N, F] (else None)."""
    dev = target.device
    n_nodes = tree.size
    anc = tree.anc
    position_ids = (past + target.pos_offset + tree.depth)[None]  # [1, N]
    if target.static:
        mask = tree_attention_mask(anc, past, target.cache.max_len)  # [1, 1, N, capacity]
    elif tree.is_chain:
        mask = torch.ones(1, past + n_nodes, dtype=torch.long, device=dev)  # causal: SDPA's fast path
    else:
        mask = tree_attention_mask(anc, past, past + n_nodes)  # [1, 1, N, past + N]
    out = target.step(ids=ids, pos=position_ids, mask=mask)
    return (out[0][0], out[1][0]) if hidden_wanted else (out[0], None)


def _verify(tree: DraftTree, ids: torch.Tensor, logits: torch.Tensor, options: EngineOptions, past: int,
            generator: torch.Generator | None) -> TreeOutcome:
    """Greedy or sampling verification of the tree (ids [N], logits [N, V]) on the device."""
    dev = logits.device
    parents, depth, anc = tree.parents, tree.depth, tree.anc
    params = options.sampling
    if params.greedy:
        return verify_tree_greedy(ids, parents, depth, anc, logits, tree.max_depth,
                                  relaxed=options.acceptance.threshold(past))
    p = logits_to_probs(logits, params)  # [N, V]
    q = None if tree.q is None else tree.q.to(dev, p.dtype)
    sampled = None if tree.sampled is None else tree.sampled.to(dev)
    return verify_tree_sampling(ids, parents, depth, anc, p, q, sampled,
                                uniforms(tree.size + 1, generator, dev), tree.max_depth)


def _on(tree: DraftTree, dev: torch.device) -> DraftTree:
    """The tree with its tensors on the target's device (itself when they are there already)."""
    if tree.tokens.device == dev:
        return tree

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return replace(tree, tokens=move(tree.tokens), parents=move(tree.parents), depth=move(tree.depth),
                   anc=move(tree.anc), fed=move(tree.fed), q=move(tree.q), sampled=move(tree.sampled))


def _root_only(root: torch.Tensor) -> DraftTree:
    dev = root.device
    return DraftTree(tokens=root, parents=torch.full((1,), -1, dtype=torch.long, device=dev),
                     depth=torch.zeros(1, dtype=torch.long, device=dev), anc=torch.ones(1, 1, dtype=torch.bool, device=dev),
                     fed=torch.full((1,), -1, dtype=torch.long, device=dev), max_depth=0, is_chain=True)


def _cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
