"""Sampling under a constraint is exact for the constrained target (p masked to the grammar's
legal tokens, renormalised): the distribution of sampled answers equals it, computed by
enumeration; the negative control (verification against the unmasked p) is caught."""

import pytest
import torch

from helpers.constrain import constrained_sequence_probs
from helpers.reference import pvalues, sample_seeds
from helpers.tiny import BOS, IMG, make_llava, make_tokenizer
from mmspec import SpecDecoder
from mmspec.constrain import Constraint
from mmspec.constrain import state as grammar_state
from mmspec.engine import step as engine_step

V, N_NEW, N_SAMPLES, N_CONTROL = 8, 3, 1200, 200  # <pad> <s> </s> <image> \n w5 w6 w7
REGEX = Constraint("regex", pattern="w[56](w[567])?")  # first w5 or w6, then any word or the end, then the end


@pytest.fixture(scope="module")
def setup():
    target = make_llava(41, vocab=V, eos=2)
    draft = make_llava(42, vocab=V, hidden=32, layers=1, eos=2)
    tok = make_tokenizer(V)
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[BOS, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    return target, draft, tok, ids, pv


def sampled(dec, ids, pv, n):
    return sample_seeds(dec, n, input_ids=ids, pixel_values=pv, max_new_tokens=N_NEW, temperature=1.0, constraint=REGEX)


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_constrained_sampling_matches_masked_target(setup, tree):
    target, draft, tok, ids, pv = setup
    dec = SpecDecoder(target, draft, tok, views="MT", **({"tree": "2x2x4"} if tree else {"gamma": 2}))
    exact = constrained_sequence_probs(target, ids, pv, dec.grammar_compiler.compile(REGEX), n_new=N_NEW)
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert exact[(7,)] == 0 and exact[(5, 5, 5)] == 0  # the grammar rules these out
    assert min(pvalues(sampled(dec, ids, pv, N_SAMPLES), exact)) > 1e-3


def test_unmasked_verification_is_caught(setup, monkeypatch):
    """Negative control: verifying against the unmasked p (the grammar only advanced, never
    applied) fails the same test."""
    target, draft, tok, ids, pv = setup
    monkeypatch.setattr(engine_step, "constrained_tree",  # nothing masked, no forced tails
                        lambda grammars, tree, tail, chain: (tree, torch.ones(*tree.tokens.shape, V, dtype=torch.bool)))
    monkeypatch.setattr(grammar_state.RowGrammar, "accept", lambda self, tokens: None)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)
    exact = constrained_sequence_probs(target, ids, pv, dec.grammar_compiler.compile(REGEX), n_new=N_NEW)
    samples = sampled(dec, ids, pv, N_CONTROL)
    outside = sum(exact.get(s, 0.0) == 0 for s in samples)  # answers the constrained target never gives
    assert outside > 0 or min(pvalues(samples, exact)) < 1e-5


def test_constrained_sampling_with_forced_tokens_and_lookup(setup):
    """Prompt lookup under a constraint: the forced tokens and the grammar-legal lookup paths
    ride as the row's proposal (drawn from their counts); still the constrained target's law."""
    target, _, tok, ids, pv = setup
    dec = SpecDecoder(target, "lookup", tok, gamma=2, lookup_options={"ngram_min": 1})
    exact = constrained_sequence_probs(target, ids, pv, dec.grammar_compiler.compile(REGEX), n_new=N_NEW)
    assert min(pvalues(sampled(dec, ids, pv, N_SAMPLES), exact)) > 1e-3
