"""Verification maths for speculative decoding: pure tensor functions, no model calls.

Notation (DEVELOPERS.md, Conventions): ``p`` is the target distribution, ``q`` the draft distribution.
A block proposes ``k`` draft tokens ``d_1..d_k`` (k <= gamma). The target scores them in one
forward pass, giving ``p`` at ``k + 1`` positions: ``p[i]`` is the target's next-token
distribution before ``d_{i+1}``, and ``p[k]`` follows the last draft token.

* **accepted** tokens: the longest prefix of drafts that passes verification;
* **recovered** token: on the first rejection at position ``i``, a token drawn from the
  residual ``norm(max(0, p[i] - q[i]))`` (greedy: ``argmax p[i]``);
* **bonus** token: when all ``k`` drafts pass, a token drawn from ``p[k]`` (greedy: argmax).

Every block therefore emits ``n_accepted + 1`` tokens (before any EOS / length cut).

Token trees (:mod:`mmspec.drafting.tree`): a block drafts a tree whose node 0 (the root) is the newest
committed token; :func:`verify_tree_greedy` and :func:`verify_tree_sampling` decide the accepted
path in closed form over all nodes at once (pure tensor ops on the device, no host sync: the
engine reads the packed outcome once per block). The engine verifies all the rows of a step at
once: :func:`verify_trees_greedy` and :func:`verify_trees_sampling` are the same maths over B
trees padded to one size (a validity mask: a padding node is never accepted, reached or removed
from a residual; each row its own uniforms and relaxed threshold); the one-tree functions are
their B = 1 case. A chain is a tree with one branch: the engine verifies chains with the tree
functions too (the chain forms and the node-by-node statement of the sampling rule are the
tests' references, in ``tests/helpers/verify_ref.py``).

Sampling over siblings is multi-candidate recursive rejection sampling (SpecInfer, Miao et al.
2024, "multi-step speculative sampling"): the children of a reached node are tested in order;
on each rejection the target distribution becomes the residual ``norm(max(0, p - q_i))`` and the
next sibling is tested against it; if all are rejected the token is drawn from the last
residual. Each candidate's ``q_i`` is the distribution it was proposed from: for a token DRAWN
from the draft's q (a chain under sampling) that is q; for a token CHOSEN deterministically
(top-k children of trees, as EAGLE-2 verifies them, Li et al. 2024) it is a point mass on the
token, whose residual is p with that token removed. Point-mass candidates accept with
probability exactly p(candidate set), the most any lossless rule can for a fixed set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmspec.errors import ArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """How logits become probabilities. Applied identically to p and to every view's q."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # refused rather than reinterpreted: transformers raises for these, or treats them otherwise
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ArgumentError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}",
                                "temperature")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise ArgumentError(f"top_k must be a whole number >= 0 (0 or None: no top-k), got {self.top_k!r}", "top_k")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ArgumentError(f"top_p must be in (0, 1] (1 or None: no nucleus filter), got {self.top_p!r}; "
                                "for the single likeliest token use temperature=0", "top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, then softmax.

    logits: [..., V] -> probs [..., V] (float32 or wider). With ``params.greedy`` the
    temperature is 1 (the distribution is only used to pick / mix, never sampled).
    """
    return torch.softmax(filtered_logits(logits, params), dim=-1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`logits_to_probs` before its softmax: the tempered logits [..., V] with the tokens
    top-k and top-p drop at -inf (float32 or wider). ``argmax(filtered + g)`` with Gumbel noise g
    is an exact draw from ``logits_to_probs`` (the Gumbel-max trick: seeded sampling)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not params.greedy:
        x = _tempered(x, params.temperature)
    if params.top_k is not None and 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and 0.0 < params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p
        # the likeliest token always stays, also where top_p is below the dtype's smallest number
        # (1e-300 is 0 in float32, and "mass before >= 0" would drop every token: NaN probabilities)
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _tempered(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` as logits [..., V], shifted so the largest is 0 (the same softmax).

    Shifted first, a small temperature cannot overflow: ``x / 1e-300`` is +-inf in float32 and
    the softmax of inf - inf is NaN, whereas ``(x - max) / t`` is 0 at the maximum and <= 0 (or
    -inf) elsewhere, so a temperature that small gives the limit it stands for: greedy (ties
    share the mass). A temperature below the dtype's smallest normal number (1e-300 rounds to 0
    in float32: 0 / 0 = NaN) is applied in float64, where it is exact, then cast back.
    """
    shifted = x - x.amax(dim=-1, keepdim=True)  # [..., V], <= 0
    if temperature < torch.finfo(x.dtype).tiny:
        return (shifted.double() / temperature).to(x.dtype)
    return shifted / temperature


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. p, q: [..., V] -> [..., V].

    Where p <= q everywhere (p == q), the residual is undefined; any rejection there has
    probability zero, so we fall back to p.
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V] and uniforms u [...] in [0, 1) -> token ids [...] long.

    Runs on the device of ``probs`` with no host sync; the uniforms come from the row's own
    stream (:mod:`mmspec.runtime.rng`), so a seed reproduces a run. Never returns a zero-probability token:
    ``searchsorted(right=True)`` lands on the first cumulative mass strictly above u * total.
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    x = (u.double() * cdf[..., -1])[..., None]  # [..., 1], < total because u < 1
    return torch.searchsorted(cdf, x, right=True)[..., 0].clamp_max(probs.shape[-1] - 1)


