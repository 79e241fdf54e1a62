"""KV caches for the decode loop: preallocated caches whose roll-back is O(1).

``transformers.DynamicCache`` grows by ``torch.cat`` on every forward, which copies the whole
cache each step, a cost that grows with rows x context: with an ensemble of views it was 14.5%
of a 4-view draft step's CPU time on a 5-image prompt (``bench/profile_draft_step.py``,
docs/perf.md §2). The layers here allocate ``max_len`` positions per
row once and write each new key/value in place; rolling back rejected drafts only moves the
write position back (the next forward overwrites what was dropped).

:class:`PreallocatedLayer` is a ``DynamicLayer`` whose attention sees exactly the filled prefix
(a view of the buffer), so masks and SDPA fast paths are those of a ``DynamicCache``. (A
``transformers.StaticLayer`` with roll-back was measured too: on CPU it was slower for one view,
because attention then spans the whole buffer and always needs a mask; docs/perf.md §2.)

Only full-attention layers are supported; :func:`new_decode_cache` falls back to a
``DynamicCache`` for anything else (sliding windows, linear attention, KV sharing).
"""

from __future__ import annotations

from transformers import Cache, DynamicCache
import torch
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a buffer of ``max_len`` positions: ``update``
    writes in place and returns views of the filled prefix; ``crop(-n)`` moves the end back."""

    def __init__(self, max_len: int, **kwargs):
        super().__init__(**kwargs)
        self.max_len = int(max_len)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H = key_states.shape[:2]
        self.keys = key_states.new_empty(B, H, self.max_len, key_states.shape[-1])  # [B, H_kv, max_len, D]
        self.values = value_states.new_empty(B, H, self.max_len, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [B, H_kv, n, D] -> all keys/values so far [B, H_kv, length + n, D] (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {self.length} + {n} positions > max_len {self.max_len}")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_len

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PreallocatedLayer holds one decode; beam search is not supported")

    batch_select_indices = batch_repeat_interleave


def new_decode_cache(config, max_len: int | None = None) -> Cache:
    """A cache for one decode, preallocated for ``max_len`` positions when every layer is full
    attention and ``max_len`` is known, else a ``DynamicCache``. Both support ``crop(-n)``."""
    text_cfg = config.get_text_config(decoder=True)
    if max_len is None:
        return DynamicCache(config=config)
    layer_types, _ = get_layer_types_and_kwargs(text_cfg)
    if any(t != "full_attention" for t in layer_types):
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(max_len=int(max_len)) for _ in layer_types])
