"""``logprobs``: each emitted token's log-probability under the target and its likeliest
alternatives, read from the verify forward that emitted it, equal the target's own log-softmax of
a forward over prompt + answer at every position: for chains, trees, plain steps, model-free
proposals and heads, greedy and sampled (raw logits: the request's temperature and filters do not
change them), alone or in a batch beside requests that do not ask."""

import pytest
import torch

from helpers.reference import engine_of, target_logprobs
from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.heads import build_head

TOP = 3
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=5)


def decoder(how: str, target, draft, tok) -> SpecDecoder:
    if how == "head":
        return SpecDecoder(target, build_head(target, "eagle", seed=2), tok, tree="dynamic", tree_depth=3,
                           tree_topk=2, tree_budget=6)
    if how == "lookup":
        return SpecDecoder(target, "lookup", tok, gamma=3)
    kw = {"static tree": dict(tree=[[0], [1], [0, 0], [1, 0]]), "dynamic tree": dict(tree="dynamic"),
          "M+suffix": dict(model_free="suffix")}.get(how, {})
    return SpecDecoder(target, draft, tok, **kw)


def check(got, want: torch.Tensor, answer: list[int], top: int) -> None:
    """``got`` (TokenLogprob per token) against the target's log-softmax ``want`` [n, V]."""
    assert [g.token_id for g in got] == answer
    for g, lp, t in zip(got, want, answer):
        assert g.logprob == pytest.approx(lp[t].item(), abs=1e-4)
        vals, ids = lp.topk(top)
        assert [v for _, v in g.top] == pytest.approx(vals.tolist(), abs=1e-4)
        ties = lp[[i for i, _ in g.top]] == vals  # a token's rank may differ only at an exact tie
        assert all(i == j or tie for (i, _), j, tie in zip(g.top, ids.tolist(), ties.tolist()))


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("how", ["chain", "static tree", "dynamic tree", "lookup", "M+suffix", "head"])
def test_logprobs_are_the_targets_own_at_every_position(target, draft_shared, tok, how, sampling):
    ids, pv = make_prompt(1, 16, seed=4)
    r = decoder(how, target, draft_shared, tok).generate(ids, pv, max_new_tokens=14, logprobs=TOP, **sampling)
    assert len(r.logprobs) == len(r.token_ids) > 1
    check(r.logprobs, target_logprobs(target, {"input_ids": ids, "pixel_values": pv}, r.token_ids), r.token_ids, TOP)
    if how != "lookup" and not sampling:  # drafts were accepted: positions past a block's first were scored
        assert any(b.n_accepted for b in r.stats.blocks)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_plain_steps_report_them_too(target, draft_shared, tok, sampling):
    ids, pv = make_prompt(1, 16, seed=6)
    dec = SpecDecoder(target, draft_shared, tok)
    [r] = dec.generate_batch([dict(input_ids=ids, pixel_values=pv, logprobs=TOP, **sampling)], max_new_tokens=10,
                             speculate="never")
    assert all(b.n_drafted == 0 for b in r.stats.blocks)
    check(r.logprobs, target_logprobs(target, {"input_ids": ids, "pixel_values": pv}, r.token_ids), r.token_ids, TOP)


def test_a_batch_mixing_requests_with_and_without_logprobs(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, tree="dynamic")
    prompts = [make_prompt(1, 16, seed=s) for s in (1, 2, 3)]
    asks = [2, None, 0]
    reqs = [dict(input_ids=i, pixel_values=p, logprobs=k, **(SAMPLED if n == 1 else {}))
            for n, ((i, p), k) in enumerate(zip(prompts, asks))]
    results = dec.generate_batch(reqs, max_new_tokens=12)
    for (i, p), k, r, req in zip(prompts, asks, results, reqs):
        alone = dec.generate(i, p, max_new_tokens=12, **{a: req[a] for a in ("temperature", "top_p", "seed") if a in req})
        assert r.token_ids == alone.token_ids  # asking for logprobs changes no token, in a batch or not
        if k is None:
            assert r.logprobs is None and alone.logprobs is None
        else:
            assert all(len(t.top) == k for t in r.logprobs)
            check(r.logprobs, target_logprobs(target, {"input_ids": i, "pixel_values": p}, r.token_ids), r.token_ids, k)
    with pytest.raises(ValueError, match="request 1: logprobs must be a whole number from 0"):
        dec.generate_batch([reqs[0], {**reqs[1], "logprobs": -1}], max_new_tokens=4)


def test_a_greedy_answer_is_its_own_top_1(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=1)
    r = SpecDecoder(target, draft_shared, tok).generate(ids, pv, max_new_tokens=8, logprobs=1)
    assert all(t.top[0] == (t.token_id, t.logprob) for t in r.logprobs)
    assert SpecDecoder(target, draft_shared, tok).generate(ids, pv, max_new_tokens=8).logprobs is None


def test_the_whole_step_as_a_graph_reads_the_same_logprobs(target, draft_shared, tok):
    """With the step captured per plan (emulated on the CPU), a step that asks is a plan of its own:
    the same tokens and log-probabilities as eager decoding, beside a request that does not ask."""
    prompts = [make_prompt(1, 16, seed=s) for s in (7, 8)]
    reqs = [dict(input_ids=i, pixel_values=p, logprobs=k) for (i, p), k in zip(prompts, (2, None))]
    eager = SpecDecoder(target, draft_shared, tok, tree="dynamic").generate_batch(reqs, max_new_tokens=10)
    dec = SpecDecoder(target, draft_shared, tok, tree="dynamic", cuda_graphs="emulate")
    graphed = dec.generate_batch(reqs, max_new_tokens=10)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert graphed[1].logprobs is None
    for g, e in zip(graphed[0].logprobs, eager[0].logprobs):
        assert g.token_id == e.token_id and g.logprob == pytest.approx(e.logprob, abs=1e-9)
        assert [i for i, _ in g.top] == [i for i, _ in e.top]
    # captured: a graph of its own, computing the engine's widest (max_logprobs, 20), read to 2 on the host
    assert 20 in {plan.logprobs for plan in engine_of(dec).step_graphs_by_plan}
