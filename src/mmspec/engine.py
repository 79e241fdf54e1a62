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
   the path is already contiguous, as in a chain) and the rest is dropped by moving the cursor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mmspec.drafter import EnsembleDrafter
from mmspec.models.base import ModelAdapter
from mmspec.models.cache import set_cache_length
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.timing import BlockClock
from mmspec.tree import DraftTree, TreeSpec, tree_attention_mask
from mmspec.verify import SamplingParams, logits_to_probs, uniforms, verify_tree_greedy, verify_tree_sampling

# target_step(ids [1, N], position_ids [1, N], mask) -> logits [1, N, V]
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_loop(
    *,
    target: ModelAdapter,
    target_cache,
    target_step: StepFn,
    target_len: int,
    drafter: EnsembleDrafter,
    spec: TreeSpec,
    first_pending: int,
    max_new_tokens: int,
    eos_ids: frozenset[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: GenerationStats,
    static: bool = False,
    first_feats: torch.Tensor | None = None,
    relaxed: "RelaxedAcceptance | None" = None,
    pos_offset: int = 0,
) -> list[int]:
    """Draft, verify, accept, compact, until EOS or max_new_tokens. Returns the new tokens.

    For a drafter that reads the target's hidden states (``drafter.needs_hidden``: heads),
    ``target_step`` returns (logits, hidden) and ``first_feats`` [1, F] is the target's feature
    before the first pending token (the last prefill position); after each block the features
    before the new pending tokens are read from the verify forward's hidden states.

    ``pos_offset``: the target's position of a token minus its cache slot after the prompt
    (0 for 1-D RoPE; the multimodal-RoPE delta of Qwen2-VL-like families).
    """
    dev = target.device
    clock = BlockClock(dev)
    tokens: list[int] = []  # new tokens emitted so far
    past = target_len  # tokens in the target cache
    pending = torch.tensor([first_pending], device=dev)  # committed, not yet in the draft cache; [-1] is the root
    feats = first_feats  # [n_pending, F]: the target's feature before each pending token (heads only)
    hidden_wanted = bool(drafter.needs_hidden)
    records: list[BlockRecord] = []
    while len(tokens) < max_new_tokens:
        remaining = max_new_tokens - len(tokens)
        block_spec = spec.for_remaining(remaining)
        clock.start()
        if block_spec is None:  # one token left: no draft, the target's next token
            tree = _root_only(pending[-1:])
        else:
            tree = drafter.draft(pending, block_spec, params, generator, feats=feats)
        clock.mark()

        n_nodes = tree.size
        ids = tree.tokens.to(dev)[None]  # [1, N]
        depth = tree.depth.to(dev)
        anc = tree.anc.to(dev)
        position_ids = (past + pos_offset + depth)[None]  # [1, N]
        if static:
            mask = tree_attention_mask(anc, past, target_cache.max_len)  # [1, 1, N, capacity]
        elif tree.is_chain:
            mask = torch.ones(1, past + n_nodes, dtype=torch.long, device=dev)  # causal: SDPA's fast path
        else:
            mask = tree_attention_mask(anc, past, past + n_nodes)  # [1, 1, N, past + N]
        out_t = target_step(ids=ids, pos=position_ids, mask=mask)
        logits, hidden = (out_t[0][0], out_t[1][0]) if hidden_wanted else (out_t[0], None)  # [N, V], [N, F]
        parents = tree.parents.to(dev)
        if params.greedy:
            thr = relaxed.threshold(past) if relaxed is not None else None
            out = verify_tree_greedy(ids[0], parents, depth, anc, logits, tree.max_depth, relaxed=thr)
        else:
            p = logits_to_probs(logits, params)  # [N, V]
            q = None if tree.q is None else tree.q.to(dev, p.dtype)
            sampled = None if tree.sampled is None else tree.sampled.to(dev)
            out = verify_tree_sampling(ids[0], parents, depth, anc, p, q, sampled,
                                       uniforms(n_nodes + 1, generator, dev), tree.max_depth)
        host = out.packed(ids[0], tree.fed.to(dev)).tolist()  # the block's one host sync
        n, nxt, D1 = host[0], host[1], tree.max_depth + 1
        path, path_tokens, path_fed = host[2:2 + D1][: n + 1], host[2 + D1:2 + 2 * D1][: n + 1], host[2 + 2 * D1:][: n + 1]

        if path != list(range(n + 1)):  # a branch other than the first: move its keys/values into place
            target_cache.move(past + out.path[1:n + 1], past + 1)
        set_cache_length(target_cache, past + n + 1)
        past += n + 1
        in_draft = drafter.commit(path_fed[1:], tree.fed, out.path) if block_spec is not None else 0
        clock.mark()

        kept = _cut_at_eos((path_tokens[1:] + [nxt])[:remaining], eos_ids)
        tokens.extend(kept)
        records.append(BlockRecord(n_drafted=n_nodes - 1, n_accepted=min(n, len(kept)), n_emitted=len(kept),
                                   depth=tree.max_depth if n_nodes > 1 else 0))
        if kept[-1] in eos_ids:
            break
        # the accepted nodes the draft never saw, then the target's token
        pending = torch.cat([ids[0][out.path[1 + in_draft:n + 1]], out.next_token.view(1)])
        if hidden_wanted:  # the feature before each pending token: root and accepted nodes, as verified
            feats = hidden[out.path[in_draft:n + 1]]
    for rec, (draft_s, verify_s) in zip(records, clock.durations()):
        rec.draft_s, rec.verify_s = draft_s, verify_s
    stats.blocks.extend(records)
    return tokens


@dataclass(frozen=True)
class RelaxedAcceptance:
    """MSD's modality-aware relaxed acceptance (LOSSY, opt-in): a drafted token is also accepted
    when the target's probability of it clears a threshold, ``vision`` for blocks that follow
    vision context (their root within ``window`` positions of the prompt's last image token),
    ``text`` otherwise. Greedy decoding only."""

    vision: float = 0.6
    text: float = 0.4
    window: int = 64
    last_image_pos: int | None = None  # position of the prompt's last image token (None: no image)

    def threshold(self, past: int) -> float:
        near = self.last_image_pos is not None and past - self.last_image_pos <= self.window
        return self.vision if near else self.text


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
