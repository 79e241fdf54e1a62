"""Drafting views: how the draft model sees the prompt (IbED Sec. 4-5).

* ``multimodal`` (M): the draft's own vision tower + projector features for each image;
* ``text`` (T): each image slot replaced by the newline token (Appendix C);
* ``caption`` (C): each image slot replaced by the tokens of a caption of that image;
* ``pooled:N`` (P): the draft's patch grid 2-D average-pooled to N tokens before its projector.
* ``substitute`` (E): each VIDEO read from a cheaper stand-in (an event stream, fewer frames,
  lower resolution: :mod:`mmspec.substitutes`) through the draft's substitute encoder and
  alignment layer (:mod:`mmspec.models.substitute`); images in the prompt read as in T.

This module parses view specs and turns the target's prompt (image tokens expanded, as the
target's processor makes it) into one draft input row per view. It runs no draft forward:
the :mod:`mmspec.drafter` batches the rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mmspec.errors import MMSpecError

VIEW_KINDS = ("multimodal", "text", "caption", "pooled", "substitute")
LETTERS = {"M": "multimodal", "T": "text", "C": "caption", "P": "pooled", "E": "substitute"}
ALIASES = {"text-only": "text", "textonly": "text", "pool": "pooled", "events": "substitute"}


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

    @property
    def needs_substitute(self) -> bool:
        return self.kind == "substitute"


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
        f"unknown view {token!r}: use multimodal, text, caption, pooled:N, substitute (events), or letters "
        "M, T, C, P, E and combinations such as MTC"
    )


def parse_views(spec: str | Iterable[str]) -> list[View]:
    """'MTC' | 'multimodal' | 'pooled:36' | ['M', 'text', 'pooled:9'] -> [View, ...]."""
    if not isinstance(spec, str) and not (isinstance(spec, Iterable) and all(isinstance(x, str) for x in spec)):
        raise MMSpecError(f"views must be view names or letters (e.g. 'MTC', 'multimodal' or ['M', 'pooled:36']), "
                          f"got {spec!r}")
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
    """The target prompt split into text pieces and vision segments (images, videos), in order.

    ``pieces`` alternate: a 1-D LongTensor of text token ids, or an int segment index;
    ``kinds[i]`` is "image" or "video" for segment i.
    """

    pieces: list  # list[torch.Tensor | int]
    kinds: list[str]

    @property
    def n_images(self) -> int:
        return sum(k == "image" for k in self.kinds)

    @property
    def n_videos(self) -> int:
        return sum(k == "video" for k in self.kinds)

    @property
    def n_segments(self) -> int:
        return len(self.kinds)


def split_prompt(input_ids: torch.Tensor, image_token_id: int, tokens_per_image: int) -> PromptLayout:
    """input_ids [L] with each image expanded to ``tokens_per_image`` image tokens (LLaVA-1.5
    layout). Text pieces are kept on the CPU; the drafter moves the finished rows to its device."""
    input_ids = input_ids.cpu()
    runs = placeholder_runs(input_ids, {image_token_id: "image"})
    counts = []
    for _, kind, n in runs:
        if n % tokens_per_image:
            raise MMSpecError(
                f"an image slot in input_ids has {n} image tokens, not a multiple of the "
                f"target's {tokens_per_image} tokens per image; build the inputs with the "
                "target's own processor (it expands each <image> to the right count)"
            )
        counts += [(kind, tokens_per_image)] * (n // tokens_per_image)
    return split_segments(input_ids, {image_token_id: "image"}, counts)


def placeholder_runs(input_ids: torch.Tensor, placeholders: dict[int, str]) -> list[tuple[int, str, int]]:
    """Maximal runs of one placeholder token: (start, kind, length)."""
    out, i, L = [], 0, input_ids.shape[0]
    ids = input_ids.tolist()
    while i < L:
        j = i
        while j < L and ids[j] == ids[i]:
            j += 1
        if ids[i] in placeholders:
            out.append((i, placeholders[ids[i]], j - i))
        i = j
    return out


def split_segments(input_ids: torch.Tensor, placeholders: dict[int, str],
                   counts: Sequence[tuple[str, int]]) -> PromptLayout:
    """input_ids [L] -> layout, given the placeholder ids (id -> "image" / "video") and each
    segment's kind and token count in prompt order (adjacent segments of one kind share a run,
    so the counts say where one ends). Refuses a prompt whose placeholders the counts do not
    cover exactly."""
    input_ids = input_ids.cpu()
    pieces: list = []
    kinds: list[str] = []
    queue = list(counts)
    cursor = 0
    for start, kind, n in placeholder_runs(input_ids, placeholders):
        if start > cursor:
            pieces.append(input_ids[cursor:start])
        left = n
        while left > 0:
            if not queue or queue[0][0] != kind or queue[0][1] > left:
                want = queue[0] if queue else None
                raise MMSpecError(
                    f"the prompt's {kind} slot at token {start} has {n} {kind} tokens, which do not match the "
                    f"{kind}s given ({'next expected: ' + str(want[1]) + ' ' + want[0] + ' tokens' if want else 'none left'}); "
                    "build input_ids and the pixel inputs with the target's own processor, one image (or video) "
                    "per placeholder, in order")
            k, c = queue.pop(0)
            pieces.append(len(kinds))
            kinds.append(k)
            left -= c
        cursor = start + n
    if cursor < input_ids.shape[0]:
        pieces.append(input_ids[cursor:])
    if queue:
        raise MMSpecError(f"{len(queue)} more image/video input(s) were given than the prompt has slots for; "
                          "give one per placeholder, in order")
    return PromptLayout(pieces=pieces, kinds=kinds)


@dataclass
class ViewRow:
    """One draft input row: token ids with image-feature slots filled in after embedding."""

    token_ids: torch.Tensor  # [L] long
    feature_positions: torch.Tensor  # [n_feat] long: where features replace token embeddings
    features: torch.Tensor | None  # [n_feat, H] in the draft's LM space, or None
    position_ids: torch.Tensor | None = None  # [3, L] multimodal-RoPE ids of the row (None: 0..L-1)


def build_row(
    layout: PromptLayout,
    view: View,
    *,
    image_token_id: int | None,
    newline_id: int | None,
    image_features=None,  # per segment [n_tok_i, H] (a list, or a tensor [n_seg, n_tok, H]) for M / P views
    caption_ids: Sequence[torch.Tensor] | None = None,  # per segment, [len] long, for C
    video_token_id: int | None = None,  # the draft's placeholder for video segments
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
        kind = layout.kinds[piece] if piece < len(layout.kinds) else "image"
        if view.kind == "text" or (view.kind == "substitute" and kind != "video"):
            seg = torch.tensor([newline_id], dtype=torch.long)
        elif view.kind == "caption":
            seg = caption_ids[piece].long()
        else:
            f = image_features[piece]  # [n_tok, H]
            token = video_token_id if (kind == "video" and video_token_id is not None) else image_token_id
            if token is None:  # a text-only draft reading substitute features: any id, its embedding is replaced
                token = newline_id
            seg = torch.full((f.shape[0],), token, dtype=torch.long)
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
