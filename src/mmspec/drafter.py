"""Drafting a block: the tree-building every drafter shares, and in-batch ensemble drafting.

:class:`TreeDrafter` owns what every drafter does the same way: the draft cache's slots and
masks (which slots hold committed tokens, which hold this block's tree nodes), building a chain,
a static tree or an EAGLE-2 dynamic tree depth by depth from the children distributions its
subclass computes, and dropping the tree's slots after verification. A subclass says how the
pending committed tokens and a frontier of tree nodes are fed (``_feed_pending`` /
``_feed_nodes``). :class:`EnsembleDrafter` is the token-level drafter below;
:class:`mmspec.heads.HeadDrafter` drafts from the target's own hidden states.

In-batch ensemble drafting (IbED Algorithm 1), as chains or token trees.

Every view of the prompt is one row of ONE batched draft forward per depth; the rows'
next-token distributions are mixed with weights (fixed, or adapting after every block to how
well each view predicted the target's confirmed tokens: :meth:`TreeDrafter.adapt`,
:mod:`mmspec.adaptive`), and the mixture is what the draft proposes from (and the q that
sampling verification uses). A single view is the ensemble of one.

Per block the drafter feeds the pending committed tokens, then drafts a tree (:mod:`mmspec.tree`)
depth by depth: one forward per depth over the whole frontier, every frontier node attending
to the committed tokens and to its own ancestors through a tree mask on the draft's own cache
(no re-prefill, no per-node forward). Children of a node come from the mixture (``children=
"mixture"``) or from each view's own top tokens (``"views"``: an ensemble of proposals rather
than a mixture of distributions). After verification :meth:`commit` keeps the accepted path's
keys/values (moved into place, O(path)) and drops the rest.

The drafter owns the draft KV cache (one cache for the whole batch; rows are left-padded so
every row's newest token sits in the same slot) and the mask of which slots hold committed
tokens. It knows nothing about the target or about acceptance. Its cache and masks are
preallocated for ``prompt + room`` positions; every forward goes through ``self.step_fn``
(eager, or a CUDA-graph replay of the same shapes: :mod:`mmspec.graphs`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from mmspec.adaptive import AdaptiveState
from mmspec.models.base import ModelAdapter
from mmspec.models.cache import DecodeCache, set_cache_length
from mmspec.prefix_cache import restore_rows
from mmspec.tree import DraftTree, TreeSpec, ancestors, best_prefix_closed, static_structure
from mmspec.verify import SamplingParams, logits_to_probs, sample, uniforms
from mmspec.views import ViewRow

# step_fn(ids=[B, n], pos=[B, n], mask=...) -> logits [B, n, V]: eager, or a CUDA-graph replay
StepFn = Callable[..., torch.Tensor]
# a drafter's steps: a generator that yields each forward's keyword arguments (pos, mask and the
# model's inputs), is sent that forward's output, and returns what it drafted (a DraftTree)
DraftSteps = Generator[dict, torch.Tensor, object]


def drive(steps: DraftSteps, forward: StepFn):
    """Run a drafter's steps alone: each forward it asks for is ``forward(**call)``. -> what
    the steps return. (A batch instead merges the forwards of many drafters' steps into one:
    :class:`mmspec.forwards.DraftForwards`.)"""
    try:
        call = next(steps)
        while True:
            call = steps.send(forward(**call))
    except StopIteration as done:
        return done.value


class TreeDrafter:
    """The tree-building and slot bookkeeping every drafter shares (module docstring).

    Subclasses set ``n_rows``, ``weights`` [B], ``target_vocab``, ``room``, ``static``,
    ``cache``, and fill ``valid`` / ``next_pos`` at their prefill. ``needs_hidden`` names the
    target layers the drafter reads (feature-level heads); ``keeps_path``: accepted nodes
    that were fed stay in the draft cache (True) or are fed again next block with the target's
    own features (False: heads).
    """

    needs_hidden: tuple[int, ...] = ()
    keeps_path: bool = True
    adaptive: AdaptiveState | None = None  # weights that adapt per block (mmspec.adaptive); None: fixed

    def _init_slots(self, room: int, static: bool, cache) -> None:
        self.room = int(room)
        self.static = static
        self.cache = cache
        self.valid: torch.Tensor | None = None  # [B, capacity] bool: slot holds a committed, non-padding token
        self.padded = False
        self.length = 0  # slots in use (left padding and in-block tree nodes included)
        self.committed = 0  # slots holding committed tokens (padding included)
        self.next_pos: torch.Tensor | None = None  # [B] position id of the next committed token
        self._seen: list[torch.Tensor] = []  # adaptive weights: this block's row logits (draft)

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    # ------------------------------------------------------------------ subclass hooks
    def _feed_pending(self, pending: torch.Tensor, feats: torch.Tensor | None) -> DraftSteps:
        """Feed the pending committed tokens [n] (their preceding target features [n, F] for
        heads); return the logits after the last one, [B, 1, V]. A generator (its forward is
        yielded: :data:`DraftSteps`), as is :meth:`_feed_nodes`."""
        raise NotImplementedError

    def _feed_nodes(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
                    block: torch.Tensor, causal: bool) -> DraftSteps:
        """Feed the tree nodes ``nodes`` [F] (ids in this block's node table; their tokens [F]
        and parent ids [F]) at depth ``depth``; return their logits [B, F, V]."""
        raise NotImplementedError

    def _begin_block(self, n_nodes: int) -> None:
        """Called before a block drafts up to ``n_nodes`` nodes (heads size a buffer here)."""

    def _slots(self, n: int, offset: int, block: torch.Tensor | None, causal: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Claim the next n cache slots; return their position ids [B, n] and attention mask.

        Position of token i: next_pos + offset (+ i when ``block`` is None: a causal run of
        committed tokens). block: [n, S] bool, which of the S in-block slots (the last n are
        these tokens) each attends to; None = causal among the new ones. causal: the host's
        promise that ``block`` is "every earlier in-block slot, and causal among the new ones"
        (a chain), so no device check is needed.
        """
        dev = self.valid.device
        if self.length + n > self.capacity:
            raise RuntimeError(f"draft cache full: {self.length} + {n} > {self.capacity} positions "
                               "(the decode fed more than the room it was given)")
        steps = torch.arange(n, device=dev) if block is None else torch.zeros(n, dtype=torch.long, device=dev)
        position_ids = self.next_pos[:, None] + offset + steps  # [B, n]
        mask = self._mask(n, block, causal)
        self.length += n
        return position_ids, mask

    def _mask(self, n: int, block: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The attention mask of a forward over the newest n slots.

        View mode, no padding, causal block: the 2-D mask (all ones), so transformers keeps
        SDPA's no-mask path. Otherwise a 4-D boolean mask [B, 1, n, span] (True = attend), span =
        the filled slots (view mode) or the whole buffer (static mode: a fixed shape).
        """
        B, dev = self.n_rows, self.valid.device
        base, end = self.committed, self.length + n
        if not self.static and not self.padded and causal:
            return torch.ones(B, end, dtype=torch.long, device=dev)  # [B, length + n]
        if block is None:
            block = torch.ones(n, end - base, dtype=torch.bool, device=dev).tril(end - base - n)
        span = self.capacity if self.static else end
        mask = torch.zeros(B, 1, n, span, dtype=torch.bool, device=dev)
        mask[:, 0, :, :base] = self.valid[:, None, :base]
        mask[:, 0, :, base:end] = block[None]
        return mask

    # ------------------------------------------------------------------ distributions
    def mixture(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Row logits [B, ..., V_draft] -> mixed q [..., V_target] (weights over rows)."""
        probs = logits_to_probs(logits, params)  # [B, ..., V_draft]
        w = self.weights.to(probs.dtype).view(-1, *([1] * (probs.dim() - 1)))
        q = (w * probs).sum(0)  # [..., V_draft]
        if q.shape[-1] < self.target_vocab:  # draft vocab is a prefix of the target's
            q = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[-1]))
        return q

    def _children(self, logits: torch.Tensor, k: int, params: SamplingParams, children: str,
                  u: torch.Tensor | None, need_scores: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Candidate children of F frontier nodes.

        logits [B, F, V_draft] -> tokens [F, k], scores (log-probabilities) [F, k], and q [F, V]
        when the children are drawn (``u`` [F] given: chains under sampling, k == 1). Without
        ``need_scores`` a greedy one-view chain takes the logits' argmax and scores are zeros.
        """
        if self.adaptive is not None:  # kept for :meth:`adapt` (a copy: a graph replay reuses its output)
            self._seen.append(logits.clone())
        if u is not None:  # sampling chain: one child drawn from the mixture
            q = self.mixture(logits, params)  # [F, V]
            tok = sample(q, u)  # [F]
            return tok[:, None], q.gather(-1, tok[:, None]).clamp_min(1e-30).log(), q
        if children == "views" and self.n_rows > 1:
            logp = logits_to_probs(logits, params).clamp_min(1e-30).log()  # [B, F, V]
            s, t = logp.topk(k, dim=-1)  # [B, F, k]
            s, t = s.permute(1, 0, 2).flatten(1), t.permute(1, 0, 2).flatten(1)  # [F, B * k]
            s = _drop_duplicates(t, s)
            best = s.topk(k, dim=-1)  # [F, k]
            return t.gather(-1, best.indices), best.values, None
        if self.n_rows == 1 and params.greedy and k == 1 and not need_scores:  # argmax of softmax == argmax of logits
            tok = logits[0].argmax(-1, keepdim=True)  # [F, 1]
            return tok, torch.zeros(tok.shape, dtype=torch.float32, device=tok.device), None
        q = self.mixture(logits, params)  # [F, V]
        s, t = q.topk(k, dim=-1)
        return t, s.clamp_min(1e-30).log(), None

    # ------------------------------------------------------------------ drafting
    def draft(self, pending: torch.Tensor, spec: TreeSpec, params: SamplingParams,
              generator: torch.Generator | None = None, feats: torch.Tensor | None = None) -> DraftTree:
        """Feed the pending committed tokens [n >= 1] (device long; for heads with the target's
        features before each, [n, F]), then draft a tree, every forward on ``self.step_fn``.

        The root (node 0) is the last pending token. Returns the tree on the draft's device;
        nodes of the deepest level are never fed (they enter the cache next block if accepted).
        """
        return drive(self.draft_steps(pending, spec, params, generator, feats), self.step_fn)

    def draft_steps(self, pending: torch.Tensor, spec: TreeSpec, params: SamplingParams,
                    generator: torch.Generator | None = None, feats: torch.Tensor | None = None) -> DraftSteps:
        """:meth:`draft` as steps: each forward is yielded (its keyword arguments) and its output
        sent back, so a batch can run many drafters' forwards as one; returns the DraftTree."""
        n_p = pending.shape[0]
        self._begin_block(1 + spec.n_generated)
        self._seen: list[torch.Tensor] = []  # [B, F, V] per depth: the root's, then each fed frontier's
        logits = yield from self._feed_pending(pending, feats)  # [B, 1, V]
        self.committed += n_p
        self.valid[:, self.committed - n_p:self.committed] = True
        self.next_pos = self.next_pos + n_p  # position of depth-1 nodes
        root_slot = self.committed - 1
        if spec.kind == "static":
            return (yield from self._draft_static(pending[-1:], root_slot, logits, spec, params))
        return (yield from self._draft_dynamic(pending[-1:], root_slot, logits, spec, params, generator))

    def _draft_dynamic(self, root, root_slot, logits, spec: TreeSpec, params, generator) -> DraftTree:
        """EAGLE-2 expansion: per depth, the children of the frontier, then the ``topk`` best new
        nodes by cumulative log q become the next frontier; finally the best ``budget`` nodes."""
        if spec.kind == "chain":
            return (yield from self._draft_chain(root, root_slot, logits, spec, params, generator))
        dev = self.valid.device
        k = spec.topk
        M = 1 + spec.n_generated
        tokens = torch.zeros(M, dtype=torch.long, device=dev)
        parents = torch.full((M,), -1, dtype=torch.long, device=dev)
        depth = torch.zeros(M, dtype=torch.long, device=dev)
        score = torch.zeros(M, dtype=torch.float32, device=dev)
        anc = torch.zeros(M, M, dtype=torch.bool, device=dev)
        fed = torch.full((M,), -1, dtype=torch.long, device=dev)
        tokens[0], anc[0, 0], fed[0] = root[0], True, root_slot

        frontier = torch.zeros(1, dtype=torch.long, device=dev)  # node ids whose logits we hold
        fed_nodes: list[torch.Tensor] = []  # node ids per in-block slot, in slot order
        made = 1
        for d in range(1, spec.depth + 1):
            tok, s, _ = self._children(logits, k, params, spec.children, None)  # [F, k]
            F = tok.shape[0]
            new = torch.arange(made, made + F * k, device=dev)
            par = frontier.repeat_interleave(k)
            tokens[new], parents[new], depth[new] = tok.flatten(), par, d
            score[new] = (score[frontier][:, None] + s.float()).flatten()
            anc[new] = anc[par]
            anc[new, new] = True
            made += F * k
            if d == spec.depth:
                break
            frontier = new[score[new].topk(k).indices.sort().values]  # the k best, in creation order
            fed[frontier] = self.length + torch.arange(k, device=dev)
            fed_nodes.append(frontier)
            block = anc[frontier][:, torch.cat(fed_nodes)]  # [k, S] ancestry over in-block slots
            logits = yield from self._feed_nodes(frontier, tokens[frontier], parents[frontier], d, block,
                                                 causal=False)  # [B, k, V]
        keep = torch.cat([torch.zeros(1, dtype=torch.long, device=dev),
                          best_prefix_closed(score[1:made], spec.n_nodes - 1) + 1])
        return self._tree(keep, tokens, parents, depth, anc, fed, None, spec.depth, spec.is_chain)

    def _draft_chain(self, root, root_slot, logits, spec: TreeSpec, params, generator) -> DraftTree:
        """A chain: one child per depth (drawn from the mixture when sampling, else its argmax);
        the tree's structure is known up front, so only tokens are gathered per depth."""
        dev = self.valid.device
        draw = not params.greedy
        u = uniforms(spec.depth, generator, dev) if draw else None
        need_scores = spec.stop_below is not None
        toks, qs = [root], []
        base = self.length  # in-block slot of the depth-1 node once fed
        d = 0
        for d in range(1, spec.depth + 1):
            tok, s, q = self._children(logits, 1, params, "mixture", u[d - 1:d] if draw else None, need_scores)
            toks.append(tok[0])
            if q is not None:
                qs.append(q)
            if need_scores and float(s.max().exp()) < spec.stop_below:
                break  # dynamic draft length: the draft is unsure, stop here
            if d == spec.depth:
                break
            block = None if not (self.static or self.padded) else torch.ones(1, d, dtype=torch.bool, device=dev)
            node = torch.full((1,), d, dtype=torch.long, device=dev)
            logits = yield from self._feed_nodes(node, tok[0], node - 1, d, block, causal=True)  # [B, 1, V]
        n = d + 1  # nodes, root included
        idx = torch.arange(n, device=dev)
        fed = torch.cat([idx[:1] + root_slot, base + idx[:-1]]) if n > 1 else idx[:1] + root_slot  # no host->device copy
        fed[-1] = -1 if n > 1 else root_slot  # the deepest draft is never fed
        q_all = None
        if draw:
            q_all = torch.cat([qs[0].new_zeros(1, qs[0].shape[-1]), *qs]).to(torch.float64)
        sampled = None
        if draw:
            sampled = idx > 0
        return DraftTree(tokens=torch.cat(toks), parents=idx - 1, depth=idx, anc=idx[None, :] <= idx[:, None],
                         fed=fed, max_depth=d, is_chain=True, q=q_all, sampled=sampled)

    def _draft_static(self, root, root_slot, logits, spec: TreeSpec, params) -> DraftTree:
        """A Medusa-style static tree: node ``path`` is the ``path[-1]``-ranked child (by the
        mixture q) of node ``path[:-1]``; nodes with children are fed, one forward per depth."""
        dev = self.valid.device
        st = self._static_plan(spec, dev)
        tokens = torch.zeros(st["M"], dtype=torch.long, device=dev)
        tokens[0] = root[0]
        fed = torch.full((st["M"],), -1, dtype=torch.long, device=dev)
        fed[0] = root_slot
        for d, level in enumerate(st["levels"], start=1):
            tok, _, _ = self._children(logits, level["R"], params, spec.children, None)  # [F, R] ranked children
            tokens[level["idx"]] = tok[level["rows"], level["ranks"]]
            if d == spec.max_depth:
                break
            fidx = level["frontier"]
            fed[fidx] = self.length + level["arange"]
            logits = yield from self._feed_nodes(fidx, tokens[fidx], st["parents"][fidx], d, level["block"],
                                                 causal=spec.is_chain)
        keep = torch.arange(st["M"], device=dev)
        return self._tree(keep, tokens, st["parents"], st["depth"], st["anc"], fed, None, spec.max_depth, spec.is_chain)

    def _static_plan(self, spec: TreeSpec, dev) -> dict:
        """The index tensors of a static tree, made once per tree and device (a block then copies
        nothing from the host: each host->device copy would wait for the GPU)."""
        plans = self.__dict__.setdefault("_static_plans", {})
        key = (spec.paths, str(dev))
        if key in plans:
            return plans[key]
        par_l, dep_l, rank_l = static_structure(spec.paths)
        M = 1 + len(par_l)
        parents = torch.tensor([-1] + par_l, dtype=torch.long, device=dev)
        anc = ancestors(parents, spec.max_depth)
        has_kids, frontier, fed_nodes, levels = set(par_l), [0], [], []
        for d in range(1, spec.max_depth + 1):
            level = [i for i in range(1, M) if dep_l[i - 1] == d]
            slot = {node: j for j, node in enumerate(frontier)}
            entry = {"idx": torch.tensor(level, device=dev), "R": max(rank_l[i - 1] for i in level) + 1,
                     "rows": torch.tensor([slot[par_l[i - 1]] for i in level], device=dev),
                     "ranks": torch.tensor([rank_l[i - 1] for i in level], device=dev)}
            frontier = [i for i in level if i in has_kids]
            if frontier:
                fed_nodes += frontier
                fidx = torch.tensor(frontier, device=dev)
                entry.update(frontier=fidx, arange=torch.arange(len(frontier), device=dev),
                             block=anc[fidx][:, torch.tensor(fed_nodes, device=dev)])
            levels.append(entry)
        plans[key] = {"M": M, "parents": parents, "depth": torch.tensor([0] + dep_l, dtype=torch.long, device=dev),
                      "anc": anc, "levels": levels}
        return plans[key]

    def _tree(self, keep, tokens, parents, depth, anc, fed, q_all, max_depth: int, is_chain: bool) -> DraftTree:
        """Restrict the drafted nodes to ``keep`` [N] (ascending, root first) and renumber."""
        inv = torch.full((tokens.shape[0] + 1,), -1, dtype=torch.long, device=keep.device)
        inv[keep] = torch.arange(keep.shape[0], device=keep.device)
        par = inv[parents[keep]]  # a parent index -1 reads inv[-1] == -1: the root stays -1
        sampled = None
        if q_all is not None:
            sampled = torch.ones(keep.shape[0], dtype=torch.bool, device=keep.device)
            sampled[0] = False
        return DraftTree(tokens=tokens[keep], parents=par, depth=depth[keep], anc=anc[keep][:, keep],
                         fed=fed[keep], max_depth=max_depth, is_chain=is_chain,
                         q=None if q_all is None else q_all[keep], sampled=sampled)

    def adapt(self, tree_fed: torch.Tensor, path: torch.Tensor, confirmed: torch.Tensor, target_logits: torch.Tensor,
              params: SamplingParams) -> None:
        """Adaptive weights, after verification: each view's distribution at the accepted path's
        nodes, scored against the target's there and the tokens it confirmed; all on the device.

        tree_fed: [N] the block's draft slots (``tree.fed``); path: [m] the accepted path, root
        first (m = accepted + 1); confirmed: [m] the token the target confirmed after each path
        node (the next accepted one, then its own next token); target_logits: [N, V].
        """
        dev = self.weights.device
        rows = torch.cat(self._seen, 1)  # [B, S, V_draft]: index = slot - root slot (slot order)
        path = path.to(dev)
        slots = tree_fed[path]  # [m]; -1: a node never fed (no draft distribution after it)
        q = logits_to_probs(rows[:, (slots - slots[0]).clamp_min(0)], params)  # [B, m, V_draft]
        p = logits_to_probs(target_logits[path.to(target_logits.device)], params).to(dev)  # [m, V]
        self.weights = self.adaptive.update(q, p, confirmed.to(dev), slots >= 0)

    def commit(self, fed_path: Sequence[int], tree_fed: torch.Tensor, path: torch.Tensor) -> int:
        """Keep the accepted nodes that were fed, drop every other tree slot.

        fed_path: host ints, the draft-cache slots of the accepted nodes (root excluded), -1 for
        a node never fed (only the last accepted one can be); tree_fed / path: the same on the
        device (``tree.fed`` and the outcome's path), used for the gather. Returns how many
        accepted nodes are now in the cache (the rest are pending for the next block).
        """
        m = sum(1 for s in fed_path if s >= 0) if self.keeps_path else 0
        base = self.committed
        if m and list(fed_path[:m]) != list(range(base, base + m)):  # a tree path: move it into place
            self.cache.move(tree_fed[path[1:1 + m]], base)
        self.valid[:, base:self.length] = False
        self.valid[:, base:base + m] = True
        self.committed = self.length = base + m
        set_cache_length(self.cache, self.length)
        self.next_pos = self.next_pos + m
        return m


class EnsembleDrafter(TreeDrafter):
    """Token-level drafting with an ensemble of views, each one row of one batched forward."""

    def __init__(self, adapter: ModelAdapter, weights: Sequence[float], target_vocab: int, room: int,
                 static: bool = False, cache=None, step_fn: StepFn | None = None):
        """room: most positions the decode appends after the prompt (new tokens + one tree).
        static: full-buffer cache and masks (the CUDA-graph path). cache: a preallocated
        :class:`~mmspec.models.cache.DecodeCache` to reuse when it is large enough (graphs
        captured on it stay valid), else one is made. step_fn: runs the draft's forwards on
        that cache (a :class:`~mmspec.graphs.StepRunner`); default: an eager forward."""
        self.adapter = adapter
        w = torch.tensor(list(weights), dtype=torch.float64)
        self.weights = (w / w.sum()).to(adapter.device)  # [B]
        self.n_rows = len(weights)
        self.target_vocab = target_vocab
        self.step_fn = step_fn
        self._init_slots(room, static, cache)

    # ------------------------------------------------------------------ prefill
    def prefill(self, rows: Sequence[ViewRow], prefix: Sequence | None = None) -> None:
        """Run all rows (left-padded) through the draft once, filling the cache. ``prefix``: per
        row, a stored prefix of its keys/values to reuse (:mod:`mmspec.prefix_cache`; None: none);
        the forward then starts at the first slot some row does not reuse."""
        dev = self.adapter.device
        lengths = [r.token_ids.shape[0] for r in rows]
        L, B = max(lengths), len(rows)
        if isinstance(self.cache, DecodeCache) and self.cache.max_len >= L + self.room:
            self.cache.reset()  # a kept cache (its CUDA graphs stay valid)
        elif not (self.cache is not None and not isinstance(self.cache, DecodeCache)):
            self.cache = self.adapter.new_cache(L + self.room, static=self.static)
        # (any other cache given, e.g. a fresh DynamicCache to time against, is used as it is)
        capacity = getattr(self.cache, "max_len", L + self.room)
        ids = torch.zeros(B, L, dtype=torch.long)  # pad id 0: masked out, any id works
        valid = torch.zeros(B, capacity, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, L - lengths[b]:] = r.token_ids
            valid[b, L - lengths[b]:L] = True
        ids, self.valid = ids.to(dev), valid.to(dev)
        self.padded = bool((valid[:, :L] == 0).any())
        embeds = self.adapter.embed(ids)  # [B, L, H]
        for b, r in enumerate(rows):
            if r.features is not None:
                pos = (r.feature_positions + (L - lengths[b])).to(dev)
                embeds[b, pos] = r.features.to(embeds.dtype)
        position_ids = (self.valid[:, :L].long().cumsum(-1) - 1).clamp_min(0)  # [B, L]
        if any(r.position_ids is not None for r in rows):  # multimodal RoPE rows: their own 3-D ids
            pos3 = position_ids[None].repeat(3, 1, 1)  # [3, B, L]
            for b, r in enumerate(rows):
                if r.position_ids is not None:
                    pos3[:, b, L - lengths[b]:] = r.position_ids[:, : lengths[b]].to(dev)
            next_pos = pos3.amax(dim=(0, 2)) + 1  # [B]: text after the prompt continues here
            position_ids = pos3
        else:
            next_pos = position_ids[:, -1] + 1
        if self.step_fn is None:
            self.step_fn = self._eager_step
        self.length = self.committed = L
        self.next_pos = next_pos
        start = 0 if prefix is None else restore_rows(self.cache, list(prefix), [L - n for n in lengths])
        if L > start:
            mask = self._prefill_mask(L)[:, :, start:] if self.static else self.valid[:, :L].long()
            self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=position_ids[..., start:],
                                 inputs_embeds=embeds[:, start:], logits_to_keep=1)

    def _prefill_mask(self, L: int) -> torch.Tensor:
        """[B, 1, L, capacity] bool: causal over the prompt, padding masked (static mode)."""
        dev = self.valid.device
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        mask = torch.zeros(self.n_rows, 1, L, self.capacity, dtype=torch.bool, device=dev)
        mask[:, 0, :, :L] = causal[None] & self.valid[:, None, :L]
        mask[:, 0, :, :L] |= torch.eye(L, dtype=torch.bool, device=dev)[None]  # a pad row sees itself: no NaN
        return mask

    # ------------------------------------------------------------------ one forward
    def _eager_step(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=pos, input_ids=ids)

    def _run(self, tokens: torch.Tensor, offset: int, block: torch.Tensor | None, causal: bool) -> DraftSteps:
        """Append the same n tokens [n] to every row; logits [B, n, V_draft] (one yielded forward)."""
        pos, mask = self._slots(tokens.shape[0], offset, block, causal)
        ids = tokens.to(self.valid.device).unsqueeze(0).expand(self.n_rows, -1)  # [B, n]
        return (yield dict(ids=ids, pos=pos, mask=mask))

    def _feed_pending(self, pending: torch.Tensor, feats: torch.Tensor | None) -> DraftSteps:
        return (yield from self._run(pending, 0, None, True))[:, -1:]

    def _feed_nodes(self, nodes, tokens, parents, depth, block, causal) -> DraftSteps:
        return (yield from self._run(tokens, depth - 1, block, causal))

    def step(self, token: int, params: SamplingParams) -> int:
        """One chain draft step as a block runs it (feed one token, pick the next), then undone
        (the cache is left as it was): repeated calls time the same work."""
        logits = drive(self._run(torch.tensor([token], device=self.valid.device), 0, None, True), self.step_fn)
        picked = int(self._children(logits, 1, params, "mixture", None, need_scores=False)[0][0, 0])
        self._seen = []  # no block to adapt from: nothing kept across timing repeats
        self.length -= 1
        set_cache_length(self.cache, self.length)
        return picked

    # ------------------------------------------------------------------ after verification

def _drop_duplicates(tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per row, keep each token's best-scoring occurrence: tokens, scores [F, C] -> scores with
    the other occurrences set to -inf (first occurrence wins a tie)."""
    same = tokens[:, :, None] == tokens[:, None, :]  # [F, C, C]
    C = tokens.shape[1]
    idx = torch.arange(C, device=tokens.device)
    better = (scores[:, None, :] > scores[:, :, None]) | ((scores[:, None, :] == scores[:, :, None])
                                                           & (idx[None, None, :] < idx[None, :, None]))
    dominated = (same & better).any(-1)  # [F, C]
    return scores.masked_fill(dominated, float("-inf"))
