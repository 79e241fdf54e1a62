"""Where a ``SpecDecoder.generate`` call spends its wall time, piece by piece.

Owns one instrumented, untimed pass: the target / draft adapters' decode ``forward``, every
cache's ``crop``, ``EnsembleDrafter._run`` / ``.mixture`` and the verification functions the
engine calls are wrapped with accumulating timers (synchronised on CUDA) for the duration of
the pass and restored afterwards. Prefill pieces come from the decoder's own stats. A helper of
``bench/speed.py`` (beside it, not in the package); it changes no engine code.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterator, Sequence

import torch

from mmspec.timing import sync


class _Timers:
    """Accumulating wall-clock timers around callables (synchronised on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, key: str, fn: Callable, when: Callable[..., bool] | None = None) -> Callable:
        def timed(*a, **k):
            if when is not None and not when(*a, **k):
                return fn(*a, **k)
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(self.device)
            self.s[key] += time.perf_counter() - t0
            self.n[key] += 1
            return out
        return timed


@contextlib.contextmanager
def _instrumented(dec, timers: _Timers) -> Iterator[None]:
    """Wrap the decoder's pieces for one profiling pass; everything is restored on exit.

    Instance-level: the target / draft adapters' ``forward`` (decode calls only: ``input_ids``
    given; prefill passes ``inputs_embeds``) and the roll-back / compaction of every cache they
    create (``crop``, ``set_length``, ``move``).
    Module / class level (our own code, restored in ``finally``): ``EnsembleDrafter._run`` and
    ``.mixture``, and the verification functions the engine looked up from ``mmspec.verify``.
    """
    import mmspec.engine as engine
    from mmspec.drafter import EnsembleDrafter

    decode = lambda *a, **k: k.get("input_ids") is not None  # noqa: E731

    def cache_factory(adapter, key):
        orig = adapter.new_cache

        def new_cache(*a, **k):
            c = orig(*a, **k)
            for name in ("crop", "set_length", "move"):
                if hasattr(c, name):
                    setattr(c, name, timers.wrap(key, getattr(c, name)))
            return c
        return new_cache

    patches = [(dec.target, "forward", timers.wrap("target_forward", dec.target.forward, decode)),
               (dec.draft, "forward", timers.wrap("draft_forward", dec.draft.forward, decode)),
               (dec.target, "new_cache", cache_factory(dec.target, "cache_crop")),
               (dec.draft, "new_cache", cache_factory(dec.draft, "cache_crop")),
               (EnsembleDrafter, "_run", timers.wrap("draft_feed", EnsembleDrafter._run)),
               (EnsembleDrafter, "mixture", timers.wrap("draft_mixture", EnsembleDrafter.mixture))]
    for fn in ("verify_tree_greedy", "verify_tree_sampling", "logits_to_probs"):
        patches.append((engine, fn, timers.wrap("verify_maths", getattr(engine, fn))))
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def profile_breakdown(dec, prompts: Sequence, max_new_tokens: int, device: torch.device) -> dict:
    """Where one decoder's wall time goes, summed over ``prompts`` (one untimed extra pass).

    prompts: objects with ``.inputs`` (processor output), ``.images`` and ``.captions``.

    draft_forward: the draft model's decode forwards; draft_glue: ``_run`` minus the forward
    (mask concat, position ids); draft_mixture: softmax + weighted mix; target_forward: the
    verify forwards; verify_maths: acceptance (and probs when sampling); cache_crop: target and
    draft roll-back; prefill: vision + captions + both prefills; python_overhead: the rest.
    """
    timers = _Timers(device)
    total = prefill = 0.0
    with _instrumented(dec, timers), torch.inference_mode():
        for p in prompts:
            res = dec.generate(p.inputs["input_ids"], pixel_values=p.inputs.get("pixel_values"),
                               attention_mask=p.inputs.get("attention_mask"), max_new_tokens=max_new_tokens,
                               images=p.images, captions=p.captions)
            st = res.stats
            total += st.total_s
            prefill += st.vision_s + st.caption_s + st.prefill_target_s + st.prefill_draft_s
    s = timers.s
    parts = {"prefill": prefill, "draft_forward": s["draft_forward"],
             "draft_glue": max(s["draft_feed"] - s["draft_forward"], 0.0), "draft_mixture": s["draft_mixture"],
             "target_forward": s["target_forward"], "verify_maths": s["verify_maths"], "cache_crop": s["cache_crop"]}
    parts["python_overhead"] = total - sum(parts.values())
    return {"total_s": total, "parts_s": parts, "share": {k: v / total for k, v in parts.items()} if total else {},
            "calls": dict(timers.n)}
