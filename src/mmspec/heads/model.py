"""Feature-level draft heads: a small decoder that drafts from the TARGET's own hidden states.

A head sees, at each position t, a feature of the target at t and the embedding of the token
that follows (t + 1), and predicts the target's feature at t + 1, whose LM-head logits give the
token at t + 2 (EAGLE, Li et al. 2024). For a vision-language target, the target's features at
image positions carry the image: that is how the vision reaches the head (SpecVLM's EagleVLM).
Three variants (``HeadConfig.variant``):

* ``eagle`` (EAGLE-1/2): the target's last (post-norm) hidden state + the token embedding,
  fused by one linear layer; scored with the target's frozen LM head.
* ``eagle3`` (EAGLE-3): a low, a middle and a high layer of the target fused into one feature
  (then as eagle); its own LM head over a draft vocabulary with a draft -> target id map; trained
  with training-time test (it learns from its own predicted features: :mod:`mmspec.train.head`).
* ``msd`` (MSD, decoupled modality): as eagle, but at positions whose token is an image
  placeholder the head reads the target's feature alone (the placeholder's embedding carries
  nothing), through a projection of its own; trained text-first, then multimodal.

The head's decoder is ``num_layers`` Llama layers at the target's width (transformers' own
``LlamaModel``, fed ``inputs_embeds``; its token embedding is a 1-row stub). It keeps its own KV
cache, driven by :class:`mmspec.heads.drafter.HeadDrafter` through the engine's drafter
interface. A head saves as a directory (``mmspec_head.json`` + ``model.safetensors``) holding
only its own weights; the target's embedding and LM head are borrowed at run time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmspec.errors import MMSpecError

VARIANTS = ("eagle", "eagle3", "msd")
CONFIG_NAME = "mmspec_head.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; saved as ``mmspec_head.json``."""

    variant: str
    hidden_size: int  # the target's width
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (scores are over it)
    feature_layers: tuple[int, ...]  # target decoder layers read (-1: the final, post-norm one)
    target_num_layers: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None  # eagle3: its own LM head's size
    image_token_id: int | None = None  # msd: positions holding this token read the feature alone
    target_model_type: str = ""
    trained: dict = field(default_factory=dict)  # the recipe that trained it (train head records it)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise MMSpecError(f"unknown head variant {self.variant!r}; use one of {', '.join(VARIANTS)}")
        self.feature_layers = tuple(int(i) for i in self.feature_layers)

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.feature_layers)


