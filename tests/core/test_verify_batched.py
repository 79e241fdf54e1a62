"""Verification batched over a step's rows equals each row verified alone: random padded batches
of trees (chains, branching trees, different sizes, with and without drawn nodes, relaxed
thresholds), greedy and sampling with the same uniforms, row by row and exactly; padding nodes
are never accepted, whatever they hold; the engine's step 3 verifies greedy and sampling rows of
different parameters in ONE call, each row exactly as alone."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.verify_ref import DraftTree, pad_rows, pad_trees
from mmspec.drafting.tree import ancestors
from mmspec.runtime.verify import (
    RowSampling,
    SamplingParams,
    flags,
    logits_to_probs,
    verify_steps,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_trees_greedy,
    verify_trees_sampling,
)

V = 8


def _tree(n: int, width: int, g: torch.Generator, drawn: bool = False) -> DraftTree:
    """A random tree of n nodes, parents first, distinct siblings, at most ``width`` children a
    node; ``drawn``: a chain whose nodes were drawn from q (q and sampled set)."""
    parents = [-1]
    for i in range(1, n):
        while True:
            p = i - 1 if width == 1 else int(torch.randint(0, i, (1,), generator=g))
            if parents.count(p) < width:
                break
        parents.append(p)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(n), key=lambda i: (depth[i], parents[i], i))  # parents first, siblings in order
    inv = {old: new for new, old in enumerate(order)}
    par = torch.tensor([-1 if parents[i] < 0 else inv[parents[i]] for i in order])
    dep = torch.tensor([depth[i] for i in order])
    tokens = torch.zeros(n, dtype=torch.long)
    tokens[0] = int(torch.randint(0, V, (1,), generator=g))
    for a in range(n):
        kids = (par == a).nonzero().flatten()
        tokens[kids] = torch.randperm(V, generator=g)[: len(kids)]
    max_depth = int(dep.max())
    q = sampled = None
    if drawn:
        q = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
        sampled = torch.arange(n) > 0
    return DraftTree(tokens=tokens, parents=par, depth=dep, anc=ancestors(par, max_depth),
                     fed=torch.randperm(n, generator=g), max_depth=max_depth, is_chain=width == 1, q=q, sampled=sampled)


def _favour_children(scores: torch.Tensor, tree: DraftTree, g: torch.Generator, boost: float) -> torch.Tensor:
    """scores [n, V] with, at most nodes, one child's token made likely (acceptance goes deep)."""
    scores = scores.clone()
    for a in range(tree.size):
        kids = (tree.parents == a).nonzero().flatten()
        if len(kids) and float(torch.rand(1, generator=g)) < 0.75:
            kid = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            scores[a, tree.tokens[kid]] += boost
    return scores


def _batch(g: torch.Generator, b: int, drawn_rows: str):
    trees = []
    for i in range(b):
        n = int(torch.randint(1, 11, (1,), generator=g))
        width = 1 if i % 3 == 0 else int(torch.randint(2, 4, (1,), generator=g))
        drawn = width == 1 and (drawn_rows == "all" or (drawn_rows == "some" and i % 2 == 0))
        trees.append(_tree(n, width, g, drawn))
    return trees


def _padded(rows: list[torch.Tensor], g: torch.Generator, extra: int = 0) -> torch.Tensor:
    """[n_b, ...] rows -> [B, N + extra, ...] with random junk (not zeros) in the padding."""
    n = max(r.shape[0] for r in rows) + extra
    out = torch.rand(len(rows), n, *rows[0].shape[1:], generator=g, dtype=rows[0].dtype) * 50
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def _same(out, b: int, ref, tree: DraftTree) -> None:
    row = out.row(b)
    d1 = tree.max_depth + 1
    assert (int(row.n_accepted), int(row.next_token)) == (int(ref.n_accepted), int(ref.next_token))
    assert row.path[:d1].tolist() == ref.path.tolist()
    assert (row.path[d1:] == ref.path[-1]).all()  # padded by repeating the leaf


