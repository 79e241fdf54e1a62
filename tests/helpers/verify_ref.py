"""Reference forms of ``mmspec.runtime.verify`` that only the tests use: the chain cases of the tree
verifiers (:func:`verify_greedy`, :func:`verify_sampling`, each a one-branch tree through
``verify_tree_greedy`` / ``verify_tree_sampling``) and :func:`accept_or_residual`, the
node-by-node statement of the sampling rule the tree verifier evaluates for all nodes at once.
The engine verifies chains as trees; these keep the hand-built chain tests readable. Also: one
drafted tree (:class:`DraftTree`) and padding single trees into a :class:`~mmspec.drafting.tree.TreeBatch`
(:func:`pad_trees`), to check the batched verifiers against each tree alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mmspec.drafting.tree import TreeBatch
from mmspec.runtime.verify import residual, verify_tree_greedy, verify_tree_sampling


def uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """n uniforms in [0, 1), float64, on ``device``, from a test's generator."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, dtype=torch.float64, device=gdev).to(device)


@dataclass(frozen=True)
class BlockOutcome:
    """What one verification produced."""

    n_accepted: int  # accepted draft tokens (0..k)
    next_token: int  # the recovered token (on rejection) or the bonus token (all accepted)
    bonus: bool  # True when all k drafts were accepted and next_token came from p[k]


def accept_or_residual(token: int, p: torch.Tensor, q: torch.Tensor, u: float) -> tuple[bool, torch.Tensor]:
    """One speculative-sampling test of ``token`` (proposed from q) against p. p, q: [V].

    Accept when ``u < p(x) / q(x)`` (u uniform in [0, 1)). Returns (accepted, residual) where the
    residual is the distribution to continue with after a rejection: for a tree node with
    further candidate children it becomes the new p. The sequential, node-by-node statement of
    what :func:`mmspec.runtime.verify.verify_tree_sampling` evaluates for all nodes at once (the tests check one
    against the other).
    """
    px, qx = float(p[token]), float(q[token])
    if qx > 0 and u * qx < px:  # u < p/q without dividing by a tiny q
        return True, p
    return False, residual(p, q)


def chain_tree(draft_tokens: torch.Tensor, root: int = 0) -> tuple[torch.Tensor, ...]:
    """A chain of k drafts as a tree: tokens, parents, depth, anc, each for k + 1 nodes."""
    k = draft_tokens.shape[0]
    dev = draft_tokens.device
    tokens = torch.cat([torch.tensor([root], device=dev, dtype=torch.long), draft_tokens.long()])
    idx = torch.arange(k + 1, device=dev)
    anc = idx[None, :] <= idx[:, None]  # [k + 1, k + 1] lower triangle
    return tokens, idx - 1, idx, anc


def verify_greedy(draft_tokens: torch.Tensor, p_logits: torch.Tensor) -> BlockOutcome:
    """Greedy verification of a chain: accept while the draft equals argmax p.

    draft_tokens: [k] long; p_logits: [k + 1, V] target logits at the k + 1 positions.
    """
    k = draft_tokens.shape[0]
    tokens, parents, depth, anc = chain_tree(draft_tokens)
    out = verify_tree_greedy(tokens, parents, depth, anc, p_logits, k)
    n = int(out.n_accepted)
    return BlockOutcome(n_accepted=n, next_token=int(out.next_token), bonus=n == k)


