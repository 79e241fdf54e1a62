"""A temperature or top_p too small for the compute dtype means greedy, and decodes greedily:
``logits / 1e-300`` overflows float32 (inf - inf: NaN probabilities, garbage tokens) unless the
logits are shifted to their maximum first, and ``top_p=1e-300`` is 0 in float32 (every token
dropped) unless the likeliest one always stays. Checked on the maths and end to end."""

import copy

import pytest
import torch

from helpers.reference import reference
from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.runtime.verify import SamplingParams, logits_to_probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-38),
                                    SamplingParams(temperature=5e-324), SamplingParams(temperature=1.0, top_p=1e-300),
                                    SamplingParams(temperature=1e-300, top_k=3, top_p=1e-300)])
def test_a_vanishing_temperature_or_top_p_is_the_one_hot_argmax(dtype, params):
    logits = (torch.randn(4, 7, 50, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)  # [B, L, V]
    p = logits_to_probs(logits, params)
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 50).to(p.dtype))


def test_ties_share_the_mass_and_ordinary_temperatures_are_unchanged():
    p = logits_to_probs(torch.tensor([[3.0, 3.0, 1.0]]), SamplingParams(temperature=1e-300))
    assert torch.equal(p, torch.tensor([[0.5, 0.5, 0.0]]))
    x = torch.randn(3, 40, dtype=torch.float64)
    for t in (0.3, 1.0, 7.0):
        assert torch.allclose(logits_to_probs(x, SamplingParams(temperature=t)), torch.softmax(x / t, -1),
                              rtol=1e-12, atol=1e-15)
    tiny = torch.tensor([[0.0, -1e-300]], dtype=torch.float64)  # differences of the temperature's own size
    assert torch.allclose(logits_to_probs(tiny, SamplingParams(temperature=1e-300)),
                          torch.softmax(torch.tensor([[0.0, -1.0]], dtype=torch.float64), -1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kw", [{"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-300}])
def test_generate_with_a_vanishing_temperature_returns_the_greedy_answer(target, draft_shared, tok, dtype, kw):
    t, d = (target, draft_shared) if dtype == torch.float64 else \
        (copy.deepcopy(target).to(dtype), copy.deepcopy(draft_shared).to(dtype))
    ids, pv = make_prompt(1, 16, seed=3)
    pv = pv.to(dtype)
    greedy = SpecDecoder(t, d, tok).generate(ids, pv, max_new_tokens=16).token_ids
    if dtype == torch.float64:
        assert greedy == reference(t, ids, pv, 16)
    for seed in (0, 1):
        assert SpecDecoder(t, d, tok).generate(ids, pv, max_new_tokens=16, seed=seed, **kw).token_ids == greedy
