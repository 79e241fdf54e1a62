"""Model-free proposals in the batched step: prompt lookup and suffix decoding
(:mod:`mmspec.drafting.lookup`) searched on the host, their trees handed to the device in one copy.

Before a step the host gives each row's proposer the tokens committed since the last one (the
prompt's last token first), asks it for a proposal cut to the step's tree shape
(:func:`mmspec.drafting.lookup.pick`), and packs every row's nodes (token, parent, depth), padded to the
step's proposal budget, into ONE staged tensor copied to the device. On the device the proposal
becomes each row's tree (drafting with no model) or is added to the drafted tree as other
branches of the root (beside a draft model or head). Whenever a row's proposal adds a node, all
of that row's nodes are verified as point masses (the rule and its reason:
:mod:`mmspec.drafting.lookup`'s docstring); a chain drawn from the proposal's counts (lookup alone, under
sampling) keeps its q, staged with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.drafting.lookup import Picked, pick
from mmspec.drafting.tree import TreeBatch, TreeSpec, ancestors_rows
from mmspec.runtime import rng
from mmspec.runtime.state import stage

PROPOSAL_SLOT = rng.DRAFT + 1024  # the proposer's draws (a drawn chain) within a step's slots


@dataclass
class Proposals:
    """Every row's proposal on the device: nodes [R, K] (root excluded) with their token, parent
    (0 = the root, i = the i-th proposed node) and depth; ``valid`` marks real nodes; ``q`` [R, K,
    V] the distribution each node was drawn from (a drawn chain; else None); ``any`` [R] bool:
    the row's proposal added a node."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    any: torch.Tensor
    q: torch.Tensor | None = None
    drawn: torch.Tensor | None = None  # [R] bool: the row's chain was drawn (q applies)


def budget(spec: TreeSpec) -> int:
    """Nodes a proposal may add: as many as the step's own block verifies (root excluded)."""
    return spec.n_nodes - 1


def propose(rows: list, spec: TreeSpec, R: int, vocab: int, device: torch.device, sampling: list,
            seeds: list[int], steps: list[int], errors: dict | None = None) -> Proposals:
    """Each active row's proposal (``rows[b]``: (proposer, new committed tokens)) cut to
    ``spec``, packed and copied to the device once. ``sampling[b]``: the row draws a chain (its
    uniforms from its own stream at ``steps[b]``). A proposer that raises proposes nothing and its
    row's exception goes into ``errors`` (the row fails alone)."""
    K = budget(spec)
    drawn_chain = spec.kind == "chain"
    rows_nodes: list[list[tuple[int, int, int]]] = []
    dists: list[list[dict[int, float]] | None] = []
    for b, (proposer, new) in enumerate(rows):
        picked = Picked([], [], [])
        try:
            proposer.extend(new)
            root, min_prob = proposer.propose(spec.max_depth)
            u = None
            if sampling[b] and drawn_chain:  # a seed's draws stay aligned: drawn even when unused
                u = rng.host_uniforms(seeds[b], steps[b], PROPOSAL_SLOT, spec.max_depth)
            if root is not None:
                picked = pick(root, spec, min_prob, u)
        except Exception as e:  # noqa: BLE001 - this row fails alone
            if errors is None:
                raise
            errors[b] = e
        k = min(len(picked.tokens), K)
        rows_nodes.append(list(zip(picked.tokens[:k], picked.parents[:k], picked.depths[:k])))
        dists.append(picked.q[:k] if picked.q else None)
    drawn = any(d is not None for d in dists)
    width = 4 + (vocab if drawn else 0)  # per node: token, parent, depth, real, [q over the vocabulary]
    host = [[0.0] * width for _ in range(R * K)]
    for b, nodes in enumerate(rows_nodes):
        for i, (t, par, d) in enumerate(nodes):
            row = host[b * K + i]
            row[0], row[1], row[2], row[3] = t, par, d, 1.0
            if dists[b] is not None:
                for tok, pr in dists[b][i].items():
                    row[4 + tok] = pr
    staged = torch.tensor(host, dtype=torch.float64).view(R, K, width)  # ONE tensor made on the host
    dev = stage(staged, device)  # and ONE copy to the device (from pinned memory on a GPU)
    nodes = dev[..., :3].long()
    valid = dev[..., 3] > 0
    q = drawn_rows = None
    if drawn:
        q = dev[..., 4:]
        drawn_rows = q.sum(-1).amax(-1) > 0  # [R] the row's chain was drawn from its counts
    return Proposals(tokens=nodes[..., 0], parents=nodes[..., 1], depth=nodes[..., 2], valid=valid,
                     any=valid.any(-1), q=q, drawn=drawn_rows)


def alone(root: torch.Tensor, p: Proposals, max_depth: int) -> TreeBatch:
    """Trees of the root [R] and each row's proposal (drafting with no model)."""
    R, K = p.tokens.shape
    dev = root.device
    zero = torch.zeros(R, 1, dtype=torch.long, device=dev)
    parents = torch.cat([zero - 1, torch.where(p.valid, p.parents, 0)], 1)
    depth = torch.cat([zero, torch.where(p.valid, p.depth, 1)], 1)
    q = sampled = None
    if p.q is not None:  # a drawn chain: each node drawn from its counts
        q = torch.cat([torch.zeros_like(p.q[:, :1]), p.q], 1)
        sampled = torch.cat([torch.zeros(R, 1, dtype=torch.bool, device=dev), p.valid & p.drawn[:, None]], 1)
    return TreeBatch(tokens=torch.cat([root[:, None], p.tokens], 1), parents=parents, depth=depth,
                     anc=ancestors_rows(parents, max_depth), fed=torch.full_like(parents, -1),
                     valid=torch.cat([torch.ones(R, 1, dtype=torch.bool, device=dev), p.valid], 1),
                     max_depth=max_depth, q=q, sampled=sampled)


def merged(tree: TreeBatch, p: Proposals) -> TreeBatch:
    """The drafted trees [R, N] with each row's proposal added as other branches of the root
    (nodes N ..); a row whose proposal added a node is verified as point masses throughout."""
    R, N = tree.tokens.shape
    K = p.tokens.shape[1]
    dev = tree.tokens.device
    par = torch.where(p.parents > 0, p.parents + N - 1, 0)  # proposal node i -> merged index N + i - 1
    parents = torch.cat([tree.parents, torch.where(p.valid, par, 0)], 1)
    depth = torch.cat([tree.depth, torch.where(p.valid, p.depth, 1)], 1)
    valid_d = tree.valid if tree.valid is not None else torch.ones(R, N, dtype=torch.bool, device=dev)
    q = sampled = None
    if tree.q is not None:  # drawn nodes stay drawn only in rows no proposal touched
        q = torch.cat([tree.q, tree.q.new_zeros(R, K, tree.q.shape[-1])], 1)
        sampled = torch.cat([tree.sampled & ~p.any[:, None], torch.zeros(R, K, dtype=torch.bool, device=dev)], 1)
    return TreeBatch(tokens=torch.cat([tree.tokens, p.tokens], 1), parents=parents, depth=depth,
                     anc=ancestors_rows(parents, tree.max_depth),
                     fed=torch.cat([tree.fed, torch.full((R, K), -1, dtype=torch.long, device=dev)], 1),
                     valid=torch.cat([valid_d, p.valid], 1), max_depth=tree.max_depth, q=q, sampled=sampled)
