"""Forced tails (src/mmspec/constrain/tails.py): beside a draft model or head, the tokens a grammar
forces after a drafted tree's leaves ride in the same block without a draft position. The answer
stays the target's own constrained decoding (greedy, coupled seeded sampling, rejection sampling),
in fewer blocks than with the tails off; free rows beside them are untouched."""

import pytest
import torch

from helpers.constrain import constrained_reference
from helpers.reference import reference
from helpers.tiny import EOS, make_prompt
from mmspec import SpecDecoder
from mmspec import request as request_module
from mmspec.constrain import Constraint
from mmspec.constrain.state import RowGrammar
from mmspec.engine import step as engine_step

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 6},
                                          "value": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
          "required": ["label", "value", "tags"]}
C = Constraint("json_schema", schema=SCHEMA)
SHAPES = {"chain": {"gamma": 4}, "static": {"tree": "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"},
          "dynamic": {"tree": "dynamic"}}


def test_forced_run_jumps_forward_and_ends(ctarget, cdraft, ctok):
    """forced_run: the jump-forward string tokenized (several tokenizations are legal, so no single
    token is forced), an EOS the finished grammar asks for; the matcher comes back where it was."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M")
    g = RowGrammar(dec.grammar_compiler.compile(C), dec.target.vocab_size, encode=dec.encode_text)
    run = g.forced_run([], 20)
    assert ctok.decode(run) == '{"label":"'
    assert g.forced_run([], 20) == run and g.forced_run([], 3) == run[:3]  # nothing consumed
    plain = RowGrammar(dec.grammar_compiler.compile(C), dec.target.vocab_size)  # no jump-forward: single forced tokens
    assert len(plain.forced_run([], 20)) < len(run)
    done = dec.encode_text('{"label":"ab","value":1,"tags":[]}')
    assert g.forced_run(done, 5) == [EOS]
    assert g.forced_run(dec.encode_text('{"label":"ab","value":1,"tags":["red"]'), 5) == dec.encode_text("}") + [EOS]
    assert g.forced_run(dec.encode_text('{"label":"ab","value":1,"tags":["red"'), 5) == []  # "," or "]"
    assert g.forced_run(dec.encode_text('{"nolabel'), 5) == []  # a path the grammar refuses forces nothing


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tails_ride_free_and_stay_lossless(ctarget, cdraft, ctok, shape, monkeypatch):
    """Chains, static and dynamic trees: the target's own constrained answer, in no more blocks than
    with the tails off, blocks accepting past the deepest drafted node."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", **SHAPES[shape])
    runs = []
    for seed in (3, 4):
        ids, pv = make_prompt(1, 16, seed=seed)
        ref = constrained_reference(ctarget, ids, pv, 60, dec.grammar_compiler.compile(C))
        fast = dec.generate(ids, pv, max_new_tokens=60, constraint=C)
        runs.append((ids, pv, ref, fast))
    monkeypatch.setattr(engine_step, "FORCED_TAIL", 0)
    for ids, pv, ref, fast in runs:
        slow = dec.generate(ids, pv, max_new_tokens=60, constraint=C)
        assert fast.token_ids == slow.token_ids == ref
        assert fast.stats.forced_tokens == slow.stats.forced_tokens > 10
        assert fast.stats.tail_tokens > 0 == slow.stats.tail_tokens
    slow_blocks = sum(dec.generate(ids, pv, max_new_tokens=60, constraint=C).stats.n_blocks for ids, pv, _, _ in runs)
    assert sum(r[3].stats.n_blocks for r in runs) <= slow_blocks
    # a tail's tokens accepted below the deepest drafted node: more accepted than the tree is deep
    assert any(b.n_accepted > dec.tree.max_depth for r in runs for b in r[3].stats.blocks)


def test_tails_beside_a_head(ctarget, ctok, monkeypatch):
    from mmspec.heads import build_head

    dec = SpecDecoder(ctarget, build_head(ctarget, "eagle", seed=1), ctok, gamma=3)
    ids, pv = make_prompt(1, 16, seed=5)
    ref = constrained_reference(ctarget, ids, pv, 50, dec.grammar_compiler.compile(C))
    fast = dec.generate(ids, pv, max_new_tokens=50, constraint=C)
    monkeypatch.setattr(engine_step, "FORCED_TAIL", 0)
    slow = dec.generate(ids, pv, max_new_tokens=50, constraint=C)
    assert fast.token_ids == slow.token_ids == ref
    assert fast.stats.n_blocks < slow.stats.n_blocks