@pytest.mark.parametrize("relaxed", [False, True])
def test_batched_greedy_equals_each_tree_alone(relaxed):
    g = torch.Generator().manual_seed(1)
    deep = 0
    for _ in range(60):
        trees = _batch(g, int(torch.randint(1, 7, (1,), generator=g)), "some")
        logits = [_favour_children(torch.randn(t.size, V, generator=g), t, g, 1.5 if relaxed else 6.0) for t in trees]
        thr = [None if not relaxed or b % 3 == 2 else float(torch.rand(1, generator=g)) * 0.4 for b in range(len(trees))]
        tb = pad_trees(trees)
        rel = None if not relaxed else torch.tensor([math.inf if x is None else x for x in thr], dtype=torch.float32)
        out = verify_trees_greedy(tb.tokens, tb.parents, tb.depth, tb.anc, tb.valid, _padded(logits, g), tb.max_depth,
                                  relaxed=rel)
        assert out.path.shape == (len(trees), tb.max_depth + 1)
        for b, t in enumerate(trees):
            ref = verify_tree_greedy(t.tokens, t.parents, t.depth, t.anc, logits[b], t.max_depth, relaxed=thr[b])
            _same(out, b, ref, t)
            deep += int(ref.n_accepted) >= 2
    assert deep >= 30  # the batches exercised long accepted paths, not only roots


@pytest.mark.parametrize("drawn_rows", ["none", "some", "all"])
def test_batched_sampling_equals_each_tree_alone_with_the_same_uniforms(drawn_rows):
    g = torch.Generator().manual_seed(2)
    deep = 0
    for _ in range(60):
        trees = _batch(g, int(torch.randint(1, 7, (1,), generator=g)), drawn_rows)
        p = [torch.softmax(_favour_children(torch.randn(t.size, V, generator=g), t, g, 3.0), -1).double() for t in trees]
        us = [torch.rand(t.size + 1, generator=g, dtype=torch.float64) for t in trees]
        tb = pad_trees(trees, q_dtype=torch.float64)
        assert (tb.q is None) == (drawn_rows == "none")
        u = _final_last(us, tb.size, g)  # junk at the padding nodes; each row's final uniform in the last column
        out = verify_trees_sampling(tb.tokens, tb.parents, tb.depth, tb.anc, tb.valid, _padded(p, g), tb.q, tb.sampled,
                                    u, tb.max_depth)
        for b, t in enumerate(trees):
            ref = verify_tree_sampling(t.tokens, t.parents, t.depth, t.anc, p[b], t.q, t.sampled, us[b], t.max_depth)
            _same(out, b, ref, t)
            deep += int(ref.n_accepted) >= 2
    assert deep >= 20


def test_batched_trees_of_one_size_need_no_mask():
    g = torch.Generator().manual_seed(3)
    trees = [_tree(6, w, g) for w in (1, 2, 3, 1)]
    tb = pad_trees(trees)
    assert tb.valid is None and tb.tokens.shape == (4, 6)
    logits = torch.stack([_favour_children(torch.randn(6, V, generator=g), t, g, 6.0) for t in trees])
    out = verify_trees_greedy(tb.tokens, tb.parents, tb.depth, tb.anc, tb.valid, logits, tb.max_depth)
    for b, t in enumerate(trees):
        _same(out, b, verify_tree_greedy(t.tokens, t.parents, t.depth, t.anc, logits[b], t.max_depth), t)


def _decoy_batch():
    """Row 0: a chain root -> 1 -> 2 (3 real nodes) whose padding nodes 3, 4 continue the chain
    with the target's own tokens, as if drafted; row 1: 5 real nodes. Target: argmax after node i
    of row 0 is token i + 1 (so nodes 1, 2 and the decoys 3, 4 are all 'correct')."""
    n = 5
    tokens = torch.tensor([[0, 1, 2, 3, 4], [0, 5, 6, 7, 1]])
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2]])
    depth = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 1, 2, 2]])
    anc = torch.stack([ancestors(parents[0], 4), ancestors(parents[1], 2)])
    valid = torch.tensor([[True, True, True, False, False], [True] * 5])
    logits = torch.full((2, n, V), -4.0)
    for i in range(n):
        logits[0, i, (i + 1) % V] = 4.0
    logits[1, :, 7] = 4.0  # row 1 accepts nothing
    return tokens, parents, depth, anc, valid, logits


