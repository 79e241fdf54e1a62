"""Training data: world samples -> token ids + labels -> right-padded batches.

Owns: the training :class:`Example` (prompt with ``<image>`` markers, answer, images,
captions), caption examples mixed into QA training, an example's encoding under a *view*
(multimodal with 64 or pooled N image tokens per image, text with each image -> ``"\\n"``,
caption with each image -> its caption), the label mask (-100 on prompt, image tokens and
padding: loss only on the answer and the closing eos), optional per-token loss weights (more
weight on the tokens that state the image's facts, ``Encoder.fact_weight``, and on the sentence
that decides an existence answer, ``Encoder.cue_weight``), length-grouped shuffled batching and
right-pad collation, in this process or in worker processes (:func:`worker_stream`, for a GPU
that outruns one core).

A training sequence is ``prompt + " " + answer + eos``, tokenised as the prompt alone (as the
engine tokenises it at inference) followed by the answer's own tokens, so training sees
exactly the token boundary that generation continues from. An example may instead carry its
answer as token ids (``Example.answer_ids``: a target's own greedy answer, for training a draft
on it; :mod:`mmspec.train.distill`), trained on as given, eos only where the target stopped.

Does not know about models or optimisers.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from PIL import Image

from mmspec.errors import MMSpecError
from mmspec.models.captioner import DEFAULT_CAPTIONER_PROMPT

IGNORE = -100
CAPTIONER_PROMPT = DEFAULT_CAPTIONER_PROMPT  # the embedded captioner's, recorded in its mmspec.json
View = Literal["multimodal", "text", "caption"]


@dataclass(frozen=True)
class Example:
    """One supervised example. ``prompt`` holds one ``<image>`` marker per image."""

    prompt: str
    answer: str
    images: tuple[Image.Image, ...]
    captions: tuple[str, ...] = ()
    family: str = ""
    facts: tuple[str, ...] = ()  # image-dependent values the answer states (loss weighting)
    cues: tuple[str, ...] = ()  # answer phrases that commit its verdict (weighed by Encoder.cue_weight)
    # The answer as token ids, eos included where it ended (a target's own greedy answer,
    # :mod:`mmspec.train.distill`); when set it is trained on instead of ``answer``'s tokens.
    answer_ids: tuple[int, ...] | None = None


def example_from_sample(sample) -> Example:
    """A world ``Sample`` as a training example (uses the world's ``training_text``)."""
    from mmspec.world.processor import training_text

    prompt, answer = training_text(sample)
    return Example(prompt, answer, tuple(sample.images), tuple(sample.captions), sample.family,
                   tuple(str(v) for v in sample.facts.values()), tuple(sample.cues))


def caption_examples(sample) -> list[Example]:
    """One captioner example per image of a world sample: image -> its ground-truth caption."""
    return [Example(CAPTIONER_PROMPT, cap, (img,), (cap,), "caption")
            for img, cap in zip(sample.images, sample.captions)]


def mix_in_captions(samples: Sequence, ratio: float, seed: int) -> list[Example]:
    """``round(ratio * len(samples))`` captioner examples (image -> caption) drawn without
    replacement from all images of ``samples``, to add to a QA training set. A caption states
    every fact of its image in a few tokens, so it supervises the vision tower far more densely
    than a verbose answer does (LLaVA's stage-1 data is captions for the same reason)."""
    pool = [ex for s in samples for ex in caption_examples(s)]
    k = min(len(pool), round(ratio * len(samples)))
    idx = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed + 1))[:k].tolist()
    return [pool[i] for i in idx]


@dataclass(frozen=True)
class Encoded:
    """Token ids of one example under one view; ``images`` are those whose tokens are in ids."""

    input_ids: list[int]
    labels: list[int]
    images: tuple[Image.Image, ...]
    weights: list[float] | None = None  # loss weight per position (None: every label weighs 1)


