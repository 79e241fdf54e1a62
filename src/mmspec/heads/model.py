"""Feature-level draft heads: a small decoder that drafts from the TARGET's own hidden states.

A head sees, at each position t, a feature of the target at t and the embedding of the token
that follows (t + 1), and predicts the target's feature at t + 1, whose LM-head logits give the
token at t + 2 (EAGLE, Li et al. 2024). For a vision-language target, the target's features at
image positions carry the image: that is how the vision reaches the head (SpecVLM's EagleVLM).
Three variants (``HeadConfig.variant``):

* ``eagle`` (EAGLE-1/2): the target's last (post-norm) hidden state + the token embedding,
  fused by one linear layer (with a bias) into EAGLE-1/2's decoder: its first layer has no input
  norm and there is no final norm; scored with the target's frozen LM head.
* ``eagle3`` (EAGLE-3): a low, a middle and a high layer of the target fused into one feature by
  ``fc``, then EAGLE-3's own first layer (:class:`Eagle3Layer`: attention over
  [input_norm(token embedding); hidden_norm(feature)], twice the width, the feature alone as the
  residual); a final norm and its own LM head over a draft vocabulary with a draft -> target id
  map; trained with training-time test (it learns from its own predicted features:
  :mod:`mmspec.train.head`).
* ``msd`` (MSD, decoupled modality): as eagle, but at positions whose token is an image
  placeholder the head reads the target's feature alone (the placeholder's embedding carries
  nothing), through a projection of its own; trained text-first, then multimodal. Its decoder is
  plain Llama layers (``layer="llama"``: input norms and a final norm).

The head's decoder is ``num_layers`` Llama layers at the target's width (transformers' own
``LlamaModel``, fed ``inputs_embeds``; its token embedding is a 1-row stub); the layer kind
(``HeadConfig.layer``) swaps in EAGLE's first layer, so a checkpoint of SafeAILab's EAGLE, of
SpecForge, SGLang or vLLM maps onto it tensor for tensor (:mod:`mmspec.heads.formats`). It keeps
its own KV cache, driven by :class:`mmspec.heads.drafter.HeadDrafter` through the engine's drafter
interface. A head saves as a directory (``mmspec_head.json`` + ``model.safetensors``) holding
only its own weights; the target's embedding (and, but for eagle3, its LM head) are borrowed at
run time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmspec.errors import MMSpecError, article
from mmspec.heads.positions import MRoPE, mrope_section
from mmspec.models.rows import full_attention

VARIANTS = ("eagle", "eagle3", "msd")
LAYERS = ("eagle", "eagle3", "llama")  # the decoder's first layer (HeadConfig.layer)
DEFAULT_LAYER = {"eagle": "eagle", "eagle3": "eagle3", "msd": "llama"}
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
    feature_layers: tuple[int, ...]  # target decoder layers read (their outputs; -1: the final, post-norm one)
    target_num_layers: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None  # eagle3: its own LM head's size
    image_token_id: int | None = None  # msd: positions holding this token read the feature alone
    target_model_type: str = ""
    trained: dict = field(default_factory=dict)  # the recipe that trained it (train head records it)
    layer: str = ""  # "eagle" (EAGLE-1/2's), "eagle3" (EAGLE-3's), "llama" (plain); "": the variant's own
    head_dim: int | None = None  # attention head width; None: hidden_size // num_attention_heads
    source: dict = field(default_factory=dict)  # an imported head: the format and path it came from

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise MMSpecError(f"unknown head variant {self.variant!r}; use one of {', '.join(VARIANTS)}")
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        self.layer = self.layer or DEFAULT_LAYER[self.variant]
        if self.layer not in LAYERS:
            raise MMSpecError(f"unknown head layer {self.layer!r}; use one of {', '.join(LAYERS)}")
        if (self.layer == "eagle3") != (self.variant == "eagle3"):
            raise MMSpecError(f"{article(self.variant)} {self.variant} head cannot use the {self.layer} layer: only eagle3 heads "
                              "(and all of them) use EAGLE-3's layer")

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.feature_layers)


def default_feature_layers(variant: str, n_layers: int) -> tuple[int, ...]:
    """eagle / msd: the target's final (post-norm) state. eagle3: the outputs of decoder layers
    1, N/2 - 1 and N - 4 of an N-layer target, EAGLE-3's low, middle and high layer (SpecForge's,
    SGLang's and vLLM's default); in a shallow target (N < 8) moved apart so that they stay three
    distinct layers in ascending order, as the engines read them (3 layers: 0, 1, 2). A target of
    fewer than 3 layers has no three: its layers are clamped (such a head cannot be exported;
    ``mmspec train head`` refuses it: :func:`check_eagle3_layers`)."""
    if variant != "eagle3":
        return (-1,)
    last = n_layers - 1
    if n_layers < 3:
        return (min(1, last), min(max(n_layers // 2 - 1, 0), last), min(max(n_layers - 4, 0), last))
    low = min(1, n_layers - 3)
    mid = max(low + 1, min(n_layers // 2 - 1, n_layers - 2))
    return (low, mid, max(mid + 1, n_layers - 4))


def check_eagle3_layers(layers: Sequence[int], n_layers: int, given: str | None = None) -> None:
    """An eagle3 head's feature layers as SGLang and vLLM fuse them (and ``export head`` writes
    them): three distinct decoder layers of the target, in ascending order. ``given``: the
    ``--feature-layers`` text they came from (None: the default for this depth)."""
    fl = list(layers)
    if n_layers < 3:
        raise MMSpecError(f"an eagle3 head fuses the outputs of three distinct decoder layers (low, middle, high), "
                          f"and the target has {n_layers}; train --variant eagle (it reads the target's final state)")
    if len(fl) != 3 or fl != sorted(set(fl)) or not all(0 <= i < n_layers for i in fl):
        ok = ",".join(map(str, default_feature_layers("eagle3", n_layers)))
        where = f"--feature-layers {given!r}" if given is not None else f"the feature layers {fl}"
        raise MMSpecError(f"{where}: an eagle3 head fuses three distinct decoder-layer outputs in ascending order, "
                          f"as SGLang and vLLM read them (export head refuses other layers); give three ascending "
                          f"layers from 0 to {n_layers - 1}, e.g. --feature-layers {ok} (the default)")


def saved_layer(raw: dict) -> dict:
    """A saved ``mmspec_head.json`` with its ``layer`` named: one written before heads had layer
    kinds (no ``layer`` key) used plain Llama layers; such an eagle3 head cannot be rebuilt."""
    if "layer" in raw:
        return raw
    if raw.get("variant") == "eagle3":
        raise MMSpecError("this eagle3 head was saved before mmspec used EAGLE-3's own first layer, which its "
                          "weights do not fit; retrain it with mmspec train head --variant eagle3")
    return {**raw, "layer": "llama"}


class Eagle3Layer(nn.Module):
    """EAGLE-3's first decoder layer, from transformers' public Llama modules (H: the width).

    residual = f (the fused feature, [B, n, H]); x = [input_layernorm(e); hidden_norm(f)] [B, n, 2H]
    (e: the next token's embedding); h = f + o_proj(attention(x)) with q/k/v over 2H;
    out = h + mlp(post_attention_layernorm(h)) [B, n, H]. Parameter names are EAGLE-3's
    (``midlayer.*`` in SpecForge / SGLang checkpoints). Called by ``LlamaModel`` in place of its
    first layer, with [e; f] as its ``inputs_embeds``: the layer splits it back.
    """

    def __init__(self, lcfg):
        super().__init__()
        import copy

        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaMLP,
            LlamaRMSNorm,
        )

        H = lcfg.hidden_size
        wide = copy.deepcopy(lcfg)  # q/k/v read 2H; heads keep their width
        wide.hidden_size, wide.head_dim = 2 * H, lcfg.head_dim
        self.hidden_size = H
        self.self_attn = LlamaAttention(wide, layer_idx=0)
        self.self_attn.o_proj = nn.Linear(lcfg.num_attention_heads * lcfg.head_dim, H, bias=False)  # back to H
        self.mlp = LlamaMLP(lcfg)
        self.input_layernorm = LlamaRMSNorm(H, eps=lcfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(H, eps=lcfg.rms_norm_eps)  # on the fused feature
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=lcfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None,
                **kwargs) -> torch.Tensor:
        """hidden_states [B, n, 2H] = [embedding; fused feature] -> [B, n, H]."""
        e, f = hidden_states.split(self.hidden_size, dim=-1)  # each [B, n, H]
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(f)], dim=-1)  # [B, n, 2H]
        kwargs.pop("position_ids", None)
        kwargs.pop("use_cache", None)
        a, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                              attention_mask=attention_mask, **kwargs)
        h = f + a  # [B, n, H]: the feature alone is the residual
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftLMHead(nn.Module):
    """EAGLE-3's output: the final norm, then a linear map onto the draft vocabulary."""

    def __init__(self, hidden_size: int, n: int, eps: float):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(hidden_size, eps=eps)
        self.linear = nn.Linear(hidden_size, n, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm, as the head's forward returns it) -> draft-vocabulary logits [..., V_draft]."""
        return self.linear(self.norm(h))


def llama_config(cfg: HeadConfig):
    """The transformers ``LlamaConfig`` of the head's decoder (also its KV cache's shape)."""
    from transformers import LlamaConfig

    lcfg = LlamaConfig(vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
                       max_position_embeddings=cfg.max_position_embeddings,
                       head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
    if cfg.rope_parameters:
        lcfg.rope_parameters = dict(cfg.rope_parameters)
    lcfg._attn_implementation = "sdpa"
    return lcfg


class FeatureHead(nn.Module):
    """The head's weights: the fusion layers, its decoder, and (eagle3) its own LM head."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        from transformers import LlamaModel

        self.config = cfg
        self.path: Path | None = None  # the directory it was loaded from (None: made or held in memory)
        H = cfg.hidden_size
        lcfg = llama_config(cfg)
        self.decoder = LlamaModel(lcfg)
        self.decoder.embed_tokens.weight.requires_grad_(False)  # a 1-row stub: the head is fed inputs_embeds
        section = mrope_section(cfg.rope_parameters)
        if section is not None:  # a Qwen2-VL-family target: the head reads its 3-D positions (heads/positions.py)
            self.decoder.rotary_emb = MRoPE(self.decoder.rotary_emb, section)
        self.fc_image = nn.Linear(H, H, bias=False) if cfg.variant == "msd" else None
        self.lm_head = None
        if cfg.layer == "eagle3":
            self.fc = nn.Linear(cfg.feature_size, H, bias=False)  # EAGLE-3's fc: [low; mid; high] -> H
            self.decoder.layers[0] = Eagle3Layer(lcfg)
            self.decoder.norm = nn.Identity()  # the final norm is applied for the logits only (DraftLMHead)
            n = cfg.draft_vocab_size or cfg.vocab_size
            self.lm_head = DraftLMHead(H, n, cfg.rms_norm_eps)
            self.register_buffer("d2t", torch.arange(n), persistent=True)  # draft id -> target id
        else:
            self.fuse = nn.Linear(cfg.feature_size, H, bias=False) if len(cfg.feature_layers) > 1 else nn.Identity()
            self.fc = nn.Linear(2 * H, H, bias=cfg.layer == "eagle")  # [feature; embedding of the next token] -> H
            if cfg.layer == "eagle":  # EAGLE-1/2: no norm before the first attention, none at the end
                self.decoder.layers[0].input_layernorm = nn.Identity()
                self.decoder.norm = nn.Identity()
        from mmspec.models.base import cache_argument

        self._cache_kw = cache_argument(self.decoder)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ------------------------------------------------------------------ forward
    def fused(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] -> the head's feature space [..., H]."""
        return self.fc(target_features) if self.config.layer == "eagle3" else self.fuse(target_features)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, image: torch.Tensor | None = None, *,
                cache=None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """feats [B, n, H] (fused target features, or the head's own predictions), embeds
        [B, n, H] (embeddings of the tokens that follow them), image [B, n] bool (msd: the
        following token is an image placeholder) -> predicted next features [B, n, H]
        (eagle3: before the final norm, as EAGLE-3 feeds them back)."""
        if self.config.layer == "eagle3":
            x = torch.cat([embeds, feats], dim=-1)  # [B, n, 2H]: Eagle3Layer splits it back
        else:
            x = self.fc(torch.cat([feats, embeds], dim=-1))
            if self.fc_image is not None and image is not None:
                x = torch.where(image[..., None], self.fc_image(feats), x)
        kw = {self._cache_kw: cache} if cache is not None else {}
        if position_ids is not None and position_ids.dim() == 3 and attention_mask is None:  # M-RoPE ids [3, B, n]
            attention_mask = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        out = self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=cache is not None, **kw)
        return out.last_hidden_state

    def logits(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Predicted features [..., H] -> logits over the TARGET's vocabulary [..., V].
        eagle / msd: the target's own LM head; eagle3: its own norm and head over the draft
        vocabulary, placed at the target ids of ``d2t`` (every other id -inf)."""
        if self.lm_head is None:
            return target_lm_head(h)
        small = self.lm_head(h)  # [..., V_draft]
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, small)

    @property
    def full_attention(self) -> bool:
        """The head's layers all attend over their whole past (what token trees need)."""
        return full_attention(self.decoder.config)

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=1))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME))
        for f in (path / CONFIG_NAME, path / WEIGHTS_NAME):  # safetensors writes 0600: a server running as
            f.chmod(0o644)  # another user could not read the head
        return path