def verify_sampling(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> BlockOutcome:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over a chain.

    draft_tokens: [k] long, each drawn from the matching row of q_probs.
    q_probs: [k, V] the draft distributions the tokens were drawn from (the ensemble mixture).
    p_probs: [k + 1, V] target distributions, processed with the same SamplingParams.
    """
    k = draft_tokens.shape[0]
    tokens, parents, depth, anc = chain_tree(draft_tokens)
    q = torch.cat([q_probs.new_zeros(1, q_probs.shape[-1]), q_probs]) if k else p_probs.new_zeros(1, p_probs.shape[-1])
    sampled = torch.ones(k + 1, dtype=torch.bool)
    sampled[0] = False
    u = uniforms(k + 2, generator, p_probs.device)
    out = verify_tree_sampling(tokens, parents, depth, anc, p_probs, q.to(p_probs.device), sampled.to(p_probs.device),
                               u, k)
    n = int(out.n_accepted)
    return BlockOutcome(n_accepted=n, next_token=int(out.next_token), bonus=n == k)


# --------------------------------------------------------------------------- single trees, padded
@dataclass
class DraftTree:
    """A drafted tree, all tensors on the target's device. N nodes, root first, parents first.

    ``q`` and ``sampled`` matter only for sampling verification: ``sampled[i]`` says node i's
    token was DRAWN from ``q[i]`` (a chain under sampling); otherwise it was chosen
    deterministically (top-k), and its proposal is a point mass on its token.
    ``fed`` is the drafter's business: node i's slot in the draft cache, -1 when never fed.
    """

    tokens: torch.Tensor  # [N] long; tokens[0] is the root (the newest committed token)
    parents: torch.Tensor  # [N] long; -1 for the root
    depth: torch.Tensor  # [N] long; root 0
    anc: torch.Tensor  # [N, N] bool: anc[i, j] = j is i or an ancestor of i
    fed: torch.Tensor  # [N] long: draft-cache slot, -1 when the node was never fed to the draft
    max_depth: int  # deepest node (host int, known from the spec)
    is_chain: bool = False  # host-known: every node has at most one child (no tree mask needed)
    q: torch.Tensor | None = None  # [N, V]: distribution node i was drawn from (sampling only)
    sampled: torch.Tensor | None = None  # [N] bool (sampling only)
    stats: dict = field(default_factory=dict)  # drafter notes (e.g. stopped early)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])




def pad_rows(xs: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    """[n_b, ...] tensors (trailing dims alike) -> [B, max n_b, ...], each padded with ``value``
    (one row: a view, no copy)."""
    if len(xs) == 1:
        return xs[0][None]
    return torch.nn.utils.rnn.pad_sequence(list(xs), batch_first=True, padding_value=value)


def pad_trees(trees: Sequence[DraftTree], q_dtype: torch.dtype | None = None) -> TreeBatch:
    """The trees of one step's rows as one :class:`TreeBatch` (their q, where present, in
    ``q_dtype``, default the first's; a row without q gets zeros). Sizes are host ints: no host
    sync. One tree: views of it (no copy)."""
    sizes = [t.size for t in trees]
    n = max(sizes)
    dev = trees[0].tokens.device
    if len(trees) == 1:
        anc = trees[0].anc[None]
    else:
        anc = torch.zeros(len(trees), n, n, dtype=torch.bool, device=dev)
        for b, t in enumerate(trees):
            anc[b, :sizes[b], :sizes[b]] = t.anc
    depth = pad_rows([t.depth for t in trees], -1)
    q = sampled = None
    with_q = [t for t in trees if t.q is not None]
    if with_q:
        v, q_dtype = with_q[0].q.shape[-1], q_dtype or with_q[0].q.dtype
        q = pad_rows([t.q.to(dtype=q_dtype) if t.q is not None else torch.zeros(t.size, v, dtype=q_dtype, device=dev)
                      for t in trees])
        sampled = pad_rows([t.sampled if t.q is not None else torch.zeros(t.size, dtype=torch.bool, device=dev)
                            for t in trees], False)
    return TreeBatch(tokens=pad_rows([t.tokens for t in trees]), parents=pad_rows([t.parents for t in trees], -1),
                     depth=depth, anc=anc, fed=pad_rows([t.fed for t in trees], -1),
                     valid=None if min(sizes) == n else depth >= 0, max_depth=max(t.max_depth for t in trees),
                     q=q, sampled=sampled)
