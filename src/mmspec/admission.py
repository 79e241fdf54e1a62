"""Requests admitted in the same step prefill together (issue 42, item 2).

:func:`prefill_together` runs the target's prompt forwards of every request of a group as ONE
forward over new rows of the batch's shared :class:`~mmspec.models.ragged.RaggedCache` (the
rows decoding meanwhile take no part): each request's prompt less its pending last token,
right-padded to the longest, at its own row and length. A request with a prefix-cache hit starts
its row with the cached keys/values and prefills only the rest in that same forward. Positions
are each request's own (multimodal RoPE's 3-D ids too, its offset kept for the decode); the 4-D
mask lets row b's queries see its own cached and earlier slots (causal), a padding query only
itself (its output is never read). Then each request's drafter is prefilled as ``generate``
prefills it (the draft views' rows; a head over its slice of the target's features), on caches
of its own that join the shared draft cache. Vision encoding stays per image (and cached).

Owns no state: the scheduler owns the rows. A request whose preparation fails (its images, its
captions, its drafter) fails alone; a failure of the shared forward fails the requests in it.
Lossless as the solo prefill: each row computes what its own forward computes (in float64 the
same tokens; in lower precision a batched product may round a last bit differently).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mmspec.errors import MMSpecError
from mmspec.forwards import TargetState
from mmspec.models.cache import DecodeCache
from mmspec.models.ragged import RaggedCache
from mmspec.timing import sync


@dataclass
class Admitted:
    """One request of a group: its row of the target cache (None: it failed before it had one)
    and either what it was prefilled into or its error."""

    row: int | None
    pre: object | None  # the decoder's Prefilled
    stats: object
    error: BaseException | None = None


def prefill_together(dec, cache: RaggedCache, reqs: list) -> list[Admitted]:
    """Prefill the checked requests ``reqs`` (:class:`~mmspec.request.Request`) of the decoder
    ``dec``: their target prompts in ONE forward over new rows of ``cache`` (module docstring),
    then their drafters. -> one :class:`Admitted` per request, in order; the rows of those that
    fail are the caller's to remove."""
    out = [Admitted(None, None, dec.new_stats()) for _ in reqs]
    if not isinstance(dec.target.new_cache(2), DecodeCache):
        err = MMSpecError("batched decoding needs a target whose layers are all full attention "
                          "(its rows are preallocated); decode this model's prompts one by one with generate()")
        for a in out:
            a.error = err
        return out
    prompts, inputs = {}, {}
    for i, (req, a) in enumerate(zip(reqs, out)):  # encode each (vision per image, cached), match the prefix cache
        try:
            prompts[i] = dec.encode_prompt(req.ids, req.mm, req.layout, a.stats, **req.extra)
            inputs[i] = dec.target_inputs(prompts[i])
        except Exception as e:  # noqa: BLE001 - this request fails alone
            a.error = e
    group = sorted(inputs)
    if not group:
        return out
    t0 = time.perf_counter()
    capacity = max(max(reqs[i].ids.shape[0] + dec.room(reqs[i].max_new_tokens) for i in group),
                   max(inputs[i].reused for i in group) + max(inputs[i].embeds.shape[1] for i in group))  # padding's slots
    rows = cache.add([prompts[i].match.target_kv() if inputs[i].reused else None for i in group], capacity)
    for i, r in zip(group, rows):
        out[i].row = r
    try:
        feats = _target_forward(dec, cache, rows[0], [inputs[i] for i in group])
    except Exception as e:  # noqa: BLE001 - the shared forward: every request in it
        for i in group:
            out[i].error = e
        return out
    sync(dec.target.device)
    seconds = time.perf_counter() - t0
    for k, (i, r) in enumerate(zip(group, rows)):
        req, a, x = reqs[i], out[i], inputs[i]
        L = req.ids.shape[0]
        cache.set_row_length(r, L - 1)
        a.stats.prompt_tokens_reused = x.reused
        a.stats.prefill_target_s = seconds  # the shared forward's time
        f = None if feats is None else feats[k:k + 1, :x.embeds.shape[1]]  # [1, L - 1 - reused, F]
        state = TargetState(cache=cache, step=None, length=L - 1, pending=int(req.ids[-1]), device=dec.target.device,
                            pos_offset=x.pos_offset, first_feats=None if f is None else f[0, -1:])
        try:
            a.pre = dec.prefill_drafter(prompts[i], state, f, req.max_new_tokens, a.stats, req.initial, static=False)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            a.error = e
    return out


def _target_forward(dec, cache: RaggedCache, first: int, inputs: list) -> torch.Tensor | None:
    """ONE target forward over rows ``first .. first + k - 1`` of ``cache``, row b fed
    ``inputs[b]`` (:class:`~mmspec.decoder.TargetInputs`) right-padded. -> for a head, the
    hidden features [k, n_max, F] (else None)."""
    dev = dec.target.device
    sizes = [x.embeds.shape[1] for x in inputs]
    n_max = max(sizes)
    if n_max == 0:  # every prompt in the prefix cache up to its pending token: nothing to run
        return None
    past = [x.reused for x in inputs]
    span = max(past) + n_max
    k, H = len(inputs), inputs[0].embeds.shape[-1]
    embeds = inputs[0].embeds.new_zeros(k, n_max, H)  # [k, n_max, H]
    positions, mask = [], torch.zeros(k, 1, n_max, span, dtype=torch.bool, device=dev)
    causal = torch.ones(n_max, n_max, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(n_max, dtype=torch.bool, device=dev)
    for b, (x, n, s) in enumerate(zip(inputs, sizes, past)):
        embeds[b, :n] = x.embeds[0]
        p = x.positions  # [1, n] or [3, 1, n]
        if n < n_max:  # padding queries at the row's last position (their outputs are never read)
            last = p[..., -1:] if n else p.new_full((*p.shape[:-1], 1), s)
            p = torch.cat([p, last.expand(*p.shape[:-1], n_max - n)], dim=-1)
        positions.append(p)
        mask[b, 0, :n, :s] = True
        mask[b, 0, :n, s:s + n] = causal[:n, :n]
        mask[b, 0, n:, s:s + n_max] = eye[n:]  # padding sees itself only
    pos = torch.cat(positions, dim=-2)  # [k, n_max] or [3, k, n_max]
    out = cache.forward_rows(first, dev, lambda: dec.target.forward(
        cache=cache, attention_mask=mask, position_ids=pos, inputs_embeds=embeds, logits_to_keep=1,
        hidden=dec.hidden_layers))
    return out[1] if dec.hidden_layers else None