@dataclass
class Batch:
    """A right-padded batch. ``pixel_values`` holds the images of all rows in token order."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    labels: torch.Tensor  # [B, T] long, -100 where no loss
    pixel_values: torch.Tensor | None  # [n_img, 3, 96, 96] or None
    tokens_per_image: int
    loss_weights: torch.Tensor | None = None  # [B, T] float, 0 where no loss; None: uniform

    def to(self, device: str | torch.device) -> Batch:
        pv = None if self.pixel_values is None else self.pixel_values.to(device)
        w = None if self.loss_weights is None else self.loss_weights.to(device)
        return Batch(self.input_ids.to(device), self.attention_mask.to(device),
                     self.labels.to(device), pv, self.tokens_per_image, w)


@dataclass
class Encoder:
    """Encodes examples with one tokenizer; ``image_token_id`` is the ``<image>`` id (4).

    ``fact_weight`` > 1 weighs the loss on the answer tokens that state one of the example's
    facts (whole-word matches, as the fact-recall check counts them) that many times more than
    the other answer tokens: a verbose answer spends most of its tokens on phrasing the LM
    learns quickly, and the few tokens that carry the image's facts are what it must get right.
    Every occurrence is weighed, incidental ones included (the deciding "no" of "Looking for a
    red star: no, ..." besides the final "No" when a fact is ``No``, another object's "right"
    when a position is ``right``). ``cue_weight`` > 1 weighs the example's ``cues`` the same
    way: the whole sentence that decides an existence answer, the object it names included
    ("Looking for a red star: yes, it is in the top left."). A token in both a fact and a cue
    weighs the larger.
    """

    tokenizer: object
    image_token_id: int = 4
    max_answer_tokens: int | None = None
    fact_weight: float = 1.0
    cue_weight: float = 1.0
    _newline: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._newline = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        if self._weighing and not getattr(self.tokenizer, "is_fast", False):
            raise MMSpecError("fact and cue weighting need a fast tokenizer (character offsets); load it "
                              "with use_fast=True or leave fact_weight and cue_weight at 1")

    @property
    def _weighing(self) -> bool:
        return (self.fact_weight, self.cue_weight) != (1.0, 1.0)

    def encode(self, ex: Example, view: View = "multimodal", tokens_per_image: int = 64) -> Encoded:
        if view not in ("multimodal", "text", "caption"):
            raise MMSpecError(f"unknown view {view!r}; use multimodal, text or caption")
        prompt_ids = self.tokenizer(ex.prompt)["input_ids"]
        n_markers = prompt_ids.count(self.image_token_id)
        if n_markers != len(ex.images):
            raise MMSpecError(f"prompt has {n_markers} <image> tokens but {len(ex.images)} images")
        if view == "caption" and len(ex.captions) != len(ex.images):
            raise MMSpecError("caption view needs one caption per image")
        ids: list[int] = []
        image_idx = 0
        for tok in prompt_ids:
            if tok != self.image_token_id:
                ids.append(tok)
                continue
            if view == "multimodal":
                ids.extend([self.image_token_id] * tokens_per_image)
            elif view == "text":
                ids.extend(self._newline)
            else:
                ids.extend(self.tokenizer(ex.captions[image_idx], add_special_tokens=False)["input_ids"])
            image_idx += 1
        eos = self.tokenizer.eos_token_id
        if ex.answer_ids is not None:  # the ids as given: eos only where the answer ended
            ended = len(ex.answer_ids) > 0 and ex.answer_ids[-1] == eos
            answer_ids, answer_w = self._answer_ids(tuple(ex.answer_ids[:-1] if ended else ex.answer_ids),
                                                    ex.facts, ex.cues)
        else:
            ended = True
            answer_ids, answer_w = self._answer(" " + ex.answer, ex.facts, ex.cues)
        if self.max_answer_tokens is not None and len(answer_ids) > self.max_answer_tokens:
            answer_ids = answer_ids[: self.max_answer_tokens]  # cut: no eos, the answer goes on
            answer_w = None if answer_w is None else answer_w[: self.max_answer_tokens]
        elif ended:
            answer_ids = answer_ids + [eos]
            answer_w = None if answer_w is None else answer_w + [1.0]
        labels = [IGNORE] * len(ids) + answer_ids
        weights = None if answer_w is None else [0.0] * len(ids) + answer_w
        images = ex.images if view == "multimodal" else ()
        return Encoded(ids + answer_ids, labels, images, weights)

    def _answer(self, text: str, facts: Sequence[str], cues: Sequence[str] = (),
                ) -> tuple[list[int], list[float] | None]:
        """Token ids of ``text`` and, when weighing, per token the largest weight of the whole-word,
        case-blind occurrences of a fact value (``fact_weight``) or cue (``cue_weight``) it
        overlaps, else 1 (None: no weights)."""
        spans = self._spans(text, facts, cues)
        if not spans:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], self._weights(spans, enc["offset_mapping"])

    def _spans(self, text: str, facts: Sequence[str], cues: Sequence[str]) -> list[tuple[tuple[int, int], float]]:
        """Character spans of the whole-word, case-blind fact and cue occurrences, with their weight."""
        return [(m.span(), weight) for phrases, weight in ((facts, self.fact_weight), (cues, self.cue_weight))
                if weight != 1.0 for value in phrases
                for m in re.finditer(r"(?<!\w)" + re.escape(value.lower()) + r"(?!\w)", text.lower())]

    @staticmethod
    def _weights(spans, offsets) -> list[float]:
        return [max([w for (s2, e2), w in spans if s < e2 and s2 < e], default=1.0) for s, e in offsets]

    def _answer_ids(self, ids: tuple[int, ...], facts: Sequence[str], cues: Sequence[str] = (),
                    ) -> tuple[list[int], list[float] | None]:
        """:meth:`_answer` for an answer given as ids: the same weights, found in the decoded text
        (each token's characters are where its prefix's decoding grows)."""
        ids = list(ids)
        if not self._weighing:
            return ids, None
        pieces = [self.tokenizer.decode([t]) for t in ids]
        text = "".join(pieces)
        if text == self.tokenizer.decode(ids):
            ends = list(itertools.accumulate(len(p) for p in pieces))
        else:  # a token that is not whole characters on its own: decode growing prefixes
            prefixes = [self.tokenizer.decode(ids[:k + 1]) for k in range(len(ids))]
            ends, text = [len(p) for p in prefixes], prefixes[-1]
        spans = self._spans(text, facts, cues)
        return ids, (self._weights(spans, list(zip([0, *ends[:-1]], ends))) if spans else None)


def collate(items: Sequence[Encoded], pad_id: int, image_processor, tokens_per_image: int) -> Batch:
    """Right-pad ``items`` into a :class:`Batch`; labels are -100 on the padding."""
    width = max(len(it.input_ids) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it.input_ids)
        ids[row, :n] = torch.tensor(it.input_ids)
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(it.labels)
    weights = None
    if any(it.weights is not None for it in items):
        weights = torch.zeros((len(items), width))
        for row, it in enumerate(items):
            w = it.weights if it.weights is not None else [float(x != IGNORE) for x in it.labels]
            weights[row, :len(w)] = torch.tensor(w)
    images = [img for it in items for img in it.images]
    pixel_values = None
    if images:
        pixel_values = image_processor(images, return_tensors="pt")["pixel_values"]
    return Batch(ids, mask, labels, pixel_values, tokens_per_image, weights)


def fixed_batches(examples: Sequence[Example], encoder: Encoder, image_processor, batch_size: int = 8,
                  tokens_per_image: int = 64) -> list[Batch]:
    """Held-out ``examples`` (multimodal view) as fixed right-padded batches, in order."""
    encoded = [encoder.encode(ex, "multimodal", tokens_per_image) for ex in examples]
    return [collate(encoded[i:i + batch_size], encoder.tokenizer.pad_token_id, image_processor, tokens_per_image)
            for i in range(0, len(encoded), batch_size)]


def batch_stream(examples: Sequence[Example], encoder: Encoder, image_processor, batch_size: int,
                 generator: torch.Generator, tokens_per_image: int = 64, text_view_prob: float = 0.0,
                 caption_view_prob: float = 0.0, group: int = 16, workers: int = 0) -> Iterator[Batch]:
    """Endless shuffled batches, epoch after epoch, each drawn by ``generator``.

    Length grouping: each run of ``batch_size * group`` shuffled examples is sorted by length
    and cut into batches (less padding), and the batch order is shuffled again. Each example's
    view is drawn per epoch: text with ``text_view_prob``, caption with ``caption_view_prob``,
    else multimodal.

    ``workers`` > 0 builds the batches in that many worker processes (a GPU step is faster than
    one CPU core can tokenise and preprocess a batch): worker ``w`` streams the shard
    ``examples[w::workers]`` with its own generator, seeded from ``generator``, and the batches
    come round-robin from the workers. Still deterministic for a seed and worker count, but a
    different order from ``workers=0``.
    """
    if not examples:
        raise MMSpecError("no training examples")
    if workers < 0 or workers > len(examples):
        raise MMSpecError(f"workers must be between 0 and the number of examples ({len(examples)}); got {workers}")
    has_captions = all(len(ex.captions) == len(ex.images) for ex in examples)  # of the whole set, not a shard
    args = (encoder, image_processor, batch_size)
    kw = dict(tokens_per_image=tokens_per_image, text_view_prob=text_view_prob, caption_view_prob=caption_view_prob,
              group=group, has_captions=has_captions)
    if workers:
        base = int(torch.randint(2**62, (1,), generator=generator))
        return worker_stream(functools.partial(_shard_stream, examples, args, kw, base, workers), workers)
    return _stream(examples, *args, generator, **kw)


def _shard_stream(examples, args, kw, base_seed: int, workers: int, w: int) -> Iterator[Batch]:
    """Worker ``w`` of ``batch_stream(workers=N)``: the stream of ``examples[w::N]``."""
    return _stream(examples[w::workers], *args, torch.Generator().manual_seed(base_seed + w), **kw)


def worker_stream(make: Callable[[int], Iterator], workers: int) -> Iterator:
    """The items of ``make(0)``, ..., ``make(workers - 1)``, each iterator run in its own worker
    process (torch DataLoader), taken round-robin. ``make`` should be a picklable callable (a
    module-level function or a ``functools.partial`` of one). Used where a GPU step outruns one
    core's data preparation (the training batches of :func:`batch_stream`)."""
    if workers < 1:
        raise MMSpecError(f"worker_stream needs workers >= 1; got {workers}")
    return iter(torch.utils.data.DataLoader(_WorkerStreams(make), batch_size=None, num_workers=workers,
                                            collate_fn=_as_is))


