"""Drafting views: how the draft model sees the prompt (IbED Sec. 4-5).

* ``multimodal`` (M): the draft's own vision tower + projector features for each image;
* ``text`` (T): each image slot replaced by the newline token (Appendix C);
* ``caption`` (C): each image slot replaced by the tokens of a caption of that image;
* ``pooled:N`` (P): the draft's patch grid 2-D average-pooled to N tokens before its projector.

This module parses view specs and turns the target's prompt (image tokens expanded, as the
target's processor makes it) into one draft input row per view. It runs no draft forward:
the :mod:`mmspec.drafter` batches the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from mmspec.errors import MMSpecError

VIEW_KINDS = ("multimodal", "text", "caption", "pooled")
LETTERS = {"M": "multimodal", "T": "text", "C": "caption", "P": "pooled"}
ALIASES = {"text-only": "text", "textonly": "text", "pool": "pooled"}


@dataclass(frozen=True)
class View:
    kind: str  # one of VIEW_KINDS
    n_tokens: int | None = None  # pooled only; None = the default (half the grid per side)

    @property
    def name(self) -> str:
        if self.kind == "pooled":
            return f"pooled:{self.n_tokens}" if self.n_tokens else "pooled"
        return self.kind

    @property
    def letter(self) -> str:
        return {v: k for k, v in LETTERS.items()}[self.kind]

    @property
    def needs_vision(self) -> bool:
        return self.kind in ("multimodal", "pooled")


def _parse_one(token: str) -> list[View]:
    t = token.strip()
    low = ALIASES.get(t.lower(), t.lower())
    if low.startswith("pooled"):
        _, _, n = low.partition(":")
        if n and (not n.isdigit() or int(n) == 0):
            raise MMSpecError(f"bad view {token!r}: write pooled:N with N a whole number >= 1, e.g. pooled:144 "
                              "(or pooled / P for the default size)")
        return [View("pooled", int(n) if n else None)]
    if low in VIEW_KINDS:
        return [View(low)]
    if t and all(c in LETTERS for c in t.upper()) and t.isupper():
        return [View(LETTERS[c]) for c in t]
    raise MMSpecError(
        f"unknown view {token!r}: use multimodal, text, caption, pooled:N, or letters M, T, C, P "
        "and combinations such as MTC"
    )


def parse_views(spec: str | Iterable[str]) -> list[View]:
    """'MTC' | 'multimodal' | 'pooled:36' | ['M', 'text', 'pooled:9'] -> [View, ...]."""
    items = [spec] if isinstance(spec, str) else list(spec)
    views: list[View] = []
    for item in items:
        for part in str(item).replace(",", "+").split("+"):
            if part.strip():
                views.extend(_parse_one(part))
    if not views:
        raise MMSpecError("no drafting view given; pass e.g. views='M' or views=('multimodal', 'text')")
    if len(set(views)) != len(views):
        raise MMSpecError(f"view listed twice in {spec!r}; each view may appear once")
    return views


def ensemble_name(views: Sequence[View]) -> str:
    """The paper's short name: 'M', 'MT', 'MTCP', or the long name for a single pooled:N."""
    if len(views) == 1:
        return views[0].name if views[0].kind == "pooled" and views[0].n_tokens else views[0].letter
    return "".join(v.letter for v in views)


# --------------------------------------------------------------------------- prompt layout
@dataclass
class PromptLayout:
    """The target prompt split into text pieces and image slots, in order.

    ``pieces`` alternate: a 1-D LongTensor of text token ids, or an int image index.
    """

    pieces: list  # list[torch.Tensor | int]
    n_images: int


def split_prompt(input_ids: torch.Tensor, image_token_id: int, tokens_per_image: int) -> PromptLayout:
    """input_ids [L] with each image expanded to ``tokens_per_image`` image tokens.
    Text pieces are kept on the CPU; the drafter moves the finished rows to its device."""
    input_ids = input_ids.cpu()
    is_img = input_ids == image_token_id  # [L]
    pieces: list = []
    n_images = 0
    i, L = 0, input_ids.shape[0]
    while i < L:
        j = i
        while j < L and bool(is_img[j]) == bool(is_img[i]):
            j += 1
        if is_img[i]:
            run = j - i
            if run % tokens_per_image:
                raise MMSpecError(
                    f"an image slot in input_ids has {run} image tokens, not a multiple of the "
                    f"target's {tokens_per_image} tokens per image; build the inputs with the "
                    "target's own processor (it expands each <image> to the right count)"
                )
            for _ in range(run // tokens_per_image):
                pieces.append(n_images)
                n_images += 1
        else:
            pieces.append(input_ids[i:j])
        i = j
    return PromptLayout(pieces=pieces, n_images=n_images)


@dataclass
class ViewRow:
    """One draft input row: token ids with image-feature slots filled in after embedding."""

    token_ids: torch.Tensor  # [L] long
    feature_positions: torch.Tensor  # [n_feat] long: where features replace token embeddings
    features: torch.Tensor | None  # [n_feat, H] in the draft's LM space, or None


def build_row(
    layout: PromptLayout,
    view: View,
    *,
    image_token_id: int | None,
    newline_id: int | None,
    image_features: torch.Tensor | None = None,  # [n_img, n_tok, H] for M / P views
    caption_ids: Sequence[torch.Tensor] | None = None,  # per image, [len] long, for C
) -> ViewRow:
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    feats: list[torch.Tensor] = []
    cursor = 0
    for piece in layout.pieces:
        if isinstance(piece, torch.Tensor):
            ids.append(piece)
            cursor += piece.shape[0]
            continue
        if view.kind == "text":
            seg = torch.tensor([newline_id], dtype=torch.long)
        elif view.kind == "caption":
            seg = caption_ids[piece].long()
        else:
            f = image_features[piece]  # [n_tok, H]
            seg = torch.full((f.shape[0],), image_token_id, dtype=torch.long)
            positions.append(torch.arange(cursor, cursor + f.shape[0]))
            feats.append(f)
        ids.append(seg)
        cursor += seg.shape[0]
    token_ids = torch.cat(ids)
    return ViewRow(
        token_ids=token_ids,
        feature_positions=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long),
        features=torch.cat(feats) if feats else None,
    )
