"""One request, checked: every argument check, default and the seed of a decode in ONE place,
used by :meth:`~mmspec.decoder.SpecDecoder.generate`, :meth:`~mmspec.decoder.SpecDecoder.generate_batch`
and ``mmspec serve`` (through :class:`~mmspec.batch.BatchScheduler`) alike.

:func:`prepare` turns generate()'s keywords (or one request dict of generate_batch) into a
:class:`Request`: token ids on the CPU, the family's multimodal inputs, the prompt's layout,
the limit, the sampling settings and the seed (greedy: None; sampling without one: drawn from
the OS, and reported in the result so the decode can be repeated): the ONE place a request's seed
is chosen (every random draw of the request then comes from its own stream keyed by it:
:mod:`mmspec.runtime.rng`). :func:`context_room` and :func:`check_context` are the context rule, the one place it
is written: a prompt, its new tokens and one block's draft positions must fit the context (the
target's, and each draft row's; ``mmspec serve`` sizes its default ``max_tokens`` with it and
rewords a :class:`ContextError` for its client). Knows nothing of caches or the loop; the
checks' texts are :mod:`mmspec.checks`'.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mmspec import checks
from mmspec.constrain.spec import Constraint
from mmspec.errors import MMSpecError
from mmspec.runtime.verify import SamplingParams

EXTRA_KEYS = ("images", "captions", "videos", "substitutes")


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


def prepare(dec, kwargs: dict, defaults: dict | None = None) -> Request:
    """The checks of ``generate`` on its keywords (``kwargs``; ``defaults`` below them) against
    the decoder ``dec``; raises MMSpecError naming the argument and the fix."""
    kw = {**(defaults or {}), **kwargs}
    if kw.get("input_ids") is None:
        raise MMSpecError("the request has no input_ids; pass the processor's output (input_ids, pixel_values, ...)")
    input_ids, attention_mask, pixel_values = kw.pop("input_ids"), kw.pop("attention_mask", None), kw.pop("pixel_values", None)
    max_new_tokens = kw.pop("max_new_tokens", 128)
    temperature, seed = kw.pop("temperature", 0.0), kw.pop("seed", None)
    top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
    initial_weights = kw.pop("initial_weights", None)
    constraint = kw.pop("constraint", None)
    logprobs = checks.check_logprobs(kw.pop("logprobs", None), dec.target.vocab_size, dec.max_logprobs)
    extra = {k: kw.pop(k, None) for k in EXTRA_KEYS}
    mm = dec.mm_inputs(pixel_values, kw)  # the rest: the family's processor outputs, unknown ones refused
    ids = checks.check_ids(input_ids, attention_mask)  # [L] on CPU
    checks.check_ids_in_vocab(ids, dec.target.vocab_size)
    max_new_tokens = checks.check_max_new_tokens(max_new_tokens)
    params = SamplingParams(temperature=checks.check_temperature(temperature), top_k=top_k, top_p=top_p)
    if dec.acceptance is not None and not params.greedy:
        raise MMSpecError("acceptance='relaxed' is defined for greedy decoding only; use temperature=0 "
                          "or the exact (lossless) acceptance for sampling")
    checks.check_video_inputs(dec.target, mm, extra["videos"], extra["substitutes"])
    checks.check_images_and_captions(extra["images"], extra["captions"])
    seed = checks.check_seed(seed)
    initial = checks.check_initial_weights(initial_weights, dec.adaptive, len(dec.views))
    if params.greedy:
        seed = None  # greedy decoding draws nothing
    elif seed is None:
        seed = new_seed()
    layout = dec.mm.layout(ids, mm)
    dec.check_context(ids.shape[0], max_new_tokens)
    grammar = None
    if constraint is not None:  # compiled (or found in the decoder's cache) before any decoding
        if not isinstance(constraint, Constraint):
            raise MMSpecError(f"constraint must be a mmspec.constrain.Constraint (or None), got {type(constraint).__name__}")
        grammar = dec.grammar_compiler.compile(constraint)
    if any(v.needs_substitute for v in dec.views):
        dec.mm.check_substitutes(layout, extra["videos"], extra["substitutes"])
    return Request(ids=ids, mm=mm, layout=layout, max_new_tokens=max_new_tokens, params=params, seed=seed,
                   extra=extra, initial=initial, logprobs=logprobs, constraint=constraint, grammar=grammar,
                   coupled=coupled(params))


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
