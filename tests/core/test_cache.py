"""The engine's KV buffer (:class:`mmspec.models.rows.RowCache`): ragged rows, each written at its
own slots, give DynamicCache's logits through feeds and roll-backs (a roll-back is a shorter row
length, the engine's; nothing in the cache moves); ``move_paths``, ``copy_row``, ``snapshot`` and
``write_prefix`` copy exactly the slots they name; growing keeps the rows; ``full_attention``
says which models it serves."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from helpers.tiny import make_llama
from mmspec.models.base import cache_argument
from mmspec.models.rows import RowCache, full_attention
from mmspec.runtime.masks import causal, rows_mask

SCRIPT = [("feed", 3), ("crop", 2), ("feed", 1), ("feed", 4), ("crop", 4), ("feed", 2), ("crop", 1), ("feed", 1)]


def _dynamic(model, prompt: torch.Tensor, feeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """One row alone on a DynamicCache: prefill, then SCRIPT (a crop drops the newest positions)."""
    kw = {cache_argument(model): DynamicCache(config=model.config)}
    outs = []
    with torch.no_grad():
        model(input_ids=prompt[None], use_cache=True, **kw)
        length, it = prompt.shape[0], iter(feeds)
        for op, n in SCRIPT:
            if op == "crop":
                kw[cache_argument(model)].crop(-n)
                length -= n
                continue
            new = next(it)
            pos = torch.arange(length, length + n)[None]
            outs.append(model(input_ids=new[None], position_ids=pos, use_cache=True, **kw).logits[0])
            length += n
    return outs


@pytest.mark.parametrize("whole", [False, True], ids=["span", "whole-buffer"])
def test_ragged_rows_match_dynamic_cache_through_feeds_and_rollbacks(whole):
    """Every row at its own length in one buffer; ``whole``: attention spans the whole buffer under
    the mask (the shapes a captured graph runs), else just the slots in use."""
    model = make_llama(0)
    kw = cache_argument(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (n,), generator=g) for n in (9, 4, 6)]
    feeds = [[torch.randint(5, 90, (n,), generator=g) for op, n in SCRIPT if op == "feed"] for _ in prompts]
    capacity = 24
    cache = RowCache(model.config.num_hidden_layers)
    cache.ensure(len(prompts), capacity)
    outs = []
    with torch.no_grad():
        for r, p in enumerate(prompts):  # each row's prefill over its own row (first=r)
            n = p.shape[0]
            span = capacity if whole else n
            zero = torch.zeros(1, dtype=torch.long)
            cache.begin(r, zero, span)
            model(input_ids=p[None], attention_mask=rows_mask(zero, span, causal(n, zero.device)),
                  position_ids=torch.arange(n)[None], use_cache=True, **{kw: cache})
        cache.store.first = 0
        committed = torch.tensor([p.shape[0] for p in prompts])
        k = 0
        for op, n in SCRIPT:
            if op == "crop":
                committed = committed - n
                continue
            ids = torch.stack([f[k] for f in feeds])
            k += 1
            span = capacity if whole else int(committed.max()) + n
            cache.begin(0, committed, span)
            pos = committed[:, None] + torch.arange(n)
            outs.append(model(input_ids=ids, attention_mask=rows_mask(committed, span, causal(n, ids.device)),
                              position_ids=pos, use_cache=True, **{kw: cache}).logits)
            committed = committed + n
    for r, p in enumerate(prompts):
        ref = _dynamic(model, p, feeds[r])
        assert len(ref) == len(outs) == 5
        for a, b in zip(ref, outs):
            torch.testing.assert_close(b[r], a, rtol=1e-10, atol=1e-10)


def _numbered(n_layers: int, rows: int, capacity: int) -> RowCache:
    """A cache whose row b, slot i holds 100 * b + i in its keys (values: + 1000)."""
    cache = RowCache(n_layers)
    cache.ensure(rows, capacity)
    for b in range(rows):
        k = (torch.arange(capacity, dtype=torch.float64) + 100 * b).view(1, 1, capacity, 1).expand(1, 2, capacity, 3)
        cache.write_prefix(b, [(k.contiguous(), k + 1000)] * n_layers)
    return cache


@torch.inference_mode()
def test_move_paths_copies_each_rows_path_at_once():
    cache = _numbered(2, 3, 10)
    rows, src, dst = torch.tensor([0, 2]), torch.tensor([[4, 2], [7, 8]]), torch.tensor([[1, 2], [5, 6]])
    cache.move_paths(rows, src, dst)  # row 0: slots 4, 2 -> 1, 2; row 2: 7, 8 -> 5, 6
    for layer in range(2):
        keys, values = cache.store.kv[layer, 0], cache.store.kv[layer, 1]
        assert keys[0, 0, :4, 0].tolist() == [0.0, 4.0, 2.0, 3.0]
        assert keys[1, 1, :4, 0].tolist() == [100.0, 101.0, 102.0, 103.0]  # a row not named is untouched
        assert keys[2, 0, 4:9, 0].tolist() == [204.0, 207.0, 208.0, 207.0, 208.0]
        assert values[2, 1, 5:7, 2].tolist() == [1207.0, 1208.0]


@torch.inference_mode()
def test_copy_row_snapshot_and_write_prefix_round_trip():
    cache = _numbered(2, 3, 8)
    snap = cache.snapshot(2, 1, 4)  # row 2, slots 1..4: copies
    assert [tuple(k.shape) for k, _ in snap] == [(1, 2, 4, 3)] * 2 and snap[0][0][0, 0, :, 0].tolist() == [201.0, 202.0,
                                                                                                             203.0, 204.0]
    cache.copy_row(0, 2)  # a leaving row 0 taken by the last one
    assert torch.equal(cache.store.kv[:, :, 0], cache.store.kv[:, :, 2])
    cache.store.kv[:, :, 2] = 0
    assert snap[1][1][0, 1, 0, 0] == 1201.0  # the snapshot is a copy: later writes do not reach it
    assert cache.write_prefix(1, snap) == 4
    assert cache.store.kv[1, 1, 1, 0, :5, 0].tolist() == [1201.0, 1202.0, 1203.0, 1204.0, 1104.0]
    assert cache.snapshot(0, 0, 0) is None and RowCache(2).snapshot(0, 0, 3) is None


def test_ensure_grows_and_keeps_the_rows():
    cache = _numbered(1, 2, 4)
    before, gen = cache.store.kv.clone(), cache.generation
    assert not cache.ensure(2, 4) and cache.generation == gen  # room enough: nothing reallocated
    assert cache.ensure(3, 9) and cache.generation == gen + 1  # graphs on the old buffer are stale
    assert (cache.rows, cache.capacity) == (3, 9)
    assert torch.equal(cache.store.kv[:, :, :2, :, :4], before)


def test_full_attention_tells_sliding_windows_apart():
    assert full_attention(make_llama(0).config)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert not full_attention(cfg)