# --------------------------------------------------------------------------- trees
@dataclass
class TreeOutcome:
    """What tree verification produced, as device tensors (read with :meth:`packed`): for one
    tree, or batched over B padded trees (one step's rows; :meth:`row` is row b's view).

    ``path`` lists the root and the accepted nodes (tree indices, parents first), padded to
    ``max_depth + 1`` entries by repeating the last accepted node."""

    path: torch.Tensor  # [D + 1] long, or [B, D + 1]
    n_accepted: torch.Tensor  # [] long (or [B]): accepted draft tokens (depth of the deepest accepted node)
    next_token: torch.Tensor  # [] long (or [B]): recovered (after a rejection) or bonus token

    def row(self, b: int) -> TreeOutcome:
        """Row b of a batched outcome: one tree's outcome (views, no copy; its path keeps the
        batch's padding to ``D + 1``, its accepted part is the row's own)."""
        return TreeOutcome(path=self.path[b], n_accepted=self.n_accepted[b], next_token=self.next_token[b])

    def packed(self, *per_node: torch.Tensor) -> torch.Tensor:
        """[2 + (1 + len(per_node)) (D + 1)] long (batched: one such row per tree, [B, ...]):
        n_accepted, next_token, the path, then each per-node tensor ([N] long, or [B, N]) read
        along the path. One ``.tolist()`` of this is the block's single host sync."""
        return torch.cat([self.n_accepted.unsqueeze(-1), self.next_token.unsqueeze(-1), self.path,
                          *[t.gather(-1, self.path) for t in per_node]], dim=-1)

    def unpack(self, host: list[int]) -> AcceptedPath:
        """The host list of one tree's :meth:`packed` (its one ``.tolist()``; batched: a row's
        part, with :meth:`row`'s view) as named fields, cut to the accepted path. Reads only
        shapes of this outcome: no further host sync."""
        d1 = self.path.shape[0]  # D + 1
        n = host[0]
        rows = [host[2 + i * d1:2 + (i + 1) * d1][: n + 1] for i in range((len(host) - 2) // d1)]
        return AcceptedPath(n_accepted=n, next_token=host[1], path=rows[0], along=tuple(rows[1:]))


@dataclass(frozen=True)
class AcceptedPath:
    """One block's verification outcome on the host (:meth:`TreeOutcome.unpack`)."""

    n_accepted: int  # accepted draft tokens
    next_token: int  # the target's token after them: recovered (after a rejection) or bonus
    path: list[int]  # [n_accepted + 1] tree indices: the root, then the accepted nodes
    along: tuple[list[int], ...]  # each per-node tensor given to packed(), read along the path

    @property
    def is_first_branch(self) -> bool:
        """The accepted nodes are 1..n in order (always, for a chain): nothing to move."""
        return self.path == list(range(self.n_accepted + 1))


def _paths_of(leaf: torch.Tensor, anc: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Per row, tree indices root..leaf (parents-first order makes ascending index = ascending
    depth), padded with the leaf to max_depth + 1. leaf [B] long, anc [B, N, N] -> [B, max_depth + 1]."""
    n = anc.shape[-1]
    idx = torch.arange(n, device=anc.device)
    on_path = anc.gather(1, leaf[:, None, None].expand(-1, 1, n))[:, 0]  # [B, N]: anc[b, leaf_b]
    key = torch.where(on_path, idx, n)  # [B, N]: path nodes keep their index, others sort last
    path = key.sort(dim=-1).values[:, : max_depth + 1]
    if path.shape[1] < max_depth + 1:
        path = torch.cat([path, path.new_full((path.shape[0], max_depth + 1 - path.shape[1]), n)], dim=1)
    return torch.where(path == n, leaf[:, None], path)


def _deepest(ok: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the deepest node with ok True (the accepted path is a chain:
    unique per depth). ok, depth [B, N] -> [B]."""
    return torch.where(ok, depth, -1).argmax(dim=-1)


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] at one node per row: index [B] long -> [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), index]


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                       p_logits: torch.Tensor, max_depth: int, relaxed: float | None = None) -> TreeOutcome:
    """Greedy tree verification: accept the longest path whose every token is the target's
    argmax at its parent; the next token is the target's argmax after that path.

    tokens, parents, depth: [N] long (root first, parents first); anc: [N, N] bool;
    p_logits: [N, V] target logits at every node. The one-tree case (B = 1) of
    :func:`verify_trees_greedy`.

    ``relaxed`` (LOSSY, opt-in; MSD's relaxed acceptance): also accept a token whose target
    probability at its parent is at least this threshold. The output then differs from the
    target's greedy output wherever such a token is not the argmax.
    """
    thr = None if relaxed is None else torch.full((1,), relaxed, dtype=torch.float32, device=tokens.device)
    return verify_trees_greedy(tokens[None], parents[None], depth[None], anc[None], None, p_logits[None],
                               max_depth, relaxed=thr).row(0)


