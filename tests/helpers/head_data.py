"""Training sequences for heads on the tiny test world: prompts followed by the target's own
greedy continuation (image-token ids in it replaced), each with its text-only twin (msd)."""

from __future__ import annotations

import torch

from helpers.tiny import IMG, make_prompt
from mmspec.train.head import Sequence_


def greedy_sequences(target, n: int = 16) -> list[Sequence_]:
    seqs = []
    for i in range(n):
        ids, pv = make_prompt(1 + i % 2, 16, seed=200 + i)
        out = target.generate(input_ids=ids, pixel_values=pv, do_sample=False, max_new_tokens=20)[0].clone()
        cont = out[ids.shape[1]:]
        cont[cont == IMG] = 5
        seqs.append(Sequence_(out, pv, text_only=Sequence_(torch.cat([ids[0][ids[0] != IMG], cont]), None)))
    return seqs
