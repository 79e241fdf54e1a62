"""What a decode returns: :class:`GenerationResult` (the tokens, the text, the stats and the
seed). Below the decoder and the batch scheduler, so both build it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from mmspec.stats import GenerationStats


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str
    stats: GenerationStats
    seed: int | None = None  # the seed used for sampling (None for greedy)
