"""One request, checked: every argument check, default and the seed of a decode in ONE place,
used by :meth:`~mmspec.decoder.SpecDecoder.generate`, :meth:`~mmspec.decoder.SpecDecoder.generate_batch`
and ``mmspec serve`` (through :class:`~mmspec.batch.BatchScheduler`) alike.

:func:`decoding` checks the limits every request has (``max_new_tokens``, temperature, top_k,
top_p, the seed) into a typed :class:`Decoding`: the ONE place they are enforced, for
``generate`` and for ``mmspec serve``, whose pydantic model calls it as the body is validated
(naming a bad value as the client spelled it). :func:`make_request` makes the :class:`Request`
from the processor's output and a ``Decoding``: token ids on the CPU, the family's multimodal
inputs, the prompt's layout, the decoder's checks and the seed (greedy: None; sampling without
one: drawn from the OS, and reported in the result so the decode can be repeated): the ONE place a
request's seed is chosen (every random draw of the request then comes from its own stream keyed by it:
:mod:`mmspec.runtime.rng`). :func:`prepare` maps generate()'s keywords (or one request dict of
generate_batch) onto both. :func:`context_room` and :func:`check_context` are the context rule, the one place it
is written: a prompt, its new tokens and one block's draft positions must fit the context (the
target's, and each draft row's; ``mmspec serve`` sizes its default ``max_tokens`` with it and
rewords a :class:`ContextError` for its client). Knows nothing of caches or the loop; the
checks' texts are :mod:`mmspec.checks`'.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mmspec import checks
from mmspec.constrain.spec import Constraint
from mmspec.errors import MMSpecError
from mmspec.runtime.verify import SamplingParams

EXTRA_KEYS = ("images", "captions", "videos", "substitutes")
MAX_NEW_TOKENS = 128  # a request's limit when it gives none (generate(), generate_batch's dicts)


@dataclass
class Request:
    """A request checked and resolved (nothing encoded or prefilled yet)."""

    ids: torch.Tensor  # [L] on the CPU
    mm: dict  # the family's multimodal inputs (pixel_values, image_grid_thw, ...)
    layout: object  # the prompt's images and videos (MultimodalPrompt.layout)
    max_new_tokens: int
    params: SamplingParams
    seed: int | None  # None: greedy (draws nothing)
    extra: dict  # images, captions, videos, substitutes
    initial: tuple[float, ...] | None = None  # adaptive weights' start (a conversation's previous turn)
    logprobs: int | None = None  # each token's target log-probability and this many alternatives (None: not asked)
    coupled: bool = False  # sampling by the Gumbel-max coupling (:func:`coupled`): the seed fixes the answer
    constraint: Constraint | None = None  # the answer's constraint (mmspec.constrain), checked and compiled
    grammar: object | None = None  # its xgrammar CompiledGrammar for the decoder's tokenizer


@dataclass(frozen=True)
class Decoding:
    """What a request asks of its decoding, its limits checked (made by :func:`decoding`, the ONE
    place they are enforced): a new-token limit, the sampling settings, a seed, log-probabilities."""

    max_new_tokens: int | None  # None: the caller sizes it (mmspec serve: its default, capped by the context's room)
    params: SamplingParams
    seed: int | None  # as asked (None: greedy, or a fresh one drawn when the request is made)
    logprobs: int | None  # alternatives per token (None: not asked); checked against the decoder by make_request


def decoding(*, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, top_k=None, top_p=None, seed=None, logprobs=None,
             names: dict[str, str] | None = None, sized_later: bool = False) -> Decoding:
    """The decoder-independent limits of a request, checked: ``max_new_tokens`` >= 1 (None with
    ``sized_later``: the caller's to size), temperature, top_k, top_p (:class:`SamplingParams`),
    the seed a whole number. An :class:`~mmspec.errors.ArgumentError` names the argument as the
    caller spells it (``names``: e.g. ``{"max_new_tokens": "max_tokens"}``). ``logprobs`` is
    checked against the decoder (:func:`make_request`)."""
    names = names or {}
    if max_new_tokens is not None or not sized_later:
        max_new_tokens = checks.check_max_new_tokens(max_new_tokens, names.get("max_new_tokens", "max_new_tokens"))
    params = SamplingParams(temperature=checks.check_temperature(temperature), top_k=top_k, top_p=top_p)
    return Decoding(max_new_tokens=max_new_tokens, params=params, seed=checks.check_seed(seed), logprobs=logprobs)


def make_request(dec, inputs: Mapping[str, object], asked: Decoding, *, images=None, captions=None, videos=None,
                 substitutes=None, initial_weights=None, constraint: Constraint | None = None) -> Request:
    """A :class:`Request` from the processor's output ``inputs`` (``input_ids``, its
    ``attention_mask``, ``pixel_values`` and the family's other inputs; any other key refused)
    and what ``asked`` (checked already): the decoder-dependent checks (the vocabulary, the
    media, ``logprobs`` against the decoder's ``max_logprobs``, the context rule, the constraint
    compiled) and the seed; raises MMSpecError naming the argument and the fix."""
    if asked.max_new_tokens is None:
        raise MMSpecError("the request has no max_new_tokens; size it before making the request")
    kw = dict(inputs)
    if kw.get("input_ids") is None:
        raise MMSpecError("the request has no input_ids; pass the processor's output (input_ids, pixel_values, ...)")
    input_ids, attention_mask, pixel_values = kw.pop("input_ids"), kw.pop("attention_mask", None), kw.pop("pixel_values", None)
    logprobs = checks.check_logprobs(asked.logprobs, dec.target.vocab_size, dec.max_logprobs)
    mm = dec.mm_inputs(pixel_values, kw)  # the rest: the family's processor outputs, unknown ones refused
    ids = checks.check_ids(input_ids, attention_mask)  # [L] on CPU
    checks.check_ids_in_vocab(ids, dec.target.vocab_size)
    params = asked.params
    if dec.acceptance is not None and not params.greedy:
        raise MMSpecError("acceptance='relaxed' is defined for greedy decoding only; use temperature=0 "
                          "or the exact (lossless) acceptance for sampling")
    checks.check_video_inputs(dec.target, mm, videos, substitutes)
    checks.check_images_and_captions(images, captions)
    initial = checks.check_initial_weights(initial_weights, dec.adaptive, len(dec.views))
    seed = None if params.greedy else new_seed() if asked.seed is None else asked.seed  # greedy draws nothing
    layout = dec.mm.layout(ids, mm)
    dec.check_context(ids.shape[0], asked.max_new_tokens)
    grammar = None
    if constraint is not None:  # compiled (or found in the decoder's cache) before any decoding
        if not isinstance(constraint, Constraint):
            raise MMSpecError(f"constraint must be a mmspec.constrain.Constraint (or None), got {type(constraint).__name__}")
        grammar = dec.grammar_compiler.compile(constraint)
    if any(v.needs_substitute for v in dec.views):
        dec.mm.check_substitutes(layout, videos, substitutes)
    extra = {"images": images, "captions": captions, "videos": videos, "substitutes": substitutes}
    return Request(ids=ids, mm=mm, layout=layout, max_new_tokens=asked.max_new_tokens, params=params, seed=seed,
                   extra=extra, initial=initial, logprobs=logprobs, constraint=constraint, grammar=grammar,
                   coupled=coupled(params))


ASKED = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "logprobs")  # generate()'s keywords: decoding()'s
MADE = ("initial_weights", "constraint", *EXTRA_KEYS)  # make_request's


def prepare(dec, kwargs: dict, defaults: dict | None = None) -> Request:
    """generate()'s keywords (``kwargs``; ``defaults`` below them): :func:`decoding` then
    :func:`make_request` on the rest (the processor's output)."""
    kw = {**(defaults or {}), **kwargs}
    asked = decoding(**{k: kw.pop(k) for k in ASKED if k in kw})
    made = {k: kw.pop(k) for k in MADE if k in kw}
    return make_request(dec, kw, asked, **made)


def coupled(params: SamplingParams) -> bool:
    """Whether a request samples by the Gumbel-max coupling: every sampling request does. Its
    token at output position t is ``argmax(log p_t + g_t)`` with g_t its seed's noise at t, the
    target's own seeded sample, so a seed fixes the answer whatever the drafter, the tree, the
    depth or the batch (and the reported seed of a request that gave none repeats it too). The
    rejection sampler (``Request.coupled = False``) stays for comparison: ``perf/seed_coupling.py``
    measured both (docs/sampling.md)."""
    return not params.greedy


class ContextError(MMSpecError):
    """A prompt and its new tokens past a context (:func:`check_context`): ``prompt_len``,
    ``max_new_tokens``, ``limit`` and ``room`` (the new tokens that would fit; < 1: none)."""

    def __init__(self, message: str, *, prompt_len: int, max_new_tokens: int, limit: int, room: int):
        super().__init__(message)
        self.prompt_len, self.max_new_tokens, self.limit, self.room = prompt_len, max_new_tokens, limit, room


def context_room(limit: int | None, prompt_len: int, depth: int) -> int | None:
    """THE context rule: the new tokens that fit after a prompt of ``prompt_len`` positions in a
    context of ``limit`` (None: no limit), one block's ``depth`` draft positions kept free
    (prompt + new tokens + draft positions <= limit)."""
    return None if limit is None else limit - prompt_len - depth


def check_context(limit: int | None, prompt_len: int, max_new_tokens: int, depth: int, *, what: str, whose: str,
                  depth_words: str, fix: str, note: str = "") -> None:
    """Raise :class:`ContextError` when ``max_new_tokens`` do not fit (:func:`context_room`): "{what}
    (N tokens{note}) plus max_new_tokens=M plus {depth_words} draft positions (T in all) exceeds
    {whose} context length of L tokens; {fix}"."""
    room = context_room(limit, prompt_len, depth)
    if room is not None and max_new_tokens > room:
        raise ContextError(f"{what} ({prompt_len} tokens{note}) plus max_new_tokens={max_new_tokens} plus {depth_words} "
                           f"draft positions ({prompt_len + max_new_tokens + depth} in all) exceeds {whose} context "
                           f"length of {limit} tokens; {fix}", prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                           limit=limit, room=room)


def new_seed() -> int:
    """A fresh seed for a sampling request that gave none (reported in its result)."""
    return int.from_bytes(os.urandom(8), "little") >> 1
