"""Adaptive ensemble weights (TABED, mmspec.drafting.adaptive): the rules' maths on hand-built
distributions, lossless greedy (equal to target.generate for MT / MTC / MTCP, chains and trees,
eager and static), exactly the target's distribution when sampling (with a negative control),
the weights following the view that predicts the target, the trajectory in the stats, the
carry-over of a turn's weights, and bad input refused."""

import copy

import pytest
import torch

from helpers.reference import captions, exact_sequence_probs, pvalues, reference, sample_seeds
from helpers.tiny import BOS, IMG, make_llava, make_prompt, make_tokenizer
from mmspec import MMSpecError, SpecDecoder
from mmspec.bench.config import parse_method
from mmspec.drafting.adaptive import AdaptiveState, AdaptiveWeights, confirmed_evidence, loglik_weights, tabed_weights
from mmspec.drafting.ensemble import EnsembleDrafting
from mmspec.runtime.forwards import RowForward

SAMPLING_VOCAB, SAMPLING_NEW, SAMPLING_TEMP = 8, 3, 1.0  # test_sampling's setting
N_SAMPLES, N_CONTROL = 1200, 600  # as test_sampling's


# ---------------------------------------------------------------------- the maths
def test_evidence_kl_and_loglik_by_hand():
    q = torch.tensor([[[0.5, 0.5, 0.0]], [[0.9, 0.1, 0.0]]])  # [B=2, m=1, V=3]
    p = torch.tensor([[0.8, 0.2, 0.0]])
    kl, lq = confirmed_evidence(q, p, torch.tensor([0]), torch.tensor([True]))
    want = [0.8 * torch.log(torch.tensor(0.8 / 0.5)) + 0.2 * torch.log(torch.tensor(0.2 / 0.5)),
            0.8 * torch.log(torch.tensor(0.8 / 0.9)) + 0.2 * torch.log(torch.tensor(0.2 / 0.1))]
    assert kl[:, 0].tolist() == pytest.approx([float(w) for w in want])
    assert lq[:, 0].tolist() == pytest.approx([float(torch.log(torch.tensor(0.5))), float(torch.log(torch.tensor(0.9)))])
    kl0, lq0 = confirmed_evidence(q, p, torch.tensor([0]), torch.tensor([False]))  # a position no draft reached
    assert kl0.abs().sum() == 0 and lq0.abs().sum() == 0


def test_draft_vocabulary_prefix_is_padded():
    q = torch.tensor([[[1.0, 0.0]]])  # draft scores 2 tokens, target 3
    p = torch.tensor([[0.5, 0.0, 0.5]])
    kl, lq = confirmed_evidence(q, p, torch.tensor([2]), torch.tensor([True]))
    assert torch.isfinite(kl).all() and kl[0, 0] > 1.0 and lq[0, 0] < -10


def test_tabed_rule_is_inverse_kl_with_temperature_and_prior():
    kl = torch.tensor([1.0, 3.0], dtype=torch.float64)
    even = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert tabed_weights(kl, even, 1.0).tolist() == pytest.approx([0.75, 0.25])  # ∝ 1/KL
    assert tabed_weights(kl, even, 0.5).tolist() == pytest.approx([0.9, 0.1])  # squared, renormalised
    assert tabed_weights(kl, torch.tensor([0.25, 0.75], dtype=torch.float64), 1.0).tolist() == pytest.approx([0.5, 0.5])
    assert tabed_weights(torch.tensor([0.0, 1.0], dtype=torch.float64), even, 1.0)[0] > 0.999  # no deviation: ~all


def test_loglik_rule_is_the_posterior():
    score = torch.tensor([0.0, -torch.log(torch.tensor(3.0))], dtype=torch.float64)
    even = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert loglik_weights(score, even, 1.0).tolist() == pytest.approx([0.75, 0.25])


