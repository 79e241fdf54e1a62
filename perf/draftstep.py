"""Timing of one real draft step of the engine, for several view sets on the same prompt.

A "draft step" is what :meth:`mmspec.drafter.EnsembleDrafter.propose` does per draft token:
feed one token to every row of the batched draft (one forward), mix the rows' distributions and
pick the next token. This is the quantity the IbED claim "an ensemble of views costs about one
draft forward" is about, so it is measured on the engine's own drafter (left-padded rows of
different lengths, the preallocated cache, the mixture), not on a bare model forward.

Protocol: one prefilled drafter per view set; each timed unit is ``n_steps`` steps, each
followed by a one-position roll-back so every step sees the same context; units of all view
sets are interleaved round-robin (``rounds`` times) so machine noise hits them alike; the
result is the median over rounds of the per-step mean. A helper of ``perf/speed.py`` (beside
it, not in the package).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from mmspec.timing import sync
from mmspec.verify import SamplingParams


@torch.inference_mode()
def draft_step_times(decoders: Mapping[str, object], input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                     *, captions: Sequence[str] | None = None, images: Sequence | None = None,
                     rounds: int = 30, n_steps: int = 10, temperature: float = 0.0,
                     max_new_tokens: int = 64, dynamic_cache: bool = False) -> dict[str, float]:
    """Median seconds per draft step for each ``SpecDecoder`` in ``decoders`` (by name).

    input_ids: [1, L] processor output; pixel_values: [n_img, 3, H, W] or None.
    dynamic_cache: True times the drafter on a growing ``DynamicCache`` (the engine before
    :mod:`mmspec.models.cache`), for a before/after comparison.
    """
    from transformers import DynamicCache

    params = SamplingParams(temperature=temperature)
    token = int(torch.as_tensor(input_ids).reshape(-1)[-1])  # the pending last prompt token
    drafters = {name: dec.new_drafter(input_ids, pixel_values, max_new_tokens=max_new_tokens, images=images,
                                      captions=captions,
                                      cache=DynamicCache(config=dec.draft_model.config) if dynamic_cache else None)
                for name, dec in decoders.items()}
    dev = {name: d.adapter.device for name, d in drafters.items()}

    def unit(name: str) -> float:
        d = drafters[name]  # greedy picks: no generator
        sync(dev[name])
        t0 = time.perf_counter()
        for _ in range(n_steps):
            d.step(token, params)  # feeds, picks and drops the token again
        sync(dev[name])
        return (time.perf_counter() - t0) / n_steps

    for name in drafters:  # warm-up
        unit(name)
    samples: dict[str, list[float]] = {name: [] for name in drafters}
    names = list(drafters)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            samples[name].append(unit(name))
    return {name: statistics.median(v) for name, v in samples.items()}
