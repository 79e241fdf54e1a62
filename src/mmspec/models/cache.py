"""KV caches for the decode loop: preallocated once, rolled back in O(1), compacted in O(path).

``transformers.DynamicCache`` grows by ``torch.cat`` on every forward, which copies the whole
cache each step, a cost that grows with rows x context (14.5% of a 4-view draft step's CPU time
on a 5-image prompt, docs/perf.md §2). A :class:`DecodeLayer` allocates ``max_len`` positions
per row once and writes each new key/value in place. Two modes:

* **view** (``static=False``, the CPU default): attention sees exactly the filled prefix (a view
  of the buffer), so masks and SDPA fast paths are those of a ``DynamicCache``. A
  ``transformers.StaticLayer`` was measured too: on CPU it was slower for one view, because
  attention then spans the whole buffer and always needs a mask (docs/perf.md §2).
* **static** (``static=True``, the GPU path): the write position is a DEVICE cursor and the
  whole buffer is returned, so every forward of a given input shape runs the same kernels on
  the same addresses whatever the context length: it can be captured once as a CUDA graph and
  replayed (:mod:`mmspec.runtime.graphs`). The caller's 4-D mask hides slots not yet written.

Both keep the host-side ``length`` (positions filled) the engine reasons with. Roll-back is
:func:`set_cache_length` (``DecodeCache.set_length``: host ints and, in static mode, one
``fill_`` of the cursor; ``crop(-n)`` also works, as in transformers 5); a token tree's accepted
path is moved into place with :meth:`DecodeCache.move` (a gather of at most ``depth`` positions,
never a re-prefill).

Only full-attention layers are supported; :func:`new_decode_cache` falls back to a
``DynamicCache`` for anything else (sliding windows, linear attention, KV sharing); such a
cache supports chains only (roll-back by ``crop``, no tree compaction).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs


class _Store:
    """What the layers of one :class:`DecodeCache` share: one buffer holding every layer's keys and
    values (so a roll-back is one ``fill_`` and a tree compaction two kernels, not 4 per layer)
    and, in static mode, one device cursor."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.kv: torch.Tensor | None = None  # [n_layers, 2, B, H_kv, max_len, D]
        self.every_layer_in_kv = True  # False once a layer needed a buffer of its own
        self.cursor: torch.Tensor | None = None  # [1] long (static mode)


class DecodeLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a buffer of ``max_len`` positions."""

    def __init__(self, max_len: int, static: bool = False, store: _Store | None = None, index: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.max_len = int(max_len)
        self.static = static
        self.store = store if store is not None else _Store(1)
        self.index = index  # this layer's place in the store; the last one advances the cursor
        self.length = 0  # host-side count of filled positions
        self.cursor: torch.Tensor | None = None  # [1] long on the device (static mode, shared)
        self._arange: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        st = self.store
        shape = (st.n_layers, 2, B, H, self.max_len, D)
        if st.kv is None and value_states.shape[-1] == D:
            # zeros, not empty, in static mode: a masked slot still enters attention as 0 * value,
            # and uninitialised memory may hold NaN bit patterns
            alloc = torch.zeros if self.static else torch.empty
            st.kv = alloc(shape, dtype=self.dtype, device=self.device)
        if st.kv is not None and st.kv.shape[2:] == shape[2:] and st.kv.dtype == self.dtype and st.kv.device == self.device:
            self.keys, self.values = st.kv[self.index, 0], st.kv[self.index, 1]  # views into the store
        else:  # a layer of another shape (or dispatched elsewhere): a buffer of its own
            alloc = torch.zeros if self.static else torch.empty
            self.keys = alloc(B, H, self.max_len, D, dtype=self.dtype, device=self.device)
            self.values = alloc(B, H, self.max_len, value_states.shape[-1], dtype=self.dtype, device=self.device)
            st.every_layer_in_kv = False  # whole-cache moves must go layer by layer
        if self.static:
            if st.cursor is None:
                st.cursor = torch.full((1,), self.length, dtype=torch.long, device=self.device)
                if self.device.type == "cuda" and not torch.compiler.is_compiling():
                    # fixed addresses: torch.compile's own CUDA graphs may then keep them as they are
                    for t in (st.kv, st.cursor):
                        if isinstance(t, torch.Tensor):
                            torch._dynamo.mark_static_address(t)
            self.cursor = st.cursor
            self._arange = torch.arange(self.max_len, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [B, H_kv, n, D] -> keys/values to attend over: the filled prefix
        [B, H_kv, length + n, D] (view mode) or the whole buffer [B, H_kv, max_len, D] (static)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.static:
            pos = self.cursor + self._arange[:n]  # [n] on the device: capturable
            self.keys.index_copy_(2, pos, key_states)
            self.values.index_copy_(2, pos, value_states)
            if self.index == self.store.n_layers - 1:  # every layer wrote at the same cursor; move it once
                self.cursor.add_(n)
            if not torch.compiler.is_compiling():  # host bookkeeping (a compiled step leaves it to its caller)
                self._grow(n)
            return self.keys, self.values
        end = self._grow(n)
        self.keys[:, :, end - n:end] = key_states
        self.values[:, :, end - n:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, n: int) -> int:
        end = self.length + n
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {self.length} + {n} positions > max_len {self.max_len}")
        self.length = end
        return end

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static:
            return self.max_len, 0
        return super().get_mask_sizes(query_length)

    def set_length(self, length: int) -> None:
        """Keep the first ``length`` positions; the next write goes there (O(1))."""
        self.length = int(length)
        if self.cursor is not None:
            self.cursor.fill_(self.length)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.set_length(max(0, self.length + tokens_to_remove))

    def move(self, src: torch.Tensor, dst: int) -> None:
        """Copy the positions ``src`` [m] long (device) to ``dst .. dst + m - 1``."""
        if not self.is_initialized or src.numel() == 0:
            return
        m = src.shape[0]
        self.keys[:, :, dst:dst + m] = self.keys.index_select(2, src)  # gathered first: overlaps are safe
        self.values[:, :, dst:dst + m] = self.values.index_select(2, src)

    def reset(self) -> None:
        self.set_length(0)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("DecodeLayer holds one decode; beam search is not supported")

    batch_select_indices = batch_repeat_interleave


class DecodeCache(Cache):
    """A ``Cache`` of :class:`DecodeLayer` s with the engine's operations over all layers."""

    def __init__(self, n_layers: int, max_len: int, static: bool = False):
        store = _Store(n_layers)
        super().__init__(layers=[DecodeLayer(max_len=max_len, static=static, store=store, index=i)
                                 for i in range(n_layers)])
        self.store = store
        self.max_len = int(max_len)
        self.static = static

    @property
    def length(self) -> int:
        return self.layers[0].length

    def set_length(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (O(1): host ints and one fill_)."""
        for layer in self.layers:
            layer.length = int(length)
        if self.store.cursor is not None:
            self.store.cursor.fill_(int(length))

    def set_host_length(self, length: int) -> None:
        """Host bookkeeping only: a CUDA-graph replay already moved the device cursor."""
        for layer in self.layers:
            layer.length = int(length)

    def move(self, src: torch.Tensor, dst: int) -> None:
        """Tree compaction: positions ``src`` [m] (device long) to ``dst..dst+m-1`` in every layer."""
        kv = self.store.kv
        if kv is not None and self.store.every_layer_in_kv:  # one gather for all layers, keys and values
            m = src.shape[0]
            kv[..., dst:dst + m, :] = kv.index_select(4, src)
            return
        for layer in self.layers:
            layer.move(src, dst)

    def reset(self) -> None:
        self.set_length(0)


def new_decode_cache(config, max_len: int | None = None, static: bool = False) -> Cache:
    """A cache for one decode, preallocated for ``max_len`` positions when every layer is full
    attention and ``max_len`` is known, else a ``DynamicCache``. Both support ``crop(-n)``;
    only a :class:`DecodeCache` supports ``move`` (token trees) and ``static``."""
    text_cfg = config.get_text_config(decoder=True)
    if max_len is None:
        return DynamicCache(config=config)
    layer_types, _ = get_layer_types_and_kwargs(text_cfg)
    if any(t != "full_attention" for t in layer_types):
        return DynamicCache(config=config)
    return DecodeCache(len(layer_types), int(max_len), static=static)


def supports_trees(cache) -> bool:
    return isinstance(cache, DecodeCache)


def set_cache_length(cache, length: int) -> None:
    """Keep the first ``length`` positions of a decode cache (a DynamicCache: by cropping)."""
    if isinstance(cache, DecodeCache):
        cache.set_length(length)
    else:
        cache.crop(length - cache.get_seq_length())