def test_state_window_decay_and_trajectory():
    cfg = AdaptiveWeights(rule="tabed", window=1)
    st = AdaptiveState(cfg, 2, torch.device("cpu"))
    good = torch.tensor([[[0.8, 0.2]], [[0.2, 0.8]]])  # view 0 matches p, view 1 does not
    bad = good.flip(0)
    p = torch.tensor([[0.8, 0.2]])
    tok, ok = torch.tensor([0]), torch.tensor([True])
    assert st.update(good, p, tok, ok)[0] > 0.99
    assert st.update(bad, p, tok, ok)[1] > 0.99  # a window of one position forgets the first block
    rows, final = st.trajectory()
    assert rows[0] == pytest.approx([0.5, 0.5]) and len(rows) == 2 and final[1] > 0.99
    ll = AdaptiveState(AdaptiveWeights(rule="loglik", decay=0.5), 2, torch.device("cpu"))
    ll.update(good, p, tok, ok)
    ll.update(bad, p, tok, ok)
    assert ll.weights[1] > ll.weights[0]  # the older evidence counts half


# ---------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("tree", [None, "dynamic"])
@pytest.mark.parametrize("method", ["MT", "MTC", "MTCP"])
def test_adaptive_matches_target_greedy(target, draft_shared, tok, method, tree):
    ids, pv = make_prompt(2, 16, seed=21)
    ref = reference(target, ids, pv, 24)
    dec = SpecDecoder(target, draft_shared, tok, views=method, captioner=captions(2), weights="adaptive", tree=tree)
    res = dec.generate(ids, pv, max_new_tokens=24)
    assert res.token_ids == ref
    st = res.stats
    assert st.weighting == "adaptive" and dec.method.startswith(f"{method}+adaptive")
    drafted = sum(1 for b in st.blocks if b.n_drafted > 0)
    assert len(st.view_weights) == drafted and len(st.final_weights) == len(method)
    assert st.view_weights[0] == pytest.approx([1 / len(method)] * len(method))
    assert all(sum(w) == pytest.approx(1.0) for w in st.view_weights)
    assert len({tuple(w) for w in st.view_weights}) > 1  # they moved


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [1, 0]], "dynamic"])
@pytest.mark.parametrize("rule", ["loglik", "tabed"])
def test_adaptive_rules_static_and_trees_match_target(target, draft_shared, tok, rule, tree):
    ids, pv = make_prompt(5, 16, seed=22)
    ref = reference(target, ids, pv, 20)
    w = AdaptiveWeights(rule=rule, temperature=0.5, window=4 if rule == "tabed" else 0, decay=0.9)
    for static in (False, True):
        dec = SpecDecoder(target, draft_shared, tok, views="MTC", captioner=captions(5), weights=w, tree=tree,
                          tree_children="views" if tree == "dynamic" else "mixture", static_cache=static)
        assert dec.generate(ids, pv, max_new_tokens=20).token_ids == ref


def test_weights_follow_the_view_that_is_the_target(target, tok):
    """The draft IS the target: its multimodal row predicts every confirmed token's distribution
    exactly (KL 0), the text row does not; the weights must find that within a block or two (a
    misaligned gather of the rows' distributions would not)."""
    ids, pv = make_prompt(1, 16, seed=23)
    for weights, tree, least in (("adaptive", None, 0.99), ("adaptive", "dynamic", 0.99),
                                 ("adaptive:loglik", None, 0.8)):  # loglik: the tokens' likelihoods alone, slower
        dec = SpecDecoder(target, target, tok, views="TM", weights=weights, tree=tree)
        st = dec.generate(ids, pv, max_new_tokens=24).stats
        m_weight = [w[1] for w in st.view_weights] + [st.final_weights[1]]
        assert m_weight[-1] > least and m_weight == sorted(m_weight), (weights, tree, st.view_weights)


def test_rows_survive_a_reused_output_buffer(target, tok, monkeypatch):
    """A CUDA-graph replay hands back the same output tensor every time: the rows kept for the
    weights' update must be copies, or every depth would read the last one's distributions."""
    orig = RowForward.__call__
    buffers = {}

    def replay_like(self, **inputs):
        out = orig(self, **inputs)
        if self.name != "draft":
            return out
        buf = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        return buf.copy_(out)

    monkeypatch.setattr(RowForward, "__call__", replay_like)
    ids, pv = make_prompt(1, 16, seed=23)
    dec = SpecDecoder(target, target, tok, views="TM", weights="adaptive")
    res = dec.generate(ids, pv, max_new_tokens=24)
    assert res.token_ids == reference(target, ids, pv, 24)
    assert res.stats.final_weights[1] > 0.99, res.stats.view_weights


