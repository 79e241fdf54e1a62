"""Where a ``SpecDecoder.generate`` call spends its wall time, piece by piece.

Owns one untimed pass that splits the decoder's own stats clock (``GenerationStats``: vision,
captions, substitutes, both prefills, CUDA-graph capture, and per block the draft phase and the
verify phase) further by the time spent inside the target's and the draft's decode forwards.
Those are read from forward hooks on the two models (PyTorch's public ``register_forward_*_hook``,
removed after the pass): no engine, drafter or adapter attribute is replaced. Each hooked
forward also runs inside a ``torch.profiler.record_function`` range (``perf::target_forward``,
``perf::draft_forward``), so a profiler taken around :func:`profile_breakdown` shows them.

On the CUDA-graph engine the decode forwards are graph replays that no hook sees: there the
forward pieces read 0 and only the clock's phases split the time (``calls`` says how many
forwards were seen). A helper of ``perf/speed.py`` (beside it, not in the package).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch

from mmspec.timing import sync

TARGET_RANGE, DRAFT_RANGE = "perf::target_forward", "perf::draft_forward"


class ForwardTimer:
    """Wall time of a model's decode forwards (``input_ids`` given; a prefill passes
    ``inputs_embeds``), synchronised on CUDA, through a pre-hook and a hook on the model.
    Forwards run while a CUDA graph is captured are skipped (a sync there would break it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self._open: list[tuple[str, float, contextlib.AbstractContextManager]] = []

    @contextlib.contextmanager
    def watching(self, models: dict[str, torch.nn.Module]) -> Iterator[ForwardTimer]:
        """Hook each ``{key: model}`` for the duration of the block; every hook is removed on exit."""
        handles = []
        try:
            for key, model in models.items():
                handles.append(model.register_forward_pre_hook(self._pre(key), with_kwargs=True))
                handles.append(model.register_forward_hook(self._post(key), with_kwargs=True))
            yield self
        finally:
            for h in handles:
                h.remove()
            while self._open:  # a forward that raised: close its range
                self._open.pop()[2].__exit__(None, None, None)

    def _pre(self, key: str):
        def pre(module, args, kwargs):
            if kwargs.get("input_ids") is None or _capturing():
                return None
            sync(self.device)
            rng = torch.profiler.record_function(key)
            rng.__enter__()
            self._open.append((key, time.perf_counter(), rng))
            return None
        return pre

    def _post(self, key: str):
        def post(module, args, kwargs, output):
            if kwargs.get("input_ids") is None or _capturing() or not self._open or self._open[-1][0] != key:
                return None
            sync(self.device)
            _, t0, rng = self._open.pop()
            self.s[key] += time.perf_counter() - t0
            self.n[key] += 1
            rng.__exit__(None, None, None)
            return None
        return post


def _capturing() -> bool:
    """A CUDA graph is being captured: no sync, no timing (the capture's own clock has it)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def profile_breakdown(dec, prompts: Sequence, max_new_tokens: int, device: torch.device) -> dict:
    """Where one decoder's wall time goes, summed over ``prompts`` (one untimed extra pass).

    prompts: objects with ``.inputs`` (processor output), ``.images`` and ``.captions``.

    prefill: vision + captions + substitutes + both prefills (the clock's); graph_capture: CUDA
    graphs captured in the pass; draft_forward: the draft model's decode forwards; draft_other:
    the rest of the draft phase (feeding glue, mixing the views, picking, tree building);
    target_forward: the verify forwards; verify_other: the rest of the verify phase (acceptance
    maths, cache roll-back and moves, the block's host sync); python_overhead: the rest of
    ``generate`` (input checks, setup, output).
    """
    timer = ForwardTimer(device)
    total = prefill = capture = draft_s = verify_s = 0.0
    models = {TARGET_RANGE: dec.target.model, DRAFT_RANGE: dec.draft.model}
    with timer.watching(models), torch.inference_mode():
        for p in prompts:
            st = dec.generate(p.inputs["input_ids"], pixel_values=p.inputs.get("pixel_values"),
                              attention_mask=p.inputs.get("attention_mask"), max_new_tokens=max_new_tokens,
                              images=p.images, captions=p.captions).stats
            total += st.total_s
            prefill += st.vision_s + st.caption_s + st.substitute_s + st.prefill_target_s + st.prefill_draft_s
            capture += st.capture_s
            draft_s += st.draft_s
            verify_s += st.verify_s
    fwd_d, fwd_t = timer.s[DRAFT_RANGE], timer.s[TARGET_RANGE]
    parts = {"prefill": prefill, "graph_capture": capture,
             "draft_forward": fwd_d, "draft_other": max(draft_s - fwd_d, 0.0),
             "target_forward": fwd_t, "verify_other": max(verify_s - fwd_t, 0.0)}
    parts["python_overhead"] = max(total - sum(parts.values()), 0.0)
    return {"total_s": total, "parts_s": parts, "share": {k: v / total for k, v in parts.items()} if total else {},
            "phases_s": {"draft": draft_s, "verify": verify_s},
            "calls": {"draft_forward": timer.n[DRAFT_RANGE], "target_forward": timer.n[TARGET_RANGE]}}
