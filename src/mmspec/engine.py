"""The speculative decoding loop (chain verification). Owns the target KV cache, the RNG and
the block records; the drafter owns the draft cache.

Invariant between blocks: every committed token except the newest is in both caches; the
newest committed token is *pending* (fed at the start of the next block). The target
verifies ``[pending, d_1..d_k]`` in one forward, giving p at k + 1 positions.
"""

from __future__ import annotations

import time
import torch

from mmspec.drafter import EnsembleDrafter
from mmspec.models.base import ModelAdapter
from mmspec.timing import sync
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.verify import SamplingParams, logits_to_probs, verify_greedy, verify_sampling


def run_loop(
    *,
    target: ModelAdapter,
    target_cache,
    target_len: int,
    drafter: EnsembleDrafter,
    first_pending: int,
    gamma: int,
    max_new_tokens: int,
    eos_ids: frozenset[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: GenerationStats,
) -> list[int]:
    """Draft, verify, accept, roll back, until EOS or max_new_tokens. Returns new tokens."""
    dev = target.device
    tokens: list[int] = []  # new tokens emitted so far
    last = first_pending  # newest committed token: the one not yet in the target cache
    draft_pending = [first_pending]  # committed tokens not yet in the draft cache (1 or 2)
    past = target_len  # tokens in the target cache
    while len(tokens) < max_new_tokens:
        k = min(gamma, max_new_tokens - len(tokens) - 1)  # a block emits at most k + 1 tokens

        t0 = time.perf_counter()
        if k > 0:
            drafts, q = drafter.propose(torch.tensor(draft_pending), k, params, generator)  # [k], [k, V] | None
        else:
            drafts, q = torch.zeros(0, dtype=torch.long), torch.zeros(0, target.vocab_size)  # [0], [0, V]
        sync(dev)
        t1 = time.perf_counter()

        drafts_dev = drafts.to(dev)
        block = torch.cat([torch.tensor([last], device=dev), drafts_dev])[None]  # [1, k + 1]
        attn = torch.ones(1, past + k + 1, dtype=torch.long, device=dev)
        pos = torch.arange(past, past + k + 1, device=dev)[None]
        logits = target.forward(cache=target_cache, attention_mask=attn, position_ids=pos,
                                input_ids=block)[0]  # [k + 1, V]
        if params.greedy:
            out = verify_greedy(drafts_dev, logits)
        else:
            p = logits_to_probs(logits, params)  # [k + 1, V]
            out = verify_sampling(drafts_dev, q.to(p.device, p.dtype), p, generator)
        n = out.n_accepted
        if k > n:
            target_cache.crop(-(k - n))  # drop the rejected drafts' keys/values
        past += n + 1
        if k > 0:
            # draft cache holds pending + d_1..d_{k-1}; keep pending + d_1..d_min(n, k-1)
            drafter.rollback((k - 1) - min(n, k - 1))
        sync(dev)
        t2 = time.perf_counter()

        kept = _cut_at_eos(drafts[:n].tolist() + [out.next_token], eos_ids)
        tokens.extend(kept)
        stats.blocks.append(BlockRecord(n_drafted=k, n_accepted=min(n, len(kept)), n_emitted=len(kept),
                                        draft_s=t1 - t0, verify_s=t2 - t1))
        if kept[-1] in eos_ids:
            break
        last = out.next_token
        if k == 0:  # the draft saw nothing this block: its pending tokens carry over
            draft_pending = draft_pending + [last]
        else:  # all accepted: the last draft token never entered the draft cache
            draft_pending = ([int(drafts[k - 1])] if n == k else []) + [last]
    return tokens


def _cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
