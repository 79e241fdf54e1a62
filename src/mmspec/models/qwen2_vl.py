"""Adapter for HF ``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration``.

What this family does differently from LLaVA-1.5, and what the adapter therefore owns:

* **Dynamic resolution.** Each image (or video) becomes a variable number of placeholder tokens:
  its patch grid ``(t, h, w)`` (``image_grid_thw`` / ``video_grid_thw`` from the processor)
  merged ``spatial_merge_size``² to one: ``t * h * w / merge²`` tokens. The vision tower and its
  merger (the projector) run as one module, so features come out in LM space.
* **Multimodal RoPE (M-RoPE).** Positions are 3-D (time, height, width) over vision tokens and
  advance by the larger grid side, not by the token count; text after the prompt continues at
  ``max position + 1``, which is NOT ``tokens so far``. :meth:`prefill_positions` computes the
  prompt's 3-D ids with the model's own ``get_rope_index`` and the next position; the engine
  offsets every later (1-D) position by the difference.
* **Video** through ``pixel_values_videos`` and ``video_grid_thw`` (``<|video_pad|>`` tokens).
* The P view pools each segment's merged grid (over time too, for a video) to ``n`` tokens.
"""

from __future__ import annotations

import math

import torch

from mmspec.models.base import ModelAdapter, order_segments, register


@register("qwen2_vl")
class Qwen2VLAdapter(ModelAdapter):
    has_vision = True
    mrope = True
    mm_keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
               "second_per_grid_ts")

    def __init__(self, model):
        super().__init__(model)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = int(cfg.video_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)

    @property
    def _core(self):
        return self.model.model  # Qwen2VLModel: visual, language_model

    @property
    def tokens_per_image(self) -> int | None:  # varies with the image: no fixed count
        return None

    def vision_key(self) -> tuple | None:
        return None  # the tower includes the merger: features are never shared with a draft

    # -- segments ------------------------------------------------------------------------
    def _counts(self, grid: torch.Tensor | None) -> list[int]:
        return [] if grid is None else (grid.prod(-1) // self.merge**2).tolist()

    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        """Images and videos in the order their placeholder runs appear in the prompt."""
        counts = {"image": self._counts(mm.get("image_grid_thw")), "video": self._counts(mm.get("video_grid_thw"))}
        return order_segments(input_ids, self.placeholders(), counts)  # extras: refused by the layout

    def encode(self, mm: dict) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
        core = self._core
        if mm.get("pixel_values") is not None:
            out["image"] = list(core.get_image_features(mm["pixel_values"].to(self.device),
                                                        mm["image_grid_thw"].to(self.device)).pooler_output)
        if mm.get("pixel_values_videos") is not None:
            out["video"] = list(core.get_video_features(mm["pixel_values_videos"].to(self.device),
                                                        mm["video_grid_thw"].to(self.device)).pooler_output)
        return out

    def pooled(self, mm: dict, n_tokens: int) -> dict[str, list[torch.Tensor]]:
        """Each segment's merged grid [t, h/m, w/m, H] averaged over time and pooled to a
        near-square grid of ``n_tokens`` cells."""
        feats = self.encode(mm)
        out = {}
        for kind, grid_key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            grids = mm.get(grid_key)
            out[kind] = [_pool(f, g, self.merge, n_tokens) for f, g in zip(feats[kind], [] if grids is None else grids)]
        return out

    # -- positions -----------------------------------------------------------------------
    def prefill_positions(self, input_ids: torch.Tensor, mm: dict, attention_mask: torch.Tensor | None = None):
        """input_ids [B, L] -> (3-D M-RoPE ids [3, B, L], next position [B])."""
        ids = input_ids.to(self.device)
        img, vid = mm.get("image_grid_thw"), mm.get("video_grid_thw")
        if img is None and vid is None:
            return super().prefill_positions(input_ids, mm, attention_mask)
        types = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()  # text 0, image 1, video 2
        kw = {}
        if mm.get("second_per_grid_ts") is not None:
            kw["second_per_grid_ts"] = mm["second_per_grid_ts"]
        # count the grids of the segments this prompt holds (a draft row's may be a prefix of them)
        pos, delta = self._core.get_rope_index(
            ids, types, image_grid_thw=None if img is None else img.to(self.device)[: _n_segments(ids, self.image_token_id, img, self.merge)],
            video_grid_thw=None if vid is None else vid.to(self.device)[: _n_segments(ids, self.video_token_id, vid, self.merge)],
            attention_mask=None if attention_mask is None else attention_mask.to(self.device), **kw)
        return pos, pos.amax(dim=(0, 2)) + 1  # [3, B, L], [B]


@register("qwen2_5_vl")
class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    """Qwen2.5-VL: the same interface (window attention in the tower, absolute-time M-RoPE for
    video, ``second_per_grid_ts``), handled inside transformers' own methods."""


def _n_segments(ids: torch.Tensor, token: int, grids: torch.Tensor, merge: int) -> int:
    """How many of ``grids`` the prompt's ``token`` placeholders cover (all, in a full prompt)."""
    n_tok = int((ids == token).sum())
    total, k = 0, 0
    for g in grids.tolist():
        c = g[0] * g[1] * g[2] // merge**2
        if total + c > n_tok:
            break
        total, k = total + c, k + 1
    return k


def _pool(feats: torch.Tensor, grid: torch.Tensor, merge: int, n_tokens: int) -> torch.Tensor:
    """feats [t*h*w/m², H] of one segment with grid (t, h, w) -> [n_tokens', H]."""
    t, h, w = (int(x) for x in grid.tolist())
    gh, gw = h // merge, w // merge
    x = feats.view(t, gh, gw, -1).mean(0).permute(2, 0, 1)[None]  # [1, H, gh, gw], time averaged
    ph = max(1, min(gh, round(math.sqrt(n_tokens * gh / max(gw, 1)))))
    pw = max(1, min(gw, n_tokens // ph))
    return torch.nn.functional.adaptive_avg_pool2d(x, (ph, pw))[0].flatten(1).T  # [ph * pw, H]
