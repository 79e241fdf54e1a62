"""Positions of a feature-level head on a multimodal-RoPE target (Qwen2-VL / Qwen2.5-VL).

Owns: the head's rotary embedding for such a target (:class:`MRoPE`: 3-D position ids
(time, height, width) mixed by the target's ``mrope_section``, as the target's own rotary
embedding mixes them; 1-D ids are plain RoPE, which M-RoPE equals on text), and the positions
a head reads: its slot t holds (the target's feature of token t, token t + 1) and sits at the
TARGET's position of token t (:func:`head_positions`), at training and at drafting alike, as
SGLang and SpecForge place an EAGLE-3 draft of such a target. After the prompt, text positions
are 1-D again: the prompt's largest position + 1, + 1 per token.

Does not know the engine: the decoder asks :func:`prompt_positions` once per prompt.
"""

from __future__ import annotations

import torch
from torch import nn


def mrope_section(rope_parameters: dict | None) -> list[int] | None:
    """The M-RoPE split of a head's (or target's) rope parameters; None for plain RoPE."""
    sec = (rope_parameters or {}).get("mrope_section")
    return [int(x) for x in sec] if sec else None


class MRoPE(nn.Module):
    """A Llama rotary embedding that also reads 3-D position ids [3, B, n]: each frequency band of
    ``section`` (time, height, width, repeated) rotates by its own axis. Position ids [B, n] are
    1-D: the wrapped embedding's own result (the same as three equal axes)."""

    def __init__(self, inner: nn.Module, section: list[int]):
        super().__init__()
        self.inner = inner
        self.section = list(section)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if position_ids.dim() == 2:
            return self.inner(x, position_ids)
        inv = self.inner.inv_freq.to(device=x.device, dtype=torch.float)  # [D/2]
        freqs = position_ids[..., None].float() * inv  # [3, B, n, D/2]
        mixed = torch.cat([band[i % 3] for i, band in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        emb = torch.cat([mixed, mixed], dim=-1)  # [B, n, D]
        scale = getattr(self.inner, "attention_scaling", 1.0)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def prompt_positions(head, target, ids: torch.Tensor, mm: dict) -> torch.Tensor | None:
    """The target's position ids of the prompt less its pending last token ([3, 1, L - 1] for an
    M-RoPE target), which an M-RoPE head's prompt slots take; None for any other head (its slots
    are at their 1-D index, as before). ``ids``: the prompt [L]; ``mm``: its processor inputs."""
    if mrope_section(head.config.rope_parameters) is None or not getattr(target, "mrope", False):
        return None
    from mmspec.multimodal import for_prefix

    prefix = ids[:-1][None].to(target.device)
    pos, _ = target.prefill_positions(prefix, for_prefix(mm, prefix))
    return pos if pos.dim() == 3 else None


def head_positions(positions: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Slots ``start``..``stop - 1`` of a head over a prompt whose target positions are
    ``positions`` ([B, L] or [3, B, L]): slot t at token t's position."""
    return positions[..., start:stop]


def next_position(positions: torch.Tensor) -> torch.Tensor:
    """[1] the 1-D position of the head's first slot after its prefill (the prompt's last token
    but the pending one, a text token: its three axes are equal); each later slot one more."""
    last = positions[..., -1]  # [B] or [3, B]
    return (last.amax(0) if positions.dim() == 3 else last).reshape(-1)[:1]
