"""``SpecDecoder.new_drafter`` on a cache of the caller's (what ``perf/draftstep.py`` times): the
drafter runs in that cache's mode, whatever the decoder's.

On a GPU the decoder is static (fixed shapes for CUDA graphs), so its masks span the whole
preallocated buffer; a ``DynamicCache``'s keys span only what was written, and SDPA refused the
two ("The expanded size of the tensor (96) must match the existing size (167) at non-singleton
dimension 3", the GPU pass of 2026-11-27). The CPU cases run the same static bookkeeping
(``static_cache=True``, emulated graphs); the CUDA case is skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers.tiny import make_llava, make_prompt, noisy_copy
from mmspec import SpecDecoder
from mmspec.models.cache import DecodeCache
from mmspec.verify import SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kw", [{"static_cache": True}, {"cuda_graphs": "emulate"},
                                pytest.param({"cuda_graphs": True}, marks=cuda)],
                         ids=["static", "emulated-graphs", "cuda-graphs"])
def test_new_drafter_on_a_dynamic_cache_of_a_static_decoder(kw, tok):
    """Two views of different lengths (left padding: the 4-D mask path), a few draft steps on the
    caller's DynamicCache: the same picks as on the decoder's own static cache."""
    dev = "cuda" if kw.get("cuda_graphs") is True else "cpu"
    target = make_llava(0).to(dev)
    draft = noisy_copy(target, 1)
    dec = SpecDecoder(target, draft, tok, views="M,T", prefix_cache_mb=0, **kw)
    assert dec.static
    ids, pv = make_prompt(1, 16, seed=1)
    ids, pv = ids.to(dev), pv.to(dev)
    token, params = int(ids[0, -1]), SamplingParams()
    own = dec.new_drafter(ids, pv, max_new_tokens=8)
    dyn = dec.new_drafter(ids, pv, max_new_tokens=8, cache=DynamicCache(config=draft.config))
    assert isinstance(own.cache, DecodeCache) and own.static
    assert isinstance(dyn.cache, DynamicCache) and not dyn.static
    with torch.inference_mode():
        picks = [(own.step(token, params), dyn.step(token, params)) for _ in range(3)]
    assert all(a == b for a, b in picks), picks
    assert dyn.cache.get_seq_length() == dyn.length  # each step undone: the cache holds the prompt only
