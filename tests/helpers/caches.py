"""Cache helpers only the tests use: :func:`kv_rows` reads a batch row's slots straight out of the
one buffer of a :class:`mmspec.models.rows.RowCache`, to check what ``mmspec.prefix_cache``
stores against the buffer itself."""

from __future__ import annotations

import torch

from mmspec.models.rows import KV


def kv_rows(kv: torch.Tensor, row: int, start: int, n: int, copy: bool = True) -> KV:
    """Slots ``start .. start + n - 1`` of row ``row`` of a one-buffer cache ``kv`` [n_layers, 2,
    rows, H, capacity, D] (a :class:`RowCache`'s ``store.kv``: the engine's rows), per
    layer [1, H, n, D]: copies unless ``copy=False``."""
    out = [(kv[i, 0, row:row + 1, :, start:start + n], kv[i, 1, row:row + 1, :, start:start + n])
           for i in range(kv.shape[0])]
    return [(k.clone(), v.clone()) for k, v in out] if copy else out
