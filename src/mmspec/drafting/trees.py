"""Drafting a step's trees for every row at once: chains, static trees and EAGLE-2 dynamic
trees built with whole-batch tensor operations (the drafters' shared maths).

:class:`Drafting` is what every model drafter does the same way, over B requests at once: feed
each row's pending tokens, then grow a tree depth by depth from the children distributions its
subclass computes (:meth:`Drafting.children`) and feeds (:meth:`Drafting.feed`), and after
verification keep the accepted path's fed nodes in the draft cache and hand back the rest as the
next step's pending tokens (:meth:`Drafting.commit`). Every request of a step drafts the same
SHAPE (the decoder's tree, cut to the step's depth); each keeps its own tokens, scores,
sampling parameters and random draws, and a row's nodes past its token limit (or after a drawn
chain's unsure token, ``stop_below``) are marked invalid rather than not drafted: the step's
work does not depend on any value read back from the device.

Node numbering, per row: node 0 is the root (the newest
pending token, the last one fed), parents first. ``fed[b, i]``: the in-block slot node i was fed
at (slots counted from the row's committed length after its pending tokens), -1 when never fed
(the deepest level, and the root, which is committed). Verification reads a
:class:`~mmspec.drafting.tree.TreeBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmspec.drafting.tree import TreeBatch, TreeSpec, ancestors_rows, static_structure
from mmspec.runtime.verify import RowSampling, sample

NEG = float("-inf")


def inblock_slots(spec: TreeSpec) -> int:
    """In-block slots a step's tree feeds after the pending tokens (its fed nodes)."""
    if spec.kind == "chain":
        return spec.depth - 1
    if spec.kind == "dynamic":
        return (spec.depth - 1) * spec.topk
    parents, _, _ = static_structure(spec.paths)
    return len(set(parents) - {0})  # the nodes with children (the root is pending, not in-block)


@dataclass
class StepInput:
    """What a step's drafting reads of the batch (all device tensors over the step's R rows)."""

    rows: int  # R: the step's rows (the active ones, padded to a shape bucket)
    pending: torch.Tensor  # [R, P] long
    pending_len: torch.Tensor  # [R] long
    remaining: torch.Tensor  # [R] long
    sampling: RowSampling  # [R]
    u: torch.Tensor | None  # [R, >= depth] the drafter's uniforms (None: no row samples by rejection)
    feats: torch.Tensor | None = None  # [R, P, F] a head's target features before the pending tokens
    span: int = 0  # draft slots the step's forwards attend over (the host's choice: StepPlan)
    noise: torch.Tensor | None = None  # [R, depth + 1, V] coupled rows' Gumbel noise per child depth (None: none)

    def noise_at(self, d: int) -> torch.Tensor | None:
        """[R, V] the coupled rows' noise at the output position of depth-d nodes (None: no row is coupled)."""
        return None if self.noise is None else self.noise[:, d - 1]
    grammar: object | None = None  # constrained rows: their drafts masked by their grammars (mmspec.constrain.state.DraftMask)

    def root(self) -> torch.Tensor:
        """[R] each row's newest pending token: the root of its tree."""
        return self.pending.gather(1, (self.pending_len - 1)[:, None])[:, 0]


@dataclass
class Drafted:
    """A step's drafted trees and what :meth:`Drafting.commit` needs of them."""

    tree: TreeBatch
    fed: torch.Tensor  # [R, N] long in-block slot of each node, -1: never fed
    seen: list = field(default_factory=list)  # adaptive weights: each fed depth's per-view logits


def coupled_key(logq: torch.Tensor, noise: torch.Tensor | None, rs: RowSampling) -> torch.Tensor:
    """What children are ranked by: ``log q`` [R, F, V], plus on coupled rows their seed's noise at
    the children's output position (noise [R, V]): the draft's own Gumbel-max draw, rank 0, is the
    token the target draws there whenever the two agree, which is what a coupled row's
    verification accepts (:func:`~mmspec.runtime.verify.verify_steps`)."""
    if noise is None or not rs.any_coupled:
        return logq
    V = logq.shape[-1]
    return torch.where(rs.coupled[:, None, None], logq + noise[:, None, :V].to(logq.dtype), logq)


