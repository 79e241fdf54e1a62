"""Timing of one real draft step of the engine, for several view sets on the same prompt.

A "draft step" is what the engine's drafting does per draft token of a chain
(:class:`mmspec.drafting.ensemble.EnsembleDrafting`): feed one token to every view row of the
request in ONE draft forward, mix the rows' distributions with the request's weights and pick
the next token. This is the quantity the IbED claim "an ensemble of views costs about one draft
forward" is about, so it is measured on the engine's own drafting (its rows, its cache, its
mixture), not on a bare model forward.

Protocol: one admitted request per view set (a scheduler of one, after its first step); each
timed unit is ``n_steps`` steps, each writing the same in-block slot (a step commits nothing, so
every step sees the same context); units of all view sets are interleaved round-robin
(``rounds`` times) so machine noise hits them alike; the result is the median over rounds of
the per-step mean. A helper of ``perf/speed.py`` (beside it, not in the package).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from mmspec.timing import sync


def draft_step(dec, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, *,
               captions: Sequence[str] | None = None, images: Sequence | None = None,
               max_new_tokens: int = 64) -> tuple[Callable[[], torch.Tensor], object]:
    """-> (one draft step of ``dec``'s engine on this prompt, the scheduler that holds it)."""
    from mmspec.batch import BatchScheduler

    sched = BatchScheduler(dec, max_batch=1)
    req = dict(input_ids=input_ids, pixel_values=pixel_values, max_new_tokens=max_new_tokens)
    if captions is not None:
        req["captions"] = captions
    if images is not None:
        req["images"] = images
    sched.submit(req)
    with torch.inference_mode():
        sched.step()  # admitted and stepped once: the row holds pending tokens
        engine = sched.engine
        R = engine.step_rows()
        drafting = engine.drafting
        x = engine._input(R, dec.tree.max_depth, drafting.span_for(dec.tree, engine.width))
        drafting.begin(R, 2)
        logits = drafting.feed_pending(x)
    tok = logits[:, 0].argmax(-1)[: R][:, None] if drafting.V == 1 else \
        drafting.distributions(logits, x.sampling)[:, 0].argmax(-1)[:, None]
    node = torch.ones(R, 1, dtype=torch.long, device=tok.device)
    inblock = torch.ones(R, 1, 1, dtype=torch.bool, device=tok.device)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        out = drafting.feed(x, node, tok, node - 1, 1, 0, inblock)  # one forward over the request's view rows
        return drafting.distributions(out, x.sampling)[:, 0].argmax(-1)  # mixed, picked
    return step, sched


def draft_step_times(decoders: Mapping[str, object], input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                     *, captions: Sequence[str] | None = None, images: Sequence | None = None,
                     rounds: int = 30, n_steps: int = 10, max_new_tokens: int = 64) -> dict[str, float]:
    """Median seconds per draft step for each ``SpecDecoder`` in ``decoders`` (by name).

    input_ids: [1, L] processor output; pixel_values: [n_img, 3, H, W] or None."""
    steps = {name: draft_step(dec, input_ids, pixel_values, captions=captions, images=images,
                              max_new_tokens=max_new_tokens) for name, dec in decoders.items()}
    dev = {name: dec.target.device for name, dec in decoders.items()}

    def unit(name: str) -> float:
        step = steps[name][0]
        sync(dev[name])
        t0 = time.perf_counter()
        for _ in range(n_steps):
            step()
        sync(dev[name])
        return (time.perf_counter() - t0) / n_steps

    for name in steps:  # warm-up
        unit(name)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            samples[name].append(unit(name))
    return {name: statistics.median(v) for name, v in samples.items()}