def test_padding_nodes_are_never_accepted_whatever_they_hold():
    tokens, parents, depth, anc, valid, logits = _decoy_batch()
    out = verify_trees_greedy(tokens, parents, depth, anc, valid, logits, 4)
    assert out.n_accepted.tolist() == [2, 0] and out.path[0].tolist() == [0, 1, 2, 2, 2]
    assert out.next_token.tolist() == [3, 7]
    # the control: without the mask, the decoys would be accepted
    assert verify_trees_greedy(tokens, parents, depth, anc, None, logits, 4).n_accepted.tolist() == [4, 0]

    p = torch.softmax(logits.double() * 4, -1)  # near point masses on the same tokens
    u = torch.full((2, 6), 0.5, dtype=torch.float64)
    out = verify_trees_sampling(tokens, parents, depth, anc, valid, p, None, None, u, 4)
    assert out.n_accepted.tolist() == [2, 0]
    assert out.next_token[0] == 3  # drawn from p after node 2: the decoy's token is not removed from it
    assert verify_trees_sampling(tokens, parents, depth, anc, None, p, None, None, u, 4).n_accepted.tolist() == [4, 0]


def _final_last(us: list[torch.Tensor], n: int, g: torch.Generator) -> torch.Tensor:
    """Per-row uniforms [n_b + 1] -> [B, n + 1]: node i's test at column i (junk at padding
    nodes), the final draw's at column n, where the batched verification reads it."""
    u = torch.rand(len(us), n + 1, generator=g, dtype=torch.float64)
    for b, x in enumerate(us):
        u[b, :x.shape[0] - 1], u[b, n] = x[:-1], x[-1]
    return u


# --------------------------------------------------------------------------- the engine's step 3
def test_one_call_verifies_greedy_and_sampling_rows_each_as_alone():
    """Greedy rows (one relaxed) and sampling rows of two SamplingParams in ONE verification: each
    row's outcome is its tree verified alone with its own parameters and uniforms."""
    g = torch.Generator().manual_seed(4)
    hot, cool = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)
    plan = [(SamplingParams(), _tree(7, 3, g), None), (hot, _tree(5, 1, g, drawn=True), None),
            (cool, _tree(9, 2, g), None), (SamplingParams(), _tree(3, 1, g), 0.2), (hot, _tree(6, 3, g), None),
            (cool, _tree(2, 1, g, drawn=True), None), (hot, _tree(4, 2, g), None)]
    trees = [t for _, t, _ in plan]
    tb = pad_trees(trees, q_dtype=torch.float64)
    logits = torch.randn(len(plan), tb.size, V, generator=g) * 2
    for b, t in enumerate(trees):
        logits[b, :t.size] = _favour_children(logits[b, :t.size], t, g, 4.0)
    us = [torch.rand(t.size + 1, generator=g, dtype=torch.float64) for t in trees]
    ps = [params for params, _, _ in plan]
    rs = RowSampling(torch.tensor([1.0 if p.greedy else p.temperature for p in ps], dtype=torch.float64),
                     torch.tensor([p.top_k or 0 for p in ps]), torch.tensor([p.top_p or 1.0 for p in ps],
                                                                           dtype=torch.float64),
                     torch.tensor([p.greedy for p in ps]), **flags(ps))
    relaxed = torch.tensor([math.inf if r is None else r for _, _, r in plan], dtype=torch.float32)
    out = verify_steps(tb, logits, rs, _final_last(us, tb.size, g), relaxed)
    for b, (params, t, rel) in enumerate(plan):
        lg = logits[b, :t.size]
        if params.greedy:
            ref = verify_tree_greedy(t.tokens, t.parents, t.depth, t.anc, lg, t.max_depth, relaxed=rel)
        else:
            p = logits_to_probs(lg, params)
            ref = verify_tree_sampling(t.tokens, t.parents, t.depth, t.anc, p, None if t.q is None else t.q.to(p.dtype),
                                       t.sampled, us[b], t.max_depth)
        _same(out, b, ref, t)


