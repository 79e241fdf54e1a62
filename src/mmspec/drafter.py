"""In-batch ensemble drafting (IbED Algorithm 1): every view of the prompt is one row of ONE
batched draft forward per step; the rows' next-token distributions are mixed with fixed
weights, the draft token is taken from the mixture, and the mixture is the q verification uses.

A single view is the ensemble of one. The drafter owns the draft KV cache (one cache for the
whole batch; rows are left-padded so every row's newest token sits in the last column) and
knows nothing about the target or about acceptance.

Per step the drafter allocates nothing that grows with the context: the KV cache and the
attention mask are preallocated for ``prompt + room`` positions (``room`` = new tokens the
decode can feed), so a step's cost does not carry a copy of every row's cache, and rolling
back rejected drafts is a pointer move.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmspec.models.base import ModelAdapter
from mmspec.verify import SamplingParams, logits_to_probs, sample
from mmspec.views import ViewRow


class EnsembleDrafter:
    def __init__(self, adapter: ModelAdapter, weights: Sequence[float], target_vocab: int,
                 room: int | None = None):
        """room: most positions the decode will append after the prompt (max_new_tokens +
        gamma is always enough); None grows the cache dynamically instead."""
        self.adapter = adapter
        self.room = room
        w = torch.tensor(list(weights), dtype=torch.float64)
        self.weights = (w / w.sum()).to(adapter.device)  # [B]
        self.n_rows = len(weights)
        self.target_vocab = target_vocab
        self.cache = None
        self._mask: torch.Tensor | None = None  # [B, capacity]: 0 over left padding, 1 elsewhere
        self._keep: torch.Tensor | None = None  # [B, 1, 1, capacity] bool, only when rows are padded
        self.length = 0  # positions in the cache (padding included)
        self.next_pos: torch.Tensor | None = None  # [B] position id of the next fed token

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, length] the mask of what the cache holds."""
        return self._mask[:, : self.length]

    # ------------------------------------------------------------------ prefill
    def prefill(self, rows: Sequence[ViewRow]) -> None:
        """Run all rows (left-padded) through the draft once, filling the cache."""
        dev = self.adapter.device
        lengths = [r.token_ids.shape[0] for r in rows]
        L = max(lengths)
        B = len(rows)
        capacity = L + (self.room if self.room is not None else 0)
        ids = torch.zeros(B, L, dtype=torch.long)  # pad id 0: masked out, any id works
        full = torch.ones(B, capacity, dtype=torch.long)  # [B, capacity]; positions past L are all real tokens
        for b, r in enumerate(rows):
            ids[b, L - lengths[b]:] = r.token_ids
            full[b, : L - lengths[b]] = 0
        ids, full = ids.to(dev), full.to(dev)
        mask = full[:, :L]
        embeds = self.adapter.embed(ids)  # [B, L, H]
        for b, r in enumerate(rows):
            if r.features is not None:
                pos = (r.feature_positions + (L - lengths[b])).to(dev)
                embeds[b, pos] = r.features.to(embeds.dtype)
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, L]
        self.cache = self.adapter.new_cache(capacity if self.room is not None else None)
        self._mask = full
        padded = bool((full[:, :L] == 0).any())
        self._keep = full.bool()[:, None, None, :] if padded and self.room is not None else None  # [B, 1, 1, cap]
        self.length = L
        self.next_pos = position_ids[:, -1] + 1
        if L > 0:
            self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=position_ids,
                                 inputs_embeds=embeds)

    # ------------------------------------------------------------------ decode
    def _feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append the same n tokens to every row; returns logits of the last one, [B, V]."""
        B, n = self.n_rows, tokens.shape[0]
        dev = self._mask.device
        ids = tokens.to(dev).unsqueeze(0).expand(B, n)  # [B, n]
        if self.room is None:  # dynamic: grow the mask with the cache
            self._mask = torch.cat([self._mask, torch.ones(B, n, dtype=self._mask.dtype, device=dev)], dim=1)
        elif self.length + n > self._mask.shape[1]:
            raise RuntimeError(f"draft cache full: {self.length} + {n} > {self._mask.shape[1]} positions "
                               "(the decode fed more than the room it was given)")
        self.length += n
        position_ids = self.next_pos[:, None] + torch.arange(n, device=dev)  # [B, n]
        self.next_pos = self.next_pos + n
        logits = self.adapter.forward(cache=self.cache, attention_mask=self._step_mask(n),
                                      position_ids=position_ids, input_ids=ids)
        return logits[:, -1]  # [B, V_draft]

    def _step_mask(self, n: int) -> torch.Tensor:
        """The attention mask of a forward over the newest ``n`` positions.

        Rows without padding: the 2D mask (all ones), so transformers keeps SDPA's no-mask path.
        Left-padded rows: a ready 4D boolean mask [B, 1, n, length] (True = attend) sliced from a
        buffer built once at prefill, instead of transformers rebuilding it every step.
        """
        if self._keep is None:
            return self.attention_mask  # [B, length]
        keep = self._keep[:, :, :, : self.length]  # [B, 1, 1, length] view
        if n == 1:
            return keep
        causal = torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()  # new tokens among themselves
        keep = keep.expand(-1, -1, n, -1).clone()  # [B, 1, n, length]
        keep[..., self.length - n:] &= causal
        return keep

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
            tok, q = self.pick(logits, params, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if i < k - 1:
                logits = self._feed(torch.tensor([tok]))
        return torch.tensor(tokens, dtype=torch.long), (torch.stack(qs) if qs else None)

    def pick(self, logits: torch.Tensor, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """Row logits [B, V_draft] -> (draft token, mixture q [V] when sampling else None)."""
        if params.greedy and self.n_rows == 1:
            return int(logits[0].argmax()), None  # argmax of softmax == argmax of logits
        if params.greedy:
            return int(self.mixture(logits, params).argmax()), None
        q = self.mixture(logits, params)  # [V]
        return sample(q, generator), q

    def step(self, token: int, params: SamplingParams, generator: torch.Generator | None = None) -> int:
        """One draft step as :meth:`propose` runs it (feed one token, pick the next); for timing."""
        return self.pick(self._feed(torch.tensor([token])), params, generator)[0]

    def rollback(self, n_remove: int) -> None:
        """Drop the newest n_remove positions from every row (rejected drafts)."""
        if n_remove <= 0:
            return
        self.cache.crop(-n_remove)
        self.length -= n_remove
        if self.room is None:
            self._mask = self._mask[:, : self.length]
        self.next_pos = self.next_pos - n_remove
