"""Adapter for HF ``LlavaNextForConditionalGeneration`` (LLaVA-NeXT, a.k.a. LLaVA-1.6).

What this family does differently from LLaVA-1.5, and what the adapter therefore owns:

* **AnyRes tiles.** The processor cuts each image into a base view (the whole image at the
  tower's resolution) and a grid of tiles, the grid picked from ``image_grid_pinpoints`` by the
  image's size: ``pixel_values`` [n_img, max_views, 3, H, W] (padded per image) and
  ``image_sizes`` [n_img, 2] (height, width), which says how many views each image really has.
* **Unpadding and image-newline.** The tiles' patch grids are stitched into one grid, the
  letterbox padding cut away again (``unpad_image``) and the learned ``image_newline`` appended
  after every row; the base view's patches come first. So an image takes a number of
  ``<image>`` tokens that depends on its size: :meth:`segment_counts` runs the model's own
  ``pack_image_features`` on zero features (only shapes matter: no tower pass).
* :meth:`encode` returns, per image, exactly what the model's forward places at its tokens (the
  model's own ``get_image_features``); with tower states shared by a same-tower draft it runs the
  same projector, split and packing on them.
* The P view pools the BASE view's patch grid (before the projector, as for LLaVA-1.5) to about
  ``n`` tokens (any ``n``: adaptive pooling to the nearest square) and drops the tiles and newlines.

Positions are plain 1-D (the default :meth:`~ModelAdapter.prefill_positions`).
"""

from __future__ import annotations

import torch

from mmspec.errors import MMSpecError
from mmspec.models.base import ModelAdapter, register
from mmspec.models.llava import layers_key, tower_features, tower_tokens
from mmspec.models.pooling import pool_grid_to


