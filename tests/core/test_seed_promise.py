"""A seed means one answer (issue 61): a seeded sampling request's answer is the target's own
seeded sample (:func:`helpers.reference.seeded_reference`: the target alone, a plain loop, token t
= argmax(filtered logits + the seed's noise at t)) token for token, whatever the drafter, the
tree, ``tree="auto"``'s shapes, ``speculate="auto"``'s depths, the batch or the overlap; and the
Gumbel-max coupling that makes it so samples the target's exact distribution (a negative control
whose acceptance favours the drafter must fail the same test)."""

from __future__ import annotations

import pytest
import torch

from helpers.reference import exact_sequence_probs, pvalues, sample_seeds, seeded_reference
from helpers.tiny import BOS, EOS, IMG, make_llava, make_prompt, make_tokenizer
from mmspec import SpecDecoder
from mmspec.heads import build_head
from mmspec.runtime import verify
from mmspec.runtime.verify import SamplingParams

# (images, max_new_tokens, text_len, temperature, top_k, top_p, seed)
REQUESTS = [(1, 20, 6, 1.0, None, None, 5), (0, 12, 3, 0.7, None, None, 7), (2, 16, 5, 1.3, 20, None, 11),
            (1, 14, 4, 0.9, None, 0.8, 3)]

CONFIGS = {
    "chain M": dict(views="M"),
    "MT ensemble": dict(views="MT", gamma=3),
    "static tree": dict(views="MT", tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dynamic tree": dict(views="M", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6),
    "views children": dict(views="MT", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6, tree_children="views"),
    "tree auto": dict(views="M", tree="auto"),
    "lookup": dict(draft="lookup"),
    "suffix": dict(draft="suffix"),
    "M+suffix": dict(views="M", model_free="suffix"),
    "head": dict(draft="head", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6),
}


def request(i: int) -> dict:
    n_img, max_new, text_len, t, k, p, seed = REQUESTS[i]
    ids, pv = make_prompt(n_img, 16, seed=60 + i, text_len=text_len)
    return dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new, temperature=t, top_k=k, top_p=p, seed=seed)


