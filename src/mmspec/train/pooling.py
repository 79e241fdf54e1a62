"""Image features of a LLaVA model for training, optionally 2-D average-pooled before the
projector (the pooled fine-tune of IbED Sec. 5.1).

The maths is the engine's own — :meth:`mmspec.models.llava.LlavaAdapter.vision_hidden` and
:func:`mmspec.models.pooling.pool_patch_grid` — so a draft is trained on exactly the features
the pooled drafting view gives it. With N = the full grid the result equals the model's own
``get_image_features`` output exactly. Pure functions: no state, no patching of transformers.
"""

from __future__ import annotations

import contextlib

import torch

from mmspec.errors import MMSpecError
from mmspec.models.llava import LlavaAdapter
from mmspec.models.pooling import pool_patch_grid as pool_patches


def vision_patch_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """Selected vision hidden states, before the projector: [n_img, grid*grid, C_vision]."""
    return LlavaAdapter(model).vision_hidden(pixel_values)


def pooled_image_features(model, pixel_values: torch.Tensor, n_tokens: int,
                          train_vision: bool = True) -> torch.Tensor:
    """Projected image features with ``n_tokens`` per image: [n_img, n_tokens, hidden_lm].
    With ``train_vision=False`` the vision tower runs without gradients (frozen stages)."""
    with contextlib.nullcontext() if train_vision else torch.no_grad():
        feats = vision_patch_features(model, pixel_values)  # [n_img, grid*grid, C]
    return model.model.multi_modal_projector(pool_patches(feats, n_tokens))


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
