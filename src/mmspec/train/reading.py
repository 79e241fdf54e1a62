"""Reading pre-training of a LLaVA vision tower: the tower learns what an image's caption says.

Our vision tower starts from scratch (there is no pretrained CLIP offline), and training it
through the LM's answer loss alone leaves it unable to read glyphs: a linear probe read the
word on a sign in 19% of test images (``mmspec.train.probe``). CLIP pre-training is what gives
LLaVA's tower that skill; this module is our small stand-in for it, with two objectives:

- contrastive (shipped since v10): :class:`ContrastiveHead` embeds the image (attention-pooled
  patch features) and the caption (mean of its token embeddings), and :func:`contrastive_loss`
  makes each image pick its own caption out of the batch (CLIP's symmetric InfoNCE).
  :func:`caption_retrieval` scores it on held-out images. Two rounds of 2.5 GPU minutes took
  the sign-word probe from 19% to 85% (docs/embedded-models.md);
- bag of words: :class:`ReadingHead`, a linear map from each patch feature (the layer the
  projector reads, ``vision_patch_features``) to vocabulary logits, pooled over the patches by
  log-mean-exp; :func:`caption_bags` the multi-hot targets, [B, V]; :func:`reading_loss` the
  softmax cross-entropy against the bag normalised to a distribution (the multi-label softmax
  loss of Mahajan et al., 2018). It made chart glyphs readable but not sign words (probe 38%):
  the tokens every sign caption shares dominate a softmax over the 1,347-token vocabulary.
  :func:`word_recall` scores it.
- :func:`image_caption_stream`: endless (images, captions) batches from the world's train
  split, optionally prepared in worker processes.
- :func:`train_reading`: the loop (a :class:`~mmspec.train.recipe.StageResult` out; AdamW on the
  tower and the head, warm-up + cosine, progress bar); only the vision tower of the model changes.

The head is thrown away after training: the LM later learns to use the features itself.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from mmspec.errors import MMSpecError
from mmspec.train.config import check_optimiser
from mmspec.train.data import worker_stream
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


def patch_feature_dim(model) -> int:
    """Width of the patch features :func:`vision_patch_features` gives for ``model`` (the
    projector's input: the selected vision layers, concatenated)."""
    layers = model.config.vision_feature_layer
    n_layers = len(layers) if isinstance(layers, (list, tuple)) else 1
    return model.config.vision_config.hidden_size * n_layers


class ReadingHead(torch.nn.Module):
    """Per-patch vocabulary logits pooled over the patches (log-mean-exp)."""

    def __init__(self, feature_dim: int, vocab_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(feature_dim, vocab_size)
        torch.nn.init.zeros_(self.proj.weight)  # uniform scores at the start: no random push into the tower,
        torch.nn.init.zeros_(self.proj.bias)    # and no dependence on the global RNG

    @classmethod
    def for_model(cls, model, vocab_size: int) -> "ReadingHead":
        """A head sized for ``model``'s projector input."""
        return cls(patch_feature_dim(model), vocab_size)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: [B, P, C] patch features -> [B, V] logits of "the caption holds token v".
        Runs in float32 even under bf16 autocast (bf16 logits of ~20 step by 0.125)."""
        with torch.autocast(device_type=feats.device.type, enabled=False):
            per_patch = self.proj(feats.float())  # [B, P, V]
        return torch.logsumexp(per_patch, dim=1) - math.log(feats.shape[1])

    def loss(self, feats: torch.Tensor, tokenizer, captions: Sequence[str]) -> torch.Tensor:
        return reading_loss(self, feats, caption_bags(tokenizer, captions, self.proj.out_features))


class ContrastiveHead(torch.nn.Module):
    """CLIP's objective, small: an image embedding from the patch features and a caption
    embedding from the caption's tokens, trained so that each image picks its own caption out of
    the batch (symmetric InfoNCE with a learnt temperature, :func:`contrastive_loss`).

    Image side: ``heads`` learnt queries attend over the patches (softmax over patches per
    query), the pooled features are concatenated and projected to ``dim``. Text side: the mean
    of the caption's token embeddings, projected. Both unit-normalised. The tokens every sign
    caption shares ("a", "sign", "that", "says") add the same vector to every caption's mean, so
    they cannot tell one caption of the batch from another: the loss can only fall through what
    differs (the word, the number, the colour), the signal the bag-of-words softmax diluted over
    the vocabulary.
    """

    def __init__(self, feature_dim: int, vocab_size: int, dim: int = 256, heads: int = 4):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.zeros(feature_dim, heads))  # uniform attention at the start
        self.image_proj = torch.nn.Linear(feature_dim * heads, dim)
        self.token_embed = torch.nn.EmbeddingBag(vocab_size, dim, mode="mean")
        self.text_proj = torch.nn.Linear(dim, dim)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature
        self.vocab_size = vocab_size

    @classmethod
    def for_model(cls, model, vocab_size: int) -> "ContrastiveHead":
        """A head sized for ``model``'s projector input."""
        return cls(patch_feature_dim(model), vocab_size)

    def embed_images(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: [B, P, C] -> [B, dim], unit norm (float32 even under autocast)."""
        with torch.autocast(device_type=feats.device.type, enabled=False):
            feats = feats.float()
            attn = torch.softmax(feats @ self.queries, dim=1)  # [B, P, H]
            pooled = torch.einsum("bph,bpc->bhc", attn, feats).flatten(1)  # [B, H*C]
            return torch.nn.functional.normalize(self.image_proj(pooled), dim=-1)

    def embed_captions(self, tokenizer, captions: Sequence[str], device) -> torch.Tensor:
        """Captions -> [B, dim], unit norm."""
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in captions]
        for caption, row in zip(captions, ids):
            if not row:
                raise MMSpecError(f"caption {caption!r} has no tokens; every image needs a caption to read")
            if max(row) >= self.vocab_size:
                raise MMSpecError(f"caption {caption!r} has token id {max(row)} >= the head's vocabulary of "
                                  f"{self.vocab_size}; the tokenizer does not match the model")
        flat = torch.tensor([t for row in ids for t in row], device=device)
        offsets = torch.tensor([0] + [len(row) for row in ids[:-1]], device=device).cumsum(0)
        with torch.autocast(device_type=torch.device(device).type, enabled=False):
            return torch.nn.functional.normalize(self.text_proj(self.token_embed(flat, offsets)), dim=-1)

    def similarities(self, feats: torch.Tensor, tokenizer, captions: Sequence[str]) -> torch.Tensor:
        """[B_images, B_captions] scaled cosine similarities, float32 even under bf16 autocast
        (at a scale near 100, bf16 logits would move in steps of about 0.5)."""
        img = self.embed_images(feats)
        txt = self.embed_captions(tokenizer, captions, feats.device)
        with torch.autocast(device_type=feats.device.type, enabled=False):
            return self.logit_scale.clamp(max=math.log(100.0)).exp() * img @ txt.T

    def loss(self, feats: torch.Tensor, tokenizer, captions: Sequence[str]) -> torch.Tensor:
        return contrastive_loss(self.similarities(feats, tokenizer, captions), captions)


def contrastive_loss(logits: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
    """Symmetric InfoNCE over a batch's [B, B] image-caption ``logits``. Images with the same
    caption text are all right answers for each other (soft targets spread over them), so two
    renderings of one caption are not pushed apart."""
    index = {c: i for i, c in enumerate(dict.fromkeys(captions))}
    keys = torch.tensor([index[c] for c in captions], device=logits.device)
    same = (keys[:, None] == keys[None, :]).float()  # [B, B]
    target = same / same.sum(-1, keepdim=True)
    image_to_text = -(target * torch.log_softmax(logits, dim=1)).sum(-1).mean()
    text_to_image = -(target * torch.log_softmax(logits.T, dim=1)).sum(-1).mean()
    return (image_to_text + text_to_image) / 2


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
                         seed: int = 0, workers: int = 0,
                         image_processor=None) -> Iterator[tuple[list | torch.Tensor, list[str]]]:
    """Endless batches of (images, captions) from the split's first ``n_per_family`` samples of
    each family. Each next sample's family is drawn with probability proportional to its count
    (``random.Random(seed)``), so the mix is the same all through training; a family walks
    through its samples in order and starts again when it reaches its count. All images of a
    sample are used. Samples are rendered as they are needed, so memory stays flat. Bad counts
    are refused here, before the first batch is asked for.

    ``workers`` > 0 renders and preprocesses in that many processes (a GPU step outruns one
    core): worker ``w`` walks each family's samples ``w, w + workers, ...`` with its own family
    draws, turns its images into pixel values with ``image_processor``, and the batches come
    round-robin as ``(pixel_values [B, 3, H, W], captions)``."""
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
    if workers < 0 or (workers and image_processor is None):
        raise MMSpecError(f"workers must be >= 0, and > 0 needs the image processor; got {workers}")
    counts = {name: n for name, n in counts.items() if n > 0}
    if workers:
        return worker_stream(functools.partial(_pixel_batches, split, counts, batch_size, seed, workers,
                                               image_processor), workers)
    return _batches(split, counts, batch_size, seed)


def _pixel_batches(split: str, counts: dict[str, int], batch_size: int, seed: int, workers: int, image_processor,
                   w: int) -> Iterator[tuple[torch.Tensor, list[str]]]:
    """Worker ``w`` of ``image_caption_stream(workers=N)``: its share of the samples, as pixel values."""
    for images, captions in _batches(split, counts, batch_size, seed, shard=(w, workers)):
        yield image_processor(images, return_tensors="pt")["pixel_values"], captions


def _batches(split: str, counts: dict[str, int], batch_size: int, seed: int,
             shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[list, list[str]]]:
    """Shard ``(w, n)`` walks samples ``w, w + n, ...`` of each family and starts again at ``w``
    (a family with ``w`` or fewer samples: all of them), so the n shards partition each family;
    families drawn by ``random.Random(seed)`` for shard 0, ``seed * 1000 + w`` for shard w."""
    from mmspec.world import make_sample

    w, n = shard
    names, weights = list(counts), list(counts.values())
    rng = random.Random(seed if w == 0 else seed * 1000 + w)
    own = {name: list(range(w, count, n)) or list(range(count)) for name, count in counts.items()}
    position = dict.fromkeys(names, 0)
    images: list = []
    captions: list[str] = []
    while True:
        name = rng.choices(names, weights)[0]
        sample = make_sample(name, split, own[name][position[name]], seed)
        position[name] = (position[name] + 1) % len(own[name])
        for image, caption in zip(sample.images, sample.captions, strict=True):
            images.append(image)
            captions.append(caption)
            if len(images) == batch_size:
                yield images, captions
                images, captions = [], []


def val_images(n: int, seed: int = 0, split: str = "val") -> tuple[list, list[str], list[str]]:
    """(images, captions, families): ``n // 8`` images of each of the 8 families (at least one),
    from the split's first samples, so every family weighs alike in :func:`word_recall` and
    :func:`caption_retrieval`."""
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


def train_reading(model, head: ReadingHead | ContrastiveHead, tokenizer, image_processor,
                  batches: Iterator[tuple[list | torch.Tensor, list[str]]], cfg: ReadingConfig, device: str = "cpu",
                  autocast_bf16: bool = False, progress: bool = True) -> StageResult:
    """Train ``model``'s vision tower (in place) and ``head`` on the head's objective (the
    caption bag or the contrastive one); the result's ``samples`` counts images. A batch's
    images may come as PIL images or already as pixel values ([B, 3, H, W], from workers)."""
    tower = model.model.vision_tower
    for p in model.parameters():
        p.requires_grad_(False)
    for p in tower.parameters():
        p.requires_grad_(True)
    params = [*tower.parameters(), *head.parameters()]
    model.to(device).train()
    head.to(device).train()

    def step_loss() -> tuple[torch.Tensor, int]:
        images, captions = next(batches)
        pv = images.to(device) if isinstance(images, torch.Tensor) else _pixels(image_processor, images, device)
        with bf16_autocast(device, autocast_bf16):
            return head.loss(vision_patch_features(model, pv), tokenizer, captions), len(captions)

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


@torch.no_grad()
def caption_retrieval(model, head: ContrastiveHead, tokenizer, image_processor, images: Sequence,
                      captions: Sequence[str], groups: Sequence[str], device: str = "cpu", batch: int = 64) -> dict:
    """How well the contrastive head reads held-out images: the share of images whose own caption
    scores highest among the distinct captions of their group (their family: a sign against the
    other signs' captions, so the word, number and colour decide) -> ``recall``, per group ->
    ``by_group`` (chance: 1 / distinct captions of the group), images per group ->
    ``images_by_group``. The caller puts ``model`` and ``head`` in eval mode on ``device``."""
    if not images:
        raise MMSpecError("no images to score the contrastive head on")
    emb = torch.cat([head.embed_images(vision_patch_features(model, _pixels(image_processor, images[i:i + batch],
                                                                            device)))
                     for i in range(0, len(images), batch)])  # [N, dim]
    by: dict[str, list[int]] = {}
    for g in dict.fromkeys(groups):
        rows = [i for i, gi in enumerate(groups) if gi == g]
        options = list(dict.fromkeys(captions[i] for i in rows))
        best = (emb[rows] @ head.embed_captions(tokenizer, options, emb.device).T).argmax(-1).tolist()
        by[g] = [sum(options[b] == captions[i] for b, i in zip(best, rows)), len(rows)]
    hits = sum(h for h, _ in by.values())
    return {"recall": hits / len(images), "images": len(images), "by_group": {g: h / n for g, (h, n) in by.items()},
            "images_by_group": {g: n for g, (_, n) in by.items()}}
