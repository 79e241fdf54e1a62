"""Drafting with a feature-level head (:mod:`mmspec.heads.model`) for every request of a step at
once: the batched tree maths of :mod:`mmspec.drafting.trees`, fed the target's own hidden states.

Each request is one row of the head's :class:`~mmspec.models.rows.RowCache`. The head's sequence
is the target's shifted by one: slot t holds the pair (target feature at t, token t + 1). After
its prefill a row holds the prompt's pairs but the last; each step feeds the pending tokens with
the TARGET's features before each (taken from the verify forward that accepted them, no extra
target pass: :class:`~mmspec.runtime.state.BatchState` keeps them beside the pending tokens),
and the tree nodes with the head's OWN predicted feature of their parent. Every tree slot is
dropped after verification (``keeps_path`` False): the accepted tokens come back pending with
the target's true features, as EAGLE does.
"""

from __future__ import annotations

import torch

from mmspec.drafting.ensemble import DraftRows
from mmspec.drafting.tree import TreeSpec
from mmspec.drafting.trees import Drafted, Drafting, StepInput
from mmspec.heads.model import FeatureHead
from mmspec.heads.positions import head_positions, next_position, prompt_positions
from mmspec.models.base import ModelAdapter
from mmspec.models.rows import KV
from mmspec.runtime.forwards import PromptRow, RowForward, prefill_rows
from mmspec.runtime.verify import RowSampling, logits_to_probs_rows


