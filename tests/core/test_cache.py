"""The decode caches: view and static modes give DynamicCache's logits through feeds and
roll-backs; moves copy positions; the drafter proposes the same trees on either mode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from helpers.tiny import make_llama
from mmspec.models.base import cache_argument
from mmspec.models.cache import DecodeCache, DecodeLayer, new_decode_cache


def _mask(valid: torch.Tensor, n: int, span: int | None) -> torch.Tensor:
    """2-D mask over the filled slots (span None), or the 4-D static mask over ``span`` slots:
    valid [B, length] with the newest n slots causal among themselves."""
    if span is None:
        return valid.long()
    B, length = valid.shape
    m = torch.zeros(B, 1, n, span, dtype=torch.bool)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    m[:, 0, :, :length - n] = valid[:, None, :length - n]
    m[:, 0, :, length - n:length] = causal[None] & valid[:, None, length - n:]
    return m


def _run(model, cache, ids, valid, pos, script, span=None):
    """Prefill, then follow ``script``: ("feed", n) appends n fixed tokens, ("crop", n) drops n."""
    kw = cache_argument(model)
    outs = []
    with torch.no_grad():
        pre = _mask(valid, ids.shape[1], span)
        if span is not None:  # a left-padded query row still needs one key: itself
            pre[:, 0, torch.arange(ids.shape[1]), torch.arange(ids.shape[1])] = True
        model(input_ids=ids, attention_mask=pre, position_ids=pos, use_cache=True, **{kw: cache})
        B, nxt = ids.shape[0], pos[:, -1] + 1
        g = torch.Generator().manual_seed(7)
        for op, n in script:
            if op == "crop":
                cache.crop(-n)
                valid, nxt = valid[:, :-n], nxt - n
                continue
            new = torch.randint(5, 90, (B, n), generator=g)
            valid = torch.cat([valid, torch.ones(B, n, dtype=torch.bool)], 1)
            p = nxt[:, None] + torch.arange(n)
            nxt = nxt + n
            outs.append(model(input_ids=new, attention_mask=_mask(valid, n, span), position_ids=p, use_cache=True,
                              **{kw: cache}).logits)
    return outs


@pytest.mark.parametrize("static", [False, True])
def test_decode_cache_rollback_matches_dynamic_cache(static):
    model = make_llama(0)
    B, L = 3, 9
    ids = torch.randint(5, 90, (B, L), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[0, :4] = False  # left padding of different lengths
    valid[1, :1] = False
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    script = [("feed", 3), ("crop", 2), ("feed", 1), ("feed", 4), ("crop", 4), ("feed", 2), ("crop", 1), ("feed", 1)]
    dyn = _run(model, DynamicCache(config=model.config), ids, valid, pos, script)
    cache = new_decode_cache(model.config, max_len=L + 12, static=static)
    assert isinstance(cache, DecodeCache) and all(type(layer) is DecodeLayer for layer in cache.layers)
    out = _run(model, cache, ids, valid, pos, script, span=L + 12 if static else None)
    assert len(dyn) == len(out) == 5
    for a, b in zip(dyn, out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert cache.length == L + 3 - 2 + 1 + 4 - 4 + 2 - 1 + 1
    if static:
        assert all(int(layer.cursor) == cache.length for layer in cache.layers)


def test_cache_falls_back_to_dynamic():
    assert isinstance(new_decode_cache(make_llama(0).config, None), DynamicCache)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert isinstance(new_decode_cache(cfg, 64), DynamicCache)


def test_crop_refuses_positive_count_and_overflow():
    with pytest.raises(ValueError, match="negative"):
        DecodeLayer(max_len=8).crop(3)
    layer = DecodeLayer(max_len=4)
    kv = torch.zeros(1, 2, 3, 8)
    layer.update(kv, kv)
    with pytest.raises(RuntimeError, match="KV cache full"):
        layer.update(kv, kv)


@pytest.mark.parametrize("static", [False, True])
@torch.inference_mode()
def test_move_copies_positions_and_set_length_moves_the_cursor(static):
    cache = DecodeCache(2, 10, static=static)
    kv = torch.arange(6, dtype=torch.float64).view(1, 1, 6, 1).expand(1, 2, 6, 3).contiguous()  # slot i holds i
    for layer in cache.layers:
        layer.update(kv, kv + 100)
    cache.move(torch.tensor([4, 2]), 1)  # a tree path: slots 4 and 2 become 1 and 2
    cache.set_length(3)
    for layer in cache.layers:
        assert layer.keys[0, 0, :3, 0].tolist() == [0.0, 4.0, 2.0]
        assert layer.values[0, 1, :3, 0].tolist() == [100.0, 104.0, 102.0]
        assert layer.get_seq_length() == 3
        if static:
            assert int(layer.cursor) == 3
