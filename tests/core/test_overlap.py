"""Overlap (BatchScheduler(overlap=True)): each step is launched before the previous one's
outcomes are read, planned from bounds on the step in flight, and a request that finishes in
it runs one step more whose tokens are dropped. The CPU runs a step as it is launched, so
overlap hides nothing here (it is on by default on a GPU only); these tests force it on and
check that it changes nothing a request sees: greedy outputs equal the target's, seeded ones
equal the same decode without overlap, for every drafter; joins, cancels, failures and the
adaptive weights' trajectories included; and that the order really is launch n+1, read n."""

import pytest
import torch

from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.engine.policy import Action, SpeculationPolicy
from mmspec.heads import build_head
from mmspec.models.captioner import FixedCaptioner


def requests(n, seed=None):
    mix = [(1, 20, 6), (0, 7, 3), (2, 1, 5), (5, 13, 2), (1, 3, 9), (2, 24, 4), (0, 16, 8)]
    out = []
    for i, (n_img, max_new, text_len) in enumerate(mix[:n]):
        ids, pv = make_prompt(n_img, 16, seed=20 + i, text_len=text_len)
        r = dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new,
                 captions=[f"w{10 + k} w{20 + k} w30" for k in range(n_img)])  # the caption view's
        if seed is not None:
            r.update(seed=seed + i, temperature=[1.0, 0.7, 1.3][i % 3])
        out.append(r)
    return out


def run(dec, reqs, overlap, max_batch=4, speculate="always", join_at=None):
    """Every request's result (input order) through one scheduler; ``join_at``: the step at
    which the second half of the requests is submitted (a join while a step is in flight)."""
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=speculate, overlap=overlap)
    first = reqs if join_at is None else reqs[:len(reqs) // 2]
    rids = [sched.submit(r) for r in first]
    results, n = {}, 0
    while sched.has_work() or (join_at is not None and len(rids) < len(reqs)):
        if join_at is not None and n == join_at:
            rids += [sched.submit(r) for r in reqs[len(first):]]
        for ev in sched.step():
            assert ev.error is None, ev.error
            if ev.finished:
                results[ev.rid] = ev.result
        n += 1
    assert sched.engine.in_flight == 0 and sched.engine.active == 0
    sched.close()
    return [results[r] for r in rids]


def reference(target, r):
    ids = r["input_ids"]
    mm = {} if r["pixel_values"] is None else {"pixel_values": r["pixel_values"]}
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=r["max_new_tokens"], **mm)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def refs(target):
    return [reference(target, r) for r in requests(7)]