def test_free_rows_beside_tails_are_untouched(ctarget, cdraft, ctok, monkeypatch):
    """A batch mixing constrained and free rows: every answer the target's own; the free rows'
    blocks (drafted, accepted, emitted) the same as with the tails off."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="MT", gamma=3)
    prompts = [make_prompt(1, 16, seed=s) for s in range(4)]
    cons = [C, None, Constraint("regex", pattern=r"[a-c]{2,5}-[0-9]{1,3}"), None]
    reqs = [dict(input_ids=i, pixel_values=p, max_new_tokens=30, constraint=c) for (i, p), c in zip(prompts, cons)]
    out = dec.generate_batch(reqs)
    monkeypatch.setattr(engine_step, "FORCED_TAIL", 0)
    off = dec.generate_batch(reqs)
    for (i, p), c, r, r0 in zip(prompts, cons, out, off):
        ref = reference(ctarget, i, p, 30) if c is None else constrained_reference(
            ctarget, i, p, 30, dec.grammar_compiler.compile(c))
        assert r.token_ids == r0.token_ids == ref
        if c is None:
            assert [(b.n_drafted, b.n_accepted, b.n_emitted) for b in r.stats.blocks] == \
                [(b.n_drafted, b.n_accepted, b.n_emitted) for b in r0.stats.blocks]
    assert sum(r.stats.n_blocks for r, c in zip(out, cons) if c) < sum(r.stats.n_blocks for r, c in zip(off, cons) if c)


@pytest.mark.parametrize("coupled", [True, False])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_seeded_sampling_with_tails(ctarget, cdraft, ctok, coupled, shape, monkeypatch):
    """Sampling: a coupled row's seeded answer is the constrained target's own seeded sample
    (plain steps), tails on or off; the rejection sampler (not coupled) stays valid and seeded
    answers repeat (its law: tests/core/test_constrain_sampling.py)."""
    monkeypatch.setattr(request_module, "coupled", lambda params: coupled and not params.greedy)
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", **SHAPES[shape])
    ids, pv = make_prompt(1, 16, seed=7)

    def run(**kw):
        return [dec.generate(ids, pv, max_new_tokens=40, temperature=0.8, seed=s, constraint=C, **kw).token_ids
                for s in range(4)]

    fast = run()
    assert fast == run()  # a seed repeats its answer
    monkeypatch.setattr(engine_step, "FORCED_TAIL", 0)
    if coupled:
        plain = dec.generate_batch([dict(input_ids=ids, pixel_values=pv, max_new_tokens=40, temperature=0.8, seed=s,
                                         constraint=C) for s in range(4)], speculate="never")
        assert fast == run() == [r.token_ids for r in plain]
    g = RowGrammar(dec.grammar_compiler.compile(C), dec.target.vocab_size)
    for answer in fast:  # every token legal where it was emitted
        for t in answer:
            if g.matcher.is_terminated():
                break
            assert g.matcher.accept_token(t)
        g.matcher.reset()


def test_tail_nodes_are_not_drafted(ctarget, cdraft, ctok):
    """A chain of 1 beside a grammar that forces most tokens: blocks emit more than gamma + 1
    tokens (a tail's tokens cost no draft position)."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=1)
    ids, pv = make_prompt(1, 16, seed=3)
    res = dec.generate(ids, pv, max_new_tokens=60, constraint=C)
    assert res.token_ids == constrained_reference(ctarget, ids, pv, 60, dec.grammar_compiler.compile(C))
    assert max(b.n_emitted for b in res.stats.blocks) > 2
    assert torch.tensor([b.n_emitted for b in res.stats.blocks]).float().mean() > 2


def test_a_chain_stops_drafting_where_the_grammar_forces_the_rest(ctarget, cdraft, ctok, monkeypatch):
    """A step whose rows are all constrained drafts no further once every row's grammar forces the
    rest of the chain (those tokens come as its tail): the same answer and blocks, fewer draft
    forwards than drafting them one by one."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=4)
    ids, pv = make_prompt(1, 16, seed=3)
    drafting = type(dec.engine_for(object()).drafting)
    feeds = []
    feed = drafting.feed
    monkeypatch.setattr(drafting, "feed", lambda self, *a: feeds.append(1) or feed(self, *a))
    fast = dec.generate(ids, pv, max_new_tokens=60, constraint=C)
    n_fast = len(feeds)
    monkeypatch.setattr(RowGrammar, "forced_count", lambda self, path, need: 0)  # never stops
    slow = dec.generate(ids, pv, max_new_tokens=60, constraint=C)
    assert fast.token_ids == slow.token_ids == constrained_reference(ctarget, ids, pv, 60,
                                                                      dec.grammar_compiler.compile(C))
    assert [b.n_emitted for b in fast.stats.blocks] == [b.n_emitted for b in slow.stats.blocks]
    assert n_fast < len(feeds) - n_fast