def verify_trees_greedy(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                        valid: torch.Tensor | None, p_logits: torch.Tensor, max_depth: int,
                        relaxed: torch.Tensor | None = None) -> TreeOutcome:
    """:func:`verify_tree_greedy` for B trees at once, each padded to N nodes (its real nodes first).

    tokens, parents, depth: [B, N] long; anc: [B, N, N] bool (a real node's ancestors are real);
    valid: [B, N] bool, False at padding nodes (None: none padded); p_logits: [B, N, V];
    max_depth: the deepest node of any row; relaxed: None, or [B] float32 thresholds (LOSSY; a
    row's inf: exact). A padding node is never accepted, whatever its token and logits.
    -> path [B, max_depth + 1], n_accepted [B], next_token [B].
    """
    choice = p_logits.argmax(dim=-1)  # [B, N] the target's token after each node
    par = parents.clamp_min(0)  # [B, N]
    correct = tokens == choice.gather(1, par)  # [B, N]
    if relaxed is not None:
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        p_tok = torch.softmax(p_logits.float(), -1)[rows, par, tokens]  # [B, N] p at the parent of each token
        correct = correct | (p_tok >= relaxed[:, None])
    correct = correct | (torch.arange(correct.shape[1], device=correct.device) == 0)  # the root is committed
    ok = ~(anc & ~correct[:, None, :]).any(-1)  # [B, N]: every node on the path is correct
    if valid is not None:
        ok = ok & valid
    leaf = _deepest(ok, depth)  # [B]
    return TreeOutcome(path=_paths_of(leaf, anc, max_depth), n_accepted=depth.gather(1, leaf[:, None])[:, 0],
                       next_token=choice.gather(1, leaf[:, None])[:, 0])


def remaining_mass(p_elder: torch.Tensor) -> torch.Tensor:
    """Target mass left for a point-mass candidate after its elder siblings were rejected:
    1 - sum of their p. p_elder [..., N, N] (p of each elder sibling's token, 0 elsewhere) -> [..., N]."""
    return 1.0 - p_elder.sum(-1)