DECODERS = {
    "M": dict(views="M"),
    "MTC-adaptive": dict(views="MTC", weights="adaptive", captioner=FixedCaptioner([])),
    "static-tree": dict(views="MT", tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dynamic-tree": dict(views="MT", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6),
    "lookup": dict(draft="lookup"),
    "suffix": dict(draft="suffix"),
    "M+suffix": dict(views="M", model_free="suffix"),
}


def decoder(target, draft, tok, name):
    kw = dict(DECODERS[name])
    return SpecDecoder(target, kw.pop("draft", draft), tok, prefix_cache_mb=0, **kw)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_overlap_changes_no_output(target, draft_shared, tok, refs, name):
    def fresh():  # no run sees another's prefix cache or suffix store: compared block by block
        return decoder(target, draft_shared, tok, name)

    reqs = requests(7)
    on = run(fresh(), reqs, overlap=True)
    assert [r.token_ids for r in on] == refs
    off = run(fresh(), reqs, overlap=False)
    for a, b in zip(on, off):
        assert a.stats.tokens_per_block == b.stats.tokens_per_block  # the same blocks, none lost or doubled
        assert sum(a.stats.tokens_per_block) == len(a.token_ids)
        if b.stats.view_weights is not None:  # adaptive: the weights each block drafted with, and the last
            # (equal to the last bits: a step planned over one in flight attends over a longer span of
            # masked slots, so its sums may round differently; the tokens above are compared exactly)
            assert len(a.stats.view_weights) == len(b.stats.view_weights)
            for wa, wb in zip(a.stats.view_weights + [a.stats.final_weights],
                              b.stats.view_weights + [b.stats.final_weights]):
                assert wa == pytest.approx(wb, rel=1e-12, abs=1e-15)
    seeded = requests(5, seed=30)
    assert [r.token_ids for r in run(fresh(), seeded, overlap=True)] == \
        [r.token_ids for r in run(fresh(), seeded, overlap=False)]


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_overlap_with_a_head(target, tok, refs, variant):
    dec = SpecDecoder(target, build_head(target, variant, seed=1), tok, tree="dynamic", tree_depth=3, tree_topk=2,
                      tree_budget=6)
    assert [r.token_ids for r in run(dec, requests(5), overlap=True)] == refs[:5]
    seeded = requests(4, seed=9)
    assert [r.token_ids for r in run(dec, seeded, overlap=True)] == \
        [r.token_ids for r in run(dec, seeded, overlap=False)]


@pytest.mark.parametrize("speculate", ["never", "auto"])
def test_overlap_under_the_policies(target, draft_shared, tok, refs, speculate):
    """Plain steps keep or feed pending tokens by a bound on the step in flight (catch-up)."""
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    assert [r.token_ids for r in run(dec, requests(7), overlap=True, speculate=speculate)] == refs


def test_joins_and_static_shapes_while_a_step_is_in_flight(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="MT", static_cache=True)
    assert [r.token_ids for r in run(dec, requests(6), overlap=True, max_batch=3, join_at=2)] == refs[:6]


def test_launch_comes_before_the_read_of_the_step_before(target, draft_shared, tok, monkeypatch):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    sched = BatchScheduler(dec, max_batch=2, overlap=True)
    log = []
    launch, finish = sched.engine.launch, sched.engine.finish

    def logged_launch(*a, **k):
        step = launch(*a, **k)
        log.append(("launch", step))
        return step

    def logged_finish(step):
        log.append(("read", step))
        return finish(step)

    monkeypatch.setattr(sched.engine, "launch", logged_launch)
    monkeypatch.setattr(sched.engine, "finish", logged_finish)
    for r in requests(2):
        sched.submit(r)
    first = sched.step()
    assert first == [] and sched.engine.in_flight == 1  # launched, nothing read yet
    while sched.has_work():
        sched.step()
    steps = [s for kind, s in log if kind == "launch"]
    assert [s for kind, s in log if kind == "read"] == steps  # every step read once, in order
    for k in range(1, len(steps)):  # step k launched before step k-1 was read
        assert log.index(("launch", steps[k])) < log.index(("read", steps[k - 1]))
    sched.close()


def test_cancel_while_in_flight(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    reqs = requests(7)
    sched = BatchScheduler(dec, max_batch=4, overlap=True)
    a, b, c = (sched.submit(reqs[i]) for i in (0, 5, 3))
    sched.step()
    sched.step()
    sched.cancel(a)  # a step that holds its row is in flight: its tokens are dropped
    events = []
    while sched.has_work():
        events += sched.step()
    assert all(ev.rid != a for ev in events)
    got = {ev.rid: ev.result.token_ids for ev in events if ev.finished}
    assert got == {b: refs[5], c: refs[3]}
    sched.close()


def test_engine_refuses_a_second_step_ahead(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    sched = BatchScheduler(dec, max_batch=1, overlap=True)
    sched.submit(requests(1)[0])
    sched.admit()
    with torch.inference_mode():
        s1 = sched.engine.launch()
        s2 = sched.engine.launch()
        with pytest.raises(RuntimeError, match="in flight"):
            sched.engine.launch()
        with pytest.raises(RuntimeError, match="order"):
            sched.engine.finish(s2)
        assert sched.engine.finish(s1)[0] and sched.engine.finish(s2)[0]


def test_overlap_keeps_each_tokens_logprobs(target, draft_shared, tok):
    """Logprobs ride the step's one read: a step read after the next one was launched gives the same."""
    reqs = requests(4)
    for r in reqs:
        r["logprobs"] = 3
    got = [decoder(target, draft_shared, tok, "dynamic-tree").generate_batch(reqs, overlap=ov) for ov in (True, False)]
    for a, b in zip(*got):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        assert a.logprobs == b.logprobs


def test_a_bad_overlap_is_refused_before_the_engine_is_leased(target, draft_shared, tok):
    from mmspec import MMSpecError

    dec = SpecDecoder(target, draft_shared, tok, views="M")
    with pytest.raises(MMSpecError, match=r"overlap must be True, False or None"):
        BatchScheduler(dec, overlap="yes")
    with pytest.raises(MMSpecError, match=r"overlap must be True, False or None"):
        dec.generate_batch(requests(1), overlap=1)
    assert BatchScheduler(dec).overlap is False  # the CPU's default; the engine was not held by the refusals


class Scripted(SpeculationPolicy):
    """A policy that decodes plainly for long runs between drafted steps (as "auto" does while a
    draft does not pay): the drafter lags up to the engine's whole pending buffer, is caught up
    by one wide forward, and a drafted step after such a run feeds the whole buffer."""

    def __init__(self, pattern):
        super().__init__("auto")
        self.pattern, self.n = pattern, 0

    def decide(self, B, spec, rows=()):
        self.n += 1
        return Action(0, self.pattern[(self.n - 1) % len(self.pattern)], 1)


LAG_PATTERN = [0] * 19 + [2, 0, 0, 3, 1] + [0] * 5 + [3]  # runs past the lag (a catch-up), then short ones


@pytest.mark.parametrize("name", ["M", "MTC-adaptive", "static-tree", "head"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_drafter_lagging_behind_plain_steps_catches_up_exactly(target, draft_shared, tok, refs, name, overlap,
                                                                 monkeypatch):
    from mmspec.engine.step import Engine
    if name == "head":
        dec = SpecDecoder(target, build_head(target, "eagle3", seed=1), tok, tree="dynamic", tree_depth=3,
                          tree_topk=2, tree_budget=6, prefix_cache_mb=0)
    else:
        dec = decoder(target, draft_shared, tok, name)
    plans = []
    plan_of = Engine._plan

    def recording(self, *a, **kw):
        out = plan_of(self, *a, **kw)
        plans.append((out[0], self.width, self.lag, self.fed_a_lag(out[0])))
        return out

    monkeypatch.setattr(Engine, "_plan", recording)
    reqs = requests(7)
    for r in reqs:
        r["max_new_tokens"] = r["max_new_tokens"] + 30  # long enough for runs past the lag
    want = [reference(target, r) for r in reqs]
    got = run(dec, reqs, overlap=overlap, speculate=Scripted(LAG_PATTERN))
    assert [r.token_ids for r in got] == want
    width, lag = plans[0][1], plans[0][2]
    assert lag > width
    assert any(p.catch_up for p, _, _, _ in plans)  # the lag filled: one wide catch-up forward
    assert any(p.spec is not None and p.feed == lag for p, _, _, _ in plans)  # a drafted step after a run
    assert any(p.spec is not None and p.feed == width for p, _, _, _ in plans)  # and one right after a drafted one
    catch_ups = sum(p.catch_up for p, _, _, _ in plans)
    plain = sum(p.spec is None for p, _, _, _ in plans)
    assert catch_ups * (lag - width) <= plain
    # a drafted step that fed the lag is not timed as its action's cost; every other step is
    assert [untimed for _, _, _, untimed in plans] == [p.spec is not None and p.feed == lag for p, _, _, _ in plans]  # the drafter is fed once a lag's worth of plain steps, not every other
    seeded = requests(5, seed=40)
    for r in seeded:
        r["max_new_tokens"] += 25
    assert [r.token_ids for r in run(dec, seeded, overlap=overlap, speculate=Scripted(LAG_PATTERN))] == \
        [r.token_ids for r in run(dec, seeded, overlap=overlap, speculate="always")]


def test_only_a_free_step_that_fed_a_lag_goes_untimed():
    """A constrained step feeds its whole buffer every step (room for forced tails): that is its
    action's cost, timed like any; a free drafted step that fed a lag is not; plain steps are."""
    from types import SimpleNamespace

    from mmspec.drafting.tree import TreeSpec
    from mmspec.engine.step import Engine, StepPlan

    engine = SimpleNamespace(width=3)
    chain = TreeSpec("chain", depth=2)

    def plan(spec, feed, constrained=False):
        return StepPlan(rows=1, spec=spec, catch_up=False, keep_pending=False, proposals=False, span=8,
                        span_draft=8, flags=(), feed=feed, constrained=constrained)

    assert Engine.fed_a_lag(engine, plan(chain, 16))
    assert not Engine.fed_a_lag(engine, plan(chain, 3))
    assert not Engine.fed_a_lag(engine, plan(chain, 16, constrained=True))
    assert not Engine.fed_a_lag(engine, plan(None, 0))
