"""Image features of a LLaVA model, optionally 2-D average-pooled before the projector.

Owns the pooled drafting view's maths (IbED "pooled multimodal drafting"): the vision tower's
patch grid (from ``vision_feature_layer``, CLS dropped for the "default" strategy) is
average-pooled in 2-D down to N tokens per image, *then* projected. Pure functions: no state,
no hooks, no patching of transformers code. With N = the full grid the result equals the
model's own ``get_image_features`` output exactly (same ops in the same order).

Used by training (pooled fine-tune, frozen-tower stages) and by the engine (the P view).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmspec.errors import MMSpecError


def vision_patch_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """Selected vision hidden states, before the projector: [n_img, grid*grid, C_vision]."""
    config = model.config
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise MMSpecError("pooled image features need a single int vision_feature_layer; "
                          f"this model has {layer!r}")
    tower = model.model.vision_tower
    pixel_values = pixel_values.to(device=tower.device, dtype=tower.dtype)
    out = tower(pixel_values, output_hidden_states=True, return_dict=True)
    feats = out.hidden_states[layer]  # [n_img, 1 + grid*grid, C]
    if config.vision_feature_select_strategy == "default":
        feats = feats[:, 1:]
    elif config.vision_feature_select_strategy != "full":
        raise MMSpecError(f"unknown vision_feature_select_strategy "
                          f"{config.vision_feature_select_strategy!r}")
    return feats


def pool_patches(feats: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """2-D average pooling of a square patch grid: [n_img, g*g, C] -> [n_img, n_tokens, C].

    ``n_tokens`` must be a square whose side divides the grid side g. n_tokens == g*g is the
    identity (returns ``feats`` itself).
    """
    n_img, n_patch, channels = feats.shape
    grid = math.isqrt(n_patch)
    side = math.isqrt(n_tokens)
    if grid * grid != n_patch:
        raise MMSpecError(f"patch count {n_patch} is not a square grid (CLS not dropped?)")
    if side * side != n_tokens or side == 0 or grid % side != 0:
        raise MMSpecError(f"pooled:{n_tokens} needs a square whose side divides the {grid}x{grid} "
                          f"grid; valid: {[k * k for k in range(1, grid + 1) if grid % k == 0]}")
    if side == grid:
        return feats
    x = feats.reshape(n_img, grid, grid, channels).permute(0, 3, 1, 2)  # [n_img, C, g, g]
    x = F.avg_pool2d(x, kernel_size=grid // side)  # [n_img, C, side, side]
    return x.flatten(2).transpose(1, 2)  # [n_img, side*side, C], row-major like the grid


def pooled_image_features(model, pixel_values: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Projected image features with ``n_tokens`` per image: [n_img, n_tokens, hidden_lm]."""
    feats = pool_patches(vision_patch_features(model, pixel_values), n_tokens)
    return model.model.multi_modal_projector(feats)


def embed_multimodal(model, input_ids: torch.Tensor, image_features: torch.Tensor | None,
                     ) -> torch.Tensor:
    """LM input embeddings with image features scattered at the image-token positions.

    input_ids: [B, T]; image_features: [n_img, N, H] in the order the image tokens appear
    (row-major over the batch) or None when no row has image tokens. Returns [B, T, H].
    """
    embeds = model.get_input_embeddings()(input_ids)  # [B, T, H]
    mask = input_ids == model.config.image_token_id  # [B, T]
    n_slots = int(mask.sum())
    n_feats = 0 if image_features is None else image_features.shape[0] * image_features.shape[1]
    if n_slots != n_feats:
        raise MMSpecError(f"{n_slots} image tokens in the input but {n_feats} image features")
    if n_slots == 0:
        return embeds
    feats = image_features.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
    return embeds.masked_scatter(mask.unsqueeze(-1), feats)
