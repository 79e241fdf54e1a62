"""The engine with fixed shapes: a decoder on static caches / CUDA graphs steps its rows padded
to a bucket, attending over a bucket of slots (not the whole buffer), one graph per (row
bucket, new tokens, span bucket) captured on first use and reused across batches, eager fallback
when capture fails. On the CPU the capture is emulated (``cuda_graphs="emulate"``: the same buffers,
bookkeeping and output aliasing as a replay). Every request still equals the target's greedy
output, a seeded one its solo run."""

import warnings

import pytest
import torch

from helpers.reference import engine_of, step_graphs
from helpers.tiny import make_prompt, make_qwen, noisy_copy, qwen_inputs
from mmspec import SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.heads import build_head
from mmspec.models.captioner import FixedCaptioner
from mmspec.runtime.graphs import StepRunner, bucket


def reference(target, ids, n, **mm):
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()


# (images, max_new_tokens, text length): 5 requests (a bucket of 8 rows), limits 1 and inside a block
MIX = [(1, 20, 6), (0, 7, 3), (2, 1, 5), (5, 13, 2), (1, 3, 9)]


def requests(n=5, captions=False):
    out = []
    for i, (n_img, max_new, text_len) in enumerate(MIX[:n]):
        ids, pv = make_prompt(n_img, 16, seed=20 + i, text_len=text_len)
        out.append(dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new))
        if captions:  # the caption view reads each request's own
            out[-1]["captions"] = [f"w{10 + k} w{20 + k} w30" for k in range(n_img)]
    return out


def want(target, reqs):
    return [reference(target, r["input_ids"], r["max_new_tokens"],
                      **({} if r["pixel_values"] is None else {"pixel_values": r["pixel_values"]})) for r in reqs]


def plans(dec):
    """The whole-step graphs the decoder's engine captured: plan -> its captured shapes."""
    return step_graphs(dec)


def decoder(target, draft, tok, how, **kw):
    if how == "head":
        return SpecDecoder(target, build_head(target, "eagle", seed=2), tok, tree="dynamic", tree_depth=3,
                           tree_topk=2, tree_budget=6, **kw)
    if how == "MTC+tree":
        return SpecDecoder(target, draft, tok, views="MTC", captioner=FixedCaptioner([]),
                           tree="dynamic", **kw)
    return SpecDecoder(target, draft, tok, views=how, **kw)


@pytest.mark.parametrize("how", ["M", "MTC+tree", "head"])
def test_graphs_per_bucket_equal_target_and_are_reused(target, draft_shared, tok, how):
    reqs = requests(captions=how == "MTC+tree")
    ref = want(target, reqs)
    dec = decoder(target, draft_shared, tok, how, cuda_graphs="emulate")
    assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    shapes = plans(dec)
    engine = engine_of(dec)
    assert shapes and all(shapes.values())  # captured, a whole step each
    for plan in shapes:
        assert plan.rows == bucket(plan.rows)  # padded to the row bucket
        assert plan.span == bucket(plan.span) >= 512 and plan.span <= engine.cache.capacity  # a span bucket
        if plan.span_draft:
            assert plan.span_draft == bucket(plan.span_draft) <= engine.drafting.rows.cache.capacity
    # a second batch on the same decoder: the same buffers, nothing new captured, the same tokens
    assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    assert plans(dec) == shapes
    assert engine_of(dec).graphs_failed is None


def test_static_without_graphs_and_a_seeded_request_equal_solo(target, draft_shared, tok):
    """static_cache=True (fixed shapes run eagerly) gives the same tokens; a seeded sampled request in
    a padded batch equals its solo generate with that seed."""
    reqs = requests()
    dec = decoder(target, draft_shared, tok, "M", static_cache=True)
    assert [r.token_ids for r in dec.generate_batch(reqs)] == want(target, reqs)
    assert not engine_of(dec).step_graphs_by_plan  # eager: nothing captured
    sampled = [dict(r, temperature=0.8, seed=100 + i) for i, r in enumerate(reqs[:3])]
    solo = [dec.generate(r["input_ids"], r["pixel_values"], max_new_tokens=r["max_new_tokens"], temperature=0.8,
                         seed=r["seed"]).token_ids for r in sampled]
    emulated = decoder(target, draft_shared, tok, "M", cuda_graphs="emulate")
    assert [r.token_ids for r in emulated.generate_batch(sampled)] == solo


def test_growing_the_buffer_drops_the_old_graphs(target, draft_shared, tok):
    """Requests joining a running batch past its row bucket grow the static cache: the graphs captured
    on the old buffer are dropped (they point at freed memory) and the tokens stay the target's."""
    reqs = requests()
    ref = want(target, reqs)
    dec = decoder(target, draft_shared, tok, "M", cuda_graphs="emulate")
    sched = BatchScheduler(dec)
    rids = [sched.submit(reqs[0])]
    events = sched.step() + sched.step()
    engine = engine_of(dec)
    generation, rows = engine.cache.generation, engine.cache.rows
    assert plans(dec)
    rids += [sched.submit(r) for r in reqs[1:]]
    while sched.has_work():
        events += sched.step()
    assert engine.cache.rows > rows and engine.cache.generation > generation
    assert engine._graphs_generation == engine.generation  # the old graphs dropped, new ones captured
    assert engine.graphs_failed is None  # recaptured after the growth, no fallback (the pool is a fresh one)
    assert max(p.rows for p in plans(dec)) >= 8
    done = {ev.rid: ev.result for ev in events if ev.finished}
    assert all(ev.error is None for ev in events)
    assert [done[r].token_ids for r in rids] == ref


