"""Structured outputs, greedy: every drafter's constrained answer equals the target's own decoding
under the same constraint (transformers' generate with xgrammar's logits processor), token for
token; a batch mixing constrained and free rows leaves the free rows as they are; a bounded
schema's answer parses, validates and ends with EOS."""

import json

import jsonschema
import pytest
import torch

from helpers.constrain import CHAR_VOCAB, constrained_reference
from helpers.reference import reference
from helpers.tiny import EOS, make_prompt
from mmspec import SpecDecoder
from mmspec.constrain import Constraint

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 6},
                                          "value": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
          "required": ["label", "value", "tags"]}
CONSTRAINTS = {
    "schema": Constraint("json_schema", schema=SCHEMA),
    "object": Constraint("json_object"),
    "regex": Constraint("regex", pattern=r"[a-c]{2,5}-[0-9]{1,3}"),
    "choice": Constraint("choice", choices=("yes", "no", "maybe not")),
}


def compiled(dec, c):
    return dec.grammar_compiler.compile(c)


def check_valid(tok, ids, c):
    """A finished answer (ends with EOS) is valid under its constraint."""
    assert ids[-1] == EOS
    text = tok.decode(ids[:-1])
    if c.kind == "json_schema":
        jsonschema.validate(json.loads(text), c.schema)
    elif c.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif c.kind == "choice":
        assert text in c.choices


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_drafted_trees_match_constrained_target(ctarget, cdraft, ctok, name, shape):
    c = CONSTRAINTS[name]
    tree = {"chain": None, "static": "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]", "dynamic": "dynamic"}[shape]
    kw = {} if tree is None else {"tree": tree}
    dec = SpecDecoder(ctarget, cdraft, ctok, views="MT", **({"gamma": 4} if tree is None else kw))
    ids, pv = make_prompt(1, 16, seed=3)
    ref = constrained_reference(ctarget, ids, pv, 40, compiled(dec, c))
    res = dec.generate(ids, pv, max_new_tokens=40, constraint=c)
    assert res.token_ids == ref
    assert res.stats.constraint == c.kind
    if ref[-1] == EOS:
        check_valid(ctok, ref, c)


def test_bounded_schema_finishes_valid(ctarget, cdraft, ctok):
    c = Constraint("json_schema", schema={"type": "object", "properties": {
        "label": {"enum": ["bar", "pie"]}, "value": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["label", "value"]})
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=4)
    for seed in range(3):
        ids, pv = make_prompt(1, 16, seed=seed)
        res = dec.generate(ids, pv, max_new_tokens=60, constraint=c)
        check_valid(ctok, res.token_ids, c)
        assert res.stats.forced_tokens > 0 and 0 < res.stats.forced_share <= 1


def test_batch_mixes_constrained_and_free_rows(ctarget, cdraft, ctok):
    dec = SpecDecoder(ctarget, cdraft, ctok, views="MT", gamma=3)
    prompts = [make_prompt(1, 16, seed=s) for s in range(4)]
    cons = [CONSTRAINTS["schema"], None, CONSTRAINTS["regex"], None]
    reqs = [dict(input_ids=i, pixel_values=p, max_new_tokens=30, constraint=c) for (i, p), c in zip(prompts, cons)]
    out = dec.generate_batch(reqs)
    for (i, p), c, r in zip(prompts, cons, out):
        ref = reference(ctarget, i, p, 30) if c is None else constrained_reference(ctarget, i, p, 30, compiled(dec, c))
        assert r.token_ids == ref
        assert (r.stats.constraint is None) == (c is None)


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "head"])
@pytest.mark.parametrize("name", ["schema", "regex"])
def test_heads_and_model_free_drafts_match_constrained_target(ctarget, ctok, drafter, name):
    from mmspec.heads import build_head

    c = CONSTRAINTS[name]
    if drafter == "head":
        dec = SpecDecoder(ctarget, build_head(ctarget, "eagle", seed=1), ctok, tree="dynamic")
    else:
        dec = SpecDecoder(ctarget, drafter, ctok, gamma=4, lookup_options={"ngram_min": 1})
    ids, pv = make_prompt(1, 16, seed=5)
    ids = torch.cat([ids, torch.tensor([ctok('{"label":"ab","value":12,"tags":["red"]} bb-12')["input_ids"]])], 1)
    ref = constrained_reference(ctarget, ids, pv, 40, compiled(dec, c))
    assert dec.generate(ids, pv, max_new_tokens=40, constraint=c).token_ids == ref


