"""Tiny Qwen2-VL / Qwen2.5-VL models built from configs, their inputs and reference output."""

from __future__ import annotations

import torch

from helpers.tiny import IMAGE, VIDEO


def qwen_reference(target, ids, mm, n):
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                          do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()