def test_repeated_sibling_tokens_take_nothing_twice():
    """Two siblings proposing one token (a model-free branch beside a drafted one): once the first
    is rejected its token is gone from the residual, so the second never passes; the rest of the
    siblings see the same remaining mass as without the repeat."""
    tokens = torch.tensor([[0, 1, 1, 2]])
    parents = torch.tensor([[-1, 0, 0, 0]])
    depth = torch.tensor([[0, 1, 1, 1]])
    anc = ancestors(parents[0], 1)[None]
    p = torch.tensor([[[0.0, 0.5, 0.3, 0.2]] * 4], dtype=torch.float64)
    u = torch.tensor([[0.0, 0.9, 0.0, 0.5, 0.5]], dtype=torch.float64)  # node 1 rejected (0.9 >= 0.5)
    out = verify_trees_sampling(tokens, parents, depth, anc, None, p, None, None, u, 1)
    assert out.path[0, 1] == 3 and int(out.n_accepted) == 1  # node 2 (the repeat) skipped; node 3: 0.5 * 0.5 < 0.3
    alone = verify_trees_sampling(tokens[:, [0, 1, 3]], torch.tensor([[-1, 0, 0]]), depth[:, :3], ancestors(
        torch.tensor([-1, 0, 0]), 1)[None], None, p[:, :3], None, None, u[:, [0, 1, 3, 4]], 1)
    assert int(alone.n_accepted) == 1 and int(alone.next_token) == int(out.next_token)


def test_pad_rows_and_pad_trees_shapes():
    g = torch.Generator().manual_seed(5)
    a, b = _tree(3, 1, g), _tree(5, 2, g, drawn=False)
    tb = pad_trees([a, b])
    assert tb.tokens.shape == (2, 5) and tb.anc.shape == (2, 5, 5) and tb.max_depth == max(a.max_depth, b.max_depth)
    assert tb.valid.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert tb.parents[0, 3:].tolist() == [-1, -1] and tb.fed[0, 3:].tolist() == [-1, -1] and not tb.anc[0, 3:].any()
    one = pad_trees([a])
    assert one.valid is None and one.tokens.data_ptr() == a.tokens.data_ptr()  # one row: views, no copy
    assert pad_rows([torch.ones(2), torch.ones(3)], 7.0).tolist() == [[1, 1, 7], [1, 1, 1]]


def test_each_rows_parameters_filter_it_exactly_as_alone():
    """logits_to_probs_rows: every row filtered with its own temperature, top-k and top-p, bit for
    bit what logits_to_probs gives that row alone (greedy rows, a temperature below float32's
    smallest normal, top-k and top-p together among them)."""
    from mmspec.runtime.verify import logits_to_probs_rows

    g = torch.Generator().manual_seed(6)
    ps = [SamplingParams(), SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(0.9, top_p=0.8),
          SamplingParams(1e-300), SamplingParams(0.5, top_k=3, top_p=0.5), SamplingParams(top_k=4)]
    x = torch.randn(len(ps), 3, 50, generator=g)
    x[:, :, 7] = x[:, :, 3]  # a tie, where an unstable sort could pick another order
    rs = RowSampling(torch.tensor([1.0 if p.greedy else p.temperature for p in ps], dtype=torch.float64),
                     torch.tensor([p.top_k or 0 for p in ps]),
                     torch.tensor([p.top_p or 1.0 for p in ps], dtype=torch.float64),
                     torch.tensor([p.greedy for p in ps]), **flags(ps))
    out = logits_to_probs_rows(x, rs)
    for b, p in enumerate(ps):
        assert torch.equal(out[b], logits_to_probs(x[b], p)), p
