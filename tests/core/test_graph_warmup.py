"""Graphs ready before traffic (mmspec.engine.warmup): in graph mode a step's plan comes from a
bounded set (two sampling-flag sets, one logprobs width, span buckets), ``warm_up`` captures all
of it for every row bucket up to the maximum batch, and a mixed workload afterwards (greedy and
seeded sampling rows, logprobs of different widths, rows crossing a span bucket, batch sizes
changing, ``speculate`` "auto" and "always") captures nothing more, every output the eager
decoder's (greedy: the target's). CPU: the emulated capture; the CUDA twin is in
test_graph_warmup_cuda.py."""

import pytest
import torch

from helpers.reference import engine_of
from helpers.tiny import make_prompt
from mmspec import MMSpecError, SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.drafting.tree import TreeBatch
from mmspec.engine.warmup import captures, graph_count
from mmspec.runtime.graphs import canonical_flags
from mmspec.runtime.verify import RowSampling, flags, logits_to_probs_rows, verify_steps


def reference(target, ids, pv, n):
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          **({} if pv is None else {"pixel_values": pv}))
    return out[0, ids.shape[1]:].tolist()


def request(i, max_new, text_len=5, **kw):
    ids, pv = make_prompt(1, 16, seed=40 + i, text_len=text_len)
    return dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new, **kw)


def run(dec, reqs, max_batch, speculate, engine=None):
    """Every request through one scheduler -> results in order, and the plans its steps ran."""
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=speculate, stream_text=False)
    seen = []
    if engine is not None:  # record each step's plan
        plan_of = engine._plan

        def recording(*a, **kw):
            out = plan_of(*a, **kw)
            seen.append(out[0])
            return out
        engine._plan = recording
    rids = [sched.submit(r) for r in reqs]
    done = {}
    try:
        while sched.has_work():
            for ev in sched.step():
                assert ev.error is None, ev.error
                if ev.finished:
                    done[ev.rid] = ev.result
    finally:
        sched.close()
        if engine is not None:
            del engine._plan
    return [done[r] for r in rids], seen


def same_logprobs(a, b):
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or []):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-9)
        assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(x.top) == len(y.top)