def build_head(target, variant: str = "eagle", *, num_layers: int = 1, feature_layers=None,
               draft_vocab: torch.Tensor | None = None, seed: int = 0, layer: str = "") -> FeatureHead:
    """An untrained head for a loaded target (an HF model or an adapter), at the target's width,
    on its device and in its dtype. ``draft_vocab`` (eagle3): target ids of the draft vocabulary;
    ``layer``: the decoder's first layer ("": the variant's own, see :class:`HeadConfig`)."""
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
        image_token_id=adapter.image_token_id, target_model_type=str(getattr(adapter.model.config, "model_type", "")),
        layer=layer, head_dim=getattr(tc, "head_dim", None))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = FeatureHead(cfg)
    if draft_vocab is not None:
        head.d2t.copy_(draft_vocab.long())
    return head.to(device=adapter.device, dtype=adapter.dtype).eval()


_DAMAGED = "the head directory is damaged or incomplete: train it again (mmspec train head) or re-save it with FeatureHead.save()"


def read_head_config(path: str | Path) -> HeadConfig:
    """The :class:`HeadConfig` of a head directory, checked without building the head: the JSON
    parses, every field is there (and no unknown one), sizes are positive whole numbers. Reads
    nothing else; every problem is an MMSpecError naming the file and the fix."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise MMSpecError(f"'{path}' is not a draft head directory (no {CONFIG_NAME}); make one with "
                          "mmspec train head (or FeatureHead.save())")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MMSpecError(f"'{file}' is not valid JSON ({getattr(e, 'msg', e.__class__.__name__)}); {_DAMAGED}") from None
    if not isinstance(raw, dict):
        raise MMSpecError(f"'{file}' holds {type(raw).__name__}, not a head config object; {_DAMAGED}")
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(HeadConfig)}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in raw]
    unknown = sorted(set(raw) - set(fields))
    if missing or unknown:
        what = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                     f"unknown {', '.join(unknown)}" if unknown else "") if x)
        raise MMSpecError(f"'{file}' is not a head config this mmspec reads ({what}); {_DAMAGED}")
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                 "target_num_layers", "num_layers", "max_position_embeddings"):
        v = raw.get(name, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MMSpecError(f"'{file}': {name} must be a whole number >= 1, got {v!r}; {_DAMAGED}")
    layers = raw["feature_layers"]
    if (not isinstance(layers, list) or not layers
            or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)):
        raise MMSpecError(f"'{file}': feature_layers must be a non-empty list of layer numbers, got {layers!r}; "
                          f"{_DAMAGED}")
    if raw.get("variant") not in VARIANTS:
        raise MMSpecError(f"'{file}': unknown head variant {raw.get('variant')!r} (one of {', '.join(VARIANTS)}); "
                          f"{_DAMAGED}")
    return HeadConfig(**saved_layer(raw))


def check_head_dir(path: str | Path) -> HeadConfig:
    """A head directory as far as it can be checked without building the head: its config
    (:func:`read_head_config`) and its weights file's safetensors header. Returns the config."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg = read_head_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise MMSpecError(f"'{path}' has no {WEIGHTS_NAME}; the head's weights are missing ({_DAMAGED})")
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise MMSpecError(f"cannot read '{weights}' as safetensors ({_first_line(e)}); {_DAMAGED}") from None
    return cfg


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [e.__class__.__name__])[0]


def load_saved_head(path: str | Path, target=None) -> FeatureHead:
    """A head saved with :meth:`FeatureHead.save` (checked against ``target`` when given). A head
    directory of any kind: :func:`mmspec.heads.directory.load_head`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_head_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise MMSpecError(f"'{path}' has no {WEIGHTS_NAME}; the head's weights are missing ({_DAMAGED})")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise MMSpecError(f"cannot read '{weights}' as safetensors ({_first_line(e)}); {_DAMAGED}") from None
    head = FeatureHead(cfg)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config says
        raise MMSpecError(f"the weights in '{weights}' do not fit its {CONFIG_NAME} ({str(e).splitlines()[-1].strip()}); "
                          f"{_DAMAGED}") from None
    if missing or unexpected:
        raise MMSpecError(f"the head in '{path}' does not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}); re-save it with this mmspec version")
    head.path = path
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
    if any(i >= adapter.num_layers or i < -1 for i in cfg.feature_layers):
        problems.append(f"it reads layers {cfg.feature_layers} of a target with {adapter.num_layers}")
    if problems:
        raise MMSpecError("this draft head was made for another target (" + "; ".join(problems)
                          + "); train one for this target with mmspec train head --target DIR")
