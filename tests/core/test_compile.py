"""``SpecDecoder(compile=True)``: the step's forwards through ``torch.compile`` (mode "default"),
captured by the step's own graph. The same tokens as the target's greedy ``generate``; a compile
that fails warns once and runs the uncompiled forwards; compile seconds in the stats.

Compiling the tiny models with inductor takes ~30 s per decoder on this project's 2-core CPU, so
the test that really compiles runs only with ``MMSPEC_TEST_COMPILE=1``; the others stand a
pass-through or a failing ``torch.compile`` in for it and run in a second."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from helpers.reference import engine_of, reference
from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError

slow_compile = pytest.mark.skipif(os.environ.get("MMSPEC_TEST_COMPILE") != "1",
                                  reason="compiles with inductor (~30 s per decoder here): MMSPEC_TEST_COMPILE=1")


def test_compile_is_a_flag_and_needs_fixed_shapes(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match="compile must be True or False"):
        SpecDecoder(target, draft_shared, tok, views="M", compile="yes")
    dec = SpecDecoder(target, draft_shared, tok, views="M", compile=True)
    assert dec.static and dec.engine == "static+compile"  # one compilation per shape: the static engine's buckets
    assert SpecDecoder(target, draft_shared, tok, views="M").engine == "eager"


def test_compile_seconds_are_counted_once_per_shape(target, draft_shared, tok, monkeypatch):
    """A pass-through compile: the first call of each shape is counted as compiling, later ones
    not; every forward of the engine (target and draft) goes through it."""
    wrapped = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: wrapped.append(kw) or fn)
    ids, pv = make_prompt(1, 16, seed=31)
    dec = SpecDecoder(target, draft_shared, tok, views="M", cuda_graphs="emulate", compile=True)
    first = dec.generate(ids, pv, max_new_tokens=12)
    assert first.token_ids == reference(target, ids, pv, 12)
    assert wrapped == [dict(mode="default", fullgraph=False, dynamic=False)] * 2  # the target's and the draft's
    assert first.stats.compile_s > 0 and first.stats.engine == "static+compile"
    again = dec.generate(ids, pv, max_new_tokens=12)
    assert again.token_ids == first.token_ids and again.stats.compile_s == 0.0  # the same shapes: nothing compiled


@pytest.mark.parametrize("where", ["call", "wrap"])
def test_a_failing_compile_warns_once_and_runs_uncompiled(target, draft_shared, tok, monkeypatch, where):
    """Inductor failing at the first call (a missing C++ compiler, an unsupported op), or
    torch.compile itself refusing: one warning for the engine, then its forwards uncompiled."""
    def broken(fn, **kw):
        if where == "wrap":
            raise RuntimeError("torch.compile is not supported on this Python")

        def call(**inputs):
            raise RuntimeError("InductorError: CppCompileError: C++ compile error")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    ids, pv = make_prompt(2, 16, seed=32)
    dec = SpecDecoder(target, draft_shared, tok, views="M", tree="dynamic", cuda_graphs="emulate", compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dec.generate(ids, pv, max_new_tokens=14)
    assert out.token_ids == reference(target, ids, pv, 14)
    msgs = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(msgs) == 1 and "uncompiled" in msgs[0], msgs
    assert engine_of(dec).compiler.failed and out.stats.compile_s == 0.0
    assert not engine_of(dec).graphs_failed  # the step's graph is still captured, over the eager forwards


@slow_compile
@pytest.mark.parametrize(("tree", "graphs"), [(None, "emulate"), ("dynamic", False)], ids=["chain-graphs", "tree-static"])
def test_compiled_forwards_give_the_targets_tokens(target, draft_shared, tok, tree, graphs):
    ids, pv = make_prompt(1, 16, seed=33)
    ref = reference(target, ids, pv, 16)
    dec = SpecDecoder(target, draft_shared, tok, views="M", tree=tree, cuda_graphs=graphs, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to uncompiled forwards fails the test
        first = dec.generate(ids, pv, max_new_tokens=16)
        again = dec.generate(ids, pv, max_new_tokens=16)
    assert first.token_ids == ref and again.token_ids == ref
    assert engine_of(dec).compiler.failed is None
    assert first.stats.compile_s > 0 and again.stats.compile_s == 0.0
