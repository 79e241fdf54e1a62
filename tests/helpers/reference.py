"""What the tests check outputs against: the target's own ``generate`` and a chi-square test."""

from __future__ import annotations

import math

import torch

from mmspec.models.captioner import FixedCaptioner


def reference(target, ids, pv, n):
    out = target.generate(input_ids=ids, pixel_values=pv, attention_mask=torch.ones_like(ids),
                          do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


def captions(n):
    return FixedCaptioner([f"w{10 + i} w{20 + i} w30" for i in range(n)])


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation, cells pooled < 5)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    c = torch.cat([counts[big], counts[~big].sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