def remove_tokens(p: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting point-mass candidates: p with ``removed`` tokens zeroed,
    renormalised. p [..., V], removed [..., V] bool -> [..., V] (p itself if nothing would be left)."""
    r = p.masked_fill(removed, 0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify_tree_sampling(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                         p_probs: torch.Tensor, q_probs: torch.Tensor | None, sampled: torch.Tensor | None,
                         u: torch.Tensor, max_depth: int) -> TreeOutcome:
    """Lossless multi-candidate verification of a tree (recursive rejection over siblings,
    module docstring), evaluated for every node at once. The one-tree case (B = 1) of
    :func:`verify_trees_sampling`.

    tokens, parents, depth: [N] long; anc: [N, N] bool; p_probs: [N, V] target distributions
    (same SamplingParams as q); q_probs: [N, V], row i the distribution node i was DRAWN from
    (read only where ``sampled``); sampled: [N] bool (a drawn node must be its parent's only
    child), or None when every node was chosen deterministically; u: [N + 1] uniforms in [0, 1): u[i] tests node i, u[N] draws the final token.

    Node i (parent a, elder siblings e) is *chosen* when reached, its elders rejected and
    ``u_i * q_i(x_i) < p_a'(x_i)`` where p_a' is a's residual after the elders:
    point mass: ``u_i * (1 - sum_e p_a(x_e)) < p_a(x_i)``; drawn: ``u_i * q_i(x_i) < p_a(x_i)``.
    """
    return verify_trees_sampling(tokens[None], parents[None], depth[None], anc[None], None, p_probs[None],
                                 None if q_probs is None else q_probs[None],
                                 None if sampled is None else sampled[None], u[None], max_depth).row(0)


def verify_trees_sampling(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                          valid: torch.Tensor | None, p_probs: torch.Tensor, q_probs: torch.Tensor | None,
                          sampled: torch.Tensor | None, u: torch.Tensor, max_depth: int) -> TreeOutcome:
    """:func:`verify_tree_sampling` for B trees at once, each padded to N nodes (its real nodes first).

    tokens, parents, depth: [B, N] long; anc: [B, N, N] bool (a real node's ancestors are real);
    valid: [B, N] bool, False at padding nodes (None: none padded); p_probs: [B, N, V]; q_probs:
    [B, N, V] and sampled [B, N] bool, or both None (no row drew a node; a row without q: zeros,
    never sampled); u: [B, N + 1] uniforms: u[b, i] tests node i, u[b, N] draws the final token.
    A padding node (anywhere in the row) is never reached or removed from a residual, whatever its
    token and probabilities.
    -> path [B, max_depth + 1], n_accepted [B], next_token [B].
    """
    B, n = tokens.shape
    dev = tokens.device
    par = parents.clamp_min(0)  # [B, N]
    rows = torch.arange(B, device=dev)[:, None]  # [B, 1]
    p_tok = p_probs[rows, par, tokens].double()  # [B, N] p at the parent of each node's token
    idx = torch.arange(n, device=dev)
    sib = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)  # [B, N, N] same parent
    elder = sib & (idx[None, :] < idx[:, None])  # [B, N, N]: j is an elder sibling of i (padding: never of a real node)
    # a sibling repeating an elder's token (two proposals of one token: a model-free branch beside a
    # drafted one) has nothing left to take: the elder's rejection removed its token from the residual
    repeat = (elder & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [B, N]
    left = remaining_mass(torch.where(elder & ~repeat[:, None, :], p_tok[:, None, :], 0.0))  # [B, N]
    ui = u[:, :n]  # [B, N]
    if sampled is not None:  # the caller passes None when no node was drawn (no host check here)
        q_tok = q_probs.gather(-1, tokens[..., None])[..., 0].double()  # [B, N]
        passes = torch.where(sampled, ui * q_tok < p_tok, ui * left < p_tok)
    else:
        passes = ui * left < p_tok  # [B, N]
    passes = passes & ~repeat
    chosen = passes & ~(elder & passes[:, None, :]).any(-1)  # first passing sibling only
    chosen = chosen | (idx == 0)
    ok = ~(anc & ~chosen[:, None, :]).any(-1)  # [B, N] reached and chosen all the way
    if valid is not None:
        ok = ok & valid
    leaf = _deepest(ok, depth)  # [B]

    # the final token: from p at the leaf, or the residual after its children were all rejected
    kids = parents == leaf[:, None]  # [B, N]
    if valid is not None:
        kids = kids & valid
    p_leaf = _at(p_probs, leaf)  # [B, V]
    removed = torch.zeros(B, p_leaf.shape[-1], device=dev).scatter_add_(1, tokens, kids.to(torch.float32)) > 0
    final = torch.where(kids.any(-1, keepdim=True), remove_tokens(p_leaf, removed), p_leaf)
    if sampled is not None:
        drawn_kid = kids & sampled  # [B, N]: at most one a row (a drawn node is an only child)
        q_kid = (drawn_kid.to(q_probs.dtype)[..., None] * q_probs).sum(1)  # [B, V]
        final = torch.where(drawn_kid.any(-1, keepdim=True), residual(p_leaf, q_kid.to(p_leaf.dtype)), final)
    u_last = u[:, n]  # [B]: no node's test reads it (valid nodes need not come first: a merged proposal's)
    return TreeOutcome(path=_paths_of(leaf, anc, max_depth), n_accepted=depth.gather(1, leaf[:, None])[:, 0],
                       next_token=sample(final, u_last))


# --------------------------------------------------------------------------- one step's rows
@dataclass
class RowSampling:
    """Each row's :class:`SamplingParams` as device tensors (one step's rows, [B] each), with what
    the host knows of them (which filters any row uses), so that a step's rows are filtered,
    verified and drawn from in a fixed number of tensor operations whatever B and whatever mix
    of greedy and sampling rows.

    ``temperature`` is 1 on greedy rows (their distributions are only mixed and argmax-ed, as
    :func:`logits_to_probs` does); ``top_k`` 0 and ``top_p`` 1 mean no filter. ``coupled``: the
    sampling rows whose draws are the Gumbel-max coupling of their seed's per-position noise
    (:func:`verify_steps`; None: no row is)."""

    temperature: torch.Tensor  # [B] float64
    top_k: torch.Tensor  # [B] long
    top_p: torch.Tensor  # [B] float64
    greedy: torch.Tensor  # [B] bool
    any_sampling: bool = False
    all_sampling: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    any_tiny: bool = False  # a temperature below float32's smallest normal number (done in float64)
    coupled: torch.Tensor | None = None  # [B] bool: a coupled sampling row (None: none is)
    any_coupled: bool = False
    all_coupled: bool = False  # every sampling row is coupled (no rejection sampling to run)

    def __post_init__(self) -> None:
        if self.coupled is None:  # no coupled rows without their mask, whatever the flags say
            self.any_coupled = self.all_coupled = False

    def rows(self, index: torch.Tensor | slice) -> RowSampling:
        """These parameters at other rows (e.g. each request's repeated for its draft views)."""
        return RowSampling(self.temperature[index], self.top_k[index], self.top_p[index], self.greedy[index],
                           self.any_sampling, self.all_sampling, self.any_top_k, self.any_top_p, self.any_tiny,
                           None if self.coupled is None else self.coupled[index], self.any_coupled, self.all_coupled)


def flags(params: list[SamplingParams], coupled: list[bool] | None = None) -> dict:
    """What the host knows of a step's rows' parameters (:class:`RowSampling`'s flags);
    ``coupled``: per row, whether it samples by the coupling (None: no row does)."""
    tiny = torch.finfo(torch.float32).tiny
    coupled = coupled or [False] * len(params)
    drawn = [c for p, c in zip(params, coupled) if not p.greedy]
    return dict(any_sampling=any(not p.greedy for p in params), all_sampling=all(not p.greedy for p in params),
                any_top_k=any(p.top_k for p in params),
                any_top_p=any(p.top_p is not None and 0.0 < p.top_p < 1.0 for p in params),
                any_tiny=any(not p.greedy and p.temperature < tiny for p in params),
                any_coupled=any(drawn), all_coupled=all(drawn))


def _per_row(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] broadcasting against ``like`` [B, ..., V]."""
    return x.view(-1, *([1] * (like.dim() - 1)))


def logits_to_probs_rows(logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """:func:`logits_to_probs` with row b's parameters on row b: logits [B, ..., V] -> probs. Each
    row gets exactly the bits :func:`logits_to_probs` gives it alone (the same element-wise
    operations; a filter no row uses is skipped, one some rows use leaves the others unchanged)."""
    return torch.softmax(filtered_logits_rows(logits, rs), dim=-1)


def filtered_logits_rows(logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """:func:`filtered_logits` with row b's parameters on row b: logits [B, ..., V] -> [B, ..., V]
    (:func:`logits_to_probs_rows` before its softmax)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if rs.any_sampling:
        shifted = x - x.amax(dim=-1, keepdim=True)
        t = _per_row(rs.temperature, x)
        tempered = shifted / t.to(x.dtype)
        if rs.any_tiny:
            tiny = t < torch.finfo(x.dtype).tiny
            tempered = torch.where(tiny, (shifted.double() / t).to(x.dtype), tempered)
        x = torch.where(_per_row(rs.greedy, x), x, tempered)
    if rs.any_top_k or rs.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        V = x.shape[-1]
        if rs.any_top_k:
            k = _per_row(rs.top_k, x)
            kth = sorted_x.gather(-1, (k - 1).clamp(0, V - 1).expand(*x.shape[:-1], 1))  # [..., 1]
            x = x.masked_fill((x < kth) & (k > 0) & (k < V), float("-inf"))
            if rs.any_top_p:
                sorted_x, order = torch.sort(x, dim=-1, descending=True)  # as logits_to_probs sorts again
        if rs.any_top_p:
            top_p = _per_row(rs.top_p, x)
            sm = torch.softmax(sorted_x, dim=-1)
            drop_sorted = ((sm.cumsum(dim=-1) - sm) >= top_p.to(sm.dtype)) & (top_p > 0) & (top_p < 1)
            drop_sorted = drop_sorted & (torch.arange(V, device=x.device) > 0)  # the likeliest token stays
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
    return x


def perturbed(filtered: torch.Tensor, noise: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """The Gumbel-perturbed target at every node: ``filtered + g`` where g is the noise of the
    output position a node's child takes. filtered [B, N, V] (:func:`filtered_logits_rows`);
    noise [B, D + 1, V] (row b's noise for the positions of depths 1 .. D + 1, indexed by the
    parent's depth); depth [B, N] -> [B, N, V]. Its argmax at a node is an exact draw from the
    target's filtered distribution there (the Gumbel-max trick), and the same noise at the same
    output position gives the same draw whatever the tree around it."""
    V = filtered.shape[-1]
    g = noise.gather(1, depth.clamp(0, noise.shape[1] - 1)[..., None].expand(-1, -1, V))  # [B, N, V]
    return filtered + g.to(filtered.dtype)


def verify_steps(t, logits: torch.Tensor, rs: RowSampling, u: torch.Tensor | None,
                 relaxed: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> TreeOutcome:
    """ONE verification of a step's rows, greedy and sampling together: t, a
    :class:`~mmspec.drafting.tree.TreeBatch` [B, N] (its ``q`` / ``sampled`` where a row drew nodes);
    logits [B, N, V]; rs: each row's parameters; u [B, N + 1]: each row's uniforms (None when
    no row samples by rejection); relaxed: [B] LOSSY thresholds of greedy rows (inf: exact) or
    None; noise [B, D + 1, V]: each coupled row's Gumbel noise (:func:`perturbed`; None when no
    row is coupled). A greedy row gets :func:`verify_trees_greedy`'s outcome, a coupled row the
    same greedy verification against its perturbed target (a node is accepted when it is the
    target's own seeded draw at its parent, so the answer is the target's seeded sample whatever
    was drafted), any other sampling row :func:`verify_trees_sampling`'s (rejection sampling);
    selected per row on the device (each kind the step holds runs: a fixed op count)."""
    greedy = sampling = None
    x = filtered_logits_rows(logits, rs) if rs.any_sampling else None  # [B, N, V]
    if not rs.all_sampling or rs.any_coupled:
        v = logits
        if rs.any_coupled:
            v = torch.where(_per_row(rs.coupled, logits), perturbed(x, noise, t.depth), logits)
        greedy = verify_trees_greedy(t.tokens, t.parents, t.depth, t.anc, t.valid, v, t.max_depth,
                                     relaxed=relaxed)
    if rs.any_sampling and not rs.all_coupled:
        p = torch.softmax(x, dim=-1)  # [B, N, V]
        q = None if t.q is None else t.q.to(p.dtype)
        sampling = verify_trees_sampling(t.tokens, t.parents, t.depth, t.anc, t.valid, p, q, t.sampled, u, t.max_depth)
    if greedy is None:
        return sampling
    if sampling is None:
        return greedy
    g = rs.greedy if not rs.any_coupled else rs.greedy | rs.coupled
    return TreeOutcome(path=torch.where(g[:, None], greedy.path, sampling.path),
                       n_accepted=torch.where(g, greedy.n_accepted, sampling.n_accepted),
                       next_token=torch.where(g, greedy.next_token, sampling.next_token))
