"""A prompt's images and videos, for the target and for every draft view.

Owns: splitting the target's prompt into text and image / video segments (checked against
the pixel inputs given), encoding them once (features shared with the draft when the towers
match), the draft's own pixel inputs (another family reads the PIL images through its own
processor), captions per image or video, substitutes per video, and the draft rows of every
view. :class:`MultimodalPrompt` is owned by :class:`mmspec.SpecDecoder` and holds exactly what
it reads (the adapters, the views, the tokenizer, the processors, the captioner, the substitute
encoder); it runs no decoding and knows nothing of caches, trees or acceptance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from mmspec.drafting.views import PromptLayout, View, ViewRow, build_row, split_prompt, split_segments
from mmspec.errors import MMSpecError
from mmspec.models.base import ModelAdapter
from mmspec.stats import GenerationStats
from mmspec.substitutes import Substitute, make_substitute
from mmspec.timing import sync

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class EncodedPrompt:
    """One prompt's multimodal side, made once per :meth:`MultimodalPrompt.encode` call."""

    layout: PromptLayout  # text and image / video segments, in prompt order
    target_feats: dict  # {kind: [[n_i, H_t], ...]}: the target's features per segment kind
    draft_feats: dict | None = None  # {view: {kind: [[n_i, H_d], ...]}}: per vision / substitute view
    draft_inputs: dict | None = None  # the draft's own pixel inputs (when it encodes them itself)
    caption_ids: list[torch.Tensor] | None = None  # one [n] long per segment, for the caption view


