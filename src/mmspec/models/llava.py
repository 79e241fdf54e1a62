"""Adapter for HF ``LlavaForConditionalGeneration`` (llava-hf format, LLaVA-1.5 style).

Image features are computed the way LLaVA does it: the vision tower's hidden state at
``vision_feature_layer`` (CLS dropped for the "default" strategy), then the projector. The
split into :meth:`vision_hidden` and :meth:`project` is what lets the engine pool the patch
grid before projecting (pooled view) and share one vision pass between target and draft.
"""

from __future__ import annotations

import torch

from mmspec.models.base import ModelAdapter, register


@register("llava")
class LlavaAdapter(ModelAdapter):
    has_vision = True

    def __init__(self, model):
        super().__init__(model)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.feature_layer = cfg.vision_feature_layer
        self.select_strategy = cfg.vision_feature_select_strategy
        # "default" drops the CLS token, "full" keeps it in front of the patches (as the processor
        # counts it: grid**2 + 1 image tokens)
        self.tokens_per_image = self.patch_grid**2 + (0 if self.select_strategy == "default" else 1)

    @property
    def _core(self):
        return self.model.model  # LlavaModel: vision_tower, multi_modal_projector, language_model

    @property
    def patch_grid(self) -> int:
        vc = self.model.config.vision_config
        return int(vc.image_size // vc.patch_size)

    def vision_hidden(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tower = self._core.vision_tower
        pixel_values = pixel_values.to(device=self.device, dtype=tower.dtype)
        out = tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        hs = [out.hidden_states[i] for i in layers]  # each [n_img, 1 + n_patches, C] (CLS first)
        if self.select_strategy == "default":
            hs = [h[:, 1:] for h in hs]  # drop CLS
        return torch.cat(hs, dim=-1)  # [n_img, tokens_per_image, C * len(layers)]

    def project(self, patch_features: torch.Tensor) -> torch.Tensor:
        return self._core.multi_modal_projector(patch_features)

    # -- the family interface (models/base.py) ----------------------------------------
    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        pv = mm.get("pixel_values")
        n = 0 if pv is None else int(pv.shape[0])
        return [("image", self.tokens_per_image)] * n

    def encode(self, mm: dict) -> dict[str, list[torch.Tensor]]:
        pv = mm.get("pixel_values")
        if pv is None:
            return {"image": []}
        return {"image": list(self.project(self.vision_hidden(pv)))}

    def pooled(self, mm: dict, n_tokens: int) -> dict[str, list[torch.Tensor]]:
        from mmspec.models.pooling import pool_patch_grid

        pv = mm.get("pixel_values")
        if pv is None:
            return {"image": []}
        return {"image": list(self.project(pool_patch_grid(self.vision_hidden(pv), n_tokens)))}

    def vision_key(self) -> tuple:
        layers = self.feature_layer if isinstance(self.feature_layer, int) else tuple(self.feature_layer)
        return (layers, self.select_strategy, self.patch_grid)

    @property
    def vision_module(self) -> torch.nn.Module:
        return self._core.vision_tower