def coupled_top(logq: torch.Tensor, noise: torch.Tensor, rs: RowSampling, k: int, tokens: torch.Tensor,
                scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k children coupled rows draft (the rest keep ``tokens``, ``scores`` [R, F, k]): the top k
    of :func:`coupled_key`, each scored by its log q, as every tree node is (scoring them by their
    key's gap to the best instead drafted trees with up to 2.5% lower tau: docs/sampling.md).
    logq [R, F, V] (-inf where q is 0) -> tokens, scores [R, F, k]."""
    t = coupled_key(logq, noise, rs).topk(k, dim=-1).indices  # [R, F, k]
    c = rs.coupled[:, None, None]
    return torch.where(c, t, tokens), torch.where(c, logq.gather(-1, t).to(scores.dtype), scores)


def drop_duplicates(tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per row, keep each token's best-scoring occurrence: tokens, scores [..., C] -> scores with the
    other occurrences at -inf (the first occurrence wins a tie)."""
    same = tokens[..., :, None] == tokens[..., None, :]  # [..., C, C]
    C = tokens.shape[-1]
    idx = torch.arange(C, device=tokens.device)
    si, sj = scores[..., :, None], scores[..., None, :]
    better = (sj > si) | ((sj == si) & (idx[None, :] < idx[:, None]))
    return scores.masked_fill((same & better).any(-1), NEG)


class Drafting:
    """The tree maths every model drafter shares, batched over a step's requests (module docstring).

    A subclass sets ``spec`` (the decoder's tree), ``vocab`` (the target's), ``keeps_path`` (the
    accepted fed nodes stay in the draft cache: True for a draft model, False for a head, whose
    accepted tokens come back pending with the target's features) and implements
    :meth:`feed_pending`, :meth:`feed` and :meth:`distributions`."""

    spec: TreeSpec
    vocab: int
    keeps_path: bool = True

    # ------------------------------------------------------------------ subclass hooks
    def feed_pending(self, x: StepInput) -> torch.Tensor:
        """Feed every row's pending tokens; -> the draft's logits after each row's last one (the
        root), in the subclass's row layout (:meth:`distributions` reads it)."""
        raise NotImplementedError

    def feed(self, x: StepInput, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
             first_slot: int, inblock: torch.Tensor) -> torch.Tensor:
        """Feed tree nodes ``nodes`` [R, n] (their tokens and parents) at depth ``depth`` into the
        in-block slots ``first_slot .. first_slot + n - 1``; inblock [R, n, first_slot + n]: which
        in-block slots each sees. -> their logits (subclass layout)."""
        raise NotImplementedError

    def distributions(self, logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
        """Logits (subclass layout) at F nodes per row -> the q each row drafts from [R, F, vocab]."""
        raise NotImplementedError

    def top_children(self, logits: torch.Tensor, k: int, rs: RowSampling,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best children of F nodes per row: tokens [R, F, k], log-scores [R, F, k] (log q).
        noise [R, V]: the coupled rows' noise at the children's position; they rank by
        ``log q + noise`` (:func:`coupled_key`), scored by :func:`coupled_scores`."""
        q = self.distributions(logits, rs)
        s, t = q.topk(k, dim=-1)
        if noise is None or not rs.any_coupled:
            return t, s.clamp_min(1e-30).log()
        return coupled_top(q.clamp_min(1e-30).log().masked_fill(q <= 0, NEG), noise, rs, k, t, s.clamp_min(1e-30).log())

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[R, F] the argmax child where that needs no distribution (one view), else None."""
        return None

    def begin(self, rows: int, n_nodes: int) -> None:
        """Called by the host before a step drafts up to ``n_nodes`` nodes for each of ``rows``
        rows (a head sizes a buffer here: never inside the step, whose graph keeps its addresses)."""

    def span_for(self, spec: TreeSpec | None, width: int, ahead: int = 0) -> int:
        """Draft slots a step of ``spec`` (None: a catch-up feed) attends over: every row's
        committed ones, its pending tokens (``width`` at most) and the tree's fed nodes;
        ``ahead``: slots a step in flight may still commit (the host has not read it)."""
        return self.rows.span(width + (inblock_slots(spec) if spec is not None else 0) + 1 + ahead)

    def step_state(self) -> list[torch.Tensor]:
        """The tensors a step writes (restored after a capture's warm-up runs)."""
        return [self.rows.length, self.rows.position]

    # ------------------------------------------------------------------ a step's tree
    def draft(self, x: StepInput, spec: TreeSpec) -> Drafted:
        """Feed the pending tokens, then draft ``spec`` (the decoder's tree, cut to the step's
        depth) for every row."""
        logits = self.feed_pending(x)
        root = x.root()[:, None]  # [R, 1]
        if spec.kind == "chain":
            return self._chain(x, root, logits, spec.max_depth, spec.stop_below)
        if spec.kind == "static":
            return self._static(x, root, logits, spec)
        return self._dynamic(x, root, logits, spec)

    def _chain(self, x: StepInput, root: torch.Tensor, logits: torch.Tensor, depth: int,
               stop_below: float | None) -> Drafted:
        """A chain of ``depth`` drafts per row: greedy rows take q's argmax, sampling rows draw from
        q (the row's own uniforms; a coupled row: q's Gumbel-max draw with its seed's noise at the
        node's position); node d is fed at in-block slot d - 1, the deepest never. A step whose rows
        are all constrained stops drafting where every row's grammar forces the rest of the chain
        (the masked q is one-hot there: drafting would copy the forced tokens at a forward each);
        its last node is then fed, and the forced tokens come as the chain's tail
        (:mod:`mmspec.constrain.tails`); ``max_depth`` stays ``depth``."""
        R, dev = x.rows, root.device
        rs = x.sampling
        toks, qs, probs = [root[:, 0]], [], []
        n_fed = depth - 1
        for d in range(1, depth + 1):
            if rs.any_sampling or stop_below is not None or x.grammar is not None:
                q = self.distributions(logits, rs)[:, 0]  # [R, V]
                if x.grammar is not None:  # constrained rows: q over the tokens their grammar allows here
                    q = self.constrained(x, q[:, None], torch.stack(toks, 1), d - 1, depth - d + 1)[:, 0]
                    if x.grammar.stop:  # every row's grammar forces nodes d .. depth: not drafted
                        n_fed = d - 1
                        break
                tok = q.argmax(-1)
                if rs.any_sampling:
                    drawn = tok if x.u is None else sample(q, x.u[:, d - 1])
                    if rs.any_coupled:
                        drawn = torch.where(rs.coupled, coupled_key(q.log()[:, None], x.noise_at(d), rs)[:, 0].argmax(-1),
                                            drawn)
                    tok = torch.where(rs.greedy, tok, drawn)
                    qs.append(q)
                probs.append(q.gather(-1, tok[:, None])[:, 0])
            else:
                tok = self.greedy_argmax(logits)
                tok = self.distributions(logits, rs)[:, 0].argmax(-1) if tok is None else tok[:, 0]
            toks.append(tok)
            if d < depth:
                node = torch.full((R, 1), d, dtype=torch.long, device=dev)
                inblock = torch.ones(1, 1, d, dtype=torch.bool, device=dev).expand(R, 1, d)
                logits = self.feed(x, node, tok[:, None], node - 1, d, d - 1, inblock)
        n = len(toks)
        idx = torch.arange(n, device=dev)
        tokens = torch.stack(toks, 1)  # [R, n]
        fed = torch.where((idx > 0) & (idx <= n_fed), idx - 1, -1).expand(R, n)
        q = sampled = None
        if qs:
            q = torch.cat([torch.zeros_like(qs[0])[:, None], torch.stack(qs, 1)], 1).to(torch.float64)  # [R, n, V]
            sampled = (idx > 0)[None] & ~rs.greedy[:, None]
        valid = None
        if stop_below is not None and probs:  # dynamic draft length: nothing after the first unsure draft
            sure = torch.stack(probs, 1) >= stop_below  # [R, depth]
            ok = torch.cat([torch.ones(R, 2, dtype=torch.bool, device=dev), sure[:, :-1].cumprod(1).bool()], 1)
            valid = ok[:, :n]
        tree = TreeBatch(tokens=tokens, parents=(idx - 1).expand(R, n), depth=idx.expand(R, n),
                         anc=(idx[None, :] <= idx[:, None]).expand(R, n, n), fed=fed, valid=valid, max_depth=depth,
                         q=q, sampled=sampled)
        return Drafted(tree=tree, fed=fed)

    def _dynamic(self, x: StepInput, root: torch.Tensor, logits: torch.Tensor, spec: TreeSpec) -> Drafted:
        """EAGLE-2: per depth the ``topk`` children of the frontier, the ``topk`` best new nodes by
        cumulative log q the next frontier (fed), finally the best ``budget`` nodes kept."""
        R, dev, k = x.rows, root.device, spec.topk
        M = 1 + spec.n_generated
        tokens = torch.zeros(R, M, dtype=torch.long, device=dev)
        parents = torch.full((R, M), -1, dtype=torch.long, device=dev)
        depth = torch.zeros(R, M, dtype=torch.long, device=dev)
        score = torch.zeros(R, M, dtype=torch.float32, device=dev)
        fed = torch.full((R, M), -1, dtype=torch.long, device=dev)
        tokens[:, 0] = root[:, 0]
        eye = torch.eye(M, dtype=torch.bool, device=dev)
        anc = eye.expand(R, M, M).clone()
        frontier = torch.zeros(R, 1, dtype=torch.long, device=dev)  # node ids whose logits we hold
        fed_nodes: list[torch.Tensor] = []  # [R, k] node ids per fed depth, in slot order
        made = 1
        for d in range(1, spec.depth + 1):
            tok, s = self.children(x, logits, k, tokens, parents, frontier, x.noise_at(d))  # [R, F, k]
            F = tok.shape[1]
            new = torch.arange(made, made + F * k, device=dev)  # [F k]
            par = frontier.repeat_interleave(k, dim=1)  # [R, F k]
            tokens[:, new] = tok.flatten(1)
            parents[:, new] = par
            depth.index_fill_(1, new, d)
            score[:, new] = (score.gather(1, frontier)[:, :, None] + s.float()).flatten(1)
            anc[:, new] = anc.gather(1, par[:, :, None].expand(R, F * k, M)) | eye[new]  # its parent's, and itself
            made += F * k
            if d == spec.depth:
                break
            best = score[:, new].topk(k, dim=-1).indices.sort(dim=-1).values  # the k best, in creation order
            frontier = new[best]  # [R, k]
            fed.scatter_(1, frontier, torch.arange((d - 1) * k, d * k, device=dev).expand(R, k))
            fed_nodes.append(frontier)
            slots = torch.cat(fed_nodes, 1)  # [R, d k]
            inblock = anc.gather(1, frontier[:, :, None].expand(R, k, M)).gather(2, slots[:, None, :].expand(R, k, d * k))
            logits = self.feed(x, frontier, tokens.gather(1, frontier), parents.gather(1, frontier), d, (d - 1) * k,
                               inblock)
        n_keep = spec.n_nodes - 1
        order = torch.sort(score[:, 1:made], dim=-1, descending=True, stable=True).indices[:, :n_keep]
        keep = torch.cat([torch.zeros(R, 1, dtype=torch.long, device=dev), order.sort(dim=-1).values + 1], 1)
        tree = self._restrict(keep, tokens, parents, depth, anc, spec.depth)
        tree.fed = fed.gather(1, keep)
        return Drafted(tree=tree, fed=tree.fed)

    @staticmethod
    def _restrict(keep, tokens, parents, depth, anc, max_depth: int) -> TreeBatch:
        """The nodes ``keep`` [R, N] (ascending, root first) of each row's drafted tree, renumbered."""
        R, M = tokens.shape
        N = keep.shape[1]
        inv = torch.full((R, M), -1, dtype=torch.long, device=keep.device)
        inv.scatter_(1, keep, torch.arange(N, device=keep.device).expand(R, N))
        par = parents.gather(1, keep)
        par = torch.where(par < 0, par, inv.gather(1, par.clamp_min(0)))
        a = anc.gather(1, keep[:, :, None].expand(R, N, M)).gather(2, keep[:, None, :].expand(R, N, N))
        return TreeBatch(tokens=tokens.gather(1, keep), parents=par, depth=depth.gather(1, keep), anc=a,
                         fed=None, valid=None, max_depth=max_depth)

    def _static(self, x: StepInput, root: torch.Tensor, logits: torch.Tensor, spec: TreeSpec) -> Drafted:
        """A Medusa-style static tree: node ``path`` is the ``path[-1]``-ranked child (by q) of node
        ``path[:-1]``; nodes with children are fed, one forward per depth."""
        R, dev = x.rows, root.device
        plans = self.__dict__.setdefault("_static_plans", {})  # made once per tree and device
        key = (spec.paths, str(dev))
        plan = plans[key] if key in plans else plans.setdefault(key, static_plan(spec, dev))
        M = plan["M"]
        tokens = torch.zeros(R, M, dtype=torch.long, device=dev)
        tokens[:, 0] = root[:, 0]
        front = None  # the nodes whose children the logits score (None: the root)
        for d, level in enumerate(plan["levels"], start=1):
            tok, _ = self.children(x, logits, level["R"], tokens, plan["parents"], front, x.noise_at(d))  # [R, F, R_d] ranked children
            tokens[:, level["idx"]] = tok[:, level["rows"], level["ranks"]]
            if d == spec.max_depth or "frontier" not in level:
                break
            f = level["frontier"]
            front = f
            logits = self.feed(x, f.expand(R, -1), tokens[:, f], plan["parents"][f].expand(R, -1), d,
                               level["first"], level["block"].expand(R, -1, -1))
        fed = plan["fed"].expand(R, M)
        tree = TreeBatch(tokens=tokens, parents=plan["parents"].expand(R, M), depth=plan["depth"].expand(R, M),
                         anc=plan["anc"].expand(R, M, M), fed=fed, valid=None, max_depth=spec.max_depth)
        return Drafted(tree=tree, fed=fed)

    # ------------------------------------------------------------------ under a constraint
    def children(self, x: StepInput, logits: torch.Tensor, k: int, tokens: torch.Tensor, parents: torch.Tensor,
                 frontier: torch.Tensor | None, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`top_children` of the frontier nodes [R, F] or [F] (None: the root) of trees
        tokens [R, M], parents [R, M] or [M]; with constrained rows (``x.grammar``) the children of
        their q masked by their grammars (a free step adds no operation); noise [R, V]: the coupled
        rows' noise at the children's position (:func:`coupled_top`)."""
        if x.grammar is None:
            return self.top_children(logits, k, x.sampling, noise)
        R = tokens.shape[0]
        parents = parents.expand(R, -1) if parents.dim() == 1 else parents
        if frontier is None:
            frontier = torch.zeros(R, 1, dtype=torch.long, device=tokens.device)
        frontier = frontier.expand(R, -1) if frontier.dim() == 1 else frontier
        q = x.grammar.mask(self.distributions(logits, x.sampling), tokens, parents, frontier)
        s, t = q.topk(k, dim=-1)
        if noise is None or not x.sampling.any_coupled:
            return t, s.clamp_min(1e-30).log()
        logq = q.clamp_min(1e-30).log().masked_fill(q <= 0, NEG)
        return coupled_top(logq, noise, x.sampling, k, t, s.clamp_min(1e-30).log())

    def constrained(self, x: StepInput, q: torch.Tensor, tokens: torch.Tensor, node: int, rest: int) -> torch.Tensor:
        """A chain's q [R, 1, V] at its node ``node`` (tokens [R, node + 1] drafted so far) masked by
        the constrained rows' grammars; ``rest``: the chain's nodes left to draft (whether the
        grammars force them all: ``x.grammar.stop``)."""
        R, n = tokens.shape
        idx = torch.arange(n, device=tokens.device)
        return x.grammar.mask(q, tokens, (idx - 1).expand(R, n), torch.full((R, 1), node, device=tokens.device), rest)

    # ------------------------------------------------------------------ after verification
    def kept(self, d: Drafted, path: torch.Tensor, n_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The accepted nodes that stay in the draft cache: their in-block slots [R, D] (along the
        path, root excluded; entries past the kept ones: their last) and their count m [R]. The fed
        nodes of an accepted path are a prefix of it (only fed nodes have children)."""
        D = path.shape[1] - 1
        slot = d.fed.gather(1, path[:, 1:])  # [R, D]
        on = (torch.arange(D, device=path.device)[None] < n_accepted[:, None]) & (slot >= 0)
        m = on.sum(1) if self.keeps_path else torch.zeros_like(n_accepted)
        return slot, m


def static_plan(spec: TreeSpec, dev: torch.device) -> dict:
    """The index tensors of a static tree (its drafter keeps them, one per tree and device): per
    level its node ids, ranks and frontier, the nodes' parents, depths, ancestors and in-block slots."""
    par_l, dep_l, rank_l = static_structure(spec.paths)
    M = 1 + len(par_l)
    parents = torch.tensor([-1] + par_l, dtype=torch.long)
    anc = ancestors_rows(parents[None], spec.max_depth)[0]
    has_kids, frontier, fed_nodes, levels = set(par_l), [0], [], []
    fed = [-1] * M
    for d in range(1, spec.max_depth + 1):
        level = [i for i in range(1, M) if dep_l[i - 1] == d]
        slot = {node: j for j, node in enumerate(frontier)}
        entry = {"idx": torch.tensor(level), "R": max(rank_l[i - 1] for i in level) + 1,
                 "rows": torch.tensor([slot[par_l[i - 1]] for i in level]),
                 "ranks": torch.tensor([rank_l[i - 1] for i in level])}
        frontier = [i for i in level if i in has_kids]
        if frontier:
            entry["first"] = len(fed_nodes)
            for j, node in enumerate(frontier):
                fed[node] = len(fed_nodes) + j
            fed_nodes += frontier
            fidx = torch.tensor(frontier)
            entry.update(frontier=fidx, block=anc[fidx][:, torch.tensor(fed_nodes)][None])
        levels.append(entry)
    on = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    plan = {"M": M, "parents": parents.to(dev), "depth": torch.tensor([0] + dep_l, dtype=torch.long, device=dev),
            "anc": anc.to(dev), "fed": torch.tensor(fed, dtype=torch.long, device=dev),
            "levels": [{k: on(v) for k, v in lv.items()} for lv in levels]}
    return plan
