"""target_logprobs: the target's own log-probabilities of an answer, from one forward, equal the
log-softmax of the target's logits computed token by token (and greedy answers are their top-1)."""

import pytest
import torch

from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.scoring import target_logprobs


def test_target_logprobs_equal_the_targets_own_logits_step_by_step(target, draft_shared, tok):
    ids, pv = make_prompt(2, 16, seed=4)
    mask = torch.ones_like(ids)
    answer = SpecDecoder(target, draft_shared, tok).generate(ids, pv, max_new_tokens=12, temperature=1.0,
                                                              seed=2).token_ids
    got = target_logprobs(target, {"input_ids": ids, "attention_mask": mask, "pixel_values": pv}, answer, top=3)
    assert [g.token_id for g in got] == answer
    prefix = ids
    for i, token in enumerate(answer):
        with torch.no_grad():
            logits = target(input_ids=prefix, attention_mask=torch.ones_like(prefix), pixel_values=pv).logits[0, -1]
        lp = torch.log_softmax(logits, -1)
        assert got[i].logprob == pytest.approx(lp[token].item(), abs=1e-9)
        top = lp.topk(3)
        assert [t for t, _ in got[i].top] == top.indices.tolist()
        assert [v for _, v in got[i].top] == pytest.approx(top.values.tolist(), abs=1e-9)
        prefix = torch.cat([prefix, torch.tensor([[token]])], -1)


def test_a_greedy_answer_is_the_top_1_everywhere_and_edge_cases(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pv}
    answer = SpecDecoder(target, draft_shared, tok).generate(ids, pv, max_new_tokens=8).token_ids
    got = target_logprobs(target, inputs, answer, top=1)
    assert all(g.top[0][0] == g.token_id and g.top[0][1] == g.logprob for g in got)
    assert target_logprobs(target, inputs, []) == []
    assert target_logprobs(target, inputs, answer[:1])[0].top == ()
