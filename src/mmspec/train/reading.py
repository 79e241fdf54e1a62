"""Reading pre-training of a LLaVA vision tower: predict which words an image's caption holds.

Our vision tower starts from scratch (there is no pretrained CLIP offline), and training it
through the LM's answer loss alone leaves it unable to read glyphs: a linear probe reads the
word on a sign in 19% of test images (``mmspec.train.probe``). CLIP pre-training is what gives
LLaVA's tower that skill; this module is our small stand-in for it, a caption bag-of-words
objective (predict the set of caption tokens from the image, as tagging pre-training does):

- :class:`ReadingHead`: a linear map from each patch feature (the layer the projector reads,
  ``vision_patch_features``) to vocabulary logits, pooled over the patches by log-mean-exp, so
  a word scores high when some patch says it. The head sees one patch at a time, so what a word
  looks like has to be in that patch's feature, which is what the projector passes to the LM.
- :func:`caption_bags`: the multi-hot targets, [B, V].
- :func:`reading_loss`: softmax cross-entropy of the pooled logits against the bag normalised to
  a distribution (the multi-label softmax loss of Mahajan et al., 2018, "Exploring the limits of
  weakly supervised pretraining"). A per-token binary loss averaged over the 1,347-token
  vocabulary was tried first and learnt nothing of sign words in 48k sign images.
  What this objective does and does not teach the shipped tower is measured in
  docs/embedded-models.md: chart glyphs yes, sign words not (yet).
- :func:`image_caption_stream`: endless (images, captions) batches from the world's train split.
- :func:`train_reading`: the loop (a :class:`~mmspec.train.recipe.StageResult` out; AdamW on the tower and the head, warm-up + cosine, progress
  bar); only the vision tower of the model changes. :func:`word_recall` scores the head on
  held-out images.

The head is thrown away after training: the LM later learns to use the features itself.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from mmspec.errors import MMSpecError
from mmspec.train.config import check_optimiser
from mmspec.train.pooling import vision_patch_features
from mmspec.train.recipe import StageResult, bf16_autocast, optimise


@dataclass(frozen=True)
class ReadingConfig:
    """One reading pre-training run. ``max_seconds`` as in :class:`~mmspec.train.config.StageConfig`:
    the schedule follows ``max(step / steps, elapsed / max_seconds)``; with ``steps=None`` the
    clock alone decides (``max_seconds`` is then required)."""

    lr: float = 3e-4
    steps: int | None = 1000
    batch_size: int = 64
    warmup_ratio: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        check_optimiser("reading pre-training", self.lr, self.steps, self.max_seconds, self.batch_size)


class ReadingHead(torch.nn.Module):
    """Per-patch vocabulary logits pooled over the patches (log-mean-exp)."""

    def __init__(self, feature_dim: int, vocab_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(feature_dim, vocab_size)
        torch.nn.init.zeros_(self.proj.weight)  # uniform scores at the start: no random push into the tower,
        torch.nn.init.zeros_(self.proj.bias)    # and no dependence on the global RNG

    @classmethod
    def for_model(cls, model, vocab_size: int) -> "ReadingHead":
        """A head sized for ``model``'s projector input (the selected vision layers, concatenated)."""
        layers = model.config.vision_feature_layer
        n_layers = len(layers) if isinstance(layers, (list, tuple)) else 1
        return cls(model.config.vision_config.hidden_size * n_layers, vocab_size)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: [B, P, C] patch features -> [B, V] logits of "the caption holds token v".
        Runs in float32 even under bf16 autocast (bf16 logits of ~20 step by 0.125)."""
        with torch.autocast(device_type=feats.device.type, enabled=False):
            per_patch = self.proj(feats.float())  # [B, P, V]
        return torch.logsumexp(per_patch, dim=1) - math.log(feats.shape[1])


def caption_bags(tokenizer, captions: Sequence[str], vocab_size: int) -> torch.Tensor:
    """[B, V] multi-hot: 1 where the caption's tokens (no special tokens) include v."""
    bags = torch.zeros(len(captions), vocab_size)
    for row, caption in enumerate(captions):
        ids = tokenizer(caption, add_special_tokens=False)["input_ids"]
        if not ids:
            raise MMSpecError(f"caption {caption!r} has no tokens; every image needs a caption to read")
        if max(ids) >= vocab_size:
            raise MMSpecError(f"caption {caption!r} has token id {max(ids)} >= the head's vocabulary of {vocab_size}; "
                              "the tokenizer does not match the model")
        bags[row, ids] = 1.0
    return bags