def test_initial_weights_carry_over_a_turn(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=24)
    dec = SpecDecoder(target, draft_shared, tok, views="MT", weights="adaptive")
    first = dec.generate(ids, pv, max_new_tokens=16).stats
    ids2 = torch.cat([ids, torch.tensor([[9, 10]])], 1)  # a next turn: the prompt extended
    second = dec.generate(ids2, pv, max_new_tokens=16, initial_weights=first.final_weights).stats
    assert second.view_weights[0] == pytest.approx(first.final_weights)
    assert dec.generate(ids2, pv, max_new_tokens=16).token_ids == reference(target, ids2, pv, 16)


# ---------------------------------------------------------------------- lossless sampling
@pytest.fixture(scope="module")
def sampling_setup():
    """test_sampling's setting: a vocabulary of 8, an unrelated draft (TV(p, q) ~ 0.3)."""
    target = make_llava(41, vocab=SAMPLING_VOCAB, eos=2)
    draft = make_llava(42, vocab=SAMPLING_VOCAB, hidden=32, layers=1, eos=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[BOS, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    return target, draft, make_tokenizer(SAMPLING_VOCAB), ids, pv


def vivid(draft):
    """The draft with its image projection scaled up, so its multimodal and text rows differ
    enough (TV ~0.1 at the first position, ~0.02 before) for a weighting to matter."""
    draft = copy.deepcopy(draft)
    with torch.no_grad():
        for w in draft.model.multi_modal_projector.parameters():
            w.mul_(50.0)
        draft.lm_head.weight.mul_(3.0)
    return draft


def sampled(dec, ids, pv, n: int = N_SAMPLES):
    """n sequences by rejection sampling, seeds 0 .. n - 1: what reads the adapted q a token was
    drawn from (the Gumbel-max coupling every sampling request uses does not depend on the
    drafting at all: test_seed_promise.py)."""
    return sample_seeds(dec, n, False, input_ids=ids, pixel_values=pv, max_new_tokens=SAMPLING_NEW,
                        temperature=SAMPLING_TEMP)


def test_adaptive_sampling_matches_target_distribution(sampling_setup):
    target, draft, tok, ids, pv = sampling_setup
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, vivid(draft), tok, views="MT", gamma=2,
                      weights=AdaptiveWeights(temperature=0.25, initial=(0.99, 0.01)))
    assert min(pvalues(sampled(dec, ids, pv), exact)) > 1e-3


def test_adaptive_tree_sampling_matches_target_distribution(sampling_setup):
    """Adaptive weights with a branching dynamic tree (siblings at both depths), sampled."""
    target, draft, tok, ids, pv = sampling_setup
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, vivid(draft), tok, views="MT", tree="dynamic", tree_depth=2, tree_topk=2,
                      tree_budget=4, weights=AdaptiveWeights(rule="loglik", temperature=0.25))
    assert min(pvalues(sampled(dec, ids, pv), exact)) > 1e-3


def test_stale_q_under_adaptive_weights_is_caught(sampling_setup, monkeypatch):
    """Negative control: drafting from the adapted mixture but handing verification another
    weighting's mixture (a stale q: here the text row's alone) biases the output; the same test
    must reject it (with the same draft the lossless decoder passes: the test above)."""
    target, draft, tok, ids, pv = sampling_setup
    draft = vivid(draft)
    exact = exact_sequence_probs(target, ids, pv)
    orig_mix, orig_chain = EnsembleDrafting.distributions, EnsembleDrafting._chain
    stale_qs = []

    def mix(self, logits, rs):  # the adapted mixture (drafted from), and the text row's alone (stale)
        w = self.weights
        self.weights = torch.tensor([[0.0, 1.0]], dtype=torch.float64).expand_as(w).clone()
        stale_qs.append(orig_mix(self, logits, rs))
        self.weights = w
        return orig_mix(self, logits, rs)

    def chain(self, *args, **kwargs):
        stale_qs.clear()
        d = orig_chain(self, *args, **kwargs)
        if d.tree.q is not None:  # verification gets the stale q of each drawn token
            d.tree.q[:, 1:] = torch.stack([q[:, 0] for q in stale_qs], 1).to(d.tree.q.dtype)
        return d

    monkeypatch.setattr(EnsembleDrafting, "distributions", mix)
    monkeypatch.setattr(EnsembleDrafting, "_chain", chain)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2,
                      weights=AdaptiveWeights(temperature=0.25, initial=(0.99, 0.01)))
    assert min(pvalues(sampled(dec, ids, pv, N_CONTROL), exact)) < 1e-5


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    ({"rule": "best"}, "unknown adaptive rule"),
    ({"temperature": 0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"decay": 0}, "decay"),
    ({"decay": 1.5}, "decay"),
    ({"window": -1}, "window"),
    ({"window": 2.5}, "window"),
    ({"initial": (1, -1)}, "initial weights"),
    ({"initial": "MT"}, "initial weights"),
])
def test_bad_adaptive_options(kw, match):
    with pytest.raises(MMSpecError, match=match):
        AdaptiveWeights(**kw)