@dataclass
class MultimodalPrompt:
    """The multimodal half of a decode (module docstring)."""

    target: ModelAdapter
    draft: ModelAdapter | None  # None: a feature-level head drafts (no views)
    views: list[View]
    tokenizer: object
    newline_id: int | None = None
    reuse_vision: bool = False  # the draft's vision tower is the target's: one pass, states shared
    processor: object = None  # the target's: turns pixel_values back into pictures for the captioner
    draft_processor: object = None  # the draft's own, when it reads images another way
    captioner: object = None
    substitute: torch.nn.Module | None = None  # the draft's substitute encoder (view E)

    def encode(self, layout: PromptLayout, mm: dict, stats: GenerationStats, images: Sequence | None = None,
               captions: Sequence[str] | None = None, videos: Sequence | None = None,
               substitutes: Sequence | None = None) -> EncodedPrompt:
        """Vision (each image / video encoded once), captions (once per segment), substitutes
        (once per video), each timed into ``stats``."""
        enc = self._encode_vision(layout, mm, images, stats)
        enc.caption_ids = self._caption_ids(layout, mm, images, captions, stats)
        if any(v.needs_substitute for v in self.views):
            enc.draft_feats = {**(enc.draft_feats or {}), **self._substitute_feats(layout, videos, substitutes, stats)}
        return enc

    def rows(self, enc: EncodedPrompt) -> list[ViewRow]:
        """The draft's prompt row of every view, whole (the decoder holds back the pending token)."""
        return [self._view_row(enc, v) for v in self.views]

    def layout(self, ids: torch.Tensor, mm: dict) -> PromptLayout:
        """The prompt split into text and image / video segments, checked against the inputs given."""
        pv = mm.get("pixel_values")
        counts = self.target.segment_counts(ids, mm)
        slots = sum(1 for i, t in enumerate(ids.tolist()) if t in self.target.placeholders()
                    and (i == 0 or int(ids[i - 1]) != t))
        if hasattr(self.target, "tokens_per_image") and self.target.placeholders() == {self.target.image_token_id: "image"}:
            layout = split_prompt(ids, self.target.image_token_id, self.target.tokens_per_image)  # LLaVA-1.5 layout
            if pv is not None and (not isinstance(pv, torch.Tensor) or pv.dim() != 4):
                shape = tuple(pv.shape) if isinstance(pv, torch.Tensor) else type(pv).__name__
                raise MMSpecError(f"pixel_values must be a tensor [n_images, 3, H, W] for this target, got {shape}; "
                                  "pass the processor's pixel_values (one image: add its batch dimension, pv[None])")
            vc = self.target.model.config.vision_config
            want = (getattr(vc, "num_channels", 3), vc.image_size, vc.image_size)
            if pv is not None and tuple(pv.shape[1:]) != want:
                raise MMSpecError(f"pixel_values holds images of {' x '.join(map(str, pv.shape[1:]))} but this target's "
                                  f"vision tower reads {' x '.join(map(str, want))} (channels x height x width); "
                                  "pass the target's own processor's pixel_values")
            n_pix = 0 if pv is None else int(pv.shape[0])
            if layout.n_images != n_pix:
                raise MMSpecError(
                    f"the prompt has {layout.n_images} image slot(s) but {n_pix} image(s) were given "
                    "in pixel_values; give one image per <image> in the prompt, in order"
                )
        else:
            if slots and not counts:
                raise MMSpecError(f"the prompt has {slots} image/video slot(s) but no pixel inputs were given; "
                                  "pass the processor's output (pixel_values, ...) for every <image> / <video>")
            layout = split_segments(ids, self.target.placeholders(), counts)
        if int(ids[-1]) in self.target.placeholders():
            raise MMSpecError("the prompt ends with an image; end it with text (e.g. '... ASSISTANT:')")
        return layout

    def _encode_vision(self, layout: PromptLayout, mm: dict, images, stats: GenerationStats) -> EncodedPrompt:
        """The target's features per segment kind and the draft's per vision view: from the
        target's tower states (``vision_states``) when its vision tower is the target's (LLaVA
        families), else the draft's own encoding of its own pixel inputs."""
        t0 = time.perf_counter()
        enc = EncodedPrompt(layout=layout, target_feats={})
        if layout.n_segments:
            vision_views = [v for v in self.views if v.needs_vision]
            if self.reuse_vision and vision_views:  # one pass of the shared tower: its states for both
                states = self.target.vision_states(mm)
                enc.target_feats = self.target.encode(mm, states)
                enc.draft_feats = {v: (self.draft.encode(mm, states) if v.kind == "multimodal"
                                       else self.draft.pooled(mm, v.n_tokens, states)) for v in vision_views}
            else:
                enc.target_feats = self.target.encode(mm)
                if vision_views:
                    mm_d = enc.draft_inputs = self._draft_inputs(mm, images, layout)
                    enc.draft_feats = {v: (self.draft.encode(mm_d) if v.kind == "multimodal"
                                           else self.draft.pooled(mm_d, v.n_tokens)) for v in vision_views}
        sync(self.target.device)
        stats.vision_s = time.perf_counter() - t0
        return enc

    def check_substitutes(self, layout: PromptLayout, videos, substitutes) -> None:
        """The substitute view's inputs, checked before anything is encoded: one per video of the
        prompt, each a :class:`~mmspec.substitutes.Substitute` of the encoder's kind (or its
        tensor) shaped [S, C, H, W] with the encoder's steps and channels."""
        n = layout.n_videos
        if substitutes is not None and videos is not None:
            raise MMSpecError("both videos= and substitutes= were given to the substitute view (E); it reads one: "
                              "pass the recorded substitutes, or the frames to make them from")
        if substitutes is None and videos is None and n:
            raise MMSpecError("the substitute view (E) reads each video's substitute: pass videos=[frames of each "
                              "video] (PIL images) or substitutes=[Substitute...] (e.g. a recorded event stream) to generate()")
        given = substitutes if substitutes is not None else videos
        if isinstance(given, (torch.Tensor, Substitute)):  # one video's, not a list of them
            raise MMSpecError("substitutes= (or videos=) takes a list, one entry per <video> of the prompt; "
                              "wrap a single one in a list")
        count = 0 if given is None else len(given)
        if count != n:
            raise MMSpecError(f"{count} substitutes (or videos) for {n} videos in the prompt; give one per <video>")
        cfg = self.substitute.config
        for i, s in enumerate(substitutes or []):
            t = s.tensor if isinstance(s, Substitute) else s
            if not isinstance(t, torch.Tensor):
                raise MMSpecError(f"substitute {i} is a {type(s).__name__}; pass Substitute objects "
                                  "(mmspec.substitutes: Substitute.from_events, make_substitute) or tensors [S, C, H, W]")
            if isinstance(s, Substitute) and s.kind != cfg.kind:
                raise MMSpecError(f"substitute {i} is of kind {s.kind!r} but the draft's substitute encoder reads "
                                  f"{cfg.kind!r}; make it with make_substitute(frames, {cfg.kind!r}, ...)")
            if t.dim() != 4 or tuple(t.shape[:2]) != (cfg.steps, cfg.channels) or 0 in t.shape:
                raise MMSpecError(f"substitute {i} has shape {tuple(t.shape)}; the draft's substitute encoder reads "
                                  f"[S, C, H, W] = [{cfg.steps}, {cfg.channels}, H, W] ({cfg.kind}, made with "
                                  f"{cfg.opts or 'the default options'}): one video's, no batch dimension")

    def _substitute_feats(self, layout: PromptLayout, videos, substitutes, stats: GenerationStats) -> dict:
        """{substitute view: {"video": [[n_tokens, H_d], ...]}}: each video's substitute (given, or
        made from its frames) through the draft's substitute encoder; timed as substitute_s."""
        t0 = time.perf_counter()
        self.check_substitutes(layout, videos, substitutes)
        cfg = self.substitute.config
        subs = list(substitutes) if substitutes is not None else [
            make_substitute(frames, cfg.kind, **cfg.opts) for frames in (videos or [])]
        enc = self.substitute.to(self.draft.device)
        feats = [enc((s.tensor if isinstance(s, Substitute) else s).to(self.draft.device)).to(self.draft.dtype)
                 for s in subs]
        sync(self.draft.device)
        stats.substitute_s = time.perf_counter() - t0
        return {v: {"video": feats, "image": []} for v in self.views if v.needs_substitute}

    def _draft_inputs(self, mm: dict, images, layout) -> dict:
        """The draft's own pixel inputs: the target's when the draft reads them the same way
        (same family), else its processor's on the PIL images. Only its image processor runs: the
        prompt is the target's, and a full processor refuses images without their placeholders."""
        if self.draft_processor is None:
            return {k: (v.to(self.draft.device) if isinstance(v, torch.Tensor) else v) for k, v in mm.items()}
        if layout.n_videos:
            raise MMSpecError("a draft with a processor of its own (draft_processor=...) reads images only, and this "
                              "prompt has a video; use the text or caption view for it")
        if images is None or len(images) != layout.n_images:
            raise MMSpecError(f"this draft has a processor of its own (draft_processor=...): pass images=[PIL images], "
                              f"one per image of the prompt ({layout.n_images}), to generate() so that it can read "
                              "them its own way")
        image_processor = getattr(self.draft_processor, "image_processor", None) or self.draft_processor
        enc = image_processor(list(images), return_tensors="pt")
        return {k: v.to(self.draft.device) for k, v in enc.items()
                if isinstance(v, torch.Tensor) and k in self.draft.mm_keys}

    def _caption_ids(self, layout, mm: dict, images, captions, stats: GenerationStats):
        """One token-id tensor per segment (image or video, in prompt order) for the caption view
        (None when no view needs them)."""
        if not (any(v.kind == "caption" for v in self.views) and layout.n_segments):
            return None
        t0 = time.perf_counter()
        caps = list(captions) if captions is not None else self.captioner.caption(
            self._images_for_captioner(images, layout, mm))
        if len(caps) != layout.n_segments:
            videos = f" and {layout.n_videos} videos" if layout.n_videos else ""
            raise MMSpecError(f"{len(caps)} captions for {layout.n_images} images{videos}; give one caption per "
                              f"image{' or video, in prompt order' if videos else ''}")
        caption_ids = [torch.tensor(self.tokenizer.encode(" " + c.strip(), add_special_tokens=False)
                                    or [self.newline_id], dtype=torch.long) for c in caps]
        stats.caption_s = time.perf_counter() - t0
        return caption_ids

    # ------------------------------------------------------------------ helpers
    def _view_row(self, enc: EncodedPrompt, view: View) -> ViewRow:
        layout, feats = enc.layout, None
        if (view.needs_vision or view.needs_substitute) and enc.draft_feats is not None and view in enc.draft_feats:
            by_kind = {k: list(v) for k, v in enc.draft_feats[view].items()}
            feats = [by_kind[kind].pop(0).to(self.draft.device) if by_kind.get(kind) else None
                     for kind in layout.kinds]  # prompt order
        row = build_row(layout, view, image_token_id=self.draft.image_token_id, newline_id=self.newline_id,
                        image_features=feats, caption_ids=enc.caption_ids, video_token_id=self.draft.video_token_id)
        if view.kind == "multimodal" and getattr(self.draft, "mrope", False) and enc.draft_inputs is not None:
            # the draft reads its images with multimodal RoPE too: the row's own 3-D positions
            row.position_ids = self.draft.prefill_positions(row.token_ids[None], enc.draft_inputs)[0][:, 0].cpu()
        return row

    def _images_for_captioner(self, images, layout, mm: dict):
        """One picture per segment in prompt order: ``images`` as given, else rebuilt from the
        normalised pixel inputs (an AnyRes image's base view; a video's middle frame)."""
        if images is not None:
            return list(images)
        ip = getattr(self.processor, "image_processor", None)
        mean = torch.tensor(getattr(ip, "image_mean", None) or CLIP_MEAN).view(3, 1, 1)
        std = torch.tensor(getattr(ip, "image_std", None) or CLIP_STD).view(3, 1, 1)
        frames = {"image": _caption_frames(mm.get("pixel_values"), "image"),
                  "video": _caption_frames(mm.get("pixel_values_videos"), "video")}
        out = []
        for pv in (frames[kind].pop(0).detach().float().cpu() for kind in layout.kinds):  # [3, H, W] normalised
            x = ((pv * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            out.append(Image.fromarray(x))
        return out


def _caption_frames(x: torch.Tensor | None, kind: str) -> list[torch.Tensor]:
    """Normalised pictures [3, H, W] to caption: each image of [n, 3, H, W], the base view of each
    AnyRes image of [n, views, 3, H, W], the middle frame of each video of [n, frames, 3, H, W]."""
    if x is None:
        return []
    if kind == "image" and x.dim() == 4:
        return list(x)
    if x.dim() == 5:
        return list(x[:, 0] if kind == "image" else x[:, x.shape[1] // 2])
    raise MMSpecError(f"the caption view cannot turn these {kind} inputs (shape {tuple(x.shape)}) back into pictures; "
                      "pass images=[PIL images] to generate(), one per image or video in prompt order")


def for_prefix(mm: dict, prefix: torch.Tensor) -> dict:
    """The multimodal inputs with per-token fields (mm_token_type_ids) cut to the prefix."""
    out = dict(mm)
    tt = out.get("mm_token_type_ids")
    if isinstance(tt, torch.Tensor):
        out["mm_token_type_ids"] = tt[..., -prefix.shape[-1] - 1:-1] if tt.shape[-1] > prefix.shape[-1] else tt
    return out
