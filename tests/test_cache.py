"""The preallocated decode cache: same logits as DynamicCache through feeds and roll-backs,
and the drafter built on it proposes exactly what the dynamically grown one does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from mmspec.drafter import EnsembleDrafter
from mmspec.models.base import adapter_for
from mmspec.models.cache import PreallocatedLayer, new_decode_cache
from mmspec.verify import SamplingParams
from mmspec.views import ViewRow

from tiny import make_llama


def _run(model, cache, ids, mask, pos, script):
    """Prefill, then follow ``script``: ("feed", n) appends n fixed tokens, ("crop", n) drops n."""
    outs = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        B, length, nxt = ids.shape[0], ids.shape[1], pos[:, -1] + 1
        g = torch.Generator().manual_seed(7)
        for op, n in script:
            if op == "crop":
                cache.crop(-n)
                length, nxt = length - n, nxt - n
                continue
            new = torch.randint(5, 90, (B, n), generator=g)
            length += n
            full = torch.cat([mask, torch.ones(B, length - mask.shape[1], dtype=torch.long)], 1)
            p = nxt[:, None] + torch.arange(n)
            nxt = nxt + n
            outs.append(model(input_ids=new, attention_mask=full, position_ids=p, past_key_values=cache,
                              use_cache=True).logits)
    return outs


def test_preallocated_rollback_matches_dynamic_cache():
    model = make_llama(0)
    B, L = 3, 9
    ids = torch.randint(5, 90, (B, L), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :4] = 0  # left padding of different lengths
    mask[1, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    script = [("feed", 3), ("crop", 2), ("feed", 1), ("feed", 4), ("crop", 4), ("feed", 2), ("crop", 1), ("feed", 1)]
    dyn = _run(model, DynamicCache(config=model.config), ids, mask, pos, script)
    static_cache = new_decode_cache(model.config, max_len=L + 12)
    assert all(type(layer) is PreallocatedLayer for layer in static_cache.layers)
    sta = _run(model, static_cache, ids, mask, pos, script)
    assert len(dyn) == len(sta) == 5
    for a, b in zip(dyn, sta):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert int(static_cache.get_seq_length()) == L + 3 - 2 + 1 + 4 - 4 + 2 - 1 + 1


def test_cache_falls_back_to_dynamic():
    assert isinstance(new_decode_cache(make_llama(0).config, None), DynamicCache)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert isinstance(new_decode_cache(cfg, 64), DynamicCache)


def test_crop_refuses_positive_count_and_overflow():
    with pytest.raises(ValueError, match="negative"):
        PreallocatedLayer(max_len=8).crop(3)
    layer = PreallocatedLayer(max_len=4)
    kv = torch.zeros(1, 2, 3, 8)
    layer.update(kv, kv)
    with pytest.raises(RuntimeError, match="KV cache full"):
        layer.update(kv, kv)


def _drafter(model, room, weights=(1.0, 2.0, 1.0)):
    rows = [ViewRow(torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(n)),
                    torch.zeros(0, dtype=torch.long), None) for n in (11, 4, 7)]
    d = EnsembleDrafter(adapter_for(model), list(weights), target_vocab=model.config.vocab_size, room=room)
    d.prefill(rows)
    return d


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preallocated_drafter_proposes_like_dynamic(temperature):
    model = make_llama(1)
    params = SamplingParams(temperature=temperature)
    dyn, sta = _drafter(model, None), _drafter(model, 40)
    pending = torch.tensor([9])
    for k, n_acc in [(4, 1), (3, 3), (5, 4), (2, 0), (4, 4), (3, 1)]:  # blocks with roll-backs
        g1, g2 = torch.Generator().manual_seed(k), torch.Generator().manual_seed(k)
        t1, q1 = dyn.propose(pending, k, params, g1)
        t2, q2 = sta.propose(pending, k, params, g2)
        assert t1.tolist() == t2.tolist()
        if q1 is not None:
            torch.testing.assert_close(q1, q2, rtol=1e-10, atol=1e-12)
        dyn.rollback((k - 1) - min(n_acc, k - 1))  # as the engine does after verification
        sta.rollback((k - 1) - min(n_acc, k - 1))
        pending = torch.tensor(([int(t1[k - 1])] if n_acc == k else []) + [20 + k])
    assert torch.equal(dyn.attention_mask, sta.attention_mask)
    assert torch.equal(dyn.next_pos, sta.next_pos)


def test_drafter_refuses_to_overrun_its_room():
    d = _drafter(make_llama(2), room=3)
    with pytest.raises(RuntimeError, match="draft cache full"):
        d.propose(torch.tensor([9]), 5, SamplingParams(), None)
