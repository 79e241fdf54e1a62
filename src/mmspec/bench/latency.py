"""Latency of the pieces of IbED eq. 1-2: T_p, T_q(batch), T_V(gamma), plus vision / prefill.

Owns the timing protocol: prefill a real KV cache once, then time single forwards on top of it,
each repeat over the same context (a ``DynamicCache`` crops the new positions off again; the
engine's :class:`~mmspec.models.rows.RowCache` keeps no length: every repeat writes the same slots). Reports medians. On CUDA every timed region is bracketed by
``torch.cuda.synchronize``. It knows nothing about speculative decoding itself.

- ``target_decode_s`` (T_p): one-token decode of the target, on the ``DynamicCache`` that
  ``target.generate`` (the baseline) uses.
- ``target_verify_s`` (T_V(gamma)): one target forward over gamma + 1 tokens, on the engine's
  rows (:class:`~mmspec.models.rows.RowCache`: the forward writes at device slots and attends over
  the prompt's slots under a 4-D mask, as the engine's), as are the draft's T_q.
- ``draft_decode_s[b]`` (T_q at batch b): one-token decode of the draft for b rows (an ensemble
  of b views runs as b rows of one batch). The draft is timed on the prompt with its image
  placeholders replaced by a text token, which keeps the context length.
- ``target_vision_s`` / ``target_prefill_s``: image encoding, and the whole prefill (vision
  included), used to split the baseline's wall time.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from mmspec.timing import median_time


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _image_token_id(model: torch.nn.Module) -> int | None:
    cfg = model.config
    for attr in ("image_token_id", "image_token_index"):
        v = getattr(cfg, attr, None)
        if v is not None:
            return int(v)
    return None


class _Rows:
    """The engine's cache for a timing: every row prefilled to ``L`` slots of a :class:`RowCache`
    with room for ``room`` more; :meth:`args` the keywords of a forward over new slots."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, room: int):
        from mmspec.models.rows import RowCache

        self.cache = RowCache(model.config.get_text_config(decoder=True).num_hidden_layers)
        self.cache.ensure(rows, length + room)
        self.rows, self.length = rows, length

    def args(self, start: int, n: int, device: torch.device) -> dict:
        """Each row's slots ``start .. start + n - 1`` written, attending over every slot before."""
        from mmspec.runtime.masks import causal, rows_mask

        write = torch.full((self.rows,), start, dtype=torch.long, device=device)
        span = start + n
        self.cache.begin(0, write, span)
        return {"attention_mask": rows_mask(write, span, causal(n, device)),
                "position_ids": (write[:, None] + torch.arange(n, device=device)).contiguous()}


@torch.inference_mode()
def _prefill(model: torch.nn.Module, room: int | None = None, **inputs: torch.Tensor):
    """room: None -> a DynamicCache (what ``generate`` uses); an int -> the engine's rows
    (:class:`_Rows`) with that many free slots after the prompt."""
    from mmspec.models.base import cache_argument

    ids = inputs["input_ids"]
    if room is None:
        cache = DynamicCache(config=model.config)
        out = model(**inputs, use_cache=True, **{cache_argument(model): cache})
    else:
        cache = _Rows(model, ids.shape[0], ids.shape[1], room)
        args = cache.args(0, ids.shape[1], ids.device)
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        out = model(**inputs, **args, use_cache=True, **{cache_argument(model): cache.cache})
    return cache, out.logits[:, -1:].argmax(-1)  # cache, next token [B, 1]