def test_auto_mixed_workload_after_warm_up_captures_nothing(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M", gamma=2, cuda_graphs="emulate")
    w = dec.warm_up(max_batch=4, speculate="auto", max_context=200)
    engine = engine_of(dec)
    # row buckets 1, 2, 4 x (plain feeding, plain keeping, depth 1 and 2 each feeding the engine's width
    # or its whole lag after plain steps) x 2 flag sets x 2 widths, one span
    assert w.captured == w.graphs == w.plans == 3 * 6 * 2 * 2 and w.seconds > 0
    graphs, tried = graph_count(engine), captures(engine)
    reqs = [request(0, 9, logprobs=20), request(1, 14, temperature=0.8, seed=5, logprobs=1),
            request(2, 3, logprobs=3), request(3, 12, temperature=1.1, top_k=5, seed=6),
            request(4, 7, temperature=0.7, top_p=0.9, seed=7, logprobs=0), request(5, 24)]
    got, plans = run(dec, reqs, 4, "auto", engine)
    assert captures(engine) == tried and graph_count(engine) == graphs  # nothing captured after the warm-up
    assert {p.rows for p in plans} >= {4, 1} and {p.spec is None for p in plans} == {True, False}
    assert {dict(p.flags)["any_sampling"] for p in plans} == {True, False} and {p.logprobs for p in plans} == {0, 20}
    eager = SpecDecoder(target, draft_shared, tok, views="M", gamma=2)
    want, _ = run(eager, reqs, 4, "auto")
    for r, g, e in zip(reqs, got, want):
        if "temperature" not in r:  # greedy: the target's tokens, the eager decoder's logprobs
            assert g.token_ids == e.token_ids == reference(target, r["input_ids"], r["pixel_values"],
                                                           r["max_new_tokens"])
            same_logprobs(g.logprobs, e.logprobs)
        assert len(g.token_ids) == r["max_new_tokens"] or g.token_ids[-1] in dec.eos_ids
        if r.get("logprobs") is not None:
            assert all(len(t.top) == r["logprobs"] for t in g.logprobs)  # 20 computed, each row's own k read


def test_always_rows_crossing_a_span_bucket_equal_eager(target, draft_shared, tok):
    """A row that crosses 512 slots, a seeded sampling row with logprobs, a batch growing and
    shrinking: no capture after warm_up, every output (sampled included) the eager decoder's."""
    dec = SpecDecoder(target, draft_shared, tok, views="M", gamma=2, cuda_graphs="emulate")
    w = dec.warm_up(max_batch=2, speculate="always", max_context=600)
    engine = engine_of(dec)
    assert w.captured == 2 * 1 * (2 * 2) * 2 * 2  # rows 1, 2 x the whole chain x target and draft spans 512 / 1024
    tried = captures(engine)
    reqs = [request(0, 24, text_len=245), request(1, 10, temperature=0.9, top_p=0.95, seed=3, logprobs=2),
            request(2, 6, logprobs=4)]
    assert reqs[0]["input_ids"].shape[1] < 512 < reqs[0]["input_ids"].shape[1] + 24
    got, plans = run(dec, reqs, 2, "always", engine)
    assert captures(engine) == tried
    assert {p.span for p in plans} == {512, 1024} and {p.rows for p in plans} == {1, 2}
    eager = SpecDecoder(target, draft_shared, tok, views="M", gamma=2)
    want, _ = run(eager, reqs, 2, "always")
    for g, e in zip(got, want):
        assert g.token_ids == e.token_ids
        same_logprobs(g.logprobs, e.logprobs)
    assert got[0].token_ids == reference(target, reqs[0]["input_ids"], reqs[0]["pixel_values"], 24)


def _chain(B, V, g):
    """B chains of 2 drafted nodes with random tokens: a TreeBatch for verify_steps."""
    tokens = torch.randint(0, V, (B, 3), generator=g)
    parents = torch.tensor([[-1, 0, 1]]).expand(B, -1)
    depth = torch.arange(3).expand(B, -1)
    anc = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(B, -1, -1)
    return TreeBatch(tokens=tokens, parents=parents, depth=depth, anc=anc, fed=depth - 1, valid=None, max_depth=2)


def test_the_general_sampling_path_gives_each_row_its_own_bits():
    """canonical_flags' general path: a greedy row's outcome, a sampling row's distribution and
    draws are bit for bit what the rows' own flags give; the negative control (a row's top-k under
    flags that skip it) differs, so the comparison can fail."""
    g = torch.Generator().manual_seed(0)
    B, V = 4, 50
    logits = torch.randn(B, 3, V, generator=g, dtype=torch.float64) * 3
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3], dtype=torch.float64)
    greedy = torch.tensor([True, False, True, False])
    top_k = torch.tensor([0, 5, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9], dtype=torch.float64)
    from mmspec.runtime.verify import SamplingParams

    params = [SamplingParams(), SamplingParams(0.7, top_k=5), SamplingParams(), SamplingParams(1.3, top_p=0.9)]
    own = flags(params)
    general = canonical_flags(own)
    assert general["any_sampling"] and not general["all_sampling"] and canonical_flags(flags([SamplingParams()])) == \
        dict.fromkeys(own, False)
    rs_own = RowSampling(temperature, top_k, top_p, greedy, **own)
    rs_gen = RowSampling(temperature, top_k, top_p, greedy, **general)
    assert torch.equal(logits_to_probs_rows(logits, rs_own), logits_to_probs_rows(logits, rs_gen))
    u = torch.rand(B, 4, generator=g, dtype=torch.float64)
    t = _chain(B, V, g)
    a, b = verify_steps(t, logits, rs_own, u), verify_steps(t, logits, rs_gen, u)
    assert torch.equal(a.path, b.path) and torch.equal(a.n_accepted, b.n_accepted) and torch.equal(a.next_token,
                                                                                                    b.next_token)
    for only in ([True] * B, [False, True, False, True]):  # every row sampling, and greedy rows alone under greedy flags
        sel = torch.tensor(only)
        mine = flags([p for p, s in zip(params, only) if s] if all(only) else params[1::2])
        x = RowSampling(temperature[sel], top_k[sel], top_p[sel], greedy[sel], **mine)
        y = RowSampling(temperature[sel], top_k[sel], top_p[sel], greedy[sel], **canonical_flags(mine))
        assert torch.equal(logits_to_probs_rows(logits[sel], x), logits_to_probs_rows(logits[sel], y))
    skipped = RowSampling(temperature, top_k, top_p, greedy, **{**own, "any_top_k": False})
    assert not torch.equal(logits_to_probs_rows(logits, rs_own), logits_to_probs_rows(logits, skipped))


def test_warm_up_arguments_and_the_eager_decoder(target, draft_shared, tok):
    eager = SpecDecoder(target, draft_shared, tok, views="M", gamma=2)
    w = eager.warm_up(max_batch=8)
    assert (w.captured, w.graphs, w.seconds) == (0, 0, 0.0)  # nothing to capture eagerly
    for bad in ({"max_batch": 0}, {"max_context": 1}, {"max_batch": True}):
        with pytest.raises(MMSpecError, match=next(iter(bad))):
            eager.warm_up(**bad)
    with pytest.raises(MMSpecError, match="speculate must be one of"):
        eager.policy_for("sometimes")


def test_warm_up_while_a_scheduler_holds_the_engine_is_refused(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M", gamma=2, cuda_graphs="emulate")
    sched = BatchScheduler(dec, max_batch=1, speculate="never")
    with pytest.raises(MMSpecError, match="while a scheduler holds this decoder's engine"):
        dec.warm_up(max_batch=1, speculate="never", max_context=64)
    sched.close()
    w = dec.warm_up(max_batch=1, speculate="never", max_context=64)
    assert w.captured == 2 * 2 and w.graphs == graph_count(engine_of(dec))  # "never": plain steps x paths x widths


def test_logprobs_past_max_logprobs_are_refused(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M", gamma=2, max_logprobs=3)
    with pytest.raises(MMSpecError, match="logprobs=4 is more than this decoder's max_logprobs=3"):
        dec.generate(*make_prompt(1, 16, seed=1), max_new_tokens=2, logprobs=4)
    assert len(dec.generate(*make_prompt(1, 16, seed=1), max_new_tokens=2, logprobs=3).logprobs[0].top) == 3
    with pytest.raises(MMSpecError, match="max_logprobs must be a whole number >= 0"):
        SpecDecoder(target, draft_shared, tok, views="M", max_logprobs=-1)
