"""In-batch ensemble drafting (IbED Algorithm 1) for every request of a step at once.

Every view of every request is one row of the draft model's :class:`~mmspec.models.rows.RowCache`:
request b's views are rows ``b * V .. b * V + V - 1``. Each step feeds every row's pending tokens
and each depth's tree nodes in ONE forward of the draft model over all rows; each request's rows'
next-token distributions are mixed with that request's weights (fixed, or adapting after every
block: :mod:`mmspec.drafting.weights`), and the mixture is what the request drafts from (and the
q its sampling verification uses). A single view is the ensemble of one.

The draft rows' committed lengths and next positions live in device tensors (``length``,
``position``) with host mirrors the engine advances from the step's one read, so a forward's
write slots and masks come from the device and its span from the host, never a copy between
them. A newcomer's views are prefilled straight into their rows (ONE forward for all newcomers,
a stored prefix reused per row), never on a cache of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmspec.drafting.tree import TreeSpec
from mmspec.drafting.trees import Drafted, Drafting, StepInput, coupled_key, drop_duplicates
from mmspec.models.base import ModelAdapter
from mmspec.models.rows import KV, RowCache
from mmspec.runtime.forwards import PromptRow, RowForward, prefill_rows
from mmspec.runtime.graphs import capacity_bucket
from mmspec.runtime.masks import causal, rows_mask
from mmspec.runtime.state import stage
from mmspec.runtime.verify import RowSampling, logits_to_probs_rows


class DraftRows:
    """The rows of one draft model (or head) over a :class:`RowCache`: their committed lengths
    and next positions (device tensors and host mirrors), ``per`` rows per request."""

    def __init__(self, n_layers: int, per: int, device: torch.device, static: bool):
        self.cache = RowCache(n_layers)
        self.per = per
        self.device = device
        self.static = static
        self.lengths: list[int] = []  # host: committed slots per draft row (active requests' rows)
        self.step_span, self.base, self.pos = 0, None, None  # this step's: slots attended, in-block slot 0, depth-1 position
        self.length = torch.zeros(per, dtype=torch.long, device=device)  # [rows]
        self.position = torch.zeros(per, dtype=torch.long, device=device)  # [rows] next position id

    def ensure(self, requests: int, capacity: int) -> bool:
        """Room for ``requests`` requests' rows of ``capacity`` slots. -> whether anything was
        reallocated (graphs captured on the old tensors are stale)."""
        rows = requests * self.per
        grown = False
        if rows > self.length.shape[0]:
            n = len(self.lengths)
            length = torch.zeros(max(rows, 2 * self.length.shape[0]), dtype=torch.long, device=self.device)
            position = torch.zeros_like(length)
            length[:n], position[:n] = self.length[:n], self.position[:n]
            self.length, self.position, grown = length, position, True
        return self.cache.ensure(rows, capacity_bucket(capacity) if self.static else capacity) or grown

    def span(self, extra: int) -> int:
        """Slots a step's forwards attend over: every row's committed ones plus ``extra``."""
        need = max(self.lengths, default=0) + extra
        return min(capacity_bucket(need) if self.static else need, self.cache.capacity)

    # ------------------------------------------------------------------ a step's forwards
    def pending_inputs(self, R: int, P: int, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``R`` rows' pending-token forward: write slots [R], mask [R, 1, P, span],
        positions [R, P] (each row's P pending slots after its committed ones, causal)."""
        self.step_span = span
        length, position = self.length[:R], self.position[:R]
        dev = length.device
        return length, rows_mask(length, span, causal(P, dev)), position[:, None] + torch.arange(P, device=dev)

    def open_block(self, R: int, plen: torch.Tensor) -> None:
        """The pending tokens [R] fed: in-block slot 0 and the depth-1 position follow them."""
        self.base, self.pos = self.length[:R] + plen, self.position[:R] + plen

    def node_inputs(self, inblock: torch.Tensor, depth: int, first_slot: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree level's forward: inblock [R, n, S] -> write slots [R], mask, positions [R, n]."""
        n = inblock.shape[1]
        pos = (self.pos + depth - 1)[:, None].expand(-1, n)
        return self.base + first_slot, rows_mask(self.base, self.step_span, inblock), pos

    def keep(self, m: torch.Tensor, live: torch.Tensor) -> None:
        """After verification: each live row keeps its pending tokens and ``m`` [R] accepted
        nodes (a free row of the bucket keeps its length)."""
        R = m.shape[0]
        self.length[:R] = torch.where(live, self.base + m, self.length[:R])
        self.position[:R] = torch.where(live, self.pos + m, self.position[:R])

    def advance(self, delta: list[int]) -> None:
        """Host mirrors after a step's read: request b's rows committed ``delta[b]`` more slots."""
        p = self.per
        if p == 1:  # one draft row per request (one view): one pass, no index arithmetic per row
            self.lengths[:len(delta)] = [n + d for n, d in zip(self.lengths, delta)]
            return
        for b, d in enumerate(delta):
            for v in range(p):
                self.lengths[b * p + v] += d

    def snapshot(self, b: int) -> list[KV | None]:
        """Request b's rows as the prefix cache keeps them (their committed slots)."""
        p = self.per
        return [self.cache.snapshot(b * p + v, 0, self.lengths[b * p + v]) for v in range(p)]

    def remove(self, b: int, last: int) -> None:
        """Request b's rows leave; the last request's rows move into them."""
        p = self.per
        for v in range(p):
            dst, src = b * p + v, last * p + v
            if dst != src:
                self.cache.copy_row(dst, src)
                self.length[dst], self.position[dst] = self.length[src], self.position[src]
                self.lengths[dst] = self.lengths[src]
        for v in range(p):
            self.length[last * p + v] = 0
            self.position[last * p + v] = 0
        del self.lengths[last * p:]


class EnsembleDrafting(Drafting):
    """Token-level drafting with an ensemble of views over all requests (module docstring)."""

    keeps_path = True

    def __init__(self, adapter: ModelAdapter, weights: Sequence[float], vocab: int, spec: TreeSpec,
                 static: bool = False, n_layers: int | None = None):
        self.adapter = adapter
        self.V = len(weights)
        w = torch.tensor(list(weights), dtype=torch.float64)
        self.base_weights = (w / w.sum()).to(adapter.device)  # [V]
        self.vocab = vocab
        self.spec = spec
        n_layers = n_layers or adapter.model.config.get_text_config(decoder=True).num_hidden_layers
        self.rows = DraftRows(n_layers, self.V, adapter.device, static)
        self.weights = self.base_weights.expand(1, self.V).clone()  # [requests, V]
        self.adaptive = None  # mmspec.drafting.weights state, when the weights adapt
        cache = self.rows.cache
        self.forward = RowForward(lambda mask, ids, pos: adapter.forward(cache=cache, attention_mask=mask,
                                                                         position_ids=pos, input_ids=ids),
                                  cache, "draft")

    # ------------------------------------------------------------------ rows
    def ensure(self, requests: int, capacity: int) -> bool:
        grown = self.rows.ensure(requests, capacity)
        if requests > self.weights.shape[0]:
            w = self.base_weights.expand(max(requests, 2 * self.weights.shape[0]), self.V).clone()
            w[:self.weights.shape[0]] = self.weights
            self.weights, grown = w, True
        if self.adaptive is not None:
            self.adaptive.ensure(requests)
        return grown

    def admit(self, first: int, prompts: list, reqs: list, feats=None) -> None:
        """Requests ``first ..`` join (their :class:`~mmspec.decoder.EncodedRequest` s and
        checked requests): each request's view rows (its prompt rows, less the pending last token)
        prefilled in ONE forward into rows ``first * V ..``, each reusing what the prefix cache
        holds of it; adaptive weights start from the request's ``initial`` weights."""
        dev, V = self.adapter.device, self.V
        rows: list[PromptRow] = []
        next_pos: list[int] = []
        three_d = any(r.position_ids is not None for p in prompts for r in p.rows)
        plan = []  # (row, view row, its length less the pending token, reused slots, stored prefix)
        for i, p in enumerate(prompts):
            match = p.match
            for v, r in enumerate(p.rows):
                L = r.token_ids.shape[0] - 1  # the last prompt token is pending
                kv = match.row_kv(v) if match is not None and v < len(match.rows) and match.rows[v] else None
                s = 0 if kv is None else min(kv[0][0].shape[-2], L)
                plan.append(((first + i) * V + v, r, L, s, kv))
        room = max(self.rows.cache.capacity, max(s for *_, s, _ in plan) + max(L - s for _, _, L, s, _ in plan))
        self.ensure(max(first + len(prompts), self.rows.length.shape[0] // self.rows.per), room)
        for row, r, L, s, kv in plan:
            if kv is not None:
                self.rows.cache.write_prefix(row, [(k[..., :s, :], v_[..., :s, :]) for k, v_ in kv])
            ids = r.token_ids[:L]
            embeds = self.adapter.embed(ids.to(dev)[None])[0]  # [L, H]
            if r.features is not None:
                embeds[r.feature_positions.to(dev)] = r.features.to(dev, embeds.dtype)
            if r.position_ids is not None:
                pos = r.position_ids[:, :L].to(dev)
                nxt = int(r.position_ids[:, :L].amax()) + 1
            else:
                pos = torch.arange(L, device=dev)
                nxt = L
                if three_d:
                    pos = pos[None].expand(3, L)
            rows.append(PromptRow(embeds=embeds[s:], positions=pos[..., s:], reused=s))
            next_pos.append(nxt)
            self.rows.lengths.append(L)
        cache = self.rows.cache
        prefill_rows(cache, first * V, rows, lambda **kw: self.adapter.forward(cache=cache, logits_to_keep=1, **kw))
        sl = slice(first * V, first * V + len(rows))
        self.rows.length[sl] = stage(torch.tensor([r.embeds.shape[0] + r.reused for r in rows], dtype=torch.long), dev)
        self.rows.position[sl] = stage(torch.tensor(next_pos, dtype=torch.long), dev)
        self.weights[first:first + len(reqs)] = self.base_weights
        if self.adaptive is not None:
            self.adaptive.admit(first, [req.initial for req in reqs])
            self.weights[first:first + len(reqs)] = self.adaptive.weights[first:first + len(reqs)]

    def remove(self, b: int, last: int) -> None:
        self.rows.remove(b, last)
        if b != last:
            self.weights[b] = self.weights[last]
        self.weights[last] = self.base_weights
        if self.adaptive is not None:
            self.adaptive.remove(b, last)

    def step_state(self) -> list[torch.Tensor]:
        out = [self.rows.length, self.rows.position, self.weights]
        if self.adaptive is not None:
            a = self.adaptive
            out += [a.weights, a.kl_sum, a.score, a.hist, a.ptr]
        return out

    def advance(self, delta: list[int]) -> None:
        self.rows.advance(delta)

    # ------------------------------------------------------------------ Drafting hooks
    def _rep(self, t: torch.Tensor) -> torch.Tensor:
        """Per request [R, ...] -> per draft row [R V, ...] (each request's repeated per view)."""
        return t if self.V == 1 else t.repeat_interleave(self.V, dim=0)

    def feed_pending(self, x: StepInput) -> torch.Tensor:
        R = x.rows * self.V
        write, mask, pos = self.rows.pending_inputs(R, x.pending.shape[1], x.span)
        logits = self.forward(write=write, mask=mask, ids=self._rep(x.pending), pos=pos)  # [R V, P, V_draft]
        plen = self._rep(x.pending_len)
        self.rows.open_block(R, plen)
        last = logits.gather(1, (plen - 1)[:, None, None].expand(R, 1, logits.shape[-1]))  # [R V, 1, V_draft]
        self._seen = [last] if self.adaptive is not None else []  # a copy (gather)
        return last

    def feed(self, x, nodes, tokens, parents, depth, first_slot, inblock) -> torch.Tensor:
        write, mask, pos = self.rows.node_inputs(self._rep(inblock), depth, first_slot)
        out = self.forward(write=write, mask=mask, ids=self._rep(tokens), pos=pos)
        if self.adaptive is not None:  # kept for adapt (a copy: a forward may hand back a reused buffer)
            self._seen.append(out.clone())
        return out

    def distributions(self, logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
        """Row logits [R V, F, V_draft] -> each request's mixture q [R, F, vocab]."""
        probs = logits_to_probs_rows(logits, self._rep_sampling(rs))  # [R V, F, V_draft]
        R = probs.shape[0] // self.V
        probs = probs.view(R, self.V, *probs.shape[1:])
        w = self.weights[:R].to(probs.dtype)[:, :, None, None]
        q = (w * probs).sum(1)  # [R, F, V_draft]
        if q.shape[-1] < self.vocab:  # the draft's vocabulary is a prefix of the target's
            q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[-1]))
        return q

    def _rep_sampling(self, rs: RowSampling) -> RowSampling:
        if self.V == 1:
            return rs
        return rs.rows(torch.arange(rs.greedy.shape[0], device=rs.greedy.device).repeat_interleave(self.V))

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        return logits.argmax(-1) if self.V == 1 else None

    def top_children(self, logits, k, rs, noise=None):
        if self.spec.children != "views" or self.V == 1:
            return super().top_children(logits, k, rs, noise)
        logp = logits_to_probs_rows(logits, self._rep_sampling(rs)).clamp_min(1e-30).log()  # [R V, F, V_draft]
        R = logp.shape[0] // self.V
        logp = logp.view(R, self.V, *logp.shape[1:])  # [R, V, F, V_draft]
        if noise is not None and rs.any_coupled:  # coupled rows: each view's own Gumbel-max draws
            logp = coupled_key(logp.flatten(1, 2), noise, rs).view(logp.shape)
        s, t = logp.topk(k, dim=-1)  # [R, V, F, k]
        s, t = s.permute(0, 2, 1, 3).flatten(2), t.permute(0, 2, 1, 3).flatten(2)  # [R, F, V k]
        best = drop_duplicates(t, s).topk(k, dim=-1)  # [R, F, k]
        tokens, scores = t.gather(-1, best.indices), best.values
        if noise is not None and rs.any_coupled:  # scored by their view's log q, as coupled_top scores
            g = noise[:, None, :logp.shape[-1]].expand(-1, tokens.shape[1], -1).gather(-1, tokens)  # [R, F, k]
            scores = torch.where(rs.coupled[:, None, None], scores - g.to(scores.dtype), scores)
        return tokens, scores

    # ------------------------------------------------------------------ after verification
    def commit(self, x: StepInput, d: Drafted, path: torch.Tensor, n_accepted: torch.Tensor,
               is_chain: bool, live: torch.Tensor) -> torch.Tensor:
        """Keep the accepted fed nodes (moved into place when the path is not the first branch),
        drop the rest. -> m [R]: accepted nodes now in the draft cache."""
        slot, m = self.kept(d, path, n_accepted)  # [R, D], [R]
        R = x.rows * self.V
        if not is_chain:
            D = slot.shape[1]
            base = self.rows.base
            src = base[:, None] + self._rep(slot).clamp_min(0)
            dst = base[:, None] + torch.arange(D, device=slot.device)
            self.rows.cache.move_paths(torch.arange(R, device=slot.device), src, dst)
        self.rows.keep(self._rep(m), self._rep(live))
        return m

    def adapt(self, x: StepInput, d: Drafted, path: torch.Tensor, n_accepted: torch.Tensor, next_token: torch.Tensor,
              target_logits: torch.Tensor, live: torch.Tensor) -> None:
        """Adaptive weights after verification: each view's distribution at every row's accepted
        path, scored against the target's there and the tokens it confirmed (all rows at once)."""
        R, dev = x.rows, path.device
        D1 = path.shape[1]
        j = torch.arange(D1, device=dev)[None]  # [1, D + 1]
        slot = d.fed.gather(1, path)  # [R, D + 1]: in-block slot of each path node (-1: never fed)
        idx = torch.where(j == 0, 0, slot + 1).clamp_min(0)  # index into the seen logits (0: the root's)
        valid = ((j == 0) | (slot >= 0)) & (j <= n_accepted[:, None])
        seen = torch.cat(self._seen, 1)  # [R V, S, V_draft]
        rows = seen.gather(1, self._rep(idx)[:, :, None].expand(-1, -1, seen.shape[-1]))  # [R V, D + 1, V_draft]
        q = logits_to_probs_rows(rows, self._rep_sampling(x.sampling)).view(R, self.V, D1, -1)
        p = logits_to_probs_rows(target_logits.gather(1, path[:, :, None].expand(-1, -1, target_logits.shape[-1])),
                                 x.sampling)  # [R, D + 1, V]
        tok = d.tree.tokens.gather(1, path)
        confirmed = torch.where(j == n_accepted[:, None], next_token[:, None],
                                torch.cat([tok[:, 1:], tok[:, -1:]], 1))  # the token after each path node
        self.weights[:R] = self.adaptive.update(q, p, confirmed, valid, n_accepted + 1, live)

    def catch_up(self, x: StepInput, live: torch.Tensor) -> None:
        """A step that drafts nothing still feeds the pending tokens (their count stays bounded)."""
        self.feed_pending(x)
        self.rows.keep(torch.zeros(x.rows * self.V, dtype=torch.long, device=live.device), self._rep(live))

    def snapshot(self, b: int) -> list[KV | None]:
        """Request b's view rows as the prefix cache keeps them (committed slots)."""
        return self.rows.snapshot(b)
