"""A constrained step's trees before verification: forced tails added, every node masked.

:func:`constrained_tree` is the hook in :meth:`mmspec.engine.step.Engine._device` between the draft
and the verify forward of a step with a constrained row. It reads the step's drafted trees
(tokens, parents, valid) to the host ONCE (xgrammar runs on the host), then per constrained row:

1. **forced tails**: the tokens the grammar forces after each leaf of the row's tree (the only
   legal token, or xgrammar's jump-forward string tokenized: :meth:`RowGrammar.forced_run`), while
   the row's budget of ``tail`` nodes lasts (the leaf of the first-child path first: :func:`leaves`), are added
   below that leaf as point-mass nodes (never fed to the drafter: no draft forward). Under the
   constrained target a forced token has probability 1 and is always accepted; a jump-forward
   token is accepted exactly where the constrained target picks it (greedy: its argmax; a coupled
   row: its seed's draw; rejection sampling: with probability p, a point mass), so the answer stays
   the constrained target's own. The drafter catches up on the accepted tail tokens as pending
   tokens next step, as it does for a model-free proposal beside it. A chain stays a chain (its
   tail continues it; padding nodes continue it too, marked invalid);
2. **masks**: every node's bitmask with the grammar state along its own path
   (:meth:`RowGrammar.fill_tree`: the matcher walks the tree with rollback), all rows' masks one
   ``[R, N, words]`` tensor copied once (free rows, padding rows and nodes below an illegal token:
   all ones).

-> the trees with their tails ([R, N + T], T the longest tail of the step, 0 when none) and the
allowed tokens [R, N + T, V]; the engine masks the verify logits with them in one ``masked_fill``.
"""

from __future__ import annotations

import torch

from mmspec.constrain.state import RowGrammar, unpack, words
from mmspec.drafting.tree import TreeBatch, ancestors_rows

FORCED_TAIL = 8  # the most forced-tail nodes a constrained row adds to a step's tree


def leaves(parents: list[int], valid: list[int], depth: list[int]) -> list[int]:
    """A tree's valid nodes without a valid child: first the leaf of its first-child path (each
    node's first child is its drafter's best: the top-ranked child of a static or dynamic tree),
    then the others deepest first, then in node order."""
    first: dict[int, int] = {}
    for i in range(len(parents) - 1, 0, -1):
        if valid[i] and parents[i] >= 0:
            first[parents[i]] = i
    node = 0
    while node in first:
        node = first[node]
    rest = sorted((i for i, v in enumerate(valid) if v and i not in first and i != node), key=lambda i: (-depth[i], i))
    return ([node] if valid[node] else []) + rest


def row_tails(g: RowGrammar, tokens: list[int], parents: list[int], valid: list[int], tail: int,
              chain: bool) -> list[tuple[int, int, int]]:
    """One row's tail nodes, (token, parent, depth) each, parents as indices of the extended tree
    (its N nodes, then the tail's). A chain's tail hangs below its last node alone."""
    N = len(tokens)
    depth = [0] * N
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1 if parents[i] >= 0 else 0
    out: list[tuple[int, int, int]] = []
    for leaf in ([N - 1] if chain else leaves(parents, valid, depth)):
        if len(out) >= tail:
            break
        path, node = [], leaf
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        parent, d = leaf, depth[leaf]
        for t in g.forced_run(path[::-1], tail - len(out)):
            d += 1
            out.append((t, parent, d))
            parent = N + len(out) - 1
    return out


def constrained_tree(grammars: list[RowGrammar | None], tree: TreeBatch, tail: int,
                     chain: bool) -> tuple[TreeBatch, torch.Tensor]:
    """The step's trees with each constrained row's forced tails, and every node's allowed tokens
    (module docstring). ``grammars[b]``: row b's state (None: free; rows past ``len(grammars)`` are
    a bucket's padding); ``tail``: the most tail nodes a row gets (0: none, masks only); ``chain``:
    the trees are chains (tails continue them)."""
    R, N = tree.tokens.shape
    B = min(len(grammars), R)
    dev = tree.tokens.device
    valid = tree.valid if tree.valid is not None else torch.ones(R, N, dtype=torch.bool, device=dev)
    host = torch.cat([tree.tokens[:B], tree.parents[:B], valid[:B].long()], 1).tolist()  # ONE read of the trees
    rows = [(h[:N], h[N:2 * N], h[2 * N:]) for h in host]
    tails: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
    if tail > 0 and chain:  # a chain that stopped drafting early (forced the rest): its tail takes the rest too
        tail += tree.max_depth - (N - 1)
    if tail > 0:
        for b in range(B):
            if grammars[b] is not None:
                tails[b] = row_tails(grammars[b], *rows[b], tail, chain)
    T = max(map(len, tails))
    M = N + T
    V = next(g.vocab for g in grammars if g is not None)
    bitmask = torch.full((R, M, words(V)), -1, dtype=torch.int32)
    for b in range(B):
        g = grammars[b]
        if g is not None:  # padding nodes are left unconnected (-1): the walk never reaches them
            toks, pars, _ = rows[b]
            pad = T - len(tails[b])
            g.fill_tree(toks + [t for t, _, _ in tails[b]] + [0] * pad,
                        pars + [p for _, p, _ in tails[b]] + [-1] * pad, bitmask[b], drafted=N)
    allowed = unpack(bitmask.to(dev), V)  # ONE copy of the masks, [R, M, V]
    if T == 0:
        return tree, allowed
    return extend(tree, tails, T, chain, valid), allowed


def extend(tree: TreeBatch, tails: list[list[tuple[int, int, int]]], T: int, chain: bool,
           valid: torch.Tensor) -> TreeBatch:
    """The trees [R, N] with each row's tail nodes (padded to T; padding invalid) -> [R, N + T],
    copied to the device in one tensor."""
    R, N = tree.tokens.shape
    dev = tree.tokens.device
    host = []
    for b in range(R):
        nodes = [(t, p, d, 1) for t, p, d in tails[b]]
        for j in range(len(nodes), T):  # padding: a chain's continues it, a tree's hangs from the root
            nodes.append((0, N + j - 1, N + j, 0) if chain else (0, 0, 1, 0))
        host.append(nodes)
    new = torch.tensor(host, dtype=torch.long).to(dev)  # [R, T, 4] ONE copy
    parents = torch.cat([tree.parents, new[..., 1]], 1)
    depth = torch.cat([tree.depth, new[..., 2]], 1)
    if chain:
        idx = torch.arange(N + T, device=dev)
        anc = (idx[None, :] <= idx[:, None]).expand(R, N + T, N + T)
        max_depth = max(tree.max_depth, N - 1 + T)
    else:
        max_depth = tree.max_depth + T
        anc = ancestors_rows(parents, max_depth)
    q = sampled = None
    if tree.q is not None:  # tail nodes are point masses
        q = torch.cat([tree.q, tree.q.new_zeros(R, T, tree.q.shape[-1])], 1)
        sampled = torch.cat([tree.sampled, torch.zeros(R, T, dtype=torch.bool, device=dev)], 1)
    return TreeBatch(tokens=torch.cat([tree.tokens, new[..., 0]], 1), parents=parents, depth=depth, anc=anc,
                     fed=torch.cat([tree.fed, torch.full((R, T), -1, dtype=torch.long, device=dev)], 1),
                     valid=torch.cat([valid, new[..., 3] > 0], 1), max_depth=max_depth, q=q, sampled=sampled)
