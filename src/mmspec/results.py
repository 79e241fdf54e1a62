"""What a decode returns: :class:`GenerationResult` (the tokens, the text, the stats and the
seed) and, where the request asked for them, its tokens' :class:`TokenLogprob`. Below the decoder
and the batch scheduler, so both build it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from mmspec.stats import GenerationStats


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token under the TARGET: its id, ``log p(token | prefix)`` and the ``top``
    likeliest tokens there (ids and log-probabilities, likeliest first). Read from the verify
    forward that emitted it (:meth:`mmspec.engine.step.Engine.step`): the log-softmax of the
    target's raw logits at that position, temperature 1 and no top-k / top-p filter, whatever the
    request samples with (as OpenAI and vLLM report them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str
    stats: GenerationStats
    seed: int | None = None  # the seed used for sampling (None for greedy)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids where asked (logprobs=K), else None