def test_bad_adaptive_arguments(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=25)
    with pytest.raises(MMSpecError, match="'adaptive'"):
        SpecDecoder(target, draft_shared, tok, views="MT", weights="adaptve")
    with pytest.raises(MMSpecError, match="one per view"):
        SpecDecoder(target, draft_shared, tok, views="MT", weights=AdaptiveWeights(initial=(1, 1, 1)))
    fixed = SpecDecoder(target, draft_shared, tok, views="MT")
    with pytest.raises(MMSpecError, match="weights='adaptive'"):
        fixed.generate(ids, pv, max_new_tokens=4, initial_weights=[0.5, 0.5])
    dec = SpecDecoder(target, draft_shared, tok, views="MT", weights="adaptive")
    for bad, match in (([1.0], "one per view"), ([1, float("inf")], "finite"), ("MT", "list of numbers")):
        with pytest.raises(MMSpecError, match=match):
            dec.generate(ids, pv, max_new_tokens=4, initial_weights=bad)
    from mmspec.heads import build_head
    with pytest.raises(MMSpecError, match="weights="):
        SpecDecoder(target, build_head(target, "eagle", seed=1), tok, weights="adaptive")


def test_bench_method_suffix():
    assert parse_method("MT+adaptive") == (("M", "T"), {"weights": "adaptive"})
    assert parse_method("MTC+tree+adaptive:loglik") == (("M", "T", "C"), {"tree": "dynamic", "weights": "adaptive:loglik"})
    assert parse_method("MT+adaptive:tabed:0.25")[1] == {"weights": "adaptive:tabed:0.25"}
    assert AdaptiveWeights.parse("adaptive:tabed:0.25") == AdaptiveWeights(temperature=0.25)
    for bad, match in (("M+adaptive", "two views or more"), ("eagle+adaptive", "head"),
                       ("MT+adaptive+adaptive", "twice"), ("MT+adaptive:best", "unknown adaptive rule"),
                       ("MT+adaptive:tabed:hot", "not a number"), ("MT+adaptive:tabed:0", "temperature")):
        with pytest.raises(MMSpecError, match=match):
            parse_method(bad)


def test_generate_batch_adapts_each_request(target, draft_shared, tok):
    """generate_batch: each request's weights adapt on its own rows, as generate's would alone."""
    prompts = [make_prompt(n, 16, seed=30 + n) for n in (1, 2, 5)]
    dec = SpecDecoder(target, draft_shared, tok, views="MTC", captioner=captions(5), weights="adaptive")
    results = dec.generate_batch([{"input_ids": ids, "pixel_values": pv, "captions": [f"w{10 + i} w{20 + i} w30"
                                                                                      for i in range(ids.eq(IMG).sum() // 16)]}
                                  for ids, pv in prompts], max_new_tokens=16)
    for (ids, pv), res in zip(prompts, results):
        assert res.token_ids == reference(target, ids, pv, 16)
        alone = dec.generate(ids, pv, max_new_tokens=16, captions=[f"w{10 + i} w{20 + i} w30"
                                                                   for i in range(ids.eq(IMG).sum() // 16)]).stats
        assert len(res.stats.view_weights) == len(alone.view_weights)
        for a, b in zip(res.stats.view_weights, alone.view_weights):
            assert a == pytest.approx(b)
        assert len(res.stats.view_weights) > 1