@register("llava_next")
class LlavaNextAdapter(ModelAdapter):
    has_vision = True
    mm_keys = ("pixel_values", "image_sizes")
    family = "LLaVA-NeXT"

    def __init__(self, model):
        super().__init__(model)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.feature_layer = cfg.vision_feature_layer
        self.select_strategy = cfg.vision_feature_select_strategy
        self.tile_size = int(cfg.vision_config.image_size)  # pixels per side of one view
        self.grid = self.tile_size // int(cfg.vision_config.patch_size)  # patches per side of one view

    @property
    def _core(self):
        return self.model.model  # vision_tower, multi_modal_projector, image_newline, language_model

    def vision_key(self) -> tuple:
        pinpoints = tuple(tuple(int(x) for x in p) for p in self.model.config.image_grid_pinpoints)
        return (type(self).__name__, layers_key(self.feature_layer), self.select_strategy, self.tile_size,
                self.grid, pinpoints)  # equal keys: same views of the same pixels, same tower outputs

    @property
    def vision_module(self) -> torch.nn.Module:
        return self._core.vision_tower

    # -- views per image -----------------------------------------------------------------
    def _image_sizes(self, mm: dict) -> torch.Tensor | None:
        """image_sizes [n_img, 2], checked against pixel_values; None without images."""
        pv, sizes = mm.get("pixel_values"), mm.get("image_sizes")
        if pv is None:
            return None
        if sizes is None:
            raise MMSpecError(f"{self.family} needs image_sizes with pixel_values (each image's height and width, "
                              "from the processor: pass its whole output)")
        sizes = torch.as_tensor(sizes).cpu()
        if sizes.dim() != 2 or sizes.shape[1] != 2:
            raise MMSpecError(f"image_sizes must be [n_images, 2] (height, width), got shape {tuple(sizes.shape)}")
        if pv.dim() not in (4, 5) or (pv.dim() == 5 and pv.shape[0] != sizes.shape[0]):
            raise MMSpecError(f"{self.family}'s pixel_values must be [n_images, views, 3, H, W] with one row of "
                              f"image_sizes per image; got pixel_values {tuple(pv.shape)} and {sizes.shape[0]} "
                              "image_sizes")
        return sizes

    def _views(self, mm: dict, sizes: torch.Tensor) -> list[int]:
        """Views per image (the base view + its tiles), as the model counts them."""
        # lazily: the modeling module is loaded only for a LLaVA-NeXT model, not at mmspec's import
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return [image_size_to_num_patches(s, self.model.config.image_grid_pinpoints, self.tile_size) for s in sizes]

    def _pixels(self, pv: torch.Tensor, views: list[int]) -> torch.Tensor:
        """pixel_values [n_img, max_views, 3, H, W] (or already [sum views, 3, H, W]) -> [sum views, 3, H, W]."""
        if pv.dim() == 5 and pv.shape[1] >= max(views):
            return torch.cat([p[:v] for p, v in zip(pv, views)])
        if pv.dim() == 4 and pv.shape[0] == sum(views):
            return pv
        raise MMSpecError(f"{self.family}'s pixel_values {tuple(pv.shape)} do not hold the {views} views per image "
                          "that image_sizes ask for; build both with the model's own processor")

    def _image_kwargs(self, mm: dict) -> dict:
        """What else the model's ``get_image_features`` reads from the processor's output."""
        return {}

    def _pack(self, feats: list[torch.Tensor], sizes: torch.Tensor, newline: torch.Tensor) -> list[torch.Tensor]:
        """Per image [views, P, H] -> [n_tokens, H]: the model's own tiling, unpadding and newlines."""
        return list(self._core.pack_image_features(feats, sizes, vision_feature_select_strategy=self.select_strategy,
                                                   image_newline=newline)[0])

    def _image_counts(self, mm: dict) -> list[int]:
        sizes = self._image_sizes(mm)
        if sizes is None:
            return []
        per_view = tower_tokens(self._core.vision_tower, self.grid, self.select_strategy)
        zeros = [torch.zeros(v, per_view, 1) for v in self._views(mm, sizes)]  # [views, P, 1]: shapes only
        try:
            return [int(f.shape[0]) for f in self._pack(zeros, sizes, torch.zeros(1))]
        except (RuntimeError, ValueError) as e:
            raise MMSpecError(f"{self.family} cannot lay out these images ({e}); check image_sizes and the "
                              "model's vision_feature_select_strategy") from e

    # -- the family interface (models/base.py) ----------------------------------------
    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        return [("image", n) for n in self._image_counts(mm)]

    def vision_states(self, mm: dict) -> dict[str, torch.Tensor | None]:
        """{"image": [sum views, P, C]}: the tower's selected features of every view."""
        sizes = self._image_sizes(mm)
        if sizes is None:
            return {"image": None}
        return {"image": self._tower(self._pixels(mm["pixel_values"], self._views(mm, sizes)))}

    def _tower(self, pixels: torch.Tensor) -> torch.Tensor:
        return tower_features(self._core.vision_tower, pixels.to(self.device), self.feature_layer, self.select_strategy)

    def encode(self, mm: dict, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        return {"image": self._encode_images(mm, None if states is None else states["image"])}

    def _encode_images(self, mm: dict, states: torch.Tensor | None) -> list[torch.Tensor]:
        sizes = self._image_sizes(mm)
        if sizes is None:
            return []
        if states is None:  # the model's own path
            pv = mm["pixel_values"].to(self.device, self._core.vision_tower.dtype)
            out = self._core.get_image_features(pv, sizes.to(self.device), **self._image_kwargs(mm))
            return list(out.pooler_output)  # each [n_tokens_i, H]
        feats = self._core.multi_modal_projector(states.to(self.device))  # [sum views, P, H]
        per_image = list(torch.split(feats, self._views(mm, sizes)))  # each [views_i, P, H]
        return self._pack(per_image, sizes.to(self.device), self._core.image_newline)

    def pooled(self, mm: dict, n_tokens: int, states: dict | None = None) -> dict[str, list[torch.Tensor]]:
        """Each image's BASE view patch grid pooled to ~n_tokens, projected; no tiles, no newlines."""
        return {"image": self._pooled_images(mm, n_tokens, None if states is None else states["image"])}

    def _pooled_images(self, mm: dict, n_tokens: int, states: torch.Tensor | None) -> list[torch.Tensor]:
        sizes = self._image_sizes(mm)
        if sizes is None:
            return []
        views = self._views(mm, sizes)
        first = torch.tensor([0] + views[:-1]).cumsum(0)  # index of each image's base view
        if states is None:  # the base views only through the tower
            base = self._tower(self._pixels(mm["pixel_values"], views)[first])
        else:
            base = states[first.to(states.device)]  # [n_img, P, C]
        grid = base[:, -self.grid**2:]  # the patch grid (a kept CLS dropped)
        return list(self._core.multi_modal_projector(pool_grid_to(grid, n_tokens).to(self.device)))
