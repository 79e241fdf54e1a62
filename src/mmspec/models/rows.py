"""One KV buffer for many sequences, a row each: the caches of the batched engine.

:class:`RowCache` holds every layer's keys and values in ONE tensor ``[n_layers, 2, rows, H_kv,
capacity, D]``. It keeps no lengths: the engine keeps each row's committed length in a device
tensor (:class:`~mmspec.state.BatchState`) and tells each forward, through :meth:`RowCache.begin`,
which rows it runs over (``first .. first + R - 1``), the slot each row writes its first new token
at (``write``, a device tensor [R]) and how many slots its attention spans (``span``: every
query attends over slots ``0 .. span - 1`` under the caller's 4-D mask, :mod:`mmspec.runtime.masks`).
So a forward reads no host value and writes none: the same kernels on the same addresses every
time for a shape, which a CUDA graph can capture.

Rows are the engine's to manage: a request that leaves hands its row back by moving the last
row into it (:meth:`copy_row`); a tree's accepted path moves into place with :meth:`move_paths`
(every row at once, O(path)); what a finished request holds is copied out by :meth:`snapshot`
(for the prefix cache) and a stored prefix copied in by :meth:`write_prefix`. Growing the buffer
(:meth:`ensure`) reallocates it and bumps :attr:`generation`: graphs captured on the old buffer
must then be dropped.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [1, H, n, D]


def full_attention(config) -> bool:
    """Whether every decoder layer of a model with this config attends over all its past slots,
    which a :class:`RowCache` assumes (slots are moved, rows cut back by the engine's lengths):
    False for sliding windows, linear attention or shared KV layers. Token trees, static shapes
    and graphs need it."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return all(t == "full_attention" for t in layer_types)


class _Store:
    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.kv: torch.Tensor | None = None  # [n_layers, 2, rows, H_kv, capacity, D]
        self.want = (0, 0)  # (rows, capacity) to allocate at the first forward (no key seen yet)
        self.first = 0  # this forward's first row
        self.write: torch.Tensor | None = None  # [R] long, device: each row's first write slot
        self.span = 0  # slots every query attends over
        self.generation = 0  # bumped at every (re)allocation


class RowLayer(DynamicLayer):
    """One layer's view of the shared buffer: each row writes at its own slot."""

    def __init__(self, store: _Store, index: int):
        super().__init__()
        self.store = store
        self.index = index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [R, H_kv, n, D] -> the keys/values attended over [R, H_kv, span, D]."""
        st = self.store
        R, _, n, _ = key_states.shape
        if st.kv is None:  # the buffer takes this forward's head count, width and dtype
            rows, cap = st.want
            st.kv = key_states.new_zeros(st.n_layers, 2, rows, key_states.shape[1], cap, key_states.shape[3])
            st.generation += 1
        keys, values = st.kv[self.index, 0], st.kv[self.index, 1]  # [rows, H, cap, D]
        f = st.first
        slots = st.write[:, None] + torch.arange(n, device=keys.device)  # [R, n]
        rows = f + torch.arange(R, device=keys.device)[:, None]  # [R, 1]
        keys[rows, :, slots] = key_states.transpose(1, 2)  # [R, n, H, D]
        values[rows, :, slots] = value_states.transpose(1, 2)
        return keys[f:f + R, :, :st.span], values[f:f + R, :, :st.span]

    def get_seq_length(self) -> int:
        return self.store.span

    def get_max_length(self) -> int:
        return -1 if self.store.kv is None else self.store.kv.shape[4]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("RowCache holds the engine's rows; beam search is not supported")

    batch_select_indices = batch_repeat_interleave


class RowCache(Cache):
    """The KV buffer of a batch of sequences (module docstring)."""

    def __init__(self, n_layers: int):
        store = _Store(n_layers)
        super().__init__(layers=[RowLayer(store, i) for i in range(n_layers)])
        self.store = store

    @property
    def generation(self) -> int:
        return self.store.generation

    @property
    def rows(self) -> int:
        """Rows allocated (0 before the first forward)."""
        return 0 if self.store.kv is None else self.store.kv.shape[2]

    @property
    def capacity(self) -> int:
        """Slots per row (the wanted capacity before the first forward)."""
        return self.store.want[1] if self.store.kv is None else self.store.kv.shape[4]

    def ensure(self, rows: int, capacity: int) -> bool:
        """Room for ``rows`` rows of ``capacity`` slots; the held rows are kept. -> whether the
        buffer was reallocated (graphs captured on the old one are stale)."""
        st = self.store
        if st.kv is None:
            st.want = (max(rows, st.want[0]), max(capacity, st.want[1]))
            return False
        if rows <= st.kv.shape[2] and capacity <= st.kv.shape[4]:
            return False
        old = st.kv
        shape = (*old.shape[:2], max(rows, old.shape[2]), old.shape[3], max(capacity, old.shape[4]), old.shape[5])
        st.kv = old.new_zeros(shape)
        st.kv[:, :, :old.shape[2], :, :old.shape[4]] = old
        st.generation += 1
        return True

    def begin(self, first: int, write: torch.Tensor, span: int) -> None:
        """The next forward runs over rows ``first .. first + len(write) - 1``, row r writing its
        first new token at slot ``write[r]`` (device long), every query attending over slots
        ``0 .. span - 1``."""
        st = self.store
        st.first, st.write, st.span = int(first), write, int(span)

    def move_paths(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Tree compaction in many rows at once: row ``rows[b]``'s slots ``src[b]`` [m] to
        ``dst[b]`` [m] (rows [B], src / dst [B, m] device long). Every source is read before any
        destination is written (paths only move down: a destination never holds a source read
        later); entries past a row's path may copy anything to slots past its new length."""
        kv = self.store.kv
        r = rows[:, None]  # [B, 1]
        moved = kv[:, :, r, :, src]  # [L, 2, B, m, H, D]
        kv[:, :, r, :, dst] = moved

    def copy_row(self, dst: int, src: int) -> None:
        """Row ``src``'s slots into row ``dst`` (a leaving request's row taken by the last one)."""
        if self.store.kv is not None and dst != src:
            self.store.kv[:, :, dst] = self.store.kv[:, :, src]

    def write_prefix(self, row: int, kv: KV) -> int:
        """A stored prefix (per layer [1, H, n, D]) into slots ``0 .. n - 1`` of ``row``. -> n."""
        n = kv[0][0].shape[-2]
        if self.store.kv is None:
            k0 = kv[0][0]
            rows, cap = self.store.want
            self.store.kv = k0.new_zeros(self.store.n_layers, 2, rows, k0.shape[1], cap, k0.shape[3])
            self.store.generation += 1
        for i, (k, v) in enumerate(kv):
            self.store.kv[i, 0, row, :, :n] = k[0]
            self.store.kv[i, 1, row, :, :n] = v[0]
        return n

    def snapshot(self, row: int, start: int, n: int) -> KV | None:
        """A copy of slots ``start .. start + n - 1`` of ``row``, per layer [1, H, n, D] (None:
        n <= 0 or nothing allocated)."""
        kv = self.store.kv
        if kv is None or n <= 0:
            return None
        return [(kv[i, 0, row:row + 1, :, start:start + n].clone(), kv[i, 1, row:row + 1, :, start:start + n].clone())
                for i in range(kv.shape[0])]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.span
