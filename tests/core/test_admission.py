"""Requests admitted in the same step prefill together (mmspec.admission, issue 42 item 2): ONE
target prefill forward for the group, whatever its prompts' lengths, images and prefix-cache
hits, and every request still exactly the target's greedy output."""

import pytest
import torch

from helpers.tiny import make_prompt, make_qwen, noisy_copy, qwen_inputs
from mmspec import SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.heads import build_head


def reference(target, ids, n, **mm):
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()


def decoder(target, draft, tok, how):
    if how == "head":
        return SpecDecoder(target, build_head(target, "eagle", seed=2), tok, tree="dynamic", tree_depth=3,
                           tree_topk=2, tree_budget=6)
    if how == "MT+tree":
        return SpecDecoder(target, draft, tok, views="MT", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6)
    return SpecDecoder(target, draft, tok, views=how)


@pytest.mark.parametrize("how", ["M", "MT", "MT+tree", "head"])
def test_a_group_prefills_in_one_forward_and_equals_solo(target, draft_shared, tok, how):
    dec = decoder(target, draft_shared, tok, how)
    ids1, pv1 = make_prompt(1, 16, seed=41)
    turn1 = dec.generate(ids1, pv1, max_new_tokens=5)  # stored: the group's first request extends it
    ids2 = torch.cat([ids1[0], torch.tensor(turn1.token_ids), torch.tensor([40, 41, 42])])[None]
    reqs = [dict(input_ids=ids2, pixel_values=pv1, max_new_tokens=9)]
    for k, (n_img, text_len) in enumerate([(2, 3), (0, 9), (1, 1)]):  # ragged lengths, 0/1/2 images
        ids, pv = make_prompt(n_img, 16, seed=50 + k, text_len=text_len)
        reqs.append(dict(input_ids=ids, pixel_values=pv, max_new_tokens=7 + k))
    want = [reference(target, r["input_ids"], r["max_new_tokens"],
                      **({} if r["pixel_values"] is None else {"pixel_values": r["pixel_values"]})) for r in reqs]
    calls = []
    hook = target.model.language_model.register_forward_hook(lambda *a: calls.append(1))
    try:
        sched = BatchScheduler(dec)
        rids = [sched.submit(r) for r in reqs]
        events = sched.step()
        assert len(calls) == 2  # ONE prefill forward for the 4 requests, then one shared step
        assert sched.engine.active == 4
        while sched.has_work():
            events += sched.step()
    finally:
        hook.remove()
    assert all(ev.error is None for ev in events)
    done = {ev.rid: ev.result for ev in events if ev.finished}
    assert [done[r].token_ids for r in rids] == want
    reused = done[rids[0]].stats.prompt_tokens_reused  # turn 1's prompt (and answer, as its caches keep it)
    assert ids1.shape[1] - 1 <= reused <= ids1.shape[1] - 1 + len(turn1.token_ids)
    assert all(done[r].stats.prompt_tokens_reused < 3 for r in rids[1:])


def test_mrope_group_prefills_together(tok):
    target = make_qwen(0)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok, views="MT")
    reqs, want = [], []
    for k, (n_img, video, n) in enumerate([(1, False, 8), (2, True, 5), (0, True, 6), (1, False, 4)]):
        ids, mm = qwen_inputs(n_img, video, seed=10 + k)
        reqs.append(dict(input_ids=ids, max_new_tokens=n, **mm))
        want.append(reference(target, ids, n, **mm))
    calls = []
    hook = target.model.language_model.register_forward_hook(lambda *a: calls.append(1))
    try:
        res = dec.generate_batch(reqs)
    finally:
        hook.remove()
    assert [r.token_ids for r in res] == want
    assert len(calls) == 1 + max(r.stats.n_blocks for r in res)  # one prefill, one forward per step
