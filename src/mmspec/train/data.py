"""Training data: world samples -> token ids + labels -> right-padded batches.

Owns: the training :class:`Example` (prompt with ``<image>`` markers, answer, images,
captions), caption examples mixed into QA training, text-only copy / lookup / list /
membership practice of random vocabulary words (:func:`copy_examples`), an example's
encoding under a *view* (multimodal with 64 or pooled N image tokens per image, text with
each image -> ``"\\n"``, caption with each image -> its caption), the label mask (-100 on
prompt, image tokens and padding: loss only on the answer and the closing eos), optional
per-token loss weights (more weight on the tokens that state the image's facts,
``Encoder.fact_weight``, on the sentence that decides an existence answer,
``Encoder.cue_weight``, and on a single-image answer's sentences after its first,
``Encoder.answer_weight``), length-grouped shuffled batching and right-pad collation, in this
process or in worker processes (:func:`worker_stream`, for a GPU that outruns one core).

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
import math
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import torch
from PIL import Image

from mmspec.embedded import DEFAULT_CAPTIONER_PROMPT
from mmspec.errors import MMSpecError
from mmspec.world import N_IMAGES
from mmspec.world.core import SENTENCE_END

IGNORE = -100
CAPTIONER_PROMPT = DEFAULT_CAPTIONER_PROMPT  # the embedded captioner's, recorded in its mmspec.json
View = Literal["multimodal", "text", "caption"]
# The world's single-image QA families: their answers read the image out in the first sentence,
# then answer the question from that reading (``Encoder.answer_weight`` weighs the second part).
ANSWERED_FAMILIES = tuple(name for name, n in N_IMAGES.items() if n == 1)


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


def word_pool(tokenizer) -> list[str]:
    """The vocabulary's whole words: alphanumeric tokens of a byte-level BPE that carry the
    leading-space marker and that, written after a space, encode as exactly themselves (so a
    text of them tokenises back to the same ids). Empty for tokenizers without the marker."""
    words = []
    for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if piece is None or not piece.startswith("\u0120") or not piece[1:].isalnum():
            continue
        w = piece[1:]
        if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1:
            words.append(w)
    return words


MEMBER_ITEMS = (1, 4)  # a membership list has as many pairs as a hallucination scene has objects


def copy_examples(tokenizer, n: int, seed: int, min_items: int = 3, max_items: int = 12,
                  lookup_share: float = 0.5, pool: Sequence[str] | None = None,
                  list_share: float = 0.0, member_share: float = 0.0,
                  reading_share: float = 0.0, reading_scenes: float = 0.5,
                  scene_kinds: Sequence[str] | None = None) -> list[Example]:
    """``n`` text-only practice examples for copying from the context, of five kinds:

    * copy: ``USER: Repeat: w1 w2 ... wk ASSISTANT: w1 w2 ... wk`` (k = min_items..2 x max_items);
    * lookup (``floor(lookup_share * n)`` of them, spread evenly):
      ``USER: Pairs: k1 v1, k2 v2, ... What goes with k3? ASSISTANT: k3 goes with v3.``
    * list (``floor(list_share * n)``, spread evenly, or one fewer where a lookup was due at the
      same example): ``USER: Items: f1 k1 v1, f2 k2 v2, ...
      List the pairs. ASSISTANT: k1 is v1, k2 is v2 and k3 is v3.`` The filler word before
      each key is the layout of a chart caption ("brown tea 1, purple egg 5"), where
      previous-token copying lands on the colour instead of the next label.
    * member (``floor(member_share * n)``, spread evenly, or up to two fewer where a lookup or
      list was due at the same example): ``USER: Is there a3 b3? Items: a1 b1, a2 b2.
      ASSISTANT: Yes, a3 b3 is there.`` or ``No, a3 b3 is not there.`` with 1-4 pairs
      (``MEMBER_ITEMS``) built from 2-4 first and 2-4 second words, as a scene's objects share
      a few colours and shapes. Half the questions ask for a listed pair, half for a near miss
      that keeps one word of a listed pair and takes the other from the same few words, where
      possible (3 times in 4) one that is listed in another pair: only a pair-by-pair
      comparison answers those. The verdict is the example's only fact. This is a
      hallucination question's decision ("Is there a red star?" against "a red cross, a blue
      star"), which the world's data alone never taught the target: it answered 0 of 35 "yes"
      existence questions right (docs/embedded-models.md). The question comes first, as there,
      so the comparison must be made while the list is read. (The world's existence answers
      have since named the object again right before deciding, which moved the target's
      verdicts within one CPU stage: docs/results/hallu-2026-11-23/.)
    * reading (``floor(reading_share * n)``, spread evenly, or fewer where another kind was due
      at the same example): a world lookup question with its image taken away
      (:func:`reading_example`), the lookup in the world's own answer form; a share
      ``reading_scenes`` of them (spread evenly) are vqav2 scene lookups, the rest chart values.
      ``scene_kinds`` narrows the scene lookups to some of ``LOOKUP_ORDER``'s kinds (default all):
      ``("position",)`` practises only the place of an object, whose key is two words.

    Words are drawn uniformly from ``pool`` (default :func:`word_pool`), so no prior predicts
    them: only copying or looking up in the prompt lowers the loss. The world's answers need exactly this (a
    chart's labels and values, a sign's word, the asked-about object), and a small LM trained
    on world data alone did not learn it: it states 6% of sign words even when the caption
    that says them is in its prompt (docs/embedded-models.md)."""
    shares = (lookup_share, list_share, member_share, reading_share)
    if (n < 0 or not 1 <= min_items <= max_items or not (min(shares) >= 0 and sum(shares) <= 1)
            or not 0 <= reading_scenes <= 1):
        raise MMSpecError(f"copy_examples needs n >= 0, 1 <= min_items <= max_items, lookup, list, member and "
                          f"reading shares >= 0 with a sum <= 1 and 0 <= reading_scenes <= 1; got {n}, "
                          f"{min_items}, {max_items}, {shares}, {reading_scenes}")
    scene_kinds = scene_kinds_checked(scene_kinds)
    pool = list(word_pool(tokenizer) if pool is None else pool)
    member_pool = sorted({w for w in pool if w.lower() not in ("yes", "no")})  # the verdicts stay unambiguous
    if member_share > 0 and len(member_pool) < 8:
        raise MMSpecError(f"membership practice needs at least 8 distinct words in the pool; got {len(member_pool)}")
    if len(pool) < 2 * max_items:
        raise MMSpecError(f"the tokenizer has only {len(pool)} whole-word tokens; copy practice needs {2 * max_items}")
    rng = random.Random(seed)
    out = []
    n_lookup = n_list = n_member = n_reading = n_scenes = 0
    for i in range(n):
        m = rng.randint(min_items, max_items)
        if n_lookup < math.floor(lookup_share * (i + 1) + 1e-9):  # each kind spread evenly, floor(share * n)
            kind = "lookup"
        elif n_list < math.floor(list_share * (i + 1) + 1e-9):
            kind = "list"
        elif n_member < math.floor(member_share * (i + 1) + 1e-9):
            kind = "member"
        elif n_reading < math.floor(reading_share * (i + 1) + 1e-9):
            kind = "reading"
        else:
            kind = "copy"
        if kind == "copy":
            words = [rng.choice(pool) for _ in range(rng.randint(min_items, 2 * max_items))]
            text = " ".join(words)
            out.append(Example(f"USER: Repeat: {text} ASSISTANT:", text, (), (), "copy", tuple(words)))
        elif kind == "list":
            n_list += 1
            keys = rng.sample(pool, m)
            values = [rng.choice(pool) for _ in keys]
            fillers = [rng.choice(pool) for _ in keys]
            items = ", ".join(f"{f} {k} {v}" for f, k, v in zip(fillers, keys, values))
            said = [f"{k} is {v}" for k, v in zip(keys, values)]
            answer = (", ".join(said[:-1]) + " and " + said[-1]) if len(said) > 1 else said[0]
            out.append(Example(f"USER: Items: {items}. List the pairs. ASSISTANT:", answer + ".", (), (), "list",
                               tuple(keys + values)))
        elif kind == "member":
            n_member += 1
            out.append(_member_example(rng, member_pool))
        elif kind == "reading":
            n_reading += 1
            scene = n_scenes < math.floor(reading_scenes * n_reading + 1e-9)
            n_scenes += scene
            out.append(reading_example(rng, scene=scene, scene_kinds=scene_kinds))
        else:
            n_lookup += 1
            keys = rng.sample(pool, m)
            values = [rng.choice(pool) for _ in keys]
            q = rng.randrange(m)
            pairs = ", ".join(f"{k} {v}" for k, v in zip(keys, values))
            out.append(Example(f"USER: Pairs: {pairs}. What goes with {keys[q]}? ASSISTANT:",
                               f"{keys[q]} goes with {values[q]}.", (), (), "lookup", (values[q],)))
    return out


def scene_kinds_checked(kinds: Sequence[str] | None) -> tuple[str, ...]:
    """``kinds`` checked against the vqav2 lookup kinds (``LOOKUP_ORDER``), repeats dropped; None:
    all of them. Raises MMSpecError naming the known kinds."""
    from mmspec.world.single import LOOKUP_ORDER

    if kinds is None:
        return tuple(LOOKUP_ORDER)
    unknown = [k for k in kinds if k not in LOOKUP_ORDER]
    if unknown or not kinds:
        raise MMSpecError(f"scene lookup kinds must be some of {', '.join(LOOKUP_ORDER)}; got "
                          f"{', '.join(kinds) or 'none'}")
    return tuple(dict.fromkeys(kinds))


def reading_example(rng: random.Random, scene: bool, scene_kinds: Sequence[str] | None = None) -> Example:
    """A world lookup question with its image taken away: ``USER: What is the value of cup?
    ASSISTANT: The chart has 3 bars: egg 4, cup 7 and box 8. So the asked bar is cup 7.``
    (``scene``: a vqav2 lookup instead, "What colour is the star? ... star blue
    top left, ... The answer is star blue."). The reading stands only in the answer and is random,
    so the final value is predictable only by looking it up in what the answer has just written,
    in the world's own answer form. A world stage alone did not teach that lookup in 50 CPU
    minutes; practice in this form, then the world again, did (docs/results/lookup-form-2026-11-23/).
    The one library practice that learned the chart lookup ran at a constant rate
    (``StageConfig.schedule``); three under a cosine decay over 300-400 steps stayed near chance
    on charts (31-38%), and a results-script practice at a constant rate learned it in a jump
    between steps 150 and 200 (docs/results/lookup-target-2026-11-24/). Only specs the world puts in its train split are
    drawn, so no test chart or scene is practised. The only fact is the asked value, which ends
    the answer (:func:`mmspec.train.recipe.final_value_accuracy`). ``scene_kinds``: the scene
    lookup kinds drawn (default all of ``LOOKUP_ORDER``)."""
    from mmspec.world.core import fix_articles, split_of
    from mmspec.world.single import draw_chart, draw_vqa, render_chart, render_vqa

    kinds = scene_kinds_checked(scene_kinds)

    while True:  # rejection: train-split specs of the kinds that look a value up by its key
        family, spec = ("vqav2", draw_vqa(rng)) if scene else ("chartqa", draw_chart(rng))
        if spec.kind in (kinds if scene else ("value",)) and split_of(family, spec) == "train":
            draft = (render_vqa if scene else render_chart)(spec, rng)
            break
    value = str(next(iter(draft.facts.values())))  # the asked fact comes first
    return Example(f"USER: {fix_articles(draft.question)} ASSISTANT:", fix_articles(draft.answer), (), (),
                   "reading", (value,))


def _member_example(rng: random.Random, pool: Sequence[str]) -> Example:
    """One membership question (see :func:`copy_examples`): listed pair or near miss, 50/50.
    ``pool`` holds at least 8 words, all distinct."""
    words = rng.sample(pool, 8)
    firsts, seconds = words[: rng.randint(2, 4)], words[4: 4 + rng.randint(2, 4)]
    k = rng.randint(*MEMBER_ITEMS)  # <= 4 <= len(firsts) * len(seconds): the loop ends
    pairs: list[tuple[str, str]] = []
    while len(pairs) < k:
        pair = (rng.choice(firsts), rng.choice(seconds))
        if pair not in pairs:
            pairs.append(pair)
    if rng.random() < 0.5:
        asked, verdict = rng.choice(pairs), "Yes"
    else:
        base, verdict = rng.choice(pairs), "No"
        misses = [p for p in [(base[0], s) for s in seconds] + [(f, base[1]) for f in firsts] if p not in pairs]
        # mostly both words listed (in other pairs): only a pair-by-pair comparison tells it apart
        crossed = [p for p in misses if p[0] in {q[0] for q in pairs} and p[1] in {q[1] for q in pairs}]
        if crossed and rng.random() < 0.75:
            misses = crossed
        asked = rng.choice(misses) if misses else (base[0], words[3])  # words[3]: never a second word
    listed = ", ".join(f"{a} {b}" for a, b in pairs)
    said = f"{asked[0]} {asked[1]}"
    answer = f"Yes, {said} is there." if verdict == "Yes" else f"No, {said} is not there."
    return Example(f"USER: Is there {said}? Items: {listed}. ASSISTANT:", answer, (), (), "member", (verdict,))


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

    def to(self, device: str | torch.device) -> "Batch":
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

    ``answer_weight`` > 1 weighs every answer token after the first sentence of a single-image
    family's answer (``ANSWERED_FAMILIES``) that many times. The world's single-image answers first
    read the whole image out ("The chart has 4 bars: cup 3, bus 6, ..."), then pick the
    asked fact out of that reading ("The answer is bus 6."). The tower
    reads well; the picking is an in-context lookup the LM gets wrong, and it is a handful of
    tokens per answer, so a uniform loss barely asks for it. The split is at the first sentence
    end, which is where the reading ends in every chart, scene and existence answer; one of the
    three textvqa phrasings of a sign with a number reads it out in two sentences ("The image
    shows a red sign. The top line says STOP and the bottom line shows 13."), and there the
    second is weighed too. Needs a fast tokenizer (character offsets), as the other weights do.
    """

    tokenizer: object
    image_token_id: int = 4
    max_answer_tokens: int | None = None
    fact_weight: float = 1.0
    cue_weight: float = 1.0
    answer_weight: float = 1.0
    _newline: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._newline = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        if self._weighing and not getattr(self.tokenizer, "is_fast", False):
            raise MMSpecError("fact, cue and answer weighting need a fast tokenizer (character offsets); load it "
                              "with use_fast=True or leave fact_weight, cue_weight and answer_weight at 1")

    @property
    def _weighing(self) -> bool:
        return (self.fact_weight, self.cue_weight, self.answer_weight) != (1.0, 1.0, 1.0)

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
                                                    ex.facts, ex.cues, ex.family in ANSWERED_FAMILIES)
        else:
            ended = True
            answer_ids, answer_w = self._answer(" " + ex.answer, ex.facts, ex.cues, ex.family in ANSWERED_FAMILIES)
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
                answered: bool = False) -> tuple[list[int], list[float] | None]:
        """Token ids of ``text`` and, when weighing, per token the largest weight of the whole-word,
        case-blind occurrences of a fact value (``fact_weight``) or cue (``cue_weight``) it
        overlaps, or of the text after the first sentence when ``answered`` (``answer_weight``),
        else 1 (None: no weights)."""
        spans = self._spans(text, facts, cues, answered)
        if not spans:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], self._weights(spans, enc["offset_mapping"])

    def _spans(self, text: str, facts: Sequence[str], cues: Sequence[str],
               answered: bool = False) -> list[tuple[tuple[int, int], float]]:
        """Character spans of the whole-word, case-blind fact and cue occurrences, and of the text
        after the first sentence when ``answered``, with their weight."""
        spans = [(m.span(), weight) for phrases, weight in ((facts, self.fact_weight), (cues, self.cue_weight))
                 if weight != 1.0 for value in phrases
                 for m in re.finditer(r"(?<!\w)" + re.escape(value.lower()) + r"(?!\w)", text.lower())]
        if answered and self.answer_weight != 1.0:
            lead = len(text) - len(text.lstrip())
            first_end = SENTENCE_END.search(text, lead)  # the rule evaluate.final_sentence splits by
            if first_end is not None:
                spans.append(((first_end.end(), len(text)), self.answer_weight))
        return spans

    @staticmethod
    def _weights(spans, offsets) -> list[float]:
        return [max([w for (s2, e2), w in spans if s < e2 and s2 < e], default=1.0) for s, e in offsets]

    def _answer_ids(self, ids: tuple[int, ...], facts: Sequence[str], cues: Sequence[str] = (),
                    answered: bool = False) -> tuple[list[int], list[float] | None]:
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
        spans = self._spans(text, facts, cues, answered)
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


def fixed_batches(examples: Sequence[Example], encoder: "Encoder", image_processor, batch_size: int = 8,
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
    core's data preparation: the training batches here and the reading pre-training's images."""
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