def reading_loss(head: ReadingHead, feats: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of the cross-entropy between softmax(pooled logits) and the bag
    normalised to sum 1. feats: [B, P, C]; bags: [B, V] multi-hot."""
    bags = bags.to(feats.device)
    logp = torch.log_softmax(head(feats), dim=-1)  # [B, V]
    return -((bags / bags.sum(-1, keepdim=True)) * logp).sum(-1).mean()


def image_caption_stream(split: str, n_per_family: int | Mapping[str, int], batch_size: int,
                         seed: int = 0) -> Iterator[tuple[list, list[str]]]:
    """Endless batches of (images, captions) from the split's first ``n_per_family`` samples of
    each family. Each next sample's family is drawn with probability proportional to its count
    (``random.Random(seed)``), so the mix is the same all through training; a family walks
    through its samples in order and starts again when it reaches its count. All images of a
    sample are used. Samples are rendered as they are needed, so memory stays flat. Bad counts
    are refused here, before the first batch is asked for."""
    from mmspec.world import FAMILIES

    counts = {name: n_per_family for name in FAMILIES} if isinstance(n_per_family, int) else dict(n_per_family)
    for name, n in counts.items():
        if name not in FAMILIES:
            raise MMSpecError(f"unknown family {name!r}; use one of {', '.join(FAMILIES)}")
        if n < 0:
            raise MMSpecError(f"family {name!r} has {n} samples; counts must be >= 0")
    if not any(counts.values()):
        raise MMSpecError("no samples to read: every family has 0 samples")
    if batch_size < 1:
        raise MMSpecError(f"batch size must be >= 1; got {batch_size}")
    return _batches(split, {name: n for name, n in counts.items() if n > 0}, batch_size, seed)


def _batches(split: str, counts: dict[str, int], batch_size: int, seed: int) -> Iterator[tuple[list, list[str]]]:
    from mmspec.world import make_sample

    names, weights = list(counts), list(counts.values())
    rng = random.Random(seed)
    next_index = dict.fromkeys(names, 0)
    images: list = []
    captions: list[str] = []
    while True:
        name = rng.choices(names, weights)[0]
        sample = make_sample(name, split, next_index[name], seed)
        next_index[name] = (next_index[name] + 1) % counts[name]
        for image, caption in zip(sample.images, sample.captions, strict=True):
            images.append(image)
            captions.append(caption)
            if len(images) == batch_size:
                yield images, captions
                images, captions = [], []


def val_images(n: int, seed: int = 0, split: str = "val") -> tuple[list, list[str], list[str]]:
    """(images, captions, families): ``n // 8`` images of each of the 8 families (at least one),
    from the split's first samples, so every family weighs alike in :func:`word_recall`."""
    from mmspec.world import FAMILIES, N_IMAGES, make_sample

    if n < 1:
        raise MMSpecError(f"need at least one evaluation image; got {n}")
    per = max(1, n // len(FAMILIES))
    images: list = []
    captions: list[str] = []
    families: list[str] = []
    for name in FAMILIES:
        samples = [make_sample(name, split, i, seed) for i in range(math.ceil(per / N_IMAGES[name]))]
        pairs = [pair for smp in samples for pair in zip(smp.images, smp.captions, strict=True)][:per]
        images += [p[0] for p in pairs]
        captions += [p[1] for p in pairs]
        families += [name] * len(pairs)
    return images, captions, families


def _pixels(image_processor, images: Sequence, device: str) -> torch.Tensor:
    pv = image_processor(list(images), return_tensors="pt")["pixel_values"]  # [B, 3, H, W]
    return pv.to(device)


def train_reading(model, head: ReadingHead, tokenizer, image_processor, batches: Iterator[tuple[list, list[str]]],
                  cfg: ReadingConfig, device: str = "cpu", autocast_bf16: bool = False,
                  progress: bool = True) -> StageResult:
    """Train ``model``'s vision tower (in place) and ``head`` on the reading objective; the
    result's ``samples`` counts images."""
    tower = model.model.vision_tower
    for p in model.parameters():
        p.requires_grad_(False)
    for p in tower.parameters():
        p.requires_grad_(True)
    params = [*tower.parameters(), *head.parameters()]
    model.to(device).train()
    head.to(device).train()
    vocab = head.proj.out_features

    def step_loss() -> tuple[torch.Tensor, int]:
        images, captions = next(batches)
        pv = _pixels(image_processor, images, device)
        bags = caption_bags(tokenizer, captions, vocab)  # [B, V]
        with bf16_autocast(device, autocast_bf16):
            return reading_loss(head, vision_patch_features(model, pv), bags), len(images)

    result = optimise("reading", params, step_loss, cfg.lr, cfg.steps, cfg.max_seconds, cfg.warmup_ratio,
                      cfg.weight_decay, cfg.grad_clip, progress)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    head.eval()
    return result


@torch.no_grad()
def word_recall(model, head: ReadingHead, tokenizer, image_processor, images: Sequence, captions: Sequence[str],
                groups: Sequence[str] | None = None, device: str = "cpu", batch: int = 64) -> dict:
    """How well the head reads held-out images: of each caption's k distinct tokens, the share
    among the head's k highest-scoring tokens (recall at k), over all images -> ``recall`` and,
    with ``groups`` (one label per image, e.g. its family), per group -> ``by_group`` and the
    images per group -> ``images_by_group``. The caller puts ``model`` and ``head`` in eval mode
    on ``device``."""
    if not images:
        raise MMSpecError("no images to score the reading head on")
    vocab = head.proj.out_features
    hits: list[float] = []
    sizes: list[float] = []
    for i in range(0, len(images), batch):
        pv = _pixels(image_processor, images[i:i + batch], device)
        logits = head(vision_patch_features(model, pv).float()).cpu()  # [b, V]
        bags = caption_bags(tokenizer, captions[i:i + batch], vocab)  # [b, V]
        ranks = logits.argsort(dim=-1, descending=True).argsort(dim=-1)  # [b, V]: 0 = best
        k = bags.sum(-1, keepdim=True)  # [b, 1]
        hits += ((ranks < k).float() * bags).sum(-1).tolist()
        sizes += k.squeeze(-1).tolist()
    out: dict = {"recall": sum(hits) / max(sum(sizes), 1.0), "images": len(hits)}
    if groups is not None:
        by: dict[str, list[float]] = {}
        for g, h, n in zip(groups, hits, sizes, strict=True):
            by.setdefault(g, [0.0, 0.0])
            by[g][0] += h
            by[g][1] += n
        out["by_group"] = {g: h / n for g, (h, n) in by.items()}
        out["images_by_group"] = {g: list(groups).count(g) for g in by}
    return out
