"""A KV cache shared by the requests of a batch, each request one row with its own length.

:class:`RaggedCache` holds ``rows`` rows of ``capacity`` positions for every layer in ONE buffer
([n_layers, 2, rows, H_kv, capacity, D]). Row ``b`` holds its request's committed tokens left-
aligned in slots ``0 .. lengths[b] - 1``; a forward over ``n`` new tokens per row writes row b's
at slots ``lengths[b] .. lengths[b] + n - 1`` (ragged: every row at its own place) and attends
over the slots ``0 .. max(lengths) + n - 1``; the caller's 4-D mask says which of them each row's
queries see (its own committed slots and its own tree nodes, never another row's padding).

Only the first ``active`` rows take part in a forward; a request that leaves hands its row back
by :meth:`RaggedCache.remove` (the last active row is copied into its place: rows stay compact).
A newcomer is prefilled on a :class:`~mmspec.models.cache.DecodeCache` of its own and
:meth:`RaggedCache.join` copies its keys/values into a free row; :meth:`RaggedCache.snapshot`
copies a finished row's out (for the prefix cache). The host-side ``lengths`` are
the truth; roll-back after verification is :meth:`set_row_length` (O(1)), and a tree's accepted
path is moved into place in one row with :meth:`move_row` (O(path)).

**Static mode** (``static=True``, a decoder on static caches / CUDA graphs): the buffer is
allocated once for a bucket of rows and a power-of-two capacity and kept (``release`` keeps it;
a request that needs more grows it, which bumps :attr:`RaggedCache.generation`: graphs captured
on the old buffer are then dropped); a *fixed-shape* forward (:meth:`RaggedCache.begin_forward`
with ``rows=``) runs over a bucket of rows (the rows past the active ones are free: they write
at slot 0 and see only themselves), reads each row's write slot from a buffer of fixed address
and attends over the WHOLE capacity under the caller's 4-D mask, so every forward of one
``(rows, new tokens)`` shape runs the same kernels on the same addresses: capturable as a CUDA
graph (:class:`~mmspec.forwards.StaticRagged`). Prefills stay eager (ragged spans) on the same buffer.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from mmspec.graphs import bucket, capacity_bucket
from mmspec.models.cache import DecodeCache


class _RaggedStore:
    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.kv: torch.Tensor | None = None  # [n_layers, 2, rows, H_kv, capacity, D]
        self.lengths: list[int] = []  # per active row, host side
        self.write: torch.Tensor | None = None  # [active - first] long: this forward's first slot per row (device)
        self.first = 0  # the first row this forward runs over (a batched prefill runs over its newcomers only)
        self.want = (0, 0)  # (rows, capacity) to allocate at the first forward (rows joined before any key was seen)
        self.static = False  # RaggedCache.static: buffers bucketed and kept
        self.span: int | None = None  # a fixed-shape forward attends over this many slots (the capacity); None: ragged
        self.write_buf: torch.Tensor | None = None  # [rows] long, static mode: every fixed-shape forward's write slots
        self.generation = 0  # bumped whenever kv is (re)allocated: addresses captured before are stale


class RaggedLayer(DynamicLayer):
    """One layer's view of the shared buffer; writes every row at its own slot."""

    def __init__(self, store: _RaggedStore, index: int):
        super().__init__()
        self.store = store
        self.index = index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [B, H_kv, n, D] (B = the active rows) -> the keys/values to attend
        over [B, H_kv, max(lengths) + n, D]."""
        st = self.store
        B, _, n, _ = key_states.shape
        if st.kv is None:  # rows joined with nothing to copy: the buffer takes this forward's shapes
            rows, cap = st.want
            if st.static:
                rows, cap = bucket(rows), capacity_bucket(cap)
            st.kv = key_states.new_zeros(st.n_layers, 2, rows, key_states.shape[1], cap, key_states.shape[3])
            st.generation += 1
        keys, values = st.kv[self.index, 0], st.kv[self.index, 1]  # [rows, H, cap, D]
        f = st.first
        slots = st.write[:, None] + torch.arange(n, device=keys.device)  # [B, n]
        rows = f + torch.arange(B, device=keys.device)[:, None]  # [B, 1]
        keys[rows, :, slots] = key_states.transpose(1, 2)  # indexed view [B, n, H, D]
        values[rows, :, slots] = value_states.transpose(1, 2)
        end = max(st.lengths[f:]) + n if st.span is None else st.span  # static: the whole capacity
        return keys[f:f + B, :, :end], values[f:f + B, :, :end]

    def get_seq_length(self) -> int:
        lengths = self.store.lengths[self.store.first:]
        return max(lengths) if lengths else 0

    def get_max_length(self) -> int:
        return -1 if self.store.kv is None else self.store.kv.shape[4]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("RaggedLayer holds one batch of decodes; beam search is not supported")

    batch_select_indices = batch_repeat_interleave


class RaggedCache(Cache):
    """The target's cache for a batch of decodes (module docstring)."""

    def __init__(self, n_layers: int, static: bool = False):
        store = _RaggedStore(n_layers)
        super().__init__(layers=[RaggedLayer(store, i) for i in range(n_layers)])
        self.store = store
        self.static = static  # module docstring: buffers kept, fixed-shape forwards capturable
        store.static = static

    @property
    def generation(self) -> int:
        """Bumped at every (re)allocation of the buffer: graphs captured before it are stale."""
        return self.store.generation

    @property
    def rows_allocated(self) -> int:
        return 0 if self.store.kv is None else self.store.kv.shape[2]

    # ------------------------------------------------------------------ rows
    @property
    def active(self) -> int:
        return len(self.store.lengths)

    @property
    def lengths(self) -> list[int]:
        return list(self.store.lengths)

    @property
    def capacity(self) -> int:
        return 0 if self.store.kv is None else self.store.kv.shape[4]

    def join(self, solo: DecodeCache, length: int, capacity: int) -> list[int]:
        """New rows holding the first ``length`` positions of every row of a request's own
        prefilled cache ``solo`` (the target's: one row; a draft ensemble's: one per view), with
        room for ``capacity`` positions in all; returns their row indices."""
        n_new = solo.layers[0].keys.shape[0]
        first = self._reserve(n_new, capacity, solo.layers[0].keys)
        kv = self.store.kv
        for i, layer in enumerate(solo.layers):
            kv[i, 0, first:first + n_new, :, :length] = layer.keys[:, :, :length]
            kv[i, 1, first:first + n_new, :, :length] = layer.values[:, :, :length]
        self.store.lengths.extend([int(length)] * n_new)
        return list(range(first, first + n_new))

    def add(self, prefixes: list, capacity: int) -> list[int]:
        """New rows for a batched prefill, row i holding ``prefixes[i]`` (per layer keys, values
        [1, H, n_i, D]: a prefix-cache hit; None: empty) at slots ``0 .. n_i - 1``, with room for
        ``capacity`` positions; returns their row indices. With no buffer yet and nothing to copy,
        the buffer is allocated at the next forward, from its keys' shapes."""
        like = next((p[0][0] for p in prefixes if p is not None), None)
        if like is None and self.store.kv is None:
            first = self.active
            self.store.want = (first + len(prefixes), capacity)
        else:
            first = self._reserve(len(prefixes), capacity, like)
        for i, p in enumerate(prefixes):
            for layer, (k, v) in enumerate(p or []):
                n = k.shape[-2]
                self.store.kv[layer, 0, first + i, :, :n] = k[0]
                self.store.kv[layer, 1, first + i, :, :n] = v[0]
        self.store.lengths.extend(0 if p is None else p[0][0].shape[-2] for p in prefixes)
        return list(range(first, first + len(prefixes)))

    def _reserve(self, n_new: int, capacity: int, like: torch.Tensor | None) -> int:
        """Room for ``n_new`` more rows of ``capacity`` positions (grown: the active rows carried
        over); ``like`` [.., H, .., D] gives the shapes of a first buffer. -> the first new row."""
        st = self.store
        need_rows, need_cap = self.active + n_new, max(capacity, self.capacity)
        if st.kv is None or need_rows > st.kv.shape[2] or need_cap > st.kv.shape[4]:
            ref = st.kv[0, 0] if st.kv is not None else like
            rows = max(need_rows, 2 * (0 if st.kv is None else st.kv.shape[2]))
            if self.static:  # a bucket of rows and a power-of-two capacity, so later requests fit as they are
                rows, need_cap = bucket(rows), capacity_bucket(need_cap)
            shape = (st.n_layers, 2, rows, ref.shape[-3], need_cap, ref.shape[-1])
            kv = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
            if st.kv is not None:
                kv[:, :, :self.active, :, :st.kv.shape[4]] = st.kv[:, :, :self.active]
            st.kv = kv
            st.generation += 1
        return self.active

    def ensure(self, rows: int, span: int) -> None:
        """Static mode: room for a fixed-shape forward over ``rows`` rows writing up to slot
        ``span - 1`` (the buffer grown, and its generation bumped, when it has not)."""
        st = self.store
        if st.kv is not None and (rows > st.kv.shape[2] or span > st.kv.shape[4]):
            self._reserve(max(0, rows - self.active), span, None)

    def remove(self, row: int) -> int | None:
        """Hand back ``row``: the last active row moves into it. Returns the index that moved
        (the old last row, now ``row``), or None when ``row`` was the last."""
        st = self.store
        last = self.active - 1
        moved = None
        if row != last:
            if st.kv is not None:
                st.kv[:, :, row] = st.kv[:, :, last]
            st.lengths[row] = st.lengths[last]
            moved = last
        st.lengths.pop()
        return moved

    def release(self) -> None:
        """Free the buffer (no active rows left): the next join allocates again. A static cache
        keeps its buffer (and so the graphs captured on it)."""
        if self.active:
            raise RuntimeError(f"release() with {self.active} active rows")
        if self.static:
            return
        self.store.kv = None
        self.store.write = None
        self.store.want = (0, 0)

    def clear(self) -> None:
        """No active rows (a reused static cache: its buffer stays)."""
        self.store.lengths.clear()
        self.store.first = 0
        if not self.static:
            self.release()

    def set_row_length(self, row: int, length: int) -> None:
        """Keep the first ``length`` positions of ``row`` (O(1))."""
        self.store.lengths[row] = int(length)

    def move_row(self, row: int, src: torch.Tensor, dst: int) -> None:
        """Tree compaction in one row: positions ``src`` [m] (device long) to ``dst .. dst + m - 1``."""
        kv = self.store.kv
        m = src.shape[0]
        kv[:, :, row, :, dst:dst + m] = kv[:, :, row].index_select(3, src)

    def snapshot(self, row: int, start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """A copy of slots ``start .. start + n - 1`` of ``row``, per layer ([1, H, n, D] keys,
        values): what a finished request leaves to the prefix cache. None when n <= 0."""
        kv = self.store.kv
        if kv is None or n <= 0:
            return None
        return [(kv[i, 0, row:row + 1, :, start:start + n].clone(), kv[i, 1, row:row + 1, :, start:start + n].clone())
                for i in range(kv.shape[0])]

    def begin_forward(self, first: int = 0, device=None, rows: int | None = None) -> None:
        """Before a forward over rows ``first ..`` (0: every active row; a batched prefill: its
        newcomers): each row writes at its own length (one small host-to-device copy).
        ``rows`` (static mode): a fixed-shape forward over rows ``0 .. rows - 1`` (the active
        ones and free ones up to the bucket, which write at slot 0), attending over the whole
        capacity; its write slots live in a buffer of fixed address."""
        st = self.store
        st.first = int(first)
        dev = st.kv.device if device is None else device
        if rows is None:
            st.span = None
            st.write = torch.tensor(st.lengths[first:], dtype=torch.long, device=dev)
            return
        if not self.static or first or rows < self.active or rows > self.rows_allocated:
            raise RuntimeError(f"a fixed-shape forward over {rows} rows needs a static cache of at least that many "
                               f"rows and the active {self.active}")
        if st.write_buf is None or st.write_buf.shape[0] != st.kv.shape[2] or st.write_buf.device != st.kv.device:
            st.write_buf = torch.zeros(st.kv.shape[2], dtype=torch.long, device=st.kv.device)
        slots = st.lengths + [0] * (rows - self.active)
        st.write_buf[:rows].copy_(torch.tensor(slots, dtype=torch.long))
        st.write = st.write_buf[:rows]  # the same address at every forward of this many rows
        st.span = st.kv.shape[4]

    def forward_rows(self, first: int, device, run):
        """``run()``, a forward over rows ``first ..`` only (a batched prefill of newcomers: the
        rows decoding meanwhile take no part)."""
        self.begin_forward(first, device)
        try:
            return run()
        finally:
            self.store.first = 0

    def set_lengths(self, lengths: list[int]) -> None:
        """Every active row's length at once (the draft side sets them before each forward)."""
        if len(lengths) != self.active:
            raise RuntimeError(f"{len(lengths)} lengths for {self.active} active rows")
        self.store.lengths[:] = [int(x) for x in lengths]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].get_seq_length()


class RowGroup:
    """A request's rows of a shared :class:`RaggedCache`, as its drafter sees its own cache: the
    tree compaction (``move``) and the roll-back (``crop``, through ``set_cache_length``) of
    :class:`~mmspec.drafter.TreeDrafter`. ``rows()`` gives the rows now (they move as others leave)."""

    def __init__(self, cache: RaggedCache, rows, length: int):
        self.cache = cache
        self.rows = rows  # () -> list[int]
        self.length = int(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, n: int) -> None:
        self.length = max(0, self.length + n)  # bookkeeping only: each forward says where rows write

    def move(self, src: torch.Tensor, dst: int) -> None:
        for row in self.rows():
            self.cache.move_row(row, src, dst)