def test_capture_failure_falls_back_to_eager_once_per_runner(target, draft_shared, tok, monkeypatch):
    def broken(self, *a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepRunner, "_capture", broken)
    reqs = requests(3)
    dec = decoder(target, draft_shared, tok, "M", cuda_graphs="emulate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [r.token_ids for r in dec.generate_batch(reqs)] == want(target, reqs)
    msgs = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(msgs) == 1 and "running it eagerly" in msgs[0]  # once for the engine
    assert engine_of(dec).graphs_failed


def test_a_second_live_scheduler_gets_forwards_of_its_own(target, draft_shared, tok):
    """Two schedulers alive on one decoder never share a static cache (the second gets its own)."""
    dec = decoder(target, draft_shared, tok, "M", cuda_graphs="emulate")
    a, b = BatchScheduler(dec), BatchScheduler(dec)
    assert a.engine is not b.engine
    reqs = requests(2)
    ra, rb = a.submit(reqs[0]), b.submit(reqs[1])
    events_a, events_b = [], []
    while a.has_work() or b.has_work():
        events_a += a.step()
        events_b += b.step()
    ref = want(target, reqs)
    assert [ev.result.token_ids for ev in events_a if ev.finished and ev.rid == ra] == [ref[0]]
    assert [ev.result.token_ids for ev in events_b if ev.finished and ev.rid == rb] == [ref[1]]


def test_a_closed_scheduler_hands_its_graphs_to_the_next(target, draft_shared, tok):
    """A server renews its scheduler after a burst while the old one is still referenced: close()
    hands the static buffers and their graphs over (without it the new one would make its own)."""
    dec = decoder(target, draft_shared, tok, "M", cuda_graphs="emulate")
    old = BatchScheduler(dec)
    old.submit(requests(1)[0])
    with pytest.raises(Exception, match="close\\(\\) with"):
        old.close()  # not while it has work
    while old.has_work():
        old.step()
    shapes = plans(dec)
    assert BatchScheduler(dec).engine is not old.engine  # still held: a fresh one
    old.close()
    new = BatchScheduler(dec)
    assert new.engine is old.engine
    assert plans(dec) == shapes and shapes


def test_mrope_batch_with_graphs(tok):
    target = make_qwen(0)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok, views="MT", cuda_graphs="emulate")
    reqs, ref = [], []
    for k, (n_img, video, n) in enumerate([(1, False, 8), (2, True, 5), (0, True, 6)]):
        ids, mm = qwen_inputs(n_img, video, seed=10 + k)
        reqs.append(dict(input_ids=ids, max_new_tokens=n, **mm))
        ref.append(reference(target, ids, n, **mm))
    assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    assert plans(dec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("how", ["M", "MTC+tree", "head"])
def test_cuda_graphs_in_a_batch_on_gpu(how, tok):
    """On a GPU: the batched engine's captured graphs (float64 tiny models, so no near-tie can flip)
    give every request the target's tokens, capture nothing new for a second batch, and never fall
    back to eager."""
    from helpers.tiny import make_llava

    target = make_llava(0).cuda()
    reqs = [{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
            for r in requests(captions=how == "MTC+tree")]
    ref = want(target, reqs)
    dec = decoder(target, noisy_copy(target, 1), tok, how, cuda_graphs=True)
    assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    shapes = plans(dec)
    assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    assert plans(dec) == shapes and all(shapes.values())
    assert engine_of(dec).graphs_failed is None


def test_a_step_attends_over_the_filled_slots_not_the_buffer(target, draft_shared, tok):
    """Issue 52 item 2: with fixed shapes a step's attention spans a bucket of the slots its rows
    fill, not the whole buffer. The same request decoded again on buffers grown 4x reads exactly
    as many keys per forward (the step's attention costs the same: 1.0x <= 1.2x), and the same
    tokens come out."""
    reqs = requests(2)
    ref = want(target, reqs)
    dec = decoder(target, draft_shared, tok, "M", static_cache=True, prefix_cache_mb=0)  # both runs prefill
    spans: list[int] = []
    hook = target.model.language_model.register_forward_pre_hook(
        lambda m, a, k: spans.append(k["attention_mask"].shape[-1]), with_kwargs=True)
    try:
        assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
        small, spans[:] = list(spans), []
        engine = engine_of(dec)
        cap = engine.cache.capacity
        engine.cache.ensure(engine.cache.rows, 4 * cap)  # a buffer 4x larger
        engine.drafting.rows.cache.ensure(engine.drafting.rows.cache.rows, 4 * engine.drafting.rows.cache.capacity)
        assert engine.cache.capacity == 4 * cap
        assert [r.token_ids for r in dec.generate_batch(reqs)] == ref
    finally:
        hook.remove()
    assert spans == small and max(spans) <= cap  # every forward read the same keys as on the smaller buffer
