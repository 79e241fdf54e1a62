"""Verification maths on hand-built distributions: perfect match, early mismatch, residual,
bonus, filtering, and a seeded statistical test that speculative sampling reproduces p."""

import torch

from helpers.reference import chi2_pvalue
from helpers.verify_ref import verify_greedy, verify_sampling
from mmspec.runtime import verify
from mmspec.runtime.verify import SamplingParams, logits_to_probs, residual


def onehot_logits(tokens, V=6):
    x = torch.full((len(tokens), V), -5.0)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


def test_greedy_perfect_match_gives_bonus():
    out = verify_greedy(torch.tensor([1, 2, 3]), onehot_logits([1, 2, 3, 4]))
    assert (out.n_accepted, out.next_token, out.bonus) == (3, 4, True)


def test_greedy_early_mismatch_recovers_target_token():
    out = verify_greedy(torch.tensor([1, 5, 3]), onehot_logits([1, 2, 3, 4]))
    assert (out.n_accepted, out.next_token, out.bonus) == (1, 2, False)


def test_greedy_first_token_rejected():
    out = verify_greedy(torch.tensor([0, 2]), onehot_logits([1, 2, 3]))
    assert (out.n_accepted, out.next_token) == (0, 1)


def test_greedy_zero_drafts_is_plain_decoding():
    out = verify_greedy(torch.zeros(0, dtype=torch.long), onehot_logits([4]))
    assert (out.n_accepted, out.next_token, out.bonus) == (0, 4, True)


def test_residual_hand_computed():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.4, 0.2, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # p == q: residual undefined, rejection impossible; falls back to p
    assert torch.allclose(residual(p, p), p)


def test_sampling_accepts_when_p_equals_q():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.6, 0.3]] * 3)
    for _ in range(50):
        d = torch.multinomial(p[0], 2, replacement=True, generator=g)
        assert verify_sampling(d, p[:2], p, g).n_accepted == 2


def test_sampling_rejects_token_target_never_emits():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    out = verify_sampling(torch.tensor([0]), q, p, g)
    assert (out.n_accepted, out.next_token) == (0, 1)


def test_filtering_applies_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    k2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    p7 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p7, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


def emitted_distribution(p, q, n_draws, seed):
    """First token emitted by a 2-draft block whose drafts come from q. Returns counts [V]."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n_draws):
        d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        out = verify_sampling(d, q, p, g)
        first = int(d[0]) if out.n_accepted > 0 else out.next_token
        counts[first] += 1
    return counts


P = torch.tensor([[0.45, 0.05, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25, 0.0]])


def test_speculative_sampling_reproduces_p_statistically():
    counts = emitted_distribution(P, Q, 6000, seed=1)
    assert chi2_pvalue(counts, P[0]) > 1e-3


def test_statistical_test_catches_a_wrong_residual(monkeypatch):
    """Negative control: sampling the recovered token from p instead of norm(max(0, p-q))
    biases the output, and the same test must reject it."""
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    counts = emitted_distribution(P, Q, 6000, seed=1)
    assert chi2_pvalue(counts, P[0]) < 1e-6


def test_same_seed_same_outcome():
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [verify_sampling(torch.tensor([1, 0]), Q, P, g) for _ in range(20)]

    assert run(3) == run(3)
    assert run(3) != run(4)
