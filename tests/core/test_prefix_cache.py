"""Automatic prefix caching: a conversation's second turn prefills only its new suffix and is
still exactly ``target.generate`` on the whole conversation (greedy), for LLaVA and Qwen2-VL
(multimodal RoPE), every view, trees and a head; an edited history (a changed token, or the
same tokens with another image) reuses nothing stale; eviction by bytes; a stored prefix is
never written by the decodes that reuse it."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import IMAGE, IMG, VEND, VIDEO, VSTART, make_prompt, make_qwen, noisy_copy, qwen_inputs
from mmspec import MMSpecError, SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.heads import build_head
from mmspec.prefix_cache import PrefixCache, PrefixEntry, RowPrefix, common_prefix, content_key, segment_digests


def reference(target, ids, n, **mm):
    if "image_grid_thw" in mm or "video_grid_thw" in mm:
        mm["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()


def stored_len(dec) -> int:
    """Positions of the newest stored entry's target cache."""
    return list(dec.prefix_cache.entries.values())[-1].target.key.shape[0]


def next_turn(ids, answer, extra=(40, 41, 42)):
    return torch.cat([ids[0], torch.tensor(answer), torch.tensor(list(extra))])[None]


def two_turns(dec, ids1, n1=12, n2=16, **mm):
    r1 = dec.generate(ids1, **mm, max_new_tokens=n1)
    held = stored_len(dec)
    ids2 = next_turn(ids1, r1.token_ids)
    r2 = dec.generate(ids2, **mm, max_new_tokens=n2)
    return r1, r2, ids2, held


LLAVA_CASES = [dict(views="M"), dict(views="T"), dict(views="MT"), dict(views="MT", tree="dynamic"),
               dict(views="M", tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]), dict(views="MT", static_cache=True),
               dict(views="M", cuda_graphs="emulate")]


@pytest.mark.parametrize("kw", LLAVA_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items())[:40])
def test_turn_two_equals_target_on_the_whole_conversation(target, draft_shared, tok, kw):
    ids1, pv = make_prompt(2, 16, seed=3)
    dec = SpecDecoder(target, draft_shared, tok, **kw)
    r1, r2, ids2, held = two_turns(dec, ids1, pixel_values=pv)
    assert r1.token_ids == reference(target, ids1, 12, pixel_values=pv)
    assert r2.token_ids == reference(target, ids2, 16, pixel_values=pv)
    assert r1.stats.prompt_tokens_reused == 0
    # everything the first turn's cache held: its prompt and answer (all but the newest token at least)
    assert r2.stats.prompt_tokens_reused == held >= ids1.shape[1] - 1 + len(r1.token_ids)
    assert r2.stats.vision_s == 0.0  # the same images: encoded once


@pytest.mark.parametrize("kw", [{}, {"tree": "dynamic"}, {"cuda_graphs": "emulate", "tree": "dynamic"}])
def test_turn_two_with_a_head(target, tok, kw):
    ids1, pv = make_prompt(1, 16, seed=5)
    dec = SpecDecoder(target, build_head(target, "eagle", seed=1), tok, **kw)
    r1, r2, ids2, held = two_turns(dec, ids1, pixel_values=pv)
    assert r2.token_ids == reference(target, ids2, 16, pixel_values=pv)
    again = dec.generate(ids2, pv, max_new_tokens=16)  # the same prompt again: all but one position reused
    assert again.token_ids == r2.token_ids and again.stats.prompt_tokens_reused == ids2.shape[1] - 2
    # the head's slots need the target's features before them: the target prefills again from the
    # head's first missing slot (the last block's tokens were pending, never fed to the head)
    assert ids1.shape[1] + len(r1.token_ids) - 1 - (dec.gamma + 1) <= r2.stats.prompt_tokens_reused < held


@pytest.fixture(scope="module")
def qwen_pair():
    target = make_qwen(0, "qwen2_vl")
    return target, noisy_copy(target, 1)


