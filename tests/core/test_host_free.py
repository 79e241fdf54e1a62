"""A step with no host in it (issue 51), counted on the CPU: what would cost on a GPU.

On a GPU a step's forwards take well under a millisecond to a few; a host read (``.item()``,
``.tolist()``, ``bool(tensor)``), a tensor built from Python data (a blocking host-to-device copy)
or a Python loop launching kernels per row costs more than the forward. The CPU hides all three,
so they are counted here with torch's function and dispatch modes around :meth:`Engine.step`,
for every drafter, greedy and sampling (the Gumbel-max coupling every seeded request uses, its
per-position noise included, and rejection sampling):

* ONE host read per step (the packed outcomes of all rows);
* at most ONE tensor made from host data per step (a model-free proposal's staging: its copy to
  the device; none for a draft model or head);
* aten operations per step independent of the batch: 32 rows no more than 1.1x one row.

The same holds with ``logprobs`` asked: they ride in the one packed read.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.reference import captions
from helpers.tiny import VOCAB, make_llava, make_prompt, noisy_copy
from mmspec import SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.drafting.adaptive import AdaptiveWeights
from mmspec.heads import build_head
from mmspec.request import prepare

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
MAKES = {torch.tensor, torch.as_tensor, torch.from_numpy}


class HostTraffic(TorchFunctionMode):
    """Host reads of tensors, and tensors made (or written) from host data."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.makes: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads.append(func.__name__)
        elif func in MAKES:
            self.makes.append(func.__name__)
        elif func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor):
            self.makes.append("__setitem__ of a host value")
        return func(*args, **(kwargs or {}))


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def decoder(how: str, target, draft, tok) -> SpecDecoder:
    kw = {}
    if how == "head":
        return SpecDecoder(target, build_head(target, "eagle", seed=2), tok, tree="dynamic", tree_depth=3,
                           tree_topk=2, tree_budget=6)
    if how in ("lookup", "suffix"):
        return SpecDecoder(target, how, tok, gamma=3)
    if "tree" in how:
        kw["tree"] = "dynamic" if how.endswith("dynamic") else [[0], [1], [0, 0], [1, 0]]
    if how == "MTC+adaptive":
        kw.update(weights=AdaptiveWeights(), captioner=captions(1))
    if how == "M+suffix":
        kw["model_free"] = "suffix"
    views = {"MTC+adaptive": "MTC", "MT": "MT"}.get(how, "M")
    return SpecDecoder(target, draft, tok, views=views, **kw)


SAMPLERS = {"greedy": 0.0, "sampling": 0.8, "rejection": 0.8}  # temperatures; "rejection": Request.coupled off


def counted_steps(dec, n_requests: int, sampler: str, steps: int = 2,
                  logprobs: int | None = None) -> tuple[list, list, int]:
    """Admit ``n_requests`` long requests, take one step (warm-up: first-use plans, allocations),
    then count ``steps`` steps. -> host reads, host-made tensors, aten ops (all steps together)."""
    sched = BatchScheduler(dec, max_batch=n_requests)
    for i in range(n_requests):
        ids, pv = make_prompt(1, 16, seed=200 + i)
        req = prepare(dec, dict(input_ids=ids, pixel_values=pv, max_new_tokens=60, temperature=SAMPLERS[sampler],
                                seed=i, logprobs=logprobs))
        sched.submit(replace(req, coupled=req.coupled and sampler != "rejection"))
    sched.step()  # admission, then the first step
    assert sched.engine.active == n_requests
    traffic, ops = HostTraffic(), AtenOps()
    with torch.inference_mode():
        for _ in range(steps):
            proposers = [a.proposer for a in sched._active]
            with traffic, ops:
                out = sched.engine.step(None, proposers if any(p is not None for p in proposers) else None)
            assert not any(isinstance(o, BaseException) for o in out)
    return traffic.reads, traffic.makes, ops.n


@pytest.fixture(scope="module")
def endless():
    """A target whose EOS is no token it can emit, and a draft: every request decodes to its limit."""
    target = make_llava(0, eos=VOCAB + 7)
    return target, noisy_copy(target, 1)


HOW = ["M", "MT", "M+tree static", "MT+tree dynamic", "head", "MTC+adaptive", "lookup", "suffix", "M+suffix"]


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("how", HOW)
def test_one_host_read_at_most_one_staged_copy_and_work_flat_in_the_batch(endless, tok, how, sampler):
    dec = decoder(how, *endless, tok)
    reads, makes, ops_1 = counted_steps(dec, 1, sampler)
    assert reads == ["tolist"] * 2, reads  # ONE host read a step: the packed outcomes
    model_free = how in ("lookup", "suffix", "M+suffix")
    assert len(makes) <= (2 if model_free else 0), makes  # a proposal's staging, once a step
    reads_32, makes_32, ops_32 = counted_steps(dec, 32, sampler)
    assert reads_32 == reads and len(makes_32) == len(makes), (reads_32, makes_32)
    assert ops_32 <= 1.1 * ops_1, (ops_1, ops_32)  # the same work launched for 32 rows as for 1


@pytest.mark.parametrize("sampler", ["greedy", "sampling"])
@pytest.mark.parametrize("how", ["M", "MT+tree dynamic", "head", "lookup", "M+suffix"])
def test_logprobs_ride_in_the_one_host_read(endless, tok, how, sampler):
    dec = decoder(how, *endless, tok)
    reads, makes, ops_1 = counted_steps(dec, 1, sampler, logprobs=3)
    assert reads == ["tolist"] * 2, reads
    assert len(makes) <= (2 if how in ("lookup", "M+suffix") else 0), makes
    reads_32, makes_32, ops_32 = counted_steps(dec, 32, sampler, logprobs=3)
    assert reads_32 == reads and len(makes_32) == len(makes), (reads_32, makes_32)
    assert ops_32 <= 1.1 * ops_1, (ops_1, ops_32)
