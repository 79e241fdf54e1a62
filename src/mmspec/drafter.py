"""In-batch ensemble drafting (IbED Algorithm 1): every view of the prompt is one row of ONE
batched draft forward per step; the rows' next-token distributions are mixed with fixed
weights, the draft token is taken from the mixture, and the mixture is the q verification uses.

A single view is the ensemble of one. The drafter owns the draft KV cache (one cache for the
whole batch; rows are left-padded so every row's newest token sits in the last column) and
knows nothing about the target or about acceptance.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmspec.models.base import ModelAdapter
from mmspec.verify import SamplingParams, logits_to_probs, sample
from mmspec.views import ViewRow


class EnsembleDrafter:
    def __init__(self, adapter: ModelAdapter, weights: Sequence[float], target_vocab: int):
        self.adapter = adapter
        w = torch.tensor(list(weights), dtype=torch.float64)
        self.weights = (w / w.sum()).to(adapter.device)  # [B]
        self.n_rows = len(weights)
        self.target_vocab = target_vocab
        self.cache = None
        self.attention_mask: torch.Tensor | None = None  # [B, cache_len]
        self.next_pos: torch.Tensor | None = None  # [B] position id of the next fed token

    # ------------------------------------------------------------------ prefill
    def prefill(self, rows: Sequence[ViewRow]) -> None:
        """Run all rows (left-padded) through the draft once, filling the cache."""
        dev = self.adapter.device
        lengths = [r.token_ids.shape[0] for r in rows]
        L = max(lengths)
        B = len(rows)
        ids = torch.zeros(B, L, dtype=torch.long)  # pad id 0: masked out, any id works
        mask = torch.zeros(B, L, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, L - lengths[b]:] = r.token_ids
            mask[b, L - lengths[b]:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        embeds = self.adapter.embed(ids)  # [B, L, H]
        for b, r in enumerate(rows):
            if r.features is not None:
                pos = (r.feature_positions + (L - lengths[b])).to(dev)
                embeds[b, pos] = r.features.to(embeds.dtype)
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, L]
        self.cache = self.adapter.new_cache()
        self.attention_mask = mask
        self.next_pos = position_ids[:, -1] + 1
        if L > 0:
            self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=position_ids,
                                 inputs_embeds=embeds)

    # ------------------------------------------------------------------ decode
    def _feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append the same n tokens to every row; returns logits of the last one, [B, V]."""
        B, n = self.n_rows, tokens.shape[0]
        dev = self.attention_mask.device
        ids = tokens.to(dev).unsqueeze(0).expand(B, n)  # [B, n]
        self.attention_mask = torch.cat(
            [self.attention_mask, torch.ones(B, n, dtype=self.attention_mask.dtype, device=dev)], dim=1
        )
        position_ids = self.next_pos[:, None] + torch.arange(n, device=dev)  # [B, n]
        self.next_pos = self.next_pos + n
        logits = self.adapter.forward(cache=self.cache, attention_mask=self.attention_mask,
                                      position_ids=position_ids, input_ids=ids)
        return logits[:, -1]  # [B, V_draft]

    def mixture(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Row logits [B, V_draft] -> mixed q [V_target] (weights over rows)."""
        probs = logits_to_probs(logits, params)  # [B, V_draft]
        q = (self.weights.to(probs.dtype)[:, None] * probs).sum(0)  # [V_draft]
        if q.shape[0] < self.target_vocab:  # draft vocab is a prefix of the target's
            q = torch.cat([q, q.new_zeros(self.target_vocab - q.shape[0])])
        return q

    def propose(
        self, pending: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the pending committed tokens, then draft k tokens.

        pending: [n>=1] tokens committed but not yet in the draft cache.
        Returns draft tokens [k] and, when sampling, the mixture q [k, V] each was drawn from
        (greedy verification never reads q, so it is not built). The last draft token is not
        fed (it enters the cache in the next block if accepted).
        """
        logits = self._feed(pending)
        tokens, qs = [], []
        for i in range(k):
            if params.greedy and self.n_rows == 1:
                tok = int(logits[0].argmax())  # argmax of softmax == argmax of logits
            elif params.greedy:
                tok = int(self.mixture(logits, params).argmax())
            else:
                q = self.mixture(logits, params)  # [V]
                tok = sample(q, generator)
                qs.append(q)
            tokens.append(tok)
            if i < k - 1:
                logits = self._feed(torch.tensor([tok]))
        return torch.tensor(tokens, dtype=torch.long), (torch.stack(qs) if qs else None)

    def rollback(self, n_remove: int) -> None:
        """Drop the newest n_remove positions from every row (rejected drafts)."""
        if n_remove <= 0:
            return
        self.cache.crop(-n_remove)
        self.attention_mask = self.attention_mask[:, :-n_remove]
        self.next_pos = self.next_pos - n_remove