def _as_is(item):
    return item


class _WorkerStreams(torch.utils.data.IterableDataset):
    """In DataLoader worker ``w``: ``make(w)``."""

    def __init__(self, make: Callable[[int], Iterator]):
        super().__init__()
        self.make = make

    def __iter__(self) -> Iterator:
        info = torch.utils.data.get_worker_info()
        return self.make(0 if info is None else info.id)


def _stream(examples: Sequence[Example], encoder: Encoder, image_processor, batch_size: int,
            generator: torch.Generator, tokens_per_image: int, text_view_prob: float, caption_view_prob: float,
            group: int, has_captions: bool) -> Iterator[Batch]:
    """The in-process stream of :func:`batch_stream` (``has_captions``: of the whole example set)."""
    while True:
        perm = torch.randperm(len(examples), generator=generator).tolist()
        draws = torch.rand(len(examples), generator=generator).tolist()
        encoded = []
        for i, u in zip(perm, draws):
            view: View = "multimodal"
            if u < text_view_prob:
                view = "text"
            elif u < text_view_prob + caption_view_prob and has_captions:
                view = "caption"
            encoded.append(encoder.encode(examples[i], view, tokens_per_image))
        batches: list[list[Encoded]] = []
        chunk = batch_size * group
        for start in range(0, len(encoded), chunk):
            part = sorted(encoded[start:start + chunk], key=lambda e: len(e.input_ids))
            batches.extend(part[j:j + batch_size] for j in range(0, len(part), batch_size))
        for b in torch.randperm(len(batches), generator=generator).tolist():
            yield collate(batches[b], encoder.tokenizer.pad_token_id, image_processor, tokens_per_image)
