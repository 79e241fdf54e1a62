"""A prompt's images and videos, for the target and for every draft view.

Owns: splitting the target's prompt into text and image / video segments (checked against
the pixel inputs given), encoding them once (features shared with the draft when the towers
match), the draft's own pixel inputs (another family reads the PIL images through its own
processor), captions per image or video, substitutes per video, and the draft rows of every
view. :class:`MultimodalInputs` is a part of :class:`mmspec.SpecDecoder` (it reads the
decoder's target, draft, views, captioner and substitute); it runs no decoding.
"""

from __future__ import annotations

import time

import torch

from mmspec.drafter import EnsembleDrafter
from mmspec.errors import MMSpecError
from mmspec.stats import GenerationStats
from mmspec.timing import sync
from mmspec.views import View, build_row, split_prompt, split_segments

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class MultimodalInputs:
    """The multimodal half of :class:`mmspec.SpecDecoder` (module docstring)."""

    def _layout(self, ids: torch.Tensor, mm: dict):
        """The prompt split into text and image / video segments, checked against the inputs given."""
        pv = mm.get("pixel_values")
        counts = self.target.segment_counts(ids, mm)
        slots = sum(1 for i, t in enumerate(ids.tolist()) if t in self.target.placeholders()
                    and (i == 0 or int(ids[i - 1]) != t))
        if hasattr(self.target, "tokens_per_image") and self.target.placeholders() == {self.target.image_token_id: "image"}:
            layout = split_prompt(ids, self.target.image_token_id, self.target.tokens_per_image)  # LLaVA-1.5 layout
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

    def _encode_vision(self, layout, mm: dict, images, stats: GenerationStats):
        """-> (target features {kind: [[n_i, H_t], ...]}, draft features per view kind or None).

        The draft's features: from the target's tower states (``vision_states``) when its vision
        tower is the target's (LLaVA families), else the draft's own encoding of its own pixel inputs.
        """
        t0 = time.perf_counter()
        target_feats: dict = {}
        draft_feats = None
        self._mm_draft = None
        if layout.n_segments:
            vision_views = [v for v in self.views if v.needs_vision]
            if self.reuse_vision and vision_views:  # one pass of the shared tower: its states for both
                states = self.target.vision_states(mm)
                target_feats = self.target.encode(mm, states)
                draft_feats = {v: (self.draft.encode(mm, states) if v.kind == "multimodal"
                                   else self.draft.pooled(mm, v.n_tokens, states)) for v in vision_views}
            else:
                target_feats = self.target.encode(mm)
                if vision_views:
                    mm_d = self._mm_draft = self._draft_inputs(mm, images, layout)
                    draft_feats = {v: (self.draft.encode(mm_d) if v.kind == "multimodal"
                                       else self.draft.pooled(mm_d, v.n_tokens)) for v in vision_views}
        sync(self.target.device)
        stats.vision_s = time.perf_counter() - t0
        return target_feats, draft_feats

    def _substitute_feats(self, layout, videos, substitutes, stats: GenerationStats) -> dict:
        """{substitute view: {"video": [[n_tokens, H_d], ...]}}: each video's substitute (given, or
        made from its frames) through the draft's substitute encoder; timed as substitute_s."""
        from mmspec.substitutes import Substitute, make_substitute

        t0 = time.perf_counter()
        n = layout.n_videos
        if substitutes is None and videos is None and n:
            raise MMSpecError("the substitute view (E) reads each video's substitute: pass videos=[frames of each "
                              "video] (PIL images) or substitutes=[Substitute...] (e.g. a recorded event stream) to generate()")
        subs = list(substitutes) if substitutes is not None else [
            make_substitute(frames, self.substitute.config.kind, **self.substitute.config.opts) for frames in (videos or [])]
        if len(subs) != n:
            raise MMSpecError(f"{len(subs)} substitutes (or videos) for {n} videos in the prompt; give one per <video>")
        enc = self.substitute.to(self.draft.device)
        feats = [enc(s.tensor.to(self.draft.device) if isinstance(s, Substitute) else s.to(self.draft.device)).to(self.draft.dtype)
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

    def _prefill_draft(self, layout, draft_feats, caption_ids, max_new_tokens: int,
                       stats: GenerationStats, cache=None) -> EnsembleDrafter:
        t0 = time.perf_counter()
        rows = [self._view_row(layout, v, draft_feats, caption_ids) for v in self.views]
        for v, r in zip(self.views, rows):
            self._check_draft_context(v, r.token_ids.shape[0], max_new_tokens)
            r.token_ids = r.token_ids[:-1]  # the last prompt token is pending
        room = self._room(max_new_tokens)
        runner = None
        if self.static and cache is None:
            needed = max(r.token_ids.shape[0] for r in rows) + room
            cache, runner = self._static_cache("draft", self.draft, len(rows), needed)
        drafter = EnsembleDrafter(self.draft, self.weights, target_vocab=self.target.vocab_size, room=room,
                                  static=self.static, cache=cache, step_fn=runner)
        drafter.prefill(rows)
        sync(self.draft.device)
        stats.prefill_draft_s = time.perf_counter() - t0
        return drafter

    # ------------------------------------------------------------------ helpers
    def _view_row(self, layout, view: View, draft_feats, caption_ids):
        feats = None
        if (view.needs_vision or view.needs_substitute) and draft_feats is not None and view in draft_feats:
            by_kind = {k: list(v) for k, v in draft_feats[view].items()}
            feats = [by_kind[kind].pop(0).to(self.draft.device) if by_kind.get(kind) else None
                     for kind in layout.kinds]  # prompt order
        row = build_row(layout, view, image_token_id=self.draft.image_token_id, newline_id=self.newline_id,
                        image_features=feats, caption_ids=caption_ids, video_token_id=self.draft.video_token_id)
        if view.kind == "multimodal" and getattr(self.draft, "mrope", False) and self._mm_draft is not None:
            # the draft reads its images with multimodal RoPE too: the row's own 3-D positions
            row.position_ids = self.draft.prefill_positions(row.token_ids[None], self._mm_draft)[0][:, 0].cpu()
        return row

    def _images_for_captioner(self, images, layout, mm: dict):
        """One picture per segment in prompt order: ``images`` as given, else rebuilt from the
        normalised pixel inputs (an AnyRes image's base view; a video's middle frame)."""
        if images is not None:
            return list(images)
        from PIL import Image

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


def _for_prefix(mm: dict, prefix: torch.Tensor) -> dict:
    """The multimodal inputs with per-token fields (mm_token_type_ids) cut to the prefix."""
    out = dict(mm)
    tt = out.get("mm_token_type_ids")
    if isinstance(tt, torch.Tensor):
        out["mm_token_type_ids"] = tt[..., -prefix.shape[-1] - 1:-1] if tt.shape[-1] > prefix.shape[-1] else tt
    return out