def expected(target, r: dict) -> list[int]:
    inputs = {"input_ids": r["input_ids"]} if r["pixel_values"] is None else \
        {"input_ids": r["input_ids"], "pixel_values": r["pixel_values"]}
    params = SamplingParams(temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"])
    return seeded_reference(target, inputs, r["max_new_tokens"], params, r["seed"], EOS)


@pytest.fixture(scope="module")
def refs(target):
    return [expected(target, request(i)) for i in range(len(REQUESTS))]


def decoder(target, draft, tok, name: str) -> SpecDecoder:
    kw = dict(CONFIGS[name])
    d = kw.pop("draft", draft)
    if d == "head":
        d = build_head(target, "eagle", seed=2)
    return SpecDecoder(target, d, tok, prefix_cache_mb=0, **kw)


def test_the_reference_is_the_targets_seeded_sampling(target, refs):
    """The reference itself: reproducible, seed-dependent, and not the greedy answer."""
    r = request(0)
    assert expected(target, r) == refs[0]
    assert expected(target, dict(r, seed=6)) != refs[0]
    assert expected(target, dict(r, temperature=1e-300)) != refs[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_drafting_gives_the_targets_seeded_answer(target, draft_shared, tok, refs, name):
    """Each request alone, twice on one decoder (tree="auto" picks its shapes by the clock, so
    the two runs' steps may differ), then all of them in one batch: the target's seeded answer."""
    dec = decoder(target, draft_shared, tok, name)
    reqs = [request(i) for i in range(len(REQUESTS))]
    for _ in range(2):
        assert [dec.generate(**r).token_ids for r in reqs] == refs
    assert [r.token_ids for r in dec.generate_batch(reqs, max_batch=4)] == refs


@pytest.mark.parametrize("name", ["chain M", "dynamic tree", "tree auto", "suffix"])
def test_speculate_auto_alone_in_a_batch_of_nine_and_with_overlap(target, draft_shared, tok, refs, name):
    """The issue's case: speculate="auto" alone, in a batch of 9 (the other 8 with other seeds
    and temperatures), alone again on the same decoder, and with overlap forced on: one answer."""
    dec = decoder(target, draft_shared, tok, name)
    r = request(0)
    others = [dict(request(i % len(REQUESTS)), seed=100 + i, temperature=0.5 + 0.1 * i) for i in range(8)]
    alone = dec.generate_batch([r], speculate="auto")[0].token_ids
    batch = dec.generate_batch(others[:4] + [r] + others[4:], speculate="auto", max_batch=9)
    again = dec.generate_batch([r], speculate="auto")[0].token_ids
    overlapped = dec.generate_batch(others[:3] + [r], speculate="auto", max_batch=4, overlap=True)
    assert alone == batch[4].token_ids == again == overlapped[3].token_ids == refs[0]
    for o, res in zip(others, batch[:4] + batch[5:]):  # each neighbour is its own seeded sample too
        assert res.token_ids == expected(target, o)


def test_greedy_rows_beside_coupled_ones_are_the_targets_greedy(target, draft_shared, tok, refs):
    """Greedy is exactly today's path: a greedy request in a batch of seeded ones is the target's
    greedy answer, and the seeded ones their seeded answers."""
    from helpers.reference import reference

    dec = decoder(target, draft_shared, tok, "dynamic tree")
    g = dict(request(3), temperature=0.0, top_p=None, seed=None)
    out = dec.generate_batch([request(0), g, request(2)], max_batch=3)
    assert out[1].token_ids == reference(target, g["input_ids"], g["pixel_values"], g["max_new_tokens"])
    assert [out[0].token_ids, out[2].token_ids] == [refs[0], refs[2]]


# --------------------------------------------------------------------------- exact distribution
V = 8  # <pad> <s> </s> <image> \n w5 w6 w7
N_NEW, N_SAMPLES, N_CONTROL = 3, 1200, 600
TREE = dict(tree="dynamic", tree_depth=2, tree_topk=2, tree_budget=4)


@pytest.fixture(scope="module")
def small():
    target = make_llava(41, vocab=V, eos=2)
    draft = make_llava(42, vocab=V, hidden=32, layers=1, eos=2)  # unrelated draft: TV(p, q) ~ 0.3
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[BOS, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    return target, draft, make_tokenizer(V), ids, pv


def sampled(dec, ids, pv, n: int) -> list[tuple]:
    return sample_seeds(dec, n, input_ids=ids, pixel_values=pv, max_new_tokens=N_NEW, temperature=1.0)


@pytest.mark.parametrize("shape", [dict(views="MT", gamma=2), TREE], ids=["chain", "tree"])
def test_the_coupling_samples_the_targets_distribution(small, shape):
    target, draft, tok, ids, pv = small
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, draft, tok, **shape)
    assert min(pvalues(sampled(dec, ids, pv, N_SAMPLES), exact)) > 1e-3


def test_an_acceptance_that_favours_the_drafter_is_caught(small, monkeypatch):
    """Negative control: a verification that always accepts the first drafted child (the
    drafter's own draw from q, not the target's) biases the output; the same test rejects it."""
    target, draft, tok, ids, pv = small
    exact = exact_sequence_probs(target, ids, pv)
    real = verify.verify_trees_greedy

    def favours_the_draft(tokens, parents, depth, anc, valid, p_logits, max_depth, relaxed=None):
        p_logits = p_logits.clone()
        p_logits[:, 0] = p_logits[:, 0].scatter(-1, tokens[:, 1:2], 1e9)  # the root's pick: node 1
        return real(tokens, parents, depth, anc, valid, p_logits, max_depth, relaxed=relaxed)

    monkeypatch.setattr(verify, "verify_trees_greedy", favours_the_draft)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)
    assert min(pvalues(sampled(dec, ids, pv, N_CONTROL), exact)) < 1e-5
