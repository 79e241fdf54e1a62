"""The one speculation policy (:mod:`mmspec.engine.policy`) on a simulated device: its decisions
alone, deterministic (a fake step cost, seeded acceptance draws). It must never lose: on ragged
batches whose size changes every few steps, ``auto`` delivers at least 0.95x the tokens per second
of the better of ``always`` and ``never``, with a draft that agrees and with one that never does;
exploration stays a bounded share of the steps; a row's acceptance is its own. Through the real
engine: ``tests/core/test_batch.py`` and ``tests/core/test_shape_policy.py``."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from mmspec.drafting.tree import TreeSpec, auto_shapes
from mmspec.engine.policy import Action, SpeculationPolicy, StepCost, expected_tokens
from mmspec.errors import MMSpecError

CHAIN = TreeSpec("chain", depth=5)


class Row:
    """What the policy reads of a row: its acceptance average and the tokens it may still emit."""

    def __init__(self, alpha: float, remaining: int = 1 << 20):
        self.alpha, self.remaining, self.accept_avg = alpha, remaining, None


def gpu_like(B: int, a: Action) -> float:
    """Seconds of a step on a device that is memory-bound until 64 verified tokens, then compute-bound."""
    return 1e-3 * (1.0 + 0.15 * a.depth + 0.02 * max(0, B * a.nodes - 64))


def ragged(steps: int, seed: int, top: int = 32) -> list[int]:
    """Batch sizes that change every few steps (requests join and leave), between 1 and ``top``."""
    r, B, out = random.Random(seed), top // 2, []
    while len(out) < steps:
        B = min(top, max(1, B + r.randint(-4, 4)))
        out += [B] * r.randint(1, 5)
    return out[:steps]


def simulate(pol: SpeculationPolicy, batches: list[int], alpha_of, device=gpu_like, spec=CHAIN, seed: int = 0) -> float:
    """Run the policy over ``batches`` (a batch size per step; rows join and leave at the end),
    each row accepting a drafted token with its own probability; -> tokens per second."""
    r = random.Random(seed)
    rows: list[Row] = []
    made = 0
    tokens = seconds = 0.0
    for B in batches:
        while len(rows) > B:
            rows.pop()
        while len(rows) < B:
            rows.append(Row(alpha_of(made)))
            made += 1
        a = pol.decide(B, spec, rows)
        width = 1 if a.depth == 0 else (pol.shapes or (spec,))[a.shape].width
        blocks, emitted = [], 0
        for row in rows:
            if a.depth == 0:
                emitted += 1
                continue
            p = 1 - (1 - row.alpha) ** width  # a wider tree: more tries per position
            k = 0
            while k < a.depth and r.random() < p:
                k += 1
            blocks.append((row, k, a.depth, int(k < a.depth), k + 1))
            emitted += k + 1
        t = device(B, a)
        pol.record(B, a, t, blocks)
        tokens, seconds = tokens + emitted, seconds + t
    return tokens / seconds


@pytest.mark.parametrize(("name", "alpha_of"), [("agreeing", lambda i: 0.8), ("rarely agrees", lambda i: 0.02),
                                                ("mixed rows", lambda i: 0.9 if i % 3 else 0.05)])
def test_auto_is_never_worse_than_the_better_of_always_and_never(name, alpha_of):
    batches = ragged(1500, seed=1)
    rates = {mode: simulate(SpeculationPolicy(mode), batches, alpha_of) for mode in ("always", "never", "auto")}
    assert rates["auto"] >= 0.95 * max(rates["always"], rates["never"]), (name, rates)


@pytest.mark.parametrize("B", [1, 8, 32])
def test_auto_at_a_fixed_batch_size(B):
    for alpha in (0.8, 0.02):
        rates = {m: simulate(SpeculationPolicy(m), [B] * 400, lambda i, a=alpha: a) for m in ("always", "never", "auto")}
        assert rates["auto"] >= 0.95 * max(rates["always"], rates["never"]), (B, alpha, rates)


def test_the_choice_follows_the_batch_size_from_one_shared_model():
    """Learnt on even batch sizes from 2 to 32: an odd one, never seen, is decided from the shared
    model at once (no probe first), within 20% of the best action's true goodput there."""
    pol = SpeculationPolicy("auto")
    simulate(pol, [b + b % 2 for b in ragged(600, seed=3, top=32)], lambda i: 0.8)  # even sizes only
    unseen = [3, 5, 29, 31]
    assert not pol.batches & set(unseen) and {2, 32} <= pol.batches
    for b in unseen:
        steps, probes = pol.steps, pol.probes
        pick = pol.decide(b, CHAIN, [Row(0.8) for _ in range(b)])
        assert pol.probes == probes and pol.steps == steps + 1
        true = {a: b * (expected_tokens(np.array(0.8), np.array(a.depth)) if a.depth else 1) / gpu_like(b, a)
                for a in pol.actions(CHAIN)}
        assert true[pick] >= 0.8 * max(true.values()), (b, pick, true)
    assert pol.decide(3, CHAIN, [Row(0.8)] * 3).depth >= 3  # deep drafts for a small batch ...
    assert pol.decide(31, CHAIN, [Row(0.8)] * 31).depth <= 2  # ... shallow for a large one