@pytest.mark.parametrize("c, words", [
    (Constraint("json_schema", schema={"type": "object", "properties": {"a": {"type": "nosuch"}}}), "nosuch"),
    (Constraint("json_schema", schema={"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}), "defs"),
    (Constraint("regex", pattern="a(b"), "parenthesis"),
    (Constraint("grammar", grammar='root ::= "a" |\nx ::= '), "line 2"),
    (Constraint("choice", choices=()), "empty"),
    (Constraint("regex", pattern="a" * 70000), "longer than"),
    ("json", "mmspec.constrain.Constraint"),
])
def test_bad_constraints_refused_before_decoding(ctarget, cdraft, ctok, c, words):
    from mmspec import MMSpecError

    dec = SpecDecoder(ctarget, cdraft, ctok, views="M")
    ids, pv = make_prompt(1, 16, seed=1)
    with pytest.raises(MMSpecError, match=words):
        dec.generate(ids, pv, max_new_tokens=5, constraint=c)


def test_bad_constraint_fails_only_its_request(ctarget, cdraft, ctok):
    from mmspec import MMSpecError
    from mmspec.batch import BatchScheduler

    dec = SpecDecoder(ctarget, cdraft, ctok, views="M")
    ids, pv = make_prompt(1, 16, seed=1)
    good = dict(input_ids=ids, pixel_values=pv, max_new_tokens=8, constraint=CONSTRAINTS["regex"])
    bad = dict(good, constraint=Constraint("regex", pattern="a(b"))
    with pytest.raises(MMSpecError, match="request 1: .*parenthesis"):
        dec.generate_batch([good, bad])
    sched = BatchScheduler(dec)
    rid = sched.submit(good)
    with pytest.raises(MMSpecError, match="parenthesis"):
        sched.submit(bad)
    done = {}
    while sched.has_work():
        for ev in sched.step():
            if ev.finished:
                done[ev.rid] = ev.result
    sched.close()
    assert done[rid].token_ids == constrained_reference(ctarget, ids, pv, 8, compiled(dec, CONSTRAINTS["regex"]))


def test_compiled_once_per_constraint(ctarget, cdraft, ctok):
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M")
    comp = dec.grammar_compiler
    a = comp.compile(Constraint("json_schema", schema={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = comp.compile(Constraint("json_schema", schema={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b and comp.hits == 1 and comp.misses == 1


def test_compilation_past_its_time_bound_is_refused(ctok):
    from mmspec import MMSpecError
    from mmspec.constrain.compile import GrammarCompiler

    props = {f"k{i}": {"type": "string", "pattern": f"[a-z]{{1,{i + 3}}}x[0-9]{{2,40}}"} for i in range(300)}
    c = Constraint("json_schema", schema={"type": "object", "properties": props, "required": list(props)})
    with pytest.raises(MMSpecError, match="took longer than 0.001 s"):
        GrammarCompiler(ctok, CHAR_VOCAB, [EOS], timeout_s=0.001).compile(c)


def test_forced_tokens_ride_free(ctarget, ctok, monkeypatch):
    """The tokens the grammar forces join a model-free proposal: the same answer in fewer steps."""
    from mmspec.constrain.state import RowGrammar

    c = CONSTRAINTS["schema"]
    dec = SpecDecoder(ctarget, "lookup", ctok, gamma=4)
    ids, pv = make_prompt(1, 16, seed=3)
    ref = constrained_reference(ctarget, ids, pv, 60, compiled(dec, c))
    fast = dec.generate(ids, pv, max_new_tokens=60, constraint=c)
    monkeypatch.setattr(RowGrammar, "forced_run", lambda self, path, budget: [])
    slow = dec.generate(ids, pv, max_new_tokens=60, constraint=c)
    assert fast.token_ids == slow.token_ids == ref
    assert fast.stats.forced_tokens == slow.stats.forced_tokens > 10
    assert fast.stats.n_blocks < slow.stats.n_blocks - 5


@pytest.mark.parametrize("tree", [None, "dynamic", "[[0], [1], [0, 0], [0, 1], [1, 0]]"])
def test_drafts_are_masked_by_the_grammar(ctarget, cdraft, ctok, tree, monkeypatch):
    """A draft model's drafts under a constraint are legal (masked at their own node): more of them
    are accepted than of the same drafts unmasked, and the answer is the same."""
    from mmspec.constrain.state import DraftMask

    c = CONSTRAINTS["schema"]
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", **({"tree": tree} if tree else {"gamma": 4}))
    ids, pv = make_prompt(1, 16, seed=3)
    masked = dec.generate(ids, pv, max_new_tokens=40, constraint=c)
    monkeypatch.setattr(DraftMask, "mask", lambda self, q, tokens, parents, frontier, need=0: q)
    free = dec.generate(ids, pv, max_new_tokens=40, constraint=c)
    assert masked.token_ids == free.token_ids == constrained_reference(ctarget, ids, pv, 40, compiled(dec, c))
    assert masked.stats.tau > free.stats.tau


def test_stream_and_a_constraint_cut_by_the_limit(ctarget, cdraft, ctok):
    """stream() takes the constraint too; an answer the grammar cannot finish within
    max_new_tokens stops there (no EOS: finish "length"), a valid prefix of the reference."""
    c = CONSTRAINTS["schema"]
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=3)
    ids, pv = make_prompt(1, 16, seed=2)
    ref = constrained_reference(ctarget, ids, pv, 60, compiled(dec, c))
    s = dec.stream(ids, pv, max_new_tokens=60, constraint=c)
    assert "".join(s) == ctok.decode(ref, skip_special_tokens=True) and s.result.token_ids == ref
    short = dec.generate(ids, pv, max_new_tokens=7, constraint=c)
    assert short.token_ids == ref[:7] and EOS not in short.token_ids


@pytest.mark.parametrize("speculate", ["never", "auto"])
def test_plain_and_auto_steps_keep_the_constraint(ctarget, cdraft, ctok, speculate):
    """Plain target steps (speculate="never", or "auto" choosing them) mask the root alone."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=3)
    prompts = [make_prompt(1, 16, seed=s) for s in (6, 7)]
    cons = [CONSTRAINTS["choice"], CONSTRAINTS["schema"]]
    out = dec.generate_batch([dict(input_ids=i, pixel_values=p, max_new_tokens=30, constraint=c)
                              for (i, p), c in zip(prompts, cons)], speculate=speculate)
    for (i, p), c, r in zip(prompts, cons, out):
        assert r.token_ids == constrained_reference(ctarget, i, p, 30, compiled(dec, c))


@pytest.mark.parametrize("engine", [{"static_cache": True}, {"cuda_graphs": "emulate"}])
def test_fixed_shapes_and_graphs_with_constrained_rows(ctarget, cdraft, ctok, engine):
    """A bucket's padding rows and the step graphs (a constrained step runs eagerly; the free steps
    after its request ends replay graphs): the same tokens."""
    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=3, **engine)
    prompts = [make_prompt(1, 16, seed=s) for s in (1, 2, 3)]
    cons = [CONSTRAINTS["regex"], None, CONSTRAINTS["choice"]]
    out = dec.generate_batch([dict(input_ids=i, pixel_values=p, max_new_tokens=24, constraint=c)
                              for (i, p), c in zip(prompts, cons)])
    for (i, p), c, r in zip(prompts, cons, out):
        ref = reference(ctarget, i, p, 24) if c is None else constrained_reference(ctarget, i, p, 24, compiled(dec, c))
        assert r.token_ids == ref


def test_logprobs_under_a_constraint_are_the_raw_targets(ctarget, cdraft, ctok):
    """logprobs= reports the target's unmasked log-probabilities (as vLLM's default raw mode)."""
    from helpers.reference import target_logprobs

    dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=3)
    ids, pv = make_prompt(1, 16, seed=4)
    res = dec.generate(ids, pv, max_new_tokens=12, constraint=CONSTRAINTS["regex"], logprobs=2)
    lp = target_logprobs(ctarget, {"input_ids": ids, "pixel_values": pv}, res.token_ids)
    for j, t in enumerate(res.token_ids):
        assert res.logprobs[j].logprob == pytest.approx(float(lp[j, t]), abs=1e-9)


class _Reads(torch.overrides.TorchFunctionMode):
    """Host reads of tensors inside a step (what a GPU would wait for)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func in self.READS
        return func(*args, **(kwargs or {}))


def test_a_constrained_steps_host_reads_do_not_grow_with_the_free_rows_beside_it(ctarget, cdraft, ctok):
    """A step with a constrained row reads the host more than once (its drafts' masks at each depth,
    its tree before verification: docs/structured.md), a fixed number whatever the batch: one
    constrained row beside 1 or 15 free rows costs the same reads (each read takes every row's
    tensors at once); a batch of free rows, one."""
    from mmspec.batch import BatchScheduler

    def reads(n_free: int, constrained: bool) -> int:
        dec = SpecDecoder(ctarget, cdraft, ctok, views="M", gamma=3)
        sched = BatchScheduler(dec, max_batch=n_free + 1, stream_text=False)
        for i in range(n_free + 1):
            ids, pv = make_prompt(1, 16, seed=300 + i)
            c = CONSTRAINTS["object"] if constrained and i == 0 else None
            sched.submit(dict(input_ids=ids, pixel_values=pv, max_new_tokens=60, constraint=c))
        sched.step()  # admission and a first step
        mode = _Reads()
        with torch.inference_mode(), mode:
            sched.engine.step(None, None)
        return mode.n

    assert reads(1, False) == reads(15, False) == 1  # the step's one packed read
    few, many = reads(1, True), reads(15, True)
    # gamma 3: one read per draft depth (its frontier's paths), one of the tree before verification,
    # the outcomes, and one .tolist() of a host tensor (no device wait): 6, whatever the batch
    assert few == many == 6, (few, many)
