"""Adapter for HF ``LlavaForConditionalGeneration`` (llava-hf format, LLaVA-1.5 style).

Image features are computed the way LLaVA does it: the vision tower's hidden state at
``vision_feature_layer`` (CLS dropped for the "default" strategy), then the projector. The
split into :meth:`vision_hidden` and :meth:`project` is what lets the engine pool the patch
grid before projecting (pooled view) and share one vision pass between target and draft.
"""

from __future__ import annotations

import torch

from mmspec.models.base import ModelAdapter, register
from mmspec.models.pooling import pool_patch_grid


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
        return tower_features(self._core.vision_tower, pixel_values.to(self.device), self.feature_layer,
                              self.select_strategy)  # [n_img, tokens_per_image, C * len(layers)]

    def project(self, patch_features: torch.Tensor) -> torch.Tensor:
        return self._core.multi_modal_projector(patch_features)

    # -- the family interface (models/base.py) ----------------------------------------
    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        pv = mm.get("pixel_values")
        n = 0 if pv is None else int(pv.shape[0])
        return [("image", self.tokens_per_image)] * n

    def vision_states(self, mm: dict) -> torch.Tensor:
        return self.vision_hidden(mm["pixel_values"])  # [n_img, P, C]

    def encode(self, mm: dict, states: torch.Tensor | None = None) -> dict[str, list[torch.Tensor]]:
        pv = mm.get("pixel_values")
        if states is None and pv is None:
            return {"image": []}
        patches = self.vision_hidden(pv) if states is None else states.to(self.device)
        return {"image": list(self.project(patches))}

    def pooled(self, mm: dict, n_tokens: int, states: torch.Tensor | None = None) -> dict[str, list[torch.Tensor]]:
        pv = mm.get("pixel_values")
        if states is None and pv is None:
            return {"image": []}
        patches = self.vision_hidden(pv) if states is None else states
        return {"image": list(self.project(pool_patch_grid(patches, n_tokens).to(self.device)))}

    def vision_key(self) -> tuple:
        layers = self.feature_layer if isinstance(self.feature_layer, int) else tuple(self.feature_layer)
        return (layers, self.select_strategy, self.patch_grid)

    @property
    def vision_module(self) -> torch.nn.Module:
        return self._core.vision_tower


# -- the LLaVA-style tower, shared by the LLaVA families (llava_next, llava_onevision, video_llava) --
def tower_features(tower: torch.nn.Module, pixel_values: torch.Tensor, layer, strategy: str) -> torch.Tensor:
    """pixel_values [n, 3, H, W] -> the tower's hidden state at ``layer`` (an int, or a list whose
    states are concatenated) [n, T, C * n_layers]; the "default" strategy drops the first (CLS) token."""
    out = tower(pixel_values.to(dtype=tower.dtype), output_hidden_states=True, return_dict=True)
    layers = [layer] if isinstance(layer, int) else layer
    hs = [out.hidden_states[i] for i in layers]  # each [n, 1 + n_patches, C] (CLS first) for CLIP
    if strategy == "default":
        hs = [h[:, 1:] for h in hs]  # drop CLS
    return torch.cat(hs, dim=-1)


def tower_tokens(tower: torch.nn.Module, grid: int, strategy: str) -> int:
    """Tokens per image (or tile, or frame) that :func:`tower_features` yields: the tower's sequence
    (``embeddings.num_positions``: patches, plus the CLS of a CLIP tower; a SigLIP tower has none)
    less one for the "default" strategy."""
    n = getattr(getattr(tower, "embeddings", None), "num_positions", None)
    n = grid * grid + 1 if n is None else int(n)  # CLIP-like when the tower does not say
    return n - (strategy == "default")


def layers_key(layer) -> int | tuple:
    return layer if isinstance(layer, int) else tuple(layer)