def default_feature_layers(variant: str, n_layers: int) -> tuple[int, ...]:
    """eagle / msd: the target's final (post-norm) state. eagle3: a low, middle and high layer
    (decoder-layer outputs), as EAGLE-3 fuses them."""
    if variant == "eagle3":
        return (min(1, n_layers - 1), n_layers // 2, max(n_layers - 2, 0))
    return (-1,)


class FeatureHead(nn.Module):
    """The head's weights: the fusion layers, its decoder, and (eagle3) its own LM head."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.config = cfg
        H = cfg.hidden_size
        self.fuse = nn.Linear(cfg.feature_size, H, bias=False) if len(cfg.feature_layers) > 1 else nn.Identity()
        self.fc = nn.Linear(2 * H, H, bias=False)  # [feature; embedding of the next token] -> H
        self.fc_image = nn.Linear(H, H, bias=False) if cfg.variant == "msd" else None
        lcfg = LlamaConfig(vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                           hidden_size=H, intermediate_size=cfg.intermediate_size,
                           num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                           num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
                           max_position_embeddings=cfg.max_position_embeddings)
        if cfg.rope_parameters:
            lcfg.rope_parameters = dict(cfg.rope_parameters)
        lcfg._attn_implementation = "sdpa"
        self.decoder = LlamaModel(lcfg)
        self.decoder.embed_tokens.weight.requires_grad_(False)  # a 1-row stub: the head is fed inputs_embeds
        self.lm_head = None
        if cfg.variant == "eagle3":
            n = cfg.draft_vocab_size or cfg.vocab_size
            self.lm_head = nn.Linear(H, n, bias=False)
            self.register_buffer("d2t", torch.arange(n), persistent=True)  # draft id -> target id
        from mmspec.models.base import cache_argument

        self._cache_kw = cache_argument(self.decoder)

    # ------------------------------------------------------------------ forward
    def fused(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] -> the head's feature space [..., H]."""
        return self.fuse(target_features)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, image: torch.Tensor | None = None, *,
                cache=None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """feats [B, n, H] (fused target features, or the head's own predictions), embeds
        [B, n, H] (embeddings of the tokens that follow them), image [B, n] bool (msd: the
        following token is an image placeholder) -> predicted next features [B, n, H]."""
        x = self.fc(torch.cat([feats, embeds], dim=-1))
        if self.fc_image is not None and image is not None:
            x = torch.where(image[..., None], self.fc_image(feats), x)
        kw = {self._cache_kw: cache} if cache is not None else {}
        out = self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=cache is not None, **kw)
        return out.last_hidden_state

    def logits(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Predicted features [..., H] -> logits over the TARGET's vocabulary [..., V].
        eagle / msd: the target's own LM head; eagle3: its own head over the draft vocabulary,
        placed at the target ids of ``d2t`` (every other id -inf)."""
        if self.lm_head is None:
            return target_lm_head(h)
        small = self.lm_head(h)  # [..., V_draft]
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, small)

    def new_cache(self, max_len: int, static: bool = False):
        from mmspec.models.cache import new_decode_cache

        return new_decode_cache(self.decoder.config, max_len, static=static)

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=1))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME))
        return path


def is_head_dir(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / CONFIG_NAME).is_file()


def build_head(target, variant: str = "eagle", *, num_layers: int = 1, feature_layers=None,
               draft_vocab: torch.Tensor | None = None, seed: int = 0) -> FeatureHead:
    """An untrained head for a loaded target (an HF model or an adapter), at the target's width,
    on its device and in its dtype. ``draft_vocab`` (eagle3): target ids of the draft vocabulary."""
    from mmspec.models.base import ModelAdapter, adapter_for

    adapter = target if isinstance(target, ModelAdapter) else adapter_for(target)
    tc = adapter.model.config.get_text_config(decoder=True)
    n_layers = adapter.num_layers
    cfg = HeadConfig(
        variant=variant, hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        intermediate_size=tc.intermediate_size, vocab_size=adapter.vocab_size,
        feature_layers=tuple(feature_layers) if feature_layers else default_feature_layers(variant, n_layers),
        target_num_layers=n_layers, num_layers=num_layers, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=dict(getattr(tc, "rope_parameters", None) or {}) or None,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()),
        image_token_id=adapter.image_token_id, target_model_type=str(getattr(adapter.model.config, "model_type", "")))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = FeatureHead(cfg)
    if draft_vocab is not None:
        head.d2t.copy_(draft_vocab.long())
    return head.to(device=adapter.device, dtype=adapter.dtype).eval()


def load_head(path: str | Path, target=None) -> FeatureHead:
    """A head saved with :meth:`FeatureHead.save`; checked against ``target`` when given."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise MMSpecError(f"'{path}' is not a draft head directory (no {CONFIG_NAME}); save one with "
                          "mmspec train head or FeatureHead.save()")
    raw = json.loads((path / CONFIG_NAME).read_text())
    cfg = HeadConfig(**raw)
    head = FeatureHead(cfg)
    if not (path / WEIGHTS_NAME).is_file():
        raise MMSpecError(f"'{path}' has no {WEIGHTS_NAME}; the head's weights are missing")
    missing, unexpected = head.load_state_dict(load_file(str(path / WEIGHTS_NAME)), strict=False)
    if missing or unexpected:
        raise MMSpecError(f"the head in '{path}' does not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}); re-save it with this mmspec version")
    if target is not None:
        check_head_fits(head, target)
        from mmspec.models.base import ModelAdapter, adapter_for

        adapter = target if isinstance(target, ModelAdapter) else adapter_for(target)
        head = head.to(device=adapter.device, dtype=adapter.dtype)
    return head.eval()


def check_head_fits(head: FeatureHead, target) -> None:
    """Refuse a head made for another target: width, vocabulary and the layers it reads."""
    from mmspec.models.base import ModelAdapter, adapter_for

    adapter = target if isinstance(target, ModelAdapter) else adapter_for(target)
    cfg = head.config
    tc = adapter.model.config.get_text_config(decoder=True)
    problems = []
    if cfg.hidden_size != tc.hidden_size:
        problems.append(f"width {cfg.hidden_size} vs the target's {tc.hidden_size}")
    if cfg.vocab_size != adapter.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {adapter.vocab_size}")
    if any(i >= adapter.num_layers for i in cfg.feature_layers):
        problems.append(f"it reads layers {cfg.feature_layers} of a target with {adapter.num_layers}")
    if problems:
        raise MMSpecError("this draft head was made for another target (" + "; ".join(problems)
                          + "); train one for this target with mmspec train head --target DIR")
