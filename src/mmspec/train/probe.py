"""Linear probes on a LLaVA vision tower: is a fact the target misses lost in the tower or in the LM?

A probe is a linear classifier on the flattened patch features the projector sees
(``vision_patch_features``: [64, C] per image), trained on world train-split images and scored
on test-split images. If the probe reads a glyph the target's answers get wrong, the information
is in the features and the LM fails to use it; if the probe cannot, the tower is the limit.

Probes (``mmspec train probe``):

- ``sign_word``: the word on a textvqa sign (40 classes);
- ``chart_label``: the label under a chart's first bar (12 classes);
- ``chart_value``: the value above a chart's first bar (10 classes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mmspec.train.pooling import vision_patch_features
from mmspec.world import make_sample, single


@dataclass(frozen=True)
class ProbeResult:
    name: str
    n_classes: int
    train_acc: float
    test_acc: float

    @property
    def chance(self) -> float:
        return 1.0 / self.n_classes


@torch.no_grad()
def patch_features(model, image_processor, images: Sequence, batch: int = 64) -> torch.Tensor:
    """[N, n_patches, C] vision-tower features of ``images``, as the projector receives them."""
    out = []
    for i in range(0, len(images), batch):
        pv = image_processor(list(images[i:i + batch]), return_tensors="pt")["pixel_values"]
        out.append(vision_patch_features(model, pv.to(model.device, model.dtype)).float().cpu())
    return torch.cat(out)


def linear_probe(x_tr: torch.Tensor, y_tr: torch.Tensor, x_te: torch.Tensor, y_te: torch.Tensor,
                 n_classes: int, epochs: int = 300) -> tuple[float, float]:
    """Full-batch AdamW logistic regression on standardised flattened features, from a zero
    init (the problem is convex, so no RNG is involved and the result is deterministic).

    x_*: [N, ...] features; y_*: [N] class ids. Returns (train accuracy, test accuracy).
    """
    x_tr, x_te = x_tr.flatten(1).float(), x_te.flatten(1).float()
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-5
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    head = torch.nn.Linear(x_tr.shape[1], n_classes)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.05)
    for _ in range(epochs):
        loss = torch.nn.functional.cross_entropy(head(x_tr), y_tr)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return ((head(x_tr).argmax(1) == y_tr).float().mean().item(),
                (head(x_te).argmax(1) == y_te).float().mean().item())


def _first_bar(sample) -> tuple[str, int]:
    """(label, value) of a chart's first bar, from its ground-truth caption."""
    m = re.match(r"a bar chart: \w+ (\w+) (\d+)", sample.captions[0])
    if m is None:
        raise ValueError(f"not a chart caption: {sample.captions[0]!r}")
    return m.group(1), int(m.group(2))


PROBES: dict[str, tuple[str, Callable, int]] = {
    "sign_word": ("textvqa", lambda s: single.SIGN_WORDS.index(s.facts["word"]), len(single.SIGN_WORDS)),
    "chart_label": ("chartqa", lambda s: single.CHART_LABELS.index(_first_bar(s)[0]), len(single.CHART_LABELS)),
    "chart_value": ("chartqa", lambda s: _first_bar(s)[1] - 1, 10),
}


def vision_probes(model, image_processor, n_train: int = 3000, n_test: int = 500, seed: int = 0,
                  names: Sequence[str] = tuple(PROBES)) -> list[ProbeResult]:
    """Run the named probes on ``model``'s vision tower (features of each family computed once)."""
    cache: dict[str, tuple[list, list, torch.Tensor, torch.Tensor]] = {}
    results = []
    for name in names:
        family, label_of, n_classes = PROBES[name]
        if family not in cache:
            tr = [make_sample(family, "train", i, seed) for i in range(n_train)]
            te = [make_sample(family, "test", i, seed) for i in range(n_test)]
            cache[family] = (tr, te, patch_features(model, image_processor, [s.images[0] for s in tr]),
                             patch_features(model, image_processor, [s.images[0] for s in te]))
        tr, te, x_tr, x_te = cache[family]
        y_tr = torch.tensor([label_of(s) for s in tr])
        y_te = torch.tensor([label_of(s) for s in te])
        acc_tr, acc_te = linear_probe(x_tr, y_tr, x_te, y_te, n_classes)
        results.append(ProbeResult(name, n_classes, acc_tr, acc_te))
    return results
