"""The target's own log-probabilities of an answer: one forward over prompt + answer.

Owns :func:`target_logprobs`. Speculative decoding emits exactly the target's tokens, but the
draft's numbers are not the target's; what a client asking for ``logprobs`` (an evaluation
harness, a losslessness audit) needs is ``log p(token | prefix)`` under the TARGET, for each
emitted token, and the target's likeliest alternatives there. This computes them after the
answer is known, at the cost of one target forward over the prompt and the answer (no KV cache,
no draft), on the raw logits: temperature 1, no top-k / top-p filter, as OpenAI and vLLM report
them. Nothing here knows about HTTP or the decoding loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token: its id and log-probability, and the ``top`` likeliest tokens there
    (ids and log-probabilities, likeliest first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@torch.inference_mode()
def target_logprobs(model, inputs: dict, token_ids: list[int], top: int = 0) -> list[TokenLogprob]:
    """``log p_target(token_ids[i] | prompt, token_ids[:i])`` for every i, and the ``top``
    likeliest alternatives at each position.

    ``model``: the target (a transformers model for image-text-to-text); ``inputs``: its
    processor's output for the prompt (``input_ids`` [1, L], ``attention_mask``, pixels and
    whatever the family adds), on the model's device; ``token_ids``: the answer. One forward
    over the L + n - 1 positions; log-softmax in float32 or wider.
    """
    n = len(token_ids)
    if n == 0:
        return []
    if top < 0 or isinstance(top, bool):
        raise ValueError(f"top must be a whole number >= 0, got {top!r}")
    ids = inputs["input_ids"]  # [1, L]
    L = ids.shape[-1]
    answer = torch.tensor([token_ids[:-1]], dtype=ids.dtype, device=ids.device)  # [1, n - 1]
    kw = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = torch.cat([mask, torch.ones_like(answer, dtype=mask.dtype)], dim=-1)  # [1, L + n - 1]
    out = model(input_ids=torch.cat([ids, answer], dim=-1), attention_mask=mask, use_cache=False, **kw)
    logits = out.logits[0, L - 1: L - 1 + n]  # [n, V]: position L-1+i predicts token_ids[i]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    lp = torch.log_softmax(logits, dim=-1)  # [n, V]
    picked = lp.gather(-1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()  # [n]
    if top:
        vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [n, top]
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * n
    return [TokenLogprob(t, p, k) for t, p, k in zip(token_ids, picked, tops)]
