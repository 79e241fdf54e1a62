"""Training-time test (EAGLE-3's): a head trained unrolled to the depth it drafts, each pass
reading the head's own previous outputs, under exactly the attention drafting gives it.

Owns: :func:`unroll` (the head's passes over a batch, one KV cache holding them all),
:func:`diagonal_mask` (what pass k attends to) and :func:`chain_valid` (the slots of pass k whose
whole chain lies where the loss trains). Knows nothing of losses or data (:mod:`mmspec.train.head`).

Per sequence of n head slots (slot t: the target's feature t and token t + 1, as in
:mod:`mmspec.heads.model`): pass 1 reads the target's TRUE features and predicts h1[t] (feature
t + 1); pass k reads h(k-1)[t - 1] at slot t, the head's own prediction of feature t, beside the
same token t + 1. That is what drafting feeds at depth k - 1 of a chain whose last true slot is
t - (k - 1), and the attention matches it too: the query of pass k at slot t sees pass 1's keys at
slots <= t - (k - 1) (the accepted context: the target's features) and its own chain, pass j's
key at slot t - (k - j) for j = 2 .. k (the nodes drafted before it, and itself): the "diagonal"
mask of EAGLE-3 and SpecForge. Every pass runs at the slot's own position id (the position the
node is drafted at). Pass k's keys join the cache after pass k - 1's, so each pass computes only
its own n queries: k passes cost k head forwards.
"""

from __future__ import annotations

import torch


def diagonal_mask(key_valid: torch.Tensor, k: int) -> torch.Tensor:
    """key_valid [B, n] bool (real slots, not padding) -> [B, 1, n, k * n] bool (True: attend): pass
    k's query at slot t over the cached keys of passes 1 .. k (pass j's slot s at column
    (j - 1) n + s): pass 1's real slots s <= t - (k - 1), and pass j's slot t - (k - j), j = 2 .. k.
    Pass 1 alone is the causal mask over the real slots; every query sees at least one key."""
    B, n = key_valid.shape
    t = torch.arange(n, device=key_valid.device)
    context = (t[None, :] <= t[:, None] - (k - 1))[None] & key_valid[:, None, :]  # [B, n, n]
    chain = [(t[None, :] == t[:, None] - (k - j))[None].expand(B, n, n) for j in range(2, k + 1)]  # each [B, n, n]
    return torch.cat([context, *chain], dim=-1)[:, None]


def unroll(head, feats: torch.Tensor, embeds: torch.Tensor, image: torch.Tensor | None,
           position_ids: torch.Tensor, key_valid: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's ``depth`` passes over a batch -> each pass's predicted features [B, n, H].

    feats [B, n, H]: the target's fused features; embeds [B, n, H]: the embedding of token t + 1
    at slot t; image [B, n] bool or None (msd: token t + 1 is an image slot; pass 1 only, as
    drafting never feeds a predicted feature beside an image slot); position_ids [B, n] or
    [3, B, n] (M-RoPE); key_valid [B, n] bool. ``head``: a FeatureHead, or DDP around one."""
    from transformers import DynamicCache

    core = getattr(head, "module", head)
    cache = DynamicCache(config=core.decoder.config) if depth > 1 else None  # pass k's keys after pass k - 1's
    outs: list[torch.Tensor] = []
    x = feats
    for k in range(1, depth + 1):
        if k > 1:  # slot t reads pass k - 1's prediction at t - 1 (slot 0 has none: never trained past pass 1)
            x = torch.cat([feats[:, :1], outs[-1][:, :-1]], dim=1)  # [B, n, H]
        outs.append(head(x, embeds, image if k == 1 else None, cache=cache, position_ids=position_ids,
                         attention_mask=diagonal_mask(key_valid, k)))
    return outs


def chain_valid(valid: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """valid [B, n] bool (the slots pass 1 trains at) -> for each pass k = 1 .. depth, [B, n] bool:
    slot t of pass k trains when slots t - (k - 1) .. t all do, i.e. every token of its chain would
    have been drafted where the loss trains (no padding, no image slot, no prompt token); the first
    k - 1 slots never do."""
    out = [valid]
    n = valid.shape[1]
    for k in range(2, depth + 1):
        start = torch.zeros_like(valid)  # [B, n]: slot t - (k - 1), the chain's first
        start[:, k - 1:] = valid[:, :max(n - (k - 1), 0)]
        out.append(out[-1] & start)
    return out


def pass_weights(depth: int, decay: float) -> list[float]:
    """Pass k's share of the loss: decay^(k - 1), normalised to sum to 1 (decay 1: every depth alike)."""
    w = [decay ** k for k in range(depth)]
    return [x / sum(w) for x in w]
