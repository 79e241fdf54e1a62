"""Sampling is lossless: the distribution of sequences SpecDecoder samples equals the target's,
computed exactly by enumeration on a tiny vocabulary (seeded, so the test is deterministic).
1,200 samples for the tests that must pass; the negative controls, whose bias is gross, 600.

These test rejection sampling (recursive rejection over siblings, residuals), which a request
samples by with ``Request.coupled = False`` (:func:`helpers.reference.rejection_generate`);
the Gumbel-max coupling every sampling request uses by default is tested the same way in
``test_seed_promise.py``."""

import pytest
import torch

from helpers.reference import exact_sequence_probs, pvalues, sample_seeds
from helpers.tiny import BOS, IMG, make_llava, make_tokenizer
from mmspec import SpecDecoder
from mmspec.models.captioner import FixedCaptioner
from mmspec.runtime import verify

V = 8  # <pad> <s> </s> <image> \n w5 w6 w7
N_NEW, TEMP, N_SAMPLES = 3, 1.0, 1200
N_CONTROL = 600  # the negative controls' bias is gross: 600 samples give p ~ 1e-11 (chain) and 1e-24 (tree)


@pytest.fixture(scope="module")
def setup():
    target = make_llava(41, vocab=V, eos=2)
    draft = make_llava(42, vocab=V, hidden=32, layers=1, eos=2)  # unrelated draft: TV(p, q) ~ 0.3
    tok = make_tokenizer(V)
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[BOS, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    return target, draft, tok, ids, pv


def sampled(dec, ids, pv, n: int = N_SAMPLES):
    """n sequences by rejection sampling, seeds 0 .. n - 1."""
    return sample_seeds(dec, n, False, input_ids=ids, pixel_values=pv, max_new_tokens=N_NEW, temperature=TEMP)


def test_sampling_matches_target_distribution(setup):
    target, draft, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    assert abs(sum(exact.values()) - 1) < 1e-9
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)  # ensemble q, drafts at 2 positions
    assert min(pvalues(sampled(dec, ids, pv), exact)) > 1e-3


def test_wrong_residual_is_caught(setup, monkeypatch):
    """Negative control: the same test rejects a decoder whose recovered token ignores q."""
    target, draft, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)
    assert min(pvalues(sampled(dec, ids, pv, N_CONTROL), exact)) < 1e-5


def test_same_seed_same_output_and_different_seeds_differ(setup):
    target, draft, tok, ids, pv = setup
    dec = SpecDecoder(target, draft, tok, views="MTC", captioner=FixedCaptioner(["w5 w7"]))
    a = [dec.generate(ids, pv, max_new_tokens=10, temperature=1.0, seed=s).token_ids for s in range(6)]
    b = [dec.generate(ids, pv, max_new_tokens=10, temperature=1.0, seed=s).token_ids for s in range(6)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_top_k_top_p_sampling_runs_and_stays_in_support(setup):
    target, draft, tok, ids, pv = setup
    dec = SpecDecoder(target, draft, tok, views="M")
    with torch.no_grad():
        first = target(input_ids=ids, pixel_values=pv).logits[0, -1]
    allowed = set(torch.topk(first, 2).indices.tolist())
    for s in range(20):
        res = dec.generate(ids, pv, max_new_tokens=1, temperature=1.0, top_k=2, seed=s)
        assert res.token_ids[0] in allowed


TREE = dict(tree="dynamic", tree_depth=2, tree_topk=2, tree_budget=4)  # siblings at both depths


def test_tree_sampling_matches_target_distribution(setup):
    """Recursive rejection over siblings (point-mass candidates of a dynamic tree) samples the
    target's exact distribution, through the whole engine (draft tree, verify, compaction)."""
    target, draft, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, draft, tok, views="MT", **TREE)
    assert min(pvalues(sampled(dec, ids, pv), exact)) > 1e-3


def test_siblings_tested_against_p_instead_of_the_residual_are_caught(setup, monkeypatch):
    """Negative control: a sibling tested against p (not the residual left by its rejected elder
    siblings), and a final token from p, bias the output; the same test must reject it."""
    target, draft, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    monkeypatch.setattr(verify, "remaining_mass", lambda p_elder: torch.ones(p_elder.shape[:-1], dtype=p_elder.dtype))
    monkeypatch.setattr(verify, "remove_tokens", lambda p, removed: p)
    dec = SpecDecoder(target, draft, tok, views="MT", **TREE)
    assert min(pvalues(sampled(dec, ids, pv, N_CONTROL), exact)) < 1e-5


def test_head_sampling_matches_target_distribution(setup):
    """A feature-level head (EAGLE) with a branching tree samples the target's exact distribution."""
    from mmspec.heads import build_head

    target, _, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, build_head(target, "eagle", seed=3), tok, **TREE)
    assert min(pvalues(sampled(dec, ids, pv), exact)) > 1e-3
