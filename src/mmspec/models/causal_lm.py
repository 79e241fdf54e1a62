"""Adapter for a text-only causal LM (e.g. a Llama) used as a draft for the text and
caption views. It has no vision tower; the multimodal and pooled views need a VLM draft."""

from __future__ import annotations

from mmspec.models.base import ModelAdapter, register


@register("causal_lm")
class CausalLMAdapter(ModelAdapter):
    has_vision = False
