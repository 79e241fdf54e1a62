"""Reference forms of ``mmspec.verify`` that only the tests use: the chain cases of the tree
verifiers (:func:`verify_greedy`, :func:`verify_sampling`, each a one-branch tree through
``verify_tree_greedy`` / ``verify_tree_sampling``) and :func:`accept_or_residual`, the
node-by-node statement of the sampling rule the tree verifier evaluates for all nodes at once.
The engine verifies chains as trees; these keep the hand-built chain tests readable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.verify import residual, uniforms, verify_tree_greedy, verify_tree_sampling


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
    what :func:`mmspec.verify.verify_tree_sampling` evaluates for all nodes at once (the tests check one
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