@torch.inference_mode()
def decode_time(model: torch.nn.Module, input_ids: torch.Tensor, n_new: int, repeats: int,
                engine_cache: bool = False, **extra: torch.Tensor) -> float:
    """Median time of one forward over ``n_new`` new tokens on top of a prefilled cache.

    input_ids: [B, L] prompt; extra: e.g. pixel_values for the prefill only.
    engine_cache: time on the cache mmspec's engine decodes with (its rows, :class:`_Rows`)
    instead of the ``DynamicCache`` that ``generate`` uses.
    """
    from mmspec.models.base import cache_argument

    dev = _device(model)
    input_ids = input_ids.to(dev)
    cache, nxt = _prefill(model, room=n_new if engine_cache else None, input_ids=input_ids,
                          **{k: v.to(dev) for k, v in extra.items()})
    prefix = input_ids.shape[1]
    new = nxt.repeat(1, n_new)  # [B, n_new]
    if engine_cache:  # the same slots every repeat: the rows keep no length to roll back
        kw = {**cache.args(prefix, n_new, dev), cache_argument(model): cache.cache}

        def step() -> None:
            model(input_ids=new, use_cache=True, **kw)
    else:
        pos = torch.arange(prefix, prefix + n_new, device=dev).unsqueeze(0).expand(new.shape[0], -1)
        mask = torch.ones(new.shape[0], prefix + n_new, dtype=torch.long, device=dev)
        kw = {cache_argument(model): cache}

        def step() -> None:
            model(input_ids=new, use_cache=True, position_ids=pos, attention_mask=mask, **kw)
            cache.crop(-n_new)  # transformers 5: a negative count removes that many positions

    step()  # warm-up
    if not engine_cache and cache.get_seq_length() != prefix:
        raise RuntimeError(f"KV cache crop left {cache.get_seq_length()} positions, expected {prefix}")
    return median_time(step, dev, repeats)


@torch.inference_mode()
def vision_time(model: torch.nn.Module, pixel_values: torch.Tensor, repeats: int) -> float | None:
    """Median time of the target's image encoding (vision tower + projector), if exposed."""
    fn = getattr(model, "get_image_features", None)
    if fn is None or pixel_values is None:
        return None
    dev = _device(model)
    pv = pixel_values.to(dev, dtype=next(model.parameters()).dtype)
    try:
        fn(pixel_values=pv)
    except (TypeError, ValueError, RuntimeError):
        return None
    return median_time(lambda: fn(pixel_values=pv), dev, repeats)


@torch.inference_mode()
def prefill_time(model: torch.nn.Module, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    dev = _device(model)
    moved = {k: v.to(dev) for k, v in inputs.items()}
    return median_time(lambda: _prefill(model, **moved), dev, repeats)


def draft_text_ids(input_ids: torch.Tensor, image_token_id: int | None) -> torch.Tensor:
    """[1, L] prompt ids with image placeholders replaced by the first text token (same L)."""
    if image_token_id is None:
        return input_ids
    is_img = input_ids == image_token_id
    if not is_img.any() or is_img.all():
        return input_ids
    filler = input_ids[~is_img][0]
    return input_ids.masked_fill(is_img, int(filler))


def measure_latency(target: torch.nn.Module, draft: torch.nn.Module, inputs: dict[str, torch.Tensor],
                    gamma: int, batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
                    repeats: int = 5) -> dict:
    """All latency numbers of one prompt (the target's processor output, batch 1)."""
    ids = inputs["input_ids"]  # [1, L]
    pixel = inputs.get("pixel_values")
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    t_p = decode_time(target, ids, 1, repeats, **extra)  # the baseline's step: generate's DynamicCache
    t_v = decode_time(target, ids, gamma + 1, repeats, engine_cache=True, **extra)  # what the engine runs
    draft_ids = draft_text_ids(ids, _image_token_id(draft) or _image_token_id(target))
    t_q = {int(b): decode_time(draft, draft_ids.repeat(b, 1), 1, repeats, engine_cache=True) for b in batch_sizes}
    prefill_inputs = {k: v for k, v in inputs.items()}
    return {
        "target_decode_s": t_p,
        "target_verify_s": t_v,
        "draft_decode_s": {str(b): t for b, t in t_q.items()},
        "target_vision_s": vision_time(target, pixel, repeats) if pixel is not None else 0.0,
        "target_prefill_s": prefill_time(target, prefill_inputs, repeats),
        "context_len": int(ids.shape[1]),
        "gamma": gamma,
        "repeats": repeats,
        "device": str(_device(target)),
    }


def predicted_speedup(tau: float, gamma: int, t_q: float, t_p: float, t_v: float) -> float:
    """IbED eq. 2: tau / (gamma * T_q / T_p + T_V(gamma) / T_p)."""
    denom = gamma * t_q / t_p + t_v / t_p
    return tau / denom if denom > 0 else float("nan")
