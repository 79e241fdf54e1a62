"""The speculative decoding loop (chain verification). Owns the target KV cache, the RNG and
the block records; the drafter owns the draft cache.

Invariant between blocks: every committed token except the newest is in both caches; the
newest committed token is *pending* (fed at the start of the next block). The target
verifies ``[pending, d_1..d_k]`` in one forward, giving p at k + 1 positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mmspec.drafter import EnsembleDrafter
from mmspec.models.base import ModelAdapter
from mmspec.stats import BlockRecord, GenerationStats
from mmspec.verify import SamplingParams, logits_to_probs, verify_greedy, verify_sampling


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopState:
    tokens: list[int]  # new tokens emitted so far
    target_pending: torch.Tensor  # [1] long
    draft_pending: torch.Tensor  # [n] long, n in {1, 2}
    done: bool = False


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
    state = LoopState(tokens=[], target_pending=torch.tensor([first_pending]),
                      draft_pending=torch.tensor([first_pending]))
    past = target_len  # tokens in the target cache
    while len(state.tokens) < max_new_tokens:
        remaining = max_new_tokens - len(state.tokens)
        k = min(gamma, remaining - 1)  # a block emits at most k + 1 tokens

        t0 = time.perf_counter()
        if k > 0:
            drafts, q = drafter.propose(state.draft_pending, k, params, generator)  # [k], [k, V] or None
        else:
            drafts, q = torch.zeros(0, dtype=torch.long), torch.zeros(0, target.vocab_size)  # [0], [0, V]
        _sync(dev)
        t1 = time.perf_counter()

        block = torch.cat([state.target_pending, drafts]).to(dev)[None]  # [1, k + 1]
        attn = torch.ones(1, past + k + 1, dtype=torch.long, device=dev)
        pos = torch.arange(past, past + k + 1, device=dev)[None]
        logits = target.forward(cache=target_cache, attention_mask=attn, position_ids=pos,
                                input_ids=block)[0]  # [k + 1, V]
        if params.greedy:
            out = verify_greedy(drafts.to(dev), logits)
        else:
            p = logits_to_probs(logits, params)  # [k + 1, V]
            out = verify_sampling(drafts.to(dev), q.to(p.device, p.dtype), p, generator)
        n = out.n_accepted
        if k > n:
            target_cache.crop(-(k - n))  # drop the rejected drafts' keys/values
        past += n + 1
        if k > 0:
            # draft cache holds pending + d_1..d_{k-1}; keep pending + d_1..d_min(n, k-1)
            drafter.rollback((k - 1) - min(n, k - 1))
        _sync(dev)
        t2 = time.perf_counter()

        emitted = drafts[:n].tolist() + [out.next_token]
        kept = _cut_at_eos(emitted, eos_ids)
        state.tokens.extend(kept)
        stats.blocks.append(BlockRecord(n_drafted=k, n_accepted=min(n, len(kept)), n_emitted=len(kept),
                                        draft_s=t1 - t0, verify_s=t2 - t1))
        if len(kept) < len(emitted) or kept[-1] in eos_ids:
            break
        state.target_pending = torch.tensor([out.next_token])
        if k == 0:  # the draft saw nothing this block: its pending tokens carry over
            carry = state.draft_pending.tolist()
        else:  # all accepted: the last draft token never entered the draft cache
            carry = [int(drafts[k - 1])] if n == k else []
        state.draft_pending = torch.tensor(carry + [out.next_token])
    return state.tokens


def _cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