class HeadDrafting(Drafting):
    """A feature-level head's drafting over all requests (module docstring)."""

    keeps_path = False

    def __init__(self, head: FeatureHead, target: ModelAdapter, spec: TreeSpec, static: bool = False):
        self.head = head
        self.target = target
        self.spec = spec
        self.vocab = target.vocab_size
        self.adaptive = None
        self.rows = DraftRows(head.decoder.config.num_hidden_layers, 1, target.device, static)
        self._embed = target.model.get_input_embeddings()
        self._lm_head = target.model.get_output_embeddings()
        cache = self.rows.cache
        self.forward = RowForward(lambda mask, feats, embeds, pos: head(feats, embeds, cache=cache, position_ids=pos,
                                                                       attention_mask=mask),
                                  cache, "draft head")
        self.hnode: torch.Tensor | None = None  # [R, M, H] the head's predicted feature at each tree node

    # ------------------------------------------------------------------ rows
    def ensure(self, requests: int, capacity: int) -> bool:
        return self.rows.ensure(requests, capacity)

    def admit(self, first: int, prompts: list, reqs: list, feats=None) -> None:
        """Requests ``first ..`` join: each one's head row holds the pairs (target feature t,
        token t + 1) of its prompt, t = 0 .. L - 3, those past its reused slots fed in ONE forward
        from the target's prefill features ``feats`` [k, n_max, F] (request i's from its reused
        position on)."""
        dev, cfg = self.target.device, self.head.config
        rows: list[PromptRow] = []
        next_pos: list[int] = []
        images = []
        three_d = False
        plans = []
        for p, req in zip(prompts, reqs):
            ids = req.ids
            n = ids.shape[0] - 2  # slots 0 .. L - 3
            k = min(p.match.head, n) if p.match is not None and p.match.head else 0
            positions = prompt_positions(self.head, self.target, ids, req.mm)
            three_d |= positions is not None
            plans.append((ids, n, k, positions))
        self.ensure(max(first + len(plans), self.rows.length.shape[0]), max(self.rows.cache.capacity,
                                            max(k for _, _, k, _ in plans) + max(n - k for _, n, k, _ in plans) + 1))
        for i, ((_, _, k, _), p) in enumerate(zip(plans, prompts)):
            if k:
                self.rows.cache.write_prefix(first + i, [(a[..., :k, :], b[..., :k, :]) for a, b in p.match.head_kv()])
        for i, (ids, n, k, positions) in enumerate(plans):
            f = feats[i, :max(n - k, 0)] if feats is not None else None  # [n - k, F]: target positions k .. n - 1
            nxt = ids[k + 1:n + 1].to(dev)  # [n - k]
            embeds = torch.cat([self.head.fused(f), self._embed(nxt)], -1) if f is not None and n > k else \
                torch.zeros(0, 2 * cfg.hidden_size, dtype=self.head.dtype, device=dev)
            if positions is None:
                pos = torch.arange(k, max(n, k), device=dev)
                if three_d:
                    pos = pos[None].expand(3, -1)
                next_pos.append(n)
            else:
                pos = head_positions(positions, k, n).to(dev)[:, 0]
                next_pos.append(int(next_position(positions)[0]))
            image = None
            if cfg.variant == "msd" and cfg.image_token_id is not None:
                image = nxt == cfg.image_token_id
            images.append(image)
            rows.append(PromptRow(embeds=embeds, positions=pos, reused=k))
            self.rows.lengths.append(max(n, 0))
        H = cfg.hidden_size
        cache = self.rows.cache

        def run(inputs_embeds, position_ids, attention_mask):
            feats_, embeds_ = inputs_embeds[..., :H], inputs_embeds[..., H:]
            image = None
            if any(im is not None for im in images):
                image = torch.zeros(embeds_.shape[:2], dtype=torch.bool, device=dev)
                for i, im in enumerate(images):
                    if im is not None:
                        image[i, :im.shape[0]] = im
            return self.head(feats_, embeds_, image, cache=cache, position_ids=position_ids,
                             attention_mask=attention_mask)

        prefill_rows(cache, first, rows, run)
        sl = slice(first, first + len(rows))
        self.rows.length[sl] = torch.tensor(self.rows.lengths[first:first + len(rows)], dtype=torch.long).to(dev)
        self.rows.position[sl] = torch.tensor(next_pos, dtype=torch.long).to(dev)

    def remove(self, b: int, last: int) -> None:
        self.rows.remove(b, last)

    def step_state(self) -> list[torch.Tensor]:
        return super().step_state() + ([self.hnode] if self.hnode is not None else [])

    def advance(self, delta: list[int]) -> None:
        self.rows.advance(delta)

    # ------------------------------------------------------------------ Drafting hooks
    def begin(self, rows: int, n_nodes: int) -> None:
        H = self.head.config.hidden_size
        if self.hnode is None or self.hnode.shape[0] < rows or self.hnode.shape[1] < n_nodes:
            self.hnode = torch.zeros(rows, n_nodes, H, dtype=self.head.dtype, device=self.target.device)

    def feed_pending(self, x: StepInput) -> torch.Tensor:
        R = x.rows
        write, mask, pos = self.rows.pending_inputs(R, x.pending.shape[1], x.span)
        h = self.forward(write=write, mask=mask, feats=self.head.fused(x.feats), embeds=self._embed(x.pending),
                         pos=pos)  # [R, P, H]
        plen = x.pending_len
        self.rows.open_block(R, plen)
        last = h.gather(1, (plen - 1)[:, None, None].expand(R, 1, h.shape[-1]))  # [R, 1, H]
        self.hnode[:R, 0] = last[:, 0]
        return self.head.logits(last, self._lm_head)  # [R, 1, V]

    def feed(self, x, nodes, tokens, parents, depth, first_slot, inblock) -> torch.Tensor:
        R, n = tokens.shape
        H = self.hnode.shape[-1]
        write, mask, pos = self.rows.node_inputs(inblock, depth, first_slot)
        feats = self.hnode[:R].gather(1, parents[:, :, None].expand(R, n, H))
        h = self.forward(write=write, mask=mask, feats=feats, embeds=self._embed(tokens), pos=pos)
        self.hnode[:R].scatter_(1, nodes[:, :, None].expand(R, n, H), h)
        return self.head.logits(h, self._lm_head)  # [R, n, V]

    def distributions(self, logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
        q = logits_to_probs_rows(logits, rs)
        if q.shape[-1] < self.vocab:
            q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[-1]))
        return q

    # ------------------------------------------------------------------ after verification
    def commit(self, x: StepInput, d: Drafted, path, n_accepted, is_chain: bool, live: torch.Tensor) -> torch.Tensor:
        """Every tree slot dropped: the rows keep the pending tokens fed this step. -> m = 0."""
        m = torch.zeros_like(n_accepted)
        self.rows.keep(m, live)
        return m

    def catch_up(self, x: StepInput, live: torch.Tensor) -> None:
        self.feed_pending(x)
        self.rows.keep(torch.zeros_like(x.pending_len), live)

    def snapshot(self, b: int) -> KV | None:
        return self.rows.snapshot(b)[0]