@pytest.mark.parametrize("views", ["M", "T", "MT", "head"])
def test_qwen_turn_two_with_a_new_image(qwen_pair, tok, views):
    """M-RoPE: the suffix's positions continue the cached prefix's (they are not past + i),
    also when the new turn brings an image of its own."""
    target, draft = qwen_pair
    ids1, mm1 = qwen_inputs(1, False, seed=2)
    dec = SpecDecoder(target, build_head(target, "eagle", seed=1) if views == "head" else draft, tok,
                      **({} if views == "head" else dict(views=views, tree="dynamic")))
    r1 = dec.generate(ids1, **mm1, max_new_tokens=10)
    assert r1.token_ids == reference(target, ids1, 10, **mm1)
    held = stored_len(dec)
    g = torch.Generator().manual_seed(9)
    ids2 = next_turn(ids1, r1.token_ids, [30, VSTART] + [IMAGE] * 8 + [VEND, 31, 32])
    mm2 = dict(pixel_values=torch.cat([mm1["pixel_values"], torch.randn(32, 96, generator=g, dtype=torch.float64)]),
               image_grid_thw=torch.cat([mm1["image_grid_thw"], torch.tensor([[1, 4, 8]])]))
    r2 = dec.generate(ids2, **mm2, max_new_tokens=14)
    assert r2.token_ids == reference(target, ids2, 14, **mm2)
    assert r2.stats.prompt_tokens_reused >= held - (views == "head") > ids1.shape[1]


def test_qwen_turn_two_text_only(qwen_pair, tok):
    target, draft = qwen_pair
    ids1, mm = qwen_inputs(2, True, seed=4)
    dec = SpecDecoder(target, draft, tok, views="MT")
    _, r2, ids2, held = two_turns(dec, ids1, **mm)
    assert r2.token_ids == reference(target, ids2, 16, **mm)
    assert r2.stats.prompt_tokens_reused == held


def test_edited_history_reuses_nothing_stale(target, draft_shared, tok):
    ids1, pv = make_prompt(2, 16, seed=6)
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    r1 = dec.generate(ids1, pv, max_new_tokens=10)
    ids2 = next_turn(ids1, r1.token_ids)
    # a changed earlier token: only what comes before it is reused
    edited = ids2.clone()
    edited[0, 3] = 50 if int(edited[0, 3]) != 50 else 51
    r = dec.generate(edited, pv, max_new_tokens=12)
    assert r.token_ids == reference(target, edited, 12, pixel_values=pv)
    assert r.stats.prompt_tokens_reused == 3
    # the same tokens with another second image: nothing from that image on
    dec.prefix_cache.clear()
    dec.generate(ids1, pv, max_new_tokens=10)
    other = pv.clone()
    other[1] = -other[1]
    r = dec.generate(ids2, other, max_new_tokens=12)
    assert r.token_ids == reference(target, ids2, 12, pixel_values=other)
    second_image = int((ids2[0] == 3).nonzero()[16, 0])  # the first token of the second image
    assert r.stats.prompt_tokens_reused == second_image
    assert r.stats.vision_s > 0  # other pixels: encoded again


def test_reused_caches_equal_a_fresh_prefill(target, draft_shared, tok):
    """Target and draft rows of different lengths (M and T): after an admission that reused a
    stored prefix, every filled slot holds what a fresh prefill computes."""
    ids1, pv = make_prompt(2, 16, seed=7)
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    fresh = SpecDecoder(target, draft_shared, tok, views="MT", prefix_cache_mb=0)
    r1 = dec.generate(ids1, pv, max_new_tokens=8)
    ids2 = next_turn(ids1, r1.token_ids)
    got = []
    for d in (dec, fresh):
        sched = BatchScheduler(d, max_batch=1)
        sched.submit(dict(input_ids=ids2, pixel_values=pv, max_new_tokens=8))
        assert sched.admit() == []
        e = sched.engine
        got.append((e.cache.store.kv, e.drafting.rows.cache.store.kv, list(e.drafting.rows.lengths),
                    e.state.lengths[0], e.rows[0].stats.prompt_tokens_reused))
    (tc, dc, lens, n, reused), (tc2, dc2, lens2, n2, reused2) = got
    assert reused > ids1.shape[1] and reused2 == 0  # the first reused turn 1, the second prefilled all
    assert n == n2 == ids2.shape[1] - 1 and lens == lens2
    assert torch.allclose(tc[:, :, 0, :, :n], tc2[:, :, 0, :, :n], atol=1e-10)
    for row, L in enumerate(lens):  # each view's row: its own length, no padding
        assert torch.allclose(dc[:, :, row, :, :L], dc2[:, :, row, :, :L], atol=1e-10)


