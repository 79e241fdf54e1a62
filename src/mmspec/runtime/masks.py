"""The one attention-mask builder of every forward the engine runs.

Every forward (a prefill, a draft round, the target's verify forward) appends ``n`` new tokens
to each of R cache rows: row r's tokens go to slots ``committed[r] .. committed[r] + n - 1`` of
its row, after the slots it already holds, and each new token attends to

* every committed slot of its row (``0 .. committed[r] - 1``), and
* the in-block slots ``committed[r] + j`` (j < S) that ``inblock[r, i, j]`` allows: causal
  order for a run of committed tokens (a prefill, the pending tokens), the node's ancestors
  for a token tree (the tree's nodes written, or fed, in slot order).

A padding query (a row of a shape bucket that holds no request, or a node a tree does not use)
is given ``inblock`` = itself only, so its softmax never sees an empty row; its output is never
read. The mask is built on the device from device tensors in a fixed number of operations,
whatever R: no host value enters it, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch


def rows_mask(committed: torch.Tensor, span: int, inblock: torch.Tensor) -> torch.Tensor:
    """committed [R] long; span: the slots the forward attends over (``>= committed + S`` for
    every row); inblock [R or 1, n, S] bool -> the 4-D mask [R, 1, n, span] bool (True: attend)."""
    R = committed.shape[0]
    _, n, S = inblock.shape
    rel = torch.arange(span, device=committed.device)[None, :] - committed[:, None]  # [R, span]
    inside = (rel >= 0) & (rel < S)
    tree = inblock.expand(R, n, S).gather(-1, rel.clamp(0, S - 1)[:, None, :].expand(R, n, span))  # [R, n, span]
    return ((rel < 0)[:, None, :] | (tree & inside[:, None, :]))[:, None]


def causal(n: int, device: torch.device) -> torch.Tensor:
    """[1, n, n] bool: a run of n new tokens, each seeing the earlier ones and itself."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
