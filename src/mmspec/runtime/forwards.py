"""The forwards of the batched engine over a :class:`~mmspec.models.rows.RowCache`: a step's
fixed-shape forwards, and the prefill of newcomers' rows.

:class:`RowForward` runs one model's step forwards (the target's verify forward, a draft round,
a head round): inputs are device tensors only, the write slots and the 4-D mask among them, so
every call of one shape ``(rows, new tokens, span)`` runs the same kernels on the same addresses
and the whole step around them can be captured as one CUDA graph (:mod:`mmspec.engine.step`).

:func:`prefill_rows` runs newcomers' prompts (each its own length, right-padded to the longest,
a stored prefix reused where the prefix cache had one) as ONE eager forward over their rows.

:class:`Compiler` (``SpecDecoder(compile=True)``) runs a step's forwards through ``torch.compile``
(inductor's fused kernels for norms, rotary embeddings and casts): mode "default", not
"reduce-overhead", whose own CUDA graphs would nest inside the step's graph
(:mod:`mmspec.runtime.graphs`), which captures the compiled kernels as it captures eager ones.
``dynamic=False``: one compilation per input shape, and the static engine's shapes are buckets.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec.models.rows import RowCache
from mmspec.runtime.masks import causal, rows_mask
from mmspec.runtime.state import stage


class RowForward:
    """``self(write=[R], mask=[R, 1, n, span], **inputs)`` -> ``fn(mask=mask, **inputs)`` after
    the cache is told where the rows write and how far they attend (module docstring)."""

    def __init__(self, fn: Callable[..., object], cache: RowCache, name: str = "model"):
        self.fn = fn
        self.cache = cache
        self.name = name

    def __call__(self, write: torch.Tensor, mask: torch.Tensor, **inputs: torch.Tensor):
        self.cache.begin(0, write, mask.shape[-1])
        return self.fn(mask=mask, **inputs)


RECOMPILE_LIMIT = 64  # compilations per forward (torch's default, 8, is fewer than a static engine's plans)


class Compiler:
    """One engine's compiled forwards (module docstring): :meth:`wrap` turns a forward into its
    compiled call. The first call of each input shape compiles (``compile_s``: the seconds of those
    calls, compiling included). If compiling or a compiled call fails, one warning, and from then on
    every forward of the engine runs eagerly (the tokens are the same, only slower)."""

    def __init__(self):
        self.failed: str | None = None  # why compiling was given up, if it was
        self.compile_s = 0.0
        self._seen: set = set()  # (forward, input shapes) compiled

    def wrap(self, fn: Callable[..., object], name: str) -> Callable[..., object]:
        try:
            compiled = torch.compile(fn, mode="default", fullgraph=False, dynamic=False)
        except Exception as e:  # noqa: BLE001 - torch.compile unavailable here: eager, said once
            self._give_up(name, e)
            return fn

        def call(**inputs: torch.Tensor):
            if self.failed:
                return fn(**inputs)
            key = (name,) + tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items()))
            t0 = time.perf_counter()
            try:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    out = compiled(**inputs)
            except Exception as e:  # noqa: BLE001 - any compile failure: say it once, run eagerly
                self._give_up(name, e)  # the forward rewrites the same cache slots: running it again is safe
                return fn(**inputs)
            if key not in self._seen:
                self._seen.add(key)
                self.compile_s += time.perf_counter() - t0
            return out
        return call

    def _give_up(self, name: str, e: Exception) -> None:
        if self.failed:
            return
        self.failed = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"mmspec: could not torch.compile the {name}'s forward ({self.failed}); running the "
                      "engine's forwards uncompiled instead (same tokens, slower)", RuntimeWarning, stacklevel=3)


@dataclass
class PromptRow:
    """One newcomer row's prefill: what it feeds after its reused prefix."""

    embeds: torch.Tensor  # [n, H] the inputs past the reused slots
    positions: torch.Tensor  # [n] long, or [3, n] (multimodal RoPE)
    reused: int  # slots its row already holds (a prefix-cache hit), before these


def prefill_rows(cache: RowCache, first: int, rows: list[PromptRow], run: Callable[..., object]):
    """ONE forward over rows ``first .. first + k - 1`` of ``cache``, row i fed ``rows[i]`` (right-
    padded to the longest; padding queries at the row's last position, their outputs never read).
    ``run(inputs_embeds=, position_ids=, attention_mask=)`` is the model's forward on ``cache``.
    -> its output, or None when no row has anything to feed."""
    sizes = [r.embeds.shape[0] for r in rows]
    n_max = max(sizes)
    if n_max == 0:
        return None
    dev = rows[0].embeds.device
    k, H = len(rows), rows[0].embeds.shape[-1]
    embeds = rows[0].embeds.new_zeros(k, n_max, H)
    pos = []
    for i, (r, n) in enumerate(zip(rows, sizes)):
        embeds[i, :n] = r.embeds
        p = r.positions
        if n < n_max:
            last = p[..., -1:] if n else p.new_full((*p.shape[:-1], 1), r.reused)
            p = torch.cat([p, last.expand(*p.shape[:-1], n_max - n)], dim=-1)
        pos.append(p)
    position_ids = torch.stack(pos, dim=-2)  # [k, n_max] or [3, k, n_max]
    reused = stage(torch.tensor([r.reused for r in rows], dtype=torch.long), dev)
    span = max(r.reused for r in rows) + n_max
    mask = rows_mask(reused, span, causal(n_max, dev))
    cache.begin(first, reused, span)
    try:
        return run(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask)
    finally:
        cache.store.first = 0