def test_exploration_is_a_bounded_share_of_the_steps():
    pol = SpeculationPolicy("auto", probe_share=1 / 32)
    simulate(pol, ragged(2000, seed=4), lambda i: 0.8)
    start = pol.explore + 1  # the full depth, then plain once
    assert pol.probes <= pol.probe_share * pol.steps + 1
    assert pol.probes >= pol.probe_share * pol.steps - 2  # and it does re-measure
    assert start + pol.probes < 0.05 * pol.steps


def test_a_rows_acceptance_is_its_own():
    pol = SpeculationPolicy("always")
    good, bad = Row(0.95), Row(0.0)
    r = random.Random(0)
    for _ in range(60):
        a = pol.decide(2, CHAIN, [good, bad])
        k = 0
        while k < a.depth and r.random() < 0.95:
            k += 1
        pol.record(2, a, 1e-3, [(good, k, a.depth, int(k < a.depth), k + 1), (bad, 0, a.depth, 1, 1)])
    assert pol.row_alpha(good) > 0.8 and pol.row_alpha(bad) < 0.05
    assert pol.row_alpha(bad) < pol.acceptance < pol.row_alpha(good)  # the average a new row starts from
    fresh = Row(0.5)
    assert pol.row_alpha(fresh) == pytest.approx(pol.acceptance + pol.optimism / (1 + pol.prior_n) ** 0.5)
    once = Row(0.5)
    once.accept_avg = (0.0, 1.0, 1)  # one unlucky block: still mostly the average
    assert pol.row_alpha(once) > 0.5 * pol.acceptance
    # bad rows add nothing to drafting's case: with them alone, plain steps win; with good ones, drafts
    auto = SpeculationPolicy("auto", cost=pol.cost)
    auto.runs = {Action(0, 5, 6): 1, Action(0, 0, 1): 1}
    auto.cost.update(2, Action(0, 0, 1), 0.6e-3)
    bads = [Row(0.0) for _ in range(2)]
    for b in bads:
        b.accept_avg = (0.0, 1.0, 50)
    goods = [Row(0.95) for _ in range(2)]
    for g in goods:
        g.accept_avg = (9.0, 1.0, 50)
    assert auto.decide(2, CHAIN, bads).depth == 0
    assert auto.decide(2, CHAIN, goods).depth > 0


def test_a_choice_does_not_thrash_between_near_equals():
    pol = SpeculationPolicy("auto", probe_share=0.0)

    def even(B, a):  # every depth within 1% of the same tokens per second
        return 1e-3 * (expected_tokens(np.array(0.5), np.array(a.depth)) if a.depth else 1.0) * (1 + 0.01 * (a.depth % 2))
    picks = []
    batches = [8] * 300
    r = random.Random(5)
    rows = [Row(0.5) for _ in range(8)]
    for B in batches:
        a = pol.decide(B, CHAIN, rows)
        blocks = []
        for row in rows:
            k = 0
            while a.depth and k < a.depth and r.random() < 0.5:
                k += 1
            if a.depth:
                blocks.append((row, k, a.depth, int(k < a.depth), k + 1))
        pol.record(B, a, even(B, a), blocks)
        picks.append(a)
    switches = sum(x != y for x, y in zip(picks[50:], picks[51:]))
    assert switches <= 25, switches


def test_trees_by_their_measured_gain():
    shapes = auto_shapes(gamma=5, device_type="cuda")  # chain, 6x4x12, 6x4x24

    def cheap_trees(B, a):
        return 1e-3 * (1.0 + 0.1 * a.depth)

    def dear_trees(B, a):
        return 1e-3 * (1.0 + 0.1 * a.depth + 0.5 * (a.nodes - a.depth - 1))
    for device, tree_wins in ((cheap_trees, True), (dear_trees, False)):
        pol = SpeculationPolicy("always", shapes=shapes)
        simulate(pol, [1] * 200, lambda i: 0.6, device=device, spec=shapes[-1])
        assert (pol.choice.shape != 0) == tree_wins, pol.choice
        rep = pol.report()["1"]
        assert set(rep["shapes"]) == {s.label for s in shapes}
        assert (rep["choice"] != shapes[0].label) == tree_wins
        json.dumps(rep)


def test_modes_and_the_start():
    pol = SpeculationPolicy("auto")
    assert pol.decide(8, CHAIN) == Action(0, 5, 6)  # the full depth first ...
    pol.record(8, Action(0, 5, 6), 1e-3, [])
    assert pol.decide(8, CHAIN) == Action(0, 0, 1)  # ... then plain steps, once
    assert SpeculationPolicy("always").decide(8, CHAIN) == Action(0, 5, 6)
    assert SpeculationPolicy("never").decide(8, CHAIN) == Action(0, 0, 1)
    assert SpeculationPolicy("always").spec_of(Action(0, 3, 4), CHAIN) == TreeSpec("chain", depth=3)
    with pytest.raises(MMSpecError, match="speculate must be one of"):
        SpeculationPolicy("sometimes")


def test_the_cost_model_shares_what_each_batch_size_measured():
    cost = StepCost()
    a = Action(0, 5, 6)
    for B in (1, 2, 4, 8, 16):
        for _ in range(5):
            cost.update(B, a, 1e-3 * (1 + 0.1 * B))
    assert cost.predict(12, a) == pytest.approx(1e-3 * 2.2, rel=0.05)  # never measured at 12
    assert cost.predict(1, Action(0, 0, 1)) is not None