@pytest.mark.parametrize("static", [False, True])
def test_stored_prefix_survives_a_decode_that_rolled_back(target, tok, static):
    draft = noisy_copy(target, 3, scale=0.5)  # often wrong: blocks roll back
    ids1, pv = make_prompt(1, 16, seed=8)
    dec = SpecDecoder(target, draft, tok, views="M", static_cache=static)
    r1 = dec.generate(ids1, pv, max_new_tokens=10)
    entry = next(iter(dec.prefix_cache.entries.values()))
    before = [t.clone() for kv in [entry.target.kv, *[r.kv for r in entry.rows]] for pair in kv for t in pair]
    r2 = dec.generate(next_turn(ids1, r1.token_ids), pv, max_new_tokens=20)
    assert any(b.n_accepted < b.n_drafted for b in r2.stats.blocks)  # something was rolled back
    after = [t for kv in [entry.target.kv, *[r.kv for r in entry.rows]] for pair in kv for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_eviction_by_bytes(target, draft_shared, tok):
    probe = SpecDecoder(target, draft_shared, tok, views="M")
    ids_a, pv_a = make_prompt(1, 16, seed=11)
    ids_b, pv_b = make_prompt(1, 16, seed=12)
    probe.generate(ids_a, pv_a, max_new_tokens=6)
    size = probe.prefix_cache.nbytes
    dec = SpecDecoder(target, draft_shared, tok, views="M", prefix_cache_mb=1.5 * size / 2**20)
    r_a = dec.generate(ids_a, pv_a, max_new_tokens=6)
    dec.generate(ids_b, pv_b, max_new_tokens=6)  # evicts A, the least recently used
    assert len(dec.prefix_cache.entries) == 1 and dec.prefix_cache.nbytes <= dec.prefix_cache.budget
    r = dec.generate(next_turn(ids_a, r_a.token_ids), pv_a, max_new_tokens=6)
    assert r.stats.prompt_tokens_reused <= 1  # only B's first token (BOS) in common
    tiny = SpecDecoder(target, draft_shared, tok, views="M", prefix_cache_mb=0.5 * size / 2**20)
    tiny.generate(ids_a, pv_a, max_new_tokens=6)
    assert not tiny.prefix_cache.entries  # larger than the whole budget: not kept


def test_off_and_bad_budgets(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M", prefix_cache_mb=0)
    ids1, pv = make_prompt(1, 16, seed=13)
    r1 = dec.generate(ids1, pv, max_new_tokens=6)
    r2 = dec.generate(next_turn(ids1, r1.token_ids), pv, max_new_tokens=6)
    assert r2.stats.prompt_tokens_reused == 0 and not dec.prefix_cache.entries
    for bad in (-1, "64", float("nan"), True):
        with pytest.raises(MMSpecError, match="prefix_cache_mb"):
            SpecDecoder(target, draft_shared, tok, prefix_cache_mb=bad)


def test_keys_tell_images_apart():
    ids = torch.tensor([1, 5, 3, 3, 3, 3, 6, 3, 3, 3, 3, 7])
    mask = ids == 3
    pv = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    d = segment_digests({"pixel_values": pv}, ["image", "image"])
    pv2 = pv.clone()
    pv2[1, 0, 0, 0] += 1e-12
    d2 = segment_digests({"pixel_values": pv2}, ["image", "image"])
    assert d[0] == d2[0] and d[1] != d2[1]
    k, k2 = content_key(ids, mask, [4, 4], d), content_key(ids, mask, [4, 4], d2)
    assert common_prefix(k, k2) == 7 and torch.equal(k[~mask], ids[~mask]) and (k[mask] < 0).all()
    # Qwen2-VL: patches split by grid
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pix = torch.randn(48, 96, dtype=torch.float64)
    q = segment_digests({"pixel_values": pix, "image_grid_thw": grid}, ["image", "image"])
    pix[20] += 1
    assert segment_digests({"pixel_values": pix, "image_grid_thw": grid}, ["image", "image"])[0] == q[0]


def test_what_is_stored_is_the_targets_own_kv(target, draft_shared, tok):
    """A finished decode's entry (copied out of its row of the engine's RowCache) holds the
    target's own keys and values of the prompt and the new tokens: those of one whole forward."""
    from transformers import DynamicCache

    from mmspec.models.base import cache_argument

    dec = SpecDecoder(target, draft_shared, tok, views="M")
    ids1, pv = make_prompt(1, 16, seed=18)
    r = dec.generate(ids1, pv, max_new_tokens=4)
    assert IMG not in r.token_ids  # (the reference forward would read a generated placeholder as an image's)
    entry = next(iter(dec.prefix_cache.entries.values()))
    n = entry.target.kv[0][0].shape[-2]
    assert n == entry.target.key.shape[0] and n >= ids1.shape[1]
    seq = torch.cat([ids1[0], torch.tensor(r.token_ids)])[:n][None]
    whole = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=seq, pixel_values=pv, use_cache=True, **{cache_argument(target): whole})
    for (k, v), layer in zip(entry.target.kv, whole.layers):
        torch.testing.assert_close(k, layer.keys, rtol=0, atol=1e-9)
        torch.testing.assert_close(v, layer.values, rtol=0, atol=1e-9)


def test_seeded_sampling_turn_two_equals_a_fresh_decode(target, draft_shared, tok):
    """Reuse changes no draw: a seeded turn 2 equals the same call on a decoder without the cache."""
    ids1, pv = make_prompt(1, 16, seed=15)
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    fresh = SpecDecoder(target, draft_shared, tok, views="MT", prefix_cache_mb=0)
    r1 = dec.generate(ids1, pv, max_new_tokens=10, temperature=0.8, seed=3)
    assert r1.token_ids == fresh.generate(ids1, pv, max_new_tokens=10, temperature=0.8, seed=3).token_ids
    ids2 = next_turn(ids1, r1.token_ids)
    r2 = dec.generate(ids2, pv, max_new_tokens=16, temperature=0.8, seed=4)
    assert r2.stats.prompt_tokens_reused > ids1.shape[1]
    assert r2.token_ids == fresh.generate(ids2, pv, max_new_tokens=16, temperature=0.8, seed=4).token_ids


def test_the_batch_path_pieces(target, draft_shared, tok):
    """The pieces a request's caches go through in a batch: admitted (its prompt kept at once,
    for a request of the same batch that extends it), its rows snapshotted as the engine holds
    them (kv_rows of the one buffer), and a later turn reusing the prompt."""
    from helpers.caches import kv_rows

    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    ids1, pv = make_prompt(1, 16, seed=16)
    sched = BatchScheduler(dec, max_batch=2)
    sched.submit(dict(input_ids=ids1, pixel_values=pv, max_new_tokens=8))
    sched.admit()
    assert stored_len(dec) == ids1.shape[1] - 1  # the prompt alone: L - 1 target positions
    cache = sched.engine.cache
    for (k, v), (k2, v2) in zip(kv_rows(cache.store.kv, 0, 0, 5), cache.snapshot(0, 0, 5)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    sched.cancel(0)
    ids2 = next_turn(ids1, [9, 10])
    r = dec.generate(ids2, pv, max_new_tokens=8)
    assert r.stats.prompt_tokens_reused == ids1.shape[1] - 1
    assert r.token_ids == reference(target, ids2, 8, pixel_values=pv)


def test_generate_batch_reuses_stored_prompts(target, draft_shared, tok):
    """generate_batch admits its requests together (mmspec.admission): a turn-2 request extending a
    conversation an earlier batch decoded prefills only what the cache lacks (turn 1's prompt AND
    answer are kept when it finishes), next to a request with nothing to reuse, and both stay the
    target's."""
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    ids1, pv = make_prompt(1, 16, seed=21)
    other, pv_o = make_prompt(2, 16, seed=22)
    r1 = dec.generate_batch([{"input_ids": ids1, "pixel_values": pv, "max_new_tokens": 6}])[0]
    assert r1.token_ids == reference(target, ids1, 6, pixel_values=pv)
    ids2 = next_turn(ids1, r1.token_ids)
    r2, ro = dec.generate_batch([{"input_ids": ids2, "pixel_values": pv}, {"input_ids": other, "pixel_values": pv_o}],
                                max_new_tokens=10)
    assert r2.token_ids == reference(target, ids2, 10, pixel_values=pv)
    assert ro.token_ids == reference(target, other, 10, pixel_values=pv_o)
    assert r2.stats.prompt_tokens_reused == ids1.shape[1] - 1 + len(r1.token_ids)  # prompt and answer
    shared = 0  # the other prompt shares only its leading text tokens (BOS) with the stored one
    while other[0, shared] == ids1[0, shared] and other[0, shared] != IMG:
        shared += 1
    assert ro.stats.prompt_tokens_reused == shared < 3


@pytest.mark.parametrize("how", ["M", "MT+tree", "head"])
def test_conversation_through_generate_batch_reuses_prompt_and_answer(target, draft_shared, tok, how):
    """Issue 42, item 5: turn 2 through generate_batch (the path of BatchScheduler and so of
    `mmspec serve`) prefills only its new part, as generate does: turn 1's prompt and answer
    come from the prefix cache, draft rows (or head) included, and both turns stay the target's."""
    def decoder():
        if how == "head":
            return SpecDecoder(target, build_head(target, "eagle", seed=2), tok, tree="dynamic", tree_depth=3,
                               tree_topk=2, tree_budget=6)
        if how == "MT+tree":
            return SpecDecoder(target, draft_shared, tok, views="MT", tree="dynamic")
        return SpecDecoder(target, draft_shared, tok, views="M")

    dec = decoder()
    ids1, pv = make_prompt(2, 16, seed=31)
    other, pv_o = make_prompt(1, 16, seed=32)
    r1, _ = dec.generate_batch([{"input_ids": ids1, "pixel_values": pv, "max_new_tokens": 12},
                                {"input_ids": other, "pixel_values": pv_o, "max_new_tokens": 5}])
    assert r1.token_ids == reference(target, ids1, 12, pixel_values=pv)
    ids2 = next_turn(ids1, r1.token_ids)
    r2 = dec.generate_batch([{"input_ids": ids2, "pixel_values": pv, "max_new_tokens": 16}])[0]
    assert r2.token_ids == reference(target, ids2, 16, pixel_values=pv)
    assert r2.stats.vision_s == 0.0  # the same images: encoded once
    # as much reused as generate reuses for the same two turns (target, draft rows or head alike)
    solo = decoder()
    solo.generate(ids1, pv, max_new_tokens=12)
    g2 = solo.generate(ids2, pv, max_new_tokens=16)
    assert r2.stats.prompt_tokens_reused == g2.stats.prompt_tokens_reused
    assert g2.stats.tokens_per_block == r2.stats.tokens_per_block  # the drafter saw the same reused context
    if how != "head":  # every position turn 1's target cache held: the prompt and the answer but its newest token
        assert r2.stats.prompt_tokens_reused == ids1.shape[1] - 1 + len(r1.token_ids)
    else:  # the head's slots lag the target's by at most one block
        assert r2.stats.prompt_tokens_reused >= ids1.shape[1] - 1 + len(r1.token_ids) - 4


def test_the_byte_count_is_kept_as_entries_come_and_go():
    """The cache's bytes are a running sum (storing must not walk every entry: with hundreds held,
    that walk was 17% of a served request's CPU), equal to the entries' own count at every step,
    and the least recently used entries go first once the budget is passed."""
    def entry(n):
        kv = [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]  # 2 x 2*n*4 float32: 64 n bytes
        return PrefixEntry(target=RowPrefix(key=torch.arange(n), kv=kv))

    pc = PrefixCache(budget_mb=64 * 100 / 2**20)  # room for 100 positions
    for n in (30, 40, 20, 25):
        pc.store(entry(n))
        assert pc.nbytes == sum(e.nbytes for e in pc.entries.values()) <= pc.budget
    assert [e.target.key.shape[0] for e in pc.entries.values()] == [40, 20, 25]  # 30, the oldest, evicted for 25
    pc.store(entry(101))  # larger than the whole budget: not kept, nothing evicted
    assert pc.nbytes == 64 * 85 and len(pc.entries) == 3
    pc.clear()
    assert pc.nbytes == 0 and not pc.entries
