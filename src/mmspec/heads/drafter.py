"""Drafting with a feature-level head (:mod:`mmspec.heads.model`) through the engine's drafter
interface: the tree-building of :class:`~mmspec.drafter.TreeDrafter`, fed the target's own
hidden states.

The head's sequence is the target's shifted by one: its slot t holds the pair (target feature
at t, token t + 1). After prefill it holds the prompt's pairs except the last; each block then
feeds the pending tokens with the TARGET's features before each (read from the verify forward
that accepted them, no extra target pass), and its tree nodes with the head's OWN predicted
feature of their parent. After verification every tree slot is dropped (``keeps_path`` False):
the accepted tokens come back next block with the target's true features, as EAGLE does.
"""

from __future__ import annotations

import torch

from mmspec.drafter import DraftSteps, StepFn, TreeDrafter
from mmspec.heads.model import FeatureHead
from mmspec.heads.positions import head_positions, next_position
from mmspec.models.base import ModelAdapter
from mmspec.models.cache import DecodeCache
from mmspec.prefix_cache import restore_rows


class HeadDrafter(TreeDrafter):
    keeps_path = False

    def __init__(self, head: FeatureHead, target: ModelAdapter, room: int, static: bool = False, cache=None,
                 step_fn: StepFn | None = None):
        self.head = head
        self.target = target
        self.n_rows = 1
        self.weights = torch.ones(1, dtype=torch.float64, device=target.device)
        self.target_vocab = target.vocab_size
        self.needs_hidden = head.config.feature_layers
        self.step_fn = step_fn
        self._embed = target.model.get_input_embeddings()
        self._lm_head = target.model.get_output_embeddings()
        self.hnode: torch.Tensor | None = None  # [M, H] the head's predicted feature at each tree node
        self._init_slots(room, static, cache)

    def eager_step(self, feats: torch.Tensor, embeds: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """feats, embeds [1, n, H], pos [1, n], mask -> predicted features [1, n, H] (extends the cache)."""
        return self.head(feats, embeds, cache=self.cache, position_ids=pos, attention_mask=mask)

    # ------------------------------------------------------------------ prefill
    def prefill(self, features: torch.Tensor, token_ids: torch.Tensor, prefix=None,
                positions: torch.Tensor | None = None) -> None:
        """features: the target's features over the prompt less its last token [1, L - 1, F];
        token_ids: the whole prompt [L]. Feeds the pairs (feature t, token t + 1), t = 0..L - 3;
        the last pair (feature L - 2, the pending token) opens the first block. ``prefix``: the
        keys/values of the first k slots, reused (:mod:`mmspec.prefix_cache`); ``features`` then
        starts at position k: [1, L - 1 - k, F]. ``positions``: an M-RoPE head's target positions
        of the prompt less its last token ([3, 1, L - 1], :func:`mmspec.heads.positions.prompt_positions`);
        None: slot t at position t."""
        dev = self.target.device
        n = token_ids.shape[0] - 2
        if isinstance(self.cache, DecodeCache) and self.cache.max_len >= n + self.room:
            self.cache.reset()
        else:
            self.cache = self.head.new_cache(n + self.room, static=self.static)
        k = 0 if prefix is None else restore_rows(self.cache, [prefix], [0])
        self.valid = torch.zeros(1, self.cache.max_len, dtype=torch.bool, device=dev)
        self.valid[:, :n] = True
        self.padded = False
        self.length = self.committed = n
        self.next_pos = torch.full((1,), n, dtype=torch.long, device=dev)
        if positions is not None:
            self.next_pos = next_position(positions).to(dev)
        if self.step_fn is None:
            self.step_fn = self.eager_step
        if n <= k:
            return
        nxt = token_ids[k + 1:n + 1].to(dev)[None]  # [1, n - k]
        image = None
        if self.head.config.variant == "msd" and self.head.config.image_token_id is not None:
            image = nxt == self.head.config.image_token_id  # [1, n - k]: the placeholder's embedding carries nothing
        if self.static:
            mask = torch.zeros(1, 1, n - k, self.cache.max_len, dtype=torch.bool, device=dev)
            mask[0, 0, :, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[k:]
        else:
            mask = torch.ones(1, n, dtype=torch.long, device=dev)
        self.head(self.head.fused(features[:, :n - k]), self._embed(nxt), image, cache=self.cache,
                  position_ids=torch.arange(k, n, device=dev)[None] if positions is None
                  else head_positions(positions, k, n).to(dev), attention_mask=mask)

    # ------------------------------------------------------------------ TreeDrafter hooks
    def _begin_block(self, n_nodes: int) -> None:
        self.hnode = torch.zeros(n_nodes, self.head.config.hidden_size, dtype=self.head.dtype,
                                 device=self.valid.device)

    def _feed_pending(self, pending: torch.Tensor, feats: torch.Tensor | None) -> DraftSteps:
        if feats is None:
            raise RuntimeError("a head drafts from the target's features: the engine must pass them")
        pos, mask = self._slots(pending.shape[0], 0, None, True)
        h = yield dict(feats=self.head.fused(feats)[None], embeds=self._embed(pending[None]), pos=pos, mask=mask)
        self.hnode[0] = h[0, -1]
        return self.head.logits(h[:, -1:], self._lm_head)  # [1, 1, V]

    def _feed_nodes(self, nodes, tokens, parents, depth, block, causal) -> DraftSteps:
        pos, mask = self._slots(nodes.shape[0], depth - 1, block, causal)
        h = yield dict(feats=self.hnode[parents][None], embeds=self._embed(tokens[None]), pos=pos, mask=mask)
        self.hnode[nodes] = h[0]
        return self.head.logits(h, self._lm_head)  # [1, F, V]
