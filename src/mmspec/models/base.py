"""The adapter interface the engine talks to, and the registry that picks one per model."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from mmspec.drafting.views import placeholder_runs
from mmspec.errors import MMSpecError
from mmspec.models.rows import full_attention


class ModelAdapter:
    """What the engine needs of a model, whatever its family.

    Subclasses for vision-language families also implement the ``vision_*`` methods; a
    text-only causal LM leaves ``has_vision`` False and can serve the text and caption views.
    """

    has_vision: bool = False
    image_token_id: int | None = None
    video_token_id: int | None = None
    # the processor outputs this family reads (besides input_ids / attention_mask)
    mm_keys: tuple[str, ...] = ("pixel_values",)

    def __init__(self, model: nn.Module):
        self.model = model
        self._cache_kw = cache_argument(model)

    # -- text side -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Where inputs go: the execution device of a model dispatched by accelerate
        (``device_map=...``; offloaded weights sit on "meta" until a hook loads them), else the
        device of its parameters."""
        hook = getattr(self.model.get_input_embeddings(), "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
        for p in self.model.parameters():
            if p.device.type != "meta":
                return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def max_positions(self) -> int | None:
        cfg = getattr(self.model.config, "text_config", self.model.config)
        return getattr(cfg, "max_position_embeddings", None)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, L] -> embeddings [B, L, H]."""
        return self.model.get_input_embeddings()(token_ids)

    def forward(
        self,
        *,
        cache,
        attention_mask: torch.Tensor,  # [B, past + L]
        position_ids: torch.Tensor,  # [B, L]
        input_ids: torch.Tensor | None = None,  # [B, L]
        inputs_embeds: torch.Tensor | None = None,  # [B, L, H]
        logits_to_keep: int = 0,  # 0: logits at every position; k: the last k only
        hidden: tuple[int, ...] = (),  # decoder layers whose outputs to return too; -1: the final (post-norm) one
    ):
        """One forward pass that extends ``cache`` in place; returns logits [B, L or k, V], or
        (logits, hidden [B, L, H * len(hidden)]) when ``hidden`` names layers: read from the
        same forward (hooks on those layers, removed after), never a second pass."""
        captured: dict[int, torch.Tensor] = {}
        hooks = [self._layer(i).register_forward_hook(
            lambda m, a, o, i=i: captured.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in hidden]
        try:
            out = self.model(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kw: cache},
            )
        finally:
            for h in hooks:
                h.remove()
        if not hidden:
            return out.logits
        return out.logits, torch.cat([captured[i] for i in hidden], dim=-1)

    def _layer(self, i: int) -> nn.Module:
        """Decoder layer ``i`` of the language model, or its final norm for -1."""
        decoder = self.model.get_decoder()
        return decoder.norm if i == -1 else decoder.layers[i]

    @property
    def num_layers(self) -> int:
        return len(self.model.get_decoder().layers)

    @property
    def full_attention(self) -> bool:
        """Every layer attends over all its past (no sliding window): what token trees, static
        shapes and graphs need of the engine's :class:`~mmspec.models.rows.RowCache`."""
        return full_attention(self.model.config)

    # -- multimodal prompts: what differs per family -----------------------------------
    def placeholders(self) -> dict[int, str]:
        """Placeholder token id -> "image" / "video"."""
        out = {}
        if self.image_token_id is not None:
            out[self.image_token_id] = "image"
        if self.video_token_id is not None:
            out[self.video_token_id] = "video"
        return out

    def segment_counts(self, input_ids: torch.Tensor, mm: dict) -> list[tuple[str, int]]:
        """(kind, placeholder tokens) of every image / video given, in prompt order."""
        raise MMSpecError(f"{type(self.model).__name__} reads no images")

    def encode(self, mm: dict, states=None) -> dict[str, list[torch.Tensor]]:
        """Vision inputs -> LM-space features per segment: {"image": [[n_i, H], ...], "video": [...]},
        each list in prompt order, each tensor one placeholder run's embeddings. ``states``: the
        output of :meth:`vision_states` of a model with the same vision tower (``same_vision``),
        reused instead of running the tower again."""
        raise MMSpecError(f"{type(self.model).__name__} reads no images")

    def pooled(self, mm: dict, n_tokens: int, states=None) -> dict[str, list[torch.Tensor]]:
        """As :meth:`encode` with every segment's patch grid average-pooled to ``n_tokens``
        (the P view: spatially, and over time for a video)."""
        raise MMSpecError(f"{type(self.model).__name__} cannot pool its vision features")

    def vision_states(self, mm: dict):
        """The vision tower's output for ``mm`` (before the projector), in the form this family's
        :meth:`encode` / :meth:`pooled` take as ``states``: computed once and shared with a draft
        whose :func:`same_vision` holds. Families without a :meth:`vision_key` never share."""
        raise MMSpecError(f"{type(self.model).__name__} shares no vision features")

    def prefill_positions(self, input_ids: torch.Tensor, mm: dict, attention_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids of a prompt [B, L] (1-D RoPE: the count of real tokens before each) and the
        position of the NEXT token per row [B]. Families with multimodal RoPE (Qwen2-VL) return
        their 3-D ids [3, B, L]; after the prompt, text positions are 1-D again: ``next + i``."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, L]
        return pos, pos[:, -1] + 1

    # -- vision side (VLM families) ----------------------------------------------------
    def vision_hidden(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n_img, 3, H, W] -> selected patch features [n_img, n_patches, C]."""
        raise MMSpecError(f"{type(self.model).__name__} has no vision tower")

    def project(self, patch_features: torch.Tensor) -> torch.Tensor:
        """[n_img, n, C] patch features -> [n_img, n, hidden] LM-space image tokens."""
        raise MMSpecError(f"{type(self.model).__name__} has no multimodal projector")

    @property
    def patch_grid(self) -> int:
        """Patches per side of the square patch grid fed to the projector."""
        raise MMSpecError(f"{type(self.model).__name__} has no vision tower")

    def vision_key(self) -> tuple | None:
        """Feature selection (layer, strategy, grid); None without a vision tower."""
        return None

    @property
    def vision_module(self) -> nn.Module | None:
        return None


def cache_argument(model: nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers >= 5.24,
    where ``past_key_values`` is deprecated for removal in 5.40), else ``past_key_values``."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "cache"
    return "cache" if "cache" in params else "past_key_values"


def same_vision(a: ModelAdapter, b: ModelAdapter) -> bool:
    """True when both adapters produce identical patch features for the same pixels: same
    feature selection and exactly equal vision-tower weights (or the very same module)."""
    if not (a.has_vision and b.has_vision) or a.vision_key() is None or a.vision_key() != b.vision_key():
        return False  # (a family whose tower includes its projector has no key: never shared)
    ma, mb = a.vision_module, b.vision_module
    if ma is mb:
        return True
    sa, sb = ma.state_dict(), mb.state_dict()
    if sa.keys() != sb.keys():
        return False
    if any(t.device.type == "meta" for t in (*sa.values(), *sb.values())):
        return False  # weights offloaded by accelerate: not compared, each tower runs its own
    return all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k].to(sa[k].device))
        for k in sa
    )


def video_pixels(mm: dict, family: str) -> torch.Tensor | None:
    """``mm["pixel_values_videos"]`` checked to be [n_videos, frames, 3, H, W] (None when absent)."""
    pvv = mm.get("pixel_values_videos")
    if pvv is not None and pvv.dim() != 5:
        raise MMSpecError(f"{family}'s pixel_values_videos must be [n_videos, frames, 3, H, W], got {tuple(pvv.shape)}")
    return pvv


def order_segments(input_ids: torch.Tensor, placeholders: dict[int, str],
                   counts: dict[str, list[int]]) -> list[tuple[str, int]]:
    """(kind, tokens) of every segment in prompt order, given each kind's counts in order: the
    placeholder runs of ``input_ids`` [L] say which kind comes next (adjacent segments of one kind
    share a run). Counts the prompt has no room for are appended, for the layout to refuse."""
    queues = {kind: list(c) for kind, c in counts.items()}
    out = []
    for _, kind, n in placeholder_runs(input_ids.cpu(), placeholders):
        while n > 0 and queues.get(kind):
            c = queues[kind].pop(0)
            out.append((kind, c))
            n -= c
    return out + [(kind, c) for kind, q in queues.items() for c in q]


ADAPTERS: dict[str, Callable[[nn.Module], ModelAdapter]] = {}


def register(model_type: str):
    def deco(cls):
        ADAPTERS[model_type] = cls
        return cls

    return deco


def video_families() -> list[str]:
    """The registered model types whose adapters read videos (``pixel_values_videos``)."""
    return sorted(k for k, cls in ADAPTERS.items() if "pixel_values_videos" in getattr(cls, "mm_keys", ()))


def adapter_for(model: nn.Module) -> ModelAdapter:
    """Pick the adapter for a loaded HF model by its ``config.model_type`` (the families register
    themselves when ``mmspec.models`` is imported, which importing this module does first)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type](model)
    if hasattr(model, "get_output_embeddings") and not hasattr(model.config, "vision_config"):
        return ADAPTERS["causal_lm"](model)
    raise MMSpecError(
        f"mmspec has no adapter for model_type={model_type!r} ({type(model).__name__}). "
        f"Supported: {sorted(k for k in ADAPTERS if k != 'causal_lm')} and text-only causal LMs "
        "(as drafts). Add one module under mmspec/models/ for a new family."
    )
