"""Requests joining the batch: their prompts prefilled together, straight into their rows.

:func:`admit` takes checked requests (:class:`~mmspec.request.Request`) and, for those whose
images encode (vision once per image, cached; captions; the prefix cache matched), runs the
target's prompt forwards as ONE forward over their new rows of the engine's target cache (each
prompt less its pending last token, right-padded; a prefix-cache hit starts its row with the
stored keys/values and feeds only the rest), then the drafter's: every view row of every
newcomer (or its head) in ONE forward over its rows of the draft cache. No request is prefilled
on a cache of its own and copied in. A request whose preparation fails fails alone; a failure
of a shared forward fails the requests in it (their rows are never taken).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.constrain.state import RowGrammar
from mmspec.drafting.trees import inblock_slots
from mmspec.engine.step import Engine, RowHost
from mmspec.runtime.forwards import PromptRow, prefill_rows
from mmspec.runtime.state import RowStart
from mmspec.timing import BlockClock


@dataclass
class Admitted:
    """One request of a group: what it was prefilled into (its row, its prompt's keys for the
    prefix cache) or its error."""

    stats: object
    row: int | None = None
    prompt: object | None = None  # the decoder's EncodedRequest
    error: BaseException | None = None


def _flat(positions: torch.Tensor) -> torch.Tensor:
    """[1, n] -> [n]; multimodal RoPE's [3, 1, n] -> [3, n]."""
    return positions[0] if positions.dim() == 2 else positions[:, 0]


def admit(dec, engine: Engine, reqs: list, max_rows: int | None = None) -> list[Admitted]:
    """Prefill the checked requests ``reqs`` of decoder ``dec`` into new rows of ``engine``
    (module docstring). -> one :class:`Admitted` per request, in order."""
    out = [Admitted(stats=dec.new_stats()) for _ in reqs]
    prompts, inputs = {}, {}
    for i, (req, a) in enumerate(zip(reqs, out)):  # encode each (vision per image, cached), match the prefix cache
        try:
            prompts[i] = dec.encode_prompt(req.ids, req.mm, req.layout, a.stats, **req.extra)
            for v, r in zip(dec.views, prompts[i].rows):
                dec.check_draft_context(v, r.token_ids.shape[0], req.max_new_tokens)
            inputs[i] = dec.target_inputs(prompts[i])
        except Exception as e:  # noqa: BLE001 - this request fails alone
            a.error = e
    group = sorted(inputs)
    if not group:
        return out
    clock = BlockClock(engine.device)  # the prefills' times, read when a request ends (no sync here)
    clock.start()
    first = engine.active
    k = len(group)
    capacity = max(reqs[i].ids.shape[0] + dec.room(reqs[i].max_new_tokens) for i in group)
    capacity = max(capacity, max(inputs[i].reused for i in group) + max(inputs[i].embeds.shape[1] for i in group))
    try:
        engine.ensure(first + k, capacity)
        rows = []
        for j, i in enumerate(group):
            x = inputs[i]
            if x.reused:
                engine.cache.write_prefix(first + j, prompts[i].match.target_kv())
            rows.append(PromptRow(embeds=x.embeds[0], positions=_flat(x.positions), reused=x.reused))
        hidden = prefill_rows(engine.cache, first, rows, lambda **kw: dec.target.forward(
            cache=engine.cache, logits_to_keep=1, hidden=dec.hidden_layers, **kw))
        feats = hidden[1] if (hidden is not None and dec.hidden_layers) else None  # [k, n_max, F]
        clock.mark()
        drafting = engine.drafting
        if drafting is not None:
            longest = max(max((len(r.token_ids) for r in prompts[i].rows), default=reqs[i].ids.shape[0]) for i in group)
            # the decode's slots; a dynamic tree feeds (depth - 1) x topk nodes, more than its budget when that is small
            room = max(dec.room(reqs[i].max_new_tokens) for i in group) + engine.lag + 1 + inblock_slots(dec.tree)
            drafting.ensure(engine.rows_for(first + k), longest + room)
            drafting.admit(first, [prompts[i] for i in group], [reqs[i] for i in group], feats)
        clock.mark()
    except Exception as e:  # noqa: BLE001 - a shared forward: every request in it
        for i in group:
            out[i].error = e
        return out
    starts = []
    for j, i in enumerate(group):
        req, x = reqs[i], inputs[i]
        f = None
        if feats is not None:  # a head: the target's feature before the pending token
            n = x.embeds.shape[1]
            f = feats[j:j + 1, n - 1] if n else None
        img = (req.ids == dec.target.image_token_id).nonzero()
        last_image = int(img[-1, 0]) if img.numel() else None
        starts.append(RowStart(length=req.ids.shape[0] - 1, root=int(req.ids[-1]), pos_offset=x.pos_offset,
                               remaining=req.max_new_tokens, seed=0 if req.seed is None else req.seed,
                               params=req.params, last_image=last_image, feats=f, coupled=req.coupled))
    indices = engine.state.admit(starts)
    for j, i in enumerate(group):
        a, req = out[i], reqs[i]
        a.row, a.prompt = indices[j], prompts[i]
        a.stats.prompt_tokens_reused = inputs[i].reused
        engine.add_row(RowHost(max_new_tokens=req.max_new_tokens, eos_ids=dec.eos_ids, stats=a.stats,
                               seed=0 if req.seed is None else req.seed, unseen=[int(req.ids[-1])],
                               prefill=clock, logprobs_top=req.logprobs,
                               grammar=None if req.grammar is None else RowGrammar(req.grammar, dec.target.vocab_size,
                                                                                   encode=dec.encode_text)))
        if req.constraint is not None:
            a.stats.constraint = req.constraint.kind
    return out

