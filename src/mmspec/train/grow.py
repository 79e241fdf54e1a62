"""Depth up-scaling of a LLaVA checkpoint's language model, exact at initialisation.

Owns :func:`grow_lm_depth`. A checkpoint that has already learned the world is grown to more
decoder layers by inserting copies of existing layers whose two residual-branch outputs
(``self_attn.o_proj`` and ``mlp.down_proj``) are zeroed: each new layer adds nothing to the
residual stream, so the grown model computes exactly what the original computed, and training
then starts from the original's loss instead of from scratch. The copied q/k/v and MLP input
weights give the new layers non-zero gradients on the zeroed projections from the first step.

The grown model is rebuilt from its config (``num_hidden_layers`` changed) so every piece of
layer bookkeeping (``layer_idx`` for the KV cache, ``layer_types``) is the library's own.
"""

from __future__ import annotations

import re

import torch
from transformers import LlavaForConditionalGeneration

_LAYER = re.compile(r"^(model\.language_model\.layers\.)(\d+)(\..+)$")
_ZEROED = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")


def insertion_plan(old_layers: int, new_layers: int) -> list[tuple[int, bool]]:
    """For each layer of the grown model: (source layer in the old model, is-a-new-copy).

    The extra layers are spread evenly: a copy of old layer ``j`` is placed right after ``j``.
    """
    if new_layers < old_layers:
        raise ValueError(f"cannot grow {old_layers} layers to {new_layers}: pass --layers >= {old_layers}")
    extra = new_layers - old_layers
    after = sorted(int((k + 0.5) * old_layers / extra) for k in range(extra)) if extra else []
    plan: list[tuple[int, bool]] = []
    for j in range(old_layers):
        plan.append((j, False))
        plan.extend((j, True) for _ in range(after.count(j)))
    return plan


@torch.no_grad()
def grow_lm_depth(model: LlavaForConditionalGeneration, num_layers: int) -> LlavaForConditionalGeneration:
    """A new model whose LM has ``num_layers`` decoder layers and the same function as ``model``."""
    text_cfg = model.config.text_config
    old = text_cfg.num_hidden_layers
    plan = insertion_plan(old, num_layers)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.text_config.num_hidden_layers = num_layers
    if getattr(config.text_config, "layer_types", None) is not None:
        config.text_config.layer_types = [text_cfg.layer_types[src] for src, _ in plan]
    grown = LlavaForConditionalGeneration(config).to(next(model.parameters()).dtype)

    new_state: dict[str, torch.Tensor] = {}
    layer_weights: dict[int, list[tuple[str, str, torch.Tensor]]] = {}  # old index -> (prefix, suffix, w)
    for key, value in model.state_dict().items():
        m = _LAYER.match(key)
        if m is None:
            new_state[key] = value
        else:
            layer_weights.setdefault(int(m.group(2)), []).append((m.group(1), m.group(3), value))
    for new_idx, (src, is_copy) in enumerate(plan):
        for prefix, suffix, value in layer_weights[src]:
            zero = is_copy and suffix[1:] in _ZEROED
            new_state[f"{prefix}{new_idx}{suffix}"] = torch.zeros_like(value) if zero else value.clone()
    missing, unexpected = grown.load_state_dict(new_state, strict=False)
    # tied embeddings: lm_head.weight may be absent from one side and is re-tied below
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"grow_lm_depth: weights did not map (missing={missing}, unexpected={unexpected})")
    grown.tie_weights()
    grown.generation_config = model.generation_config
    return grown.eval()
