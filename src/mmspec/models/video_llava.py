"""Adapter for HF ``VideoLlavaForConditionalGeneration`` (Video-LLaVA).

What this family does differently from LLaVA-1.5, and what the adapter therefore owns:

* **Two towers.** Images go through ``image_tower``, video frames through ``video_tower`` (two
  CLIP-like towers with their own weights), then one shared projector.
* **Two placeholders.** ``<image>`` (a fixed grid per image: ``g²`` tokens, CLS dropped by the
  "default" strategy) and ``<video>`` (every frame's tokens one after the other, and a frame keeps
  its CLS whatever the strategy: ``frames * (g² + 1)`` for a CLIP tower).
* **Input names.** Images come as ``pixel_values`` [n_img, 3, H, W] or, from older processors,
  ``pixel_values_images`` (the same tensor: both are accepted, one at a time); videos as
  ``pixel_values_videos`` [n_vid, frames, 3, H, W].
* The P view pools each image's patch grid, and each video's patch grid averaged over its
  frames (CLS dropped), to about ``n`` tokens before the projector.

Positions are plain 1-D (the default :meth:`~ModelAdapter.prefill_positions`).
"""

from __future__ import annotations

import torch

from mmspec.errors import MMSpecError
from mmspec.models.base import ModelAdapter, order_segments, register, video_pixels
from mmspec.models.llava import layers_key, tower_features, tower_tokens
from mmspec.models.pooling import pool_grid_to


@register("video_llava")
class VideoLlavaAdapter(ModelAdapter):
    has_vision = True
    mm_keys = ("pixel_values", "pixel_values_images", "pixel_values_videos")

    def __init__(self, model):
        super().__init__(model)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = int(cfg.video_token_id)
        self.feature_layer = cfg.vision_feature_layer
        self.select_strategy = cfg.vision_feature_select_strategy
        self.grid = int(cfg.vision_config.image_size) // int(cfg.vision_config.patch_size)

    @property
    def _core(self):
        return self.model.model  # image_tower, video_tower, multi_modal_projector, language_model

    def vision_key(self) -> tuple:
        return (type(self).__name__, layers_key(self.feature_layer), self.select_strategy, self.grid)

    @property
    def vision_module(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"image": self._core.image_tower, "video": self._core.video_tower})

    # -- inputs ------------------------------------------------------------------------------
    def _images(self, mm: dict) -> torch.Tensor | None:
        pv, legacy = mm.get("pixel_values"), mm.get("pixel_values_images")
        if pv is not None and legacy is not None:
            raise MMSpecError("Video-LLaVA's images were given twice (pixel_values and pixel_values_images); "
                              "pass them once")
        pv = legacy if pv is None else pv
        if pv is not None and pv.dim() != 4:
            raise MMSpecError(f"Video-LLaVA's images must be [n_images, 3, H, W], got {tuple(pv.shape)}")
        return pv

    def _videos(self, mm: dict) -> torch.Tensor | None:
        return video_pixels(mm, "Video-LLaVA")

    # -- the family interface (models/base.py) ----------------------------------------
    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        pv, pvv = self._images(mm), self._videos(mm)
        per_image = tower_tokens(self._core.image_tower, self.grid, self.select_strategy)
        per_frame = tower_tokens(self._core.video_tower, self.grid, "full")  # frames keep their CLS
        return order_segments(input_ids, self.placeholders(), {
            "image": [] if pv is None else [per_image] * pv.shape[0],
            "video": [] if pvv is None else [per_frame * pvv.shape[1]] * pvv.shape[0]})

    def vision_states(self, mm: dict) -> dict[str, torch.Tensor | None]:
        """{"image": [n_img, T, C] (strategy applied), "video": [n_vid * frames, T + 1, C] (CLS kept)}."""
        pv, pvv = self._images(mm), self._videos(mm)
        core = self._core
        return {"image": None if pv is None else tower_features(core.image_tower, pv.to(self.device),
                                                                  self.feature_layer, self.select_strategy),
                "video": None if pvv is None else tower_features(core.video_tower, pvv.flatten(0, 1).to(self.device),
                                                                   self.feature_layer, "full")}

    def encode(self, mm: dict, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        pv, pvv = self._images(mm), self._videos(mm)
        core, out = self._core, {"image": [], "video": []}
        if states is None:  # the model's own path
            if pv is not None:
                out["image"] = list(core.get_image_features(pixel_values=pv.to(self.device)).pooler_output)
            if pvv is not None:
                frames = core.get_video_features(pixel_values_videos=pvv.to(self.device)).pooler_output
                # frames [n_vid * F, T, H]: one video's frames one after the other
                out["video"] = list(frames.reshape(pvv.shape[0], -1, frames.shape[-1]))  # each [F * T, H]
            return out
        if pv is not None:
            out["image"] = list(core.multi_modal_projector(states["image"].to(self.device)))
        if pvv is not None:
            frames = core.multi_modal_projector(states["video"].to(self.device))
            out["video"] = list(frames.reshape(pvv.shape[0], -1, frames.shape[-1]))
        return out

    def pooled(self, mm: dict, n_tokens: int, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        pv, pvv = self._images(mm), self._videos(mm)
        states = states or self.vision_states(mm)
        g2, out = self.grid**2, {"image": [], "video": []}
        if pv is not None:
            out["image"] = self._project_pooled(states["image"][:, -g2:], n_tokens)
        if pvv is not None:
            v = states["video"]
            grids = v.reshape(pvv.shape[0], pvv.shape[1], *v.shape[1:])[:, :, -g2:]  # [n_vid, F, g², C]
            out["video"] = self._project_pooled(grids.mean(1), n_tokens)
        return out

    def _project_pooled(self, grids: torch.Tensor, n_tokens: int) -> list[torch.Tensor]:
        return list(self._core.multi_modal_projector(pool_grid_to(grids, n_tokens).to(self.device)))
