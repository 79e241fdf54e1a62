"""The latency pieces of IbED eq. 1-2 (``mmspec.bench.latency``): the engine's rows (a RowCache)
prefilled and fed as the engine feeds them give the logits of generate's DynamicCache, the same
every repeat (nothing to roll back), and ``measure_latency`` times every piece."""

from __future__ import annotations

import torch

from helpers.tiny import make_prompt
from mmspec.bench import latency
from mmspec.models.base import cache_argument


@torch.inference_mode()
def test_engine_rows_give_the_dynamic_caches_logits(target):
    ids, pv = make_prompt(1, 16, seed=3)
    ids = ids.repeat(2, 1)
    pv = pv.repeat(2, 1, 1, 1)
    n = 3
    dyn, nxt = latency._prefill(target, input_ids=ids, pixel_values=pv)
    rows, nxt2 = latency._prefill(target, room=n, input_ids=ids, pixel_values=pv)
    assert torch.equal(nxt, nxt2)
    new = torch.tensor([[7, 9, 11], [12, 5, 8]])
    L = ids.shape[1]
    ref = target(input_ids=new, position_ids=torch.arange(L, L + n)[None].expand(2, -1),
                 attention_mask=torch.ones(2, L + n, dtype=torch.long), use_cache=True,
                 **{cache_argument(target): dyn}).logits
    for _ in range(2):  # a repeat writes the same slots again
        out = target(input_ids=new, use_cache=True, **rows.args(L, n, new.device),
                     **{cache_argument(target): rows.cache}).logits
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_measure_latency_times_every_piece(target, draft_small):
    ids, pv = make_prompt(1, 16, seed=4)
    out = latency.measure_latency(target, draft_small, {"input_ids": ids, "pixel_values": pv,
                                                        "attention_mask": torch.ones_like(ids)},
                                  gamma=2, batch_sizes=(1, 2), repeats=1)
    assert out["target_decode_s"] > 0 and out["target_verify_s"] > 0 and out["target_prefill_s"] > 0
    assert set(out["draft_decode_s"]) == {"1", "2"} and all(t > 0 for t in out["draft_decode_s"].values())
