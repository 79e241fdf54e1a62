"""``tree="auto"``: each step's block shape (the chain, or the device's dynamic tree at one of two
budgets) chosen by its measured tokens per second (:class:`~mmspec.engine.policy.SpeculationPolicy`; its
decisions alone: ``tests/core/test_policy.py``).
Lossless whatever it picks (the target's greedy tokens); with a fake clock the choice is
deterministic: the tree where its steps are cheap for what they accept, the chain where they are
dear."""

from __future__ import annotations

import pytest

from helpers.reference import reference
from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.bench.config import method_tree
from mmspec.drafting.tree import DYNAMIC_DEFAULTS, TreeSpec, auto_shapes, parse_shapes, parse_tree
from mmspec.engine.scheduler import BatchScheduler
from mmspec.errors import MMSpecError


def test_auto_shapes_are_the_chain_and_the_devices_tree_at_two_budgets():
    for device in ("cpu", "cuda"):
        d, k, b = DYNAMIC_DEFAULTS[device]
        chain, half, full = auto_shapes(gamma=5, device_type=device)
        assert chain == TreeSpec("chain", depth=5)
        assert (full.kind, full.depth, full.topk, full.budget) == ("dynamic", d, k, b)
        assert half == TreeSpec("dynamic", depth=d, topk=k, budget=b // 2)
    assert parse_shapes("auto", gamma=3, depth=4, budget=10)[1:] == (TreeSpec("dynamic", depth=4, topk=3, budget=5),
                                                                     TreeSpec("dynamic", depth=4, topk=3, budget=10))
    assert parse_shapes("6x4x16", gamma=5) == (parse_tree("6x4x16", gamma=5),)
    with pytest.raises(MMSpecError, match="lower gamma"):  # the largest tree bounds every block
        auto_shapes(gamma=8, device_type="cuda")
    with pytest.raises(MMSpecError, match="--stop-below shortens"):
        parse_shapes("auto", gamma=5, stop_below=0.3, spelling="cli")
    with pytest.raises(MMSpecError, match="parse_shapes"):
        parse_tree("auto", gamma=5)
    assert method_tree("M+tree:auto") == {"tree": "auto"}


class FakeClock:
    """The scheduler's clock: a step of a tree costs ``tree_s``, a chain's 1 s, whatever the host does."""

    def __init__(self, tree_s: float):
        self.now, self.tree_s = 0.0, tree_s

    def __call__(self) -> float:
        return self.now

    def times(self, engine) -> None:
        real = engine.launch

        def launch(shape=None, proposers=None):
            self.now += 1.0 if shape.kind == "chain" else self.tree_s
            return real(shape, proposers)
        engine.launch = launch


@pytest.mark.parametrize(("tree_s", "chosen"), [(1e-3, "tree"), (1e3, "chain")])
def test_a_fake_clock_steers_the_decoder_and_every_answer_is_the_targets(target, draft_shared, tok, tree_s, chosen):
    """Through the real engine: a tree step 1000x cheaper than a chain step wins whatever the
    acceptance (a step emits 1 to 10 tokens a row), 1000x dearer loses; the tokens are the target's."""
    dec = SpecDecoder(target, draft_shared, tok, views="M", tree="auto")
    assert dec.method == "M+tree:auto" and dec.tree == dec.tree_shapes[-1]
    for seed in (41, 42, 43):
        ids, pv = make_prompt(1, 16, seed=seed)
        clock = FakeClock(tree_s)
        sched = BatchScheduler(dec, max_batch=1, stream_text=False, clock=clock)
        clock.times(sched.engine)
        sched.submit(dict(input_ids=ids, pixel_values=pv, max_new_tokens=24))
        results = [ev.result for _ in range(100) if sched.has_work() for ev in sched.step() if ev.finished]
        sched.close()
        (res,) = results
        assert res.token_ids == reference(target, ids, pv, 24)
        assert sum(res.stats.shapes.values()) == res.stats.n_blocks and res.stats.shape_rates["1"]["shapes"]
    best = dec.shape_policy.choice.shape
    assert (dec.tree_shapes[best].kind == "chain") == (chosen == "chain")
    chains = res.stats.shapes.get(dec.tree_shapes[0].label, 0)  # the last request's steps: mostly the choice
    assert (chains > res.stats.n_blocks / 2) == (chosen == "chain"), res.stats.shapes
    assert res.stats.shape_rates["1"]["choice"] == dec.tree_shapes[best].label
    assert res.stats.tree.startswith("chain(γ=5) | dynamic(") and res.stats.tree.endswith(", chosen per step")


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_auto_trees_are_lossless_alone_and_in_a_batch(target, draft_shared, tok, graphs):
    """The real clock: whatever is picked, each request is the target's; a batch's picks apart
    from a single request's (the policy is per batch size)."""
    dec = SpecDecoder(target, draft_shared, tok, views="M", tree="auto", cuda_graphs=graphs)
    prompts = [make_prompt(n, 16, seed=50 + n) for n in (1, 2, 3)]
    refs = [reference(target, ids, pv, 18) for ids, pv in prompts]
    for (ids, pv), ref in zip(prompts, refs):
        assert dec.generate(ids, pv, max_new_tokens=18).token_ids == ref
    reqs = [dict(input_ids=ids, pixel_values=pv, max_new_tokens=18) for ids, pv in prompts]
    out = dec.generate_batch(reqs, max_batch=3)
    assert [r.token_ids for r in out] == refs
    assert len(dec.shape_policy.shapes) == 3 and "3" in dec.shape_policy.report()
    assert dec.speculation_policy.shapes == dec.tree_shapes  # "auto" chooses among the same shapes


@pytest.mark.parametrize("graphs", [False, "emulate"])
@pytest.mark.parametrize("tree", ["9x3x8", "auto"])
def test_a_tree_feeding_more_nodes_than_it_keeps_fits_the_draft_cache(target, draft_shared, tok, tree, graphs):
    """A dynamic tree feeds (depth - 1) x topk nodes to the draft (here 24) before its budget keeps
    8: the draft's rows were sized by the budget, and a request's last steps ran past them."""
    dec = SpecDecoder(target, draft_shared, tok, views="M", tree=tree, cuda_graphs=graphs,
                      **({"tree_budget": 8, "gamma": 4} if tree == "auto" else {}))
    for n in (8, 21):
        ids, pv = make_prompt(1, 16, seed=60 + n)
        assert dec.generate(ids, pv, max_new_tokens=n).token_ids == reference(target, ids, pv, n)
