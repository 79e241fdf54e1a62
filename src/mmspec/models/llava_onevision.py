"""Adapter for HF ``LlavaOnevisionForConditionalGeneration`` (LLaVA-OneVision).

LLaVA-NeXT's AnyRes images (:mod:`mmspec.models.llava_next`: tiles, unpadding, image-newline),
with what this family does differently:

* **Tiles only for a lone image.** With ``batch_num_images`` (the processor's output) an image
  is tiled only when it is its prompt's only image; in a multi-image prompt each image is its
  base view plus one newline. Without it every image is tiled (the model's own fallback).
* **anyres_max_N.** A stitched grid larger than N base views is bilinearly shrunk
  (``vision_aspect_ratio``) before the newlines; the model's own packing does it, so the counts
  and features follow.
* **Video** through ``pixel_values_videos`` [n_vid, frames, 3, H, W] and ``<video>`` tokens: every
  frame's patch grid goes through the projector, is bilinearly pooled to half its side (the
  model's ``apply_pooling``), and one image-newline closes the video: ``frames * ceil(g/2)² + 1``
  tokens per video (counted by running ``apply_pooling`` on zero features).
* The P view pools each image's base view, and each video's patch grid averaged over its frames,
  to about ``n`` tokens before the projector.
"""

from __future__ import annotations

import torch

from mmspec.errors import MMSpecError
from mmspec.models.base import order_segments, register, video_pixels
from mmspec.models.llava import tower_tokens
from mmspec.models.llava_next import LlavaNextAdapter
from mmspec.models.pooling import pool_grid_to


@register("llava_onevision")
class LlavaOnevisionAdapter(LlavaNextAdapter):
    mm_keys = ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
    family = "LLaVA-OneVision"

    def __init__(self, model):
        super().__init__(model)
        self.video_token_id = int(model.config.video_token_id)

    # -- images: NeXT's, with the per-prompt tiling rule and anyres_max ---------------------
    def _views(self, mm: dict, sizes: torch.Tensor) -> list[int]:
        bni = mm.get("batch_num_images")
        tiled = [True] * len(sizes) if bni is None else [int(n) == 1 for n in bni for _ in range(int(n))]
        if len(tiled) != len(sizes):
            raise MMSpecError(f"batch_num_images {torch.as_tensor(bni).tolist()} does not add up to the "
                              f"{len(sizes)} images given")
        full = super()._views(mm, sizes)
        return [v if t else 1 for v, t in zip(full, tiled)]

    def _image_kwargs(self, mm: dict) -> dict:
        bni = mm.get("batch_num_images")
        return {} if bni is None else {"batch_num_images": bni}

    def _pack(self, feats: list[torch.Tensor], sizes: torch.Tensor, newline: torch.Tensor) -> list[torch.Tensor]:
        return list(self._core.pack_image_features(feats, sizes, image_newline=newline,
                                                   vision_aspect_ratio=self.model.config.vision_aspect_ratio)[0])

    # -- videos ----------------------------------------------------------------------------
    def _videos(self, mm: dict) -> torch.Tensor | None:
        return video_pixels(mm, self.family)

    def _video_counts(self, mm: dict) -> list[int]:
        pvv = self._videos(mm)
        if pvv is None:
            return []
        per_frame = tower_tokens(self._core.vision_tower, self.grid, self.select_strategy)
        try:
            pooled = self._core.apply_pooling(torch.zeros(pvv.shape[1], per_frame, 1))  # [frames, pp, 1]: shapes only
        except RuntimeError as e:
            raise MMSpecError(f"{self.family} cannot pool these video frames ({e})") from e
        return [pooled.shape[0] * pooled.shape[1] + 1] * pvv.shape[0]  # + the closing newline

    # -- the family interface ----------------------------------------------------------------
    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        return order_segments(input_ids, self.placeholders(),
                              {"image": self._image_counts(mm), "video": self._video_counts(mm)})

    def vision_states(self, mm: dict) -> dict[str, torch.Tensor | None]:
        """{"image": [sum views, P, C], "video": [n_vid * frames, P, C]}."""
        pvv = self._videos(mm)
        return {**super().vision_states(mm), "video": None if pvv is None else self._tower(pvv.flatten(0, 1))}

    def encode(self, mm: dict, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        states = states or {}
        return {"image": self._encode_images(mm, states.get("image")),
                "video": self._encode_videos(mm, states.get("video"))}

    def _encode_videos(self, mm: dict, states: torch.Tensor | None) -> list[torch.Tensor]:
        pvv = self._videos(mm)
        if pvv is None:
            return []
        core = self._core
        if states is None:  # the model's own path
            return list(core.get_video_features(pvv.to(self.device, core.vision_tower.dtype)).pooler_output)
        f = core.apply_pooling(core.multi_modal_projector(states.to(self.device)))  # [n_vid * F, pp, H]
        f = f.reshape(pvv.shape[0], -1, f.shape[-1])  # [n_vid, F * pp, H]
        newline = core.image_newline[None, None, :].expand(f.shape[0], 1, -1).to(f.device)
        return list(torch.cat((f, newline), dim=1))  # each [F * pp + 1, H]

    def pooled(self, mm: dict, n_tokens: int, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        states = states or {}
        return {"image": self._pooled_images(mm, n_tokens, states.get("image")),
                "video": self._pooled_videos(mm, n_tokens, states.get("video"))}

    def _pooled_videos(self, mm: dict, n_tokens: int, states: torch.Tensor | None) -> list[torch.Tensor]:
        pvv = self._videos(mm)
        if pvv is None:
            return []
        if states is None:
            states = self._tower(pvv.flatten(0, 1))  # [n_vid * F, P, C]
        grids = states.reshape(*pvv.shape[:2], *states.shape[1:])[:, :, -self.grid**2:]  # [n_vid, F, g², C]
        return list(self._core.multi_modal_projector(pool_grid_to(grids.mean(1), n_tokens).to(self.device)))
