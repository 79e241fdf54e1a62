"""Heads the ecosystem trained, and ours for its engines: import and export of EAGLE checkpoints.

Two formats, read from their projects' loaders (tensor names and config fields; no code taken):

* ``eagle`` — EAGLE-1/2 (SafeAILab/EAGLE ``cnets1.py``; SGLang ``LlamaForCausalLMEagle``): a
  Llama ``config.json`` (``bias``: whether ``fc`` has one, default true) and ``pytorch_model.bin``
  (or safetensors) holding ``fc.{weight,bias}`` over [token embedding; target's last post-norm
  state] (embedding FIRST), ``layers.{i}.*`` Llama layers whose first has no ``input_layernorm``,
  no final norm, and ``embed_tokens.weight`` (a copy of the target's). Scored with the target's
  LM head. Maps onto an mmspec ``eagle`` head (``layer="eagle"``); ``fc``'s two halves swap.
* ``eagle3`` — EAGLE-3 as SafeAILab's ``cnets.py``, SpecForge, SGLang and vLLM read it
  (``architectures: ["LlamaForCausalLMEagle3"]``): ``fc.weight`` [H, 3H] over the target's
  low/mid/high features, ``midlayer.*`` (q/k/v over 2H, ``input_layernorm`` on the embedding,
  ``hidden_norm`` on the feature, ``post_attention_layernorm``, ``mlp``), ``norm.weight``,
  ``lm_head.weight`` [V_draft, H], ``draft_vocab_size`` in the config (always), and for a
  reduced vocabulary only (V_draft < V) ``d2t`` [V_draft] int64 OFFSETS (target id = draft id +
  d2t[draft id]) and ``t2d`` [V] bool: vLLM's ``Eagle3LlamaForCausalLM`` makes the parameter
  ``d2t`` loads into only when ``draft_vocab_size`` differs from the target's vocabulary (and
  refuses the tensor otherwise); a head without them scores target ids directly. The feature layers:
  SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as decoder-layer OUTPUT ids;
  vLLM and ``speculators`` read the top-level ``eagle_aux_hidden_state_layer_ids`` as
  "hidden state before layer j" (= output of layer j - 1); with neither, both capture the
  outputs of layers 1, N/2 - 1 and N - 4. Export writes both fields, each in its reader's
  convention. ``speculators``' own layout (``Eagle3Speculator``: ``layers.0.*`` for
  ``midlayer.*``, a nested ``transformer_layer_config``) is read too.

Import (:func:`load_external_head`) checks the head against the target before building
anything; export (:func:`export_head`) validates, writes into a temporary directory and renames
it into place. :func:`detect_format` says which format a directory holds, from its config and
tensor names (never its name).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch

from mmspec.errors import MMSpecError, article
from mmspec.heads.model import CONFIG_NAME, FeatureHead, HeadConfig

FORMATS = ("eagle3", "eagle")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLMEagle"  # SGLang's name; SafeAILab's loader ignores architectures
_LAYER_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "post_attention_layernorm.weight")


# --------------------------------------------------------------------------- reading a directory
def _read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise MMSpecError(f"'{f}' is not valid JSON ({e.msg}); re-download or re-export the head") from None


def _weight_files(path: Path) -> list[Path]:
    st = sorted(path.glob("*.safetensors"))
    if st:
        return st
    return [p for p in (path / "pytorch_model.bin",) if p.is_file()]


def _tensor_names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                names.update(h.keys())
        else:
            names.update(_load_bin(f, mmap=True).keys())  # names only: nothing is read in
    return names


def _load_bin(f: Path, mmap: bool = False) -> dict:
    try:
        return torch.load(str(f), map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:  # code in the pickle, or a broken file
        raise MMSpecError(f"cannot read '{f}' as plain tensors ({type(e).__name__}); "
                          "convert it to model.safetensors") from None


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        state.update(load_file(str(f)) if f.suffix == ".safetensors" else _load_bin(f))
    return state


def detect_format(path) -> str | None:
    """``"mmspec"``, ``"eagle3"``, ``"speculators-eagle3"``, ``"eagle"`` or None (not a head)."""
    if not isinstance(path, (str, os.PathLike)) or not Path(path).is_dir():
        return None
    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        return "mmspec"
    cfg = _read_config(path)
    if not cfg or not _weight_files(path):
        return None
    arch = " ".join(cfg.get("architectures") or [])
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in arch:
        return "speculators-eagle3"
    if "Eagle3" in arch:
        return "eagle3"
    if "text_config" in cfg or "vision_config" in cfg or int(cfg.get("num_hidden_layers") or 0) > 4:
        return None  # a model, not a head: its tensors are not scanned
    names = _tensor_names(path)
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    return None


def is_external_head_dir(path) -> bool:
    return detect_format(path) in ("eagle3", "speculators-eagle3", "eagle")


# --------------------------------------------------------------------------- import
def _rope_parameters(cfg: dict) -> dict | None:
    """transformers 5's ``rope_parameters`` from a config's ``rope_theta`` / ``rope_scaling``
    (or its own ``rope_parameters``). M-RoPE (Qwen2-VL's) runs as plain RoPE over 1-D positions."""
    if cfg.get("rope_parameters"):
        rp = dict(cfg["rope_parameters"])
    else:
        rp = dict(cfg.get("rope_scaling") or {})
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
        rp["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    if rp.get("rope_type") in (None, "mrope"):
        rp["rope_type"] = "default"
    return rp


def _target_info(target):
    from mmspec.models.base import ModelAdapter, adapter_for

    adapter = target if isinstance(target, ModelAdapter) else adapter_for(target)
    return adapter, adapter.model.config.get_text_config(decoder=True)


def _aux_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    """The target decoder layers (their outputs) an EAGLE-3 head reads, in mmspec's convention."""
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sgl:  # the engines concatenate the captured states in layer order, whatever the list's
        return tuple(sorted(int(i) for i in sgl))
    if vllm:
        return tuple(sorted(int(i) - 1 for i in vllm))  # vLLM: the state before layer j
    return (1, n_layers // 2 - 1, n_layers - 4)


def _check_fits(kind: str, path: Path, cfg: dict, *, hidden: int, vocab: int, layers, adapter, tc) -> None:
    """Refuse a head made for another target before any tensor is built."""
    problems = []
    if hidden != tc.hidden_size:
        problems.append(f"width {hidden} vs the target's {tc.hidden_size}")
    if vocab != adapter.vocab_size:
        problems.append(f"vocabulary {vocab} vs the target's {adapter.vocab_size}")
    n = adapter.num_layers
    if any(i < 0 or i >= n for i in layers):
        problems.append(f"it reads the outputs of layers {list(layers)} of a target with {n} decoder layers")
    made_for = (cfg.get("mmspec") or {}).get("target_model_type")
    model_type = str(getattr(adapter.model.config, "model_type", ""))
    if made_for and made_for != model_type:
        problems.append(f"it was exported from a {made_for} target, this one is {model_type}")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("architectures") or []
    own = list(getattr(adapter.model.config, "architectures", None) or [])
    if verifier and own and not set(verifier) & set(own):
        problems.append(f"it was trained for a {verifier[0]} target, this one is {own[0]}")
    if "mrope_section" in (cfg.get("rope_scaling") or {}) and "mrope_section" not in (
            getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}):
        problems.append("it uses M-RoPE (a Qwen2-VL-family head) and this target does not")
    if problems:
        raise MMSpecError(f"the {kind} head in '{path}' does not fit this target (" + "; ".join(problems)
                          + "); use a head trained for this target, or train one with mmspec train head")


def _common(cfg: dict, tc) -> dict:
    return {"hidden_size": int(cfg["hidden_size"]), "num_attention_heads": int(cfg["num_attention_heads"]),
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            "intermediate_size": int(cfg["intermediate_size"]), "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_parameters": _rope_parameters(cfg),
            "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096),
            "head_dim": cfg.get("head_dim")}


def _refuse_extras(kind: str, path: Path, cfg: dict, state: dict, allowed) -> None:
    flags = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "add_para_norm",
                         "attention_bias", "mlp_bias") if cfg.get(k)]
    extra = sorted(k for k in state if not allowed(k))
    if flags or extra:
        what = ", ".join(flags + extra[:4])
        raise MMSpecError(f"the {kind} head in '{path}' uses parts mmspec's {kind} layer does not have ({what}); "
                          "only the standard layout loads: use a head without them")


def _missing(kind: str, path: Path, state: dict, names) -> None:
    gone = [n for n in names if n not in state]
    if gone:
        raise MMSpecError(f"the {kind} head in '{path}' lacks {', '.join(gone[:4])}; the checkpoint is "
                          "incomplete: re-download or re-export it")


def _load_eagle3(path: Path, cfg: dict, target, speculators: bool) -> FeatureHead:
    adapter, tc = _target_info(target)
    if speculators:
        layer_cfg = dict(cfg.get("transformer_layer_config") or {})
        flat = {**layer_cfg, **{k: v for k, v in cfg.items() if k in ("draft_vocab_size", "norm_before_residual",
                                                                      "norm_before_fc", "fc_norm", "norm_output")}}
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(sorted(int(i) - 1 for i in ids)) if ids else (1, adapter.num_layers // 2 - 1, adapter.num_layers - 4)
        prefix = "layers.0."
    else:
        flat, prefix = cfg, "midlayer."
        layers = _aux_layers(cfg, adapter.num_layers)
    if not flat.get("hidden_size"):
        raise MMSpecError(f"'{path}/config.json' has no hidden_size; it is not an EAGLE-3 head config")
    if int(flat.get("num_hidden_layers", 1)) != 1:
        raise MMSpecError(f"the EAGLE-3 head in '{path}' has {flat['num_hidden_layers']} layers; SGLang and vLLM "
                          "disagree on the layers after the first, so only one-layer EAGLE-3 heads load")
    th = flat.get("target_hidden_size")
    hidden = int(th if th else flat["hidden_size"])
    if hidden != int(flat["hidden_size"]):
        raise MMSpecError(f"the EAGLE-3 head in '{path}' is narrower than its target ({flat['hidden_size']} vs "
                          f"{hidden}); mmspec heads run at the target's width: use a head of the target's width")
    _check_fits("EAGLE-3", path, flat, hidden=hidden, vocab=int(flat.get("vocab_size") or adapter.vocab_size),
                layers=layers, adapter=adapter, tc=tc)
    state = _load_weights(path)
    renames = {"fc.weight": "fc.weight", "norm.weight": "lm_head.norm.weight", "lm_head.weight": "lm_head.linear.weight"}
    for part in _LAYER_PARTS + ("input_layernorm.weight", "hidden_norm.weight"):
        renames[prefix + part] = "decoder.layers.0." + part
    _refuse_extras("EAGLE-3", path, flat, state, lambda k: k in renames or k in ("d2t", "t2d", "embed_tokens.weight"))
    _missing("EAGLE-3", path, state, list(renames))
    n_draft = int(state["lm_head.weight"].shape[0])
    if "embed_tokens.weight" in state and tuple(state["embed_tokens.weight"].shape) != (adapter.vocab_size, hidden):
        raise MMSpecError(f"the EAGLE-3 head in '{path}' embeds a vocabulary of {state['embed_tokens.weight'].shape[0]}"
                          f" tokens, the target has {adapter.vocab_size}; use a head trained for this target")
    d2t = state["d2t"].long() + torch.arange(n_draft) if "d2t" in state else torch.arange(n_draft)
    if d2t.numel() != n_draft or (d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= adapter.vocab_size)):
        raise MMSpecError(f"the EAGLE-3 head in '{path}' maps its {n_draft} draft ids outside the target's vocabulary"
                          f" of {adapter.vocab_size}; use a head trained for this target's tokenizer")
    hc = HeadConfig(variant="eagle3", vocab_size=adapter.vocab_size, feature_layers=layers,
                    target_num_layers=adapter.num_layers, num_layers=1, draft_vocab_size=n_draft,
                    image_token_id=adapter.image_token_id,
                    target_model_type=str(getattr(adapter.model.config, "model_type", "")),
                    source={"format": "speculators-eagle3" if speculators else "eagle3", "path": str(path)},
                    **{**_common(flat, tc), "hidden_size": hidden})
    head = FeatureHead(hc).to(adapter.dtype)  # the weights land in the dtype the head runs in
    mapped = {renames[k]: v for k, v in state.items() if k in renames}
    mapped["d2t"] = d2t
    _assign(head, mapped, path)
    return head


def _load_eagle(path: Path, cfg: dict, target) -> FeatureHead:
    adapter, tc = _target_info(target)
    if not cfg.get("hidden_size"):
        raise MMSpecError(f"'{path}/config.json' has no hidden_size; it is not an EAGLE head config")
    H, n = int(cfg["hidden_size"]), int(cfg.get("num_hidden_layers", 1))
    _check_fits("EAGLE", path, cfg, hidden=H, vocab=int(cfg.get("vocab_size") or adapter.vocab_size), layers=(),
                adapter=adapter, tc=tc)
    state = _load_weights(path)
    renames = {f"layers.{i}.{p}": f"decoder.layers.{i}.{p}" for i in range(n) for p in _LAYER_PARTS}
    renames.update({f"layers.{i}.input_layernorm.weight": f"decoder.layers.{i}.input_layernorm.weight"
                    for i in range(1, n)})
    _refuse_extras("EAGLE", path, cfg, state,
                   lambda k: k in renames or k in ("fc.weight", "fc.bias", "embed_tokens.weight"))
    _missing("EAGLE", path, state, ["fc.weight", *renames])
    if tuple(state["fc.weight"].shape) != (H, 2 * H):
        raise MMSpecError(f"the EAGLE head in '{path}' has an fc of shape {tuple(state['fc.weight'].shape)}, not "
                          f"({H}, {2 * H}); it is not an EAGLE-1/2 head")
    hc = HeadConfig(variant="eagle", vocab_size=adapter.vocab_size, feature_layers=(-1,),
                    target_num_layers=adapter.num_layers, num_layers=n, image_token_id=adapter.image_token_id,
                    target_model_type=str(getattr(adapter.model.config, "model_type", "")), layer="eagle",
                    source={"format": "eagle", "path": str(path)}, **_common(cfg, tc))
    head = FeatureHead(hc).to(adapter.dtype)  # the weights land in the dtype the head runs in
    mapped = {renames[k]: v for k, v in state.items() if k in renames}
    w = state["fc.weight"]  # [H, 2H] over [embedding; feature]; mmspec's fc reads [feature; embedding]
    mapped["fc.weight"] = torch.cat([w[:, H:], w[:, :H]], dim=1)
    mapped["fc.bias"] = state.get("fc.bias", torch.zeros(H, dtype=w.dtype))
    _assign(head, mapped, path)
    return head


def _assign(head: FeatureHead, mapped: dict, path: Path) -> None:
    own = head.state_dict()
    expected = {k for k in own if not k.startswith("decoder.embed_tokens.")}
    for k, v in mapped.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise MMSpecError(f"the head in '{path}' has {k.replace('decoder.', '')} of shape {tuple(v.shape)}, its "
                              f"config implies {tuple(own[k].shape)}; the config and weights disagree: re-export it")
    missing = sorted(expected - set(mapped))
    if missing:
        raise MMSpecError(f"the head in '{path}' lacks {', '.join(missing[:4])}; re-export it")
    with torch.no_grad():
        for k, v in mapped.items():
            own[k].copy_(v.to(own[k].dtype) if own[k].is_floating_point() else v)


def load_external_head(path, target) -> FeatureHead:
    """An EAGLE-1/2 or EAGLE-3 head directory (SafeAILab, SpecForge, SGLang, vLLM, speculators)
    as an mmspec :class:`FeatureHead`, checked against ``target`` (an HF model or an adapter)
    and placed on its device in its dtype."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt not in ("eagle3", "speculators-eagle3", "eagle"):
        raise MMSpecError(f"'{path}' is not an EAGLE, EAGLE-3 or mmspec head directory (no config.json with "
                          "an EAGLE layout and weights); pass a head directory")
    cfg = _read_config(path)
    head = _load_eagle(path, cfg, target) if fmt == "eagle" else _load_eagle3(path, cfg, target, fmt != "eagle3")
    adapter, _ = _target_info(target)
    return head.to(device=adapter.device, dtype=adapter.dtype).eval()


# --------------------------------------------------------------------------- export
def _check_exportable(head: FeatureHead, fmt: str) -> None:
    c = head.config
    if fmt not in FORMATS:
        raise MMSpecError(f"unknown head format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "eagle3":
        if c.variant != "eagle3":
            raise MMSpecError(f"{article(c.variant)} {c.variant} head cannot be written as EAGLE-3 (it reads other features); "
                              "export it with --format eagle, or train an eagle3 head")
        if c.num_layers != 1:
            raise MMSpecError(f"this eagle3 head has {c.num_layers} layers; SGLang and vLLM disagree on the layers "
                              "after the first: train a one-layer head (the default) to export it")
        fl = list(c.feature_layers)
        if len(fl) != 3 or min(fl) < 0 or fl != sorted(set(fl)):
            raise MMSpecError(f"this eagle3 head reads layers {fl}; the engines fuse three distinct decoder-layer "
                              "outputs in layer order: train it with three ascending feature layers")
    else:
        if c.variant != "eagle" or c.layer != "eagle":
            raise MMSpecError(f"{article(c.variant)} {c.variant} head with the {c.layer} layer cannot be written as EAGLE-1/2 (its "
                              "layer differs from EAGLE's); train an eagle head with this mmspec version")
        if c.feature_layers != (-1,):
            raise MMSpecError(f"this eagle head reads layers {list(c.feature_layers)}; EAGLE-1/2 reads the target's "
                              "final state only: train it with the default feature layers")


def _rope_fields(c: HeadConfig) -> dict:
    rp = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    theta = float(rp.pop("rope_theta", 10000.0))
    scaling = None if rp.get("rope_type", "default") == "default" and "mrope_section" not in rp else rp
    return {"rope_theta": theta, "rope_scaling": scaling}


def _base_config(c: HeadConfig, dtype: torch.dtype) -> dict:
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim or c.hidden_size // c.num_attention_heads, "num_hidden_layers": c.num_layers,
            "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            **_rope_fields(c), "vocab_size": c.vocab_size, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).replace("torch.", ""),
            "mmspec": {"variant": c.variant, "target_model_type": c.target_model_type,
                       "target_num_layers": c.target_num_layers, "feature_layers": list(c.feature_layers),
                       "trained": c.trained}}


def _eagle3_files(head: FeatureHead) -> tuple[dict, dict]:
    c = head.config
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    n = int(sd["d2t"].numel())
    out = {"fc.weight": sd["fc.weight"], "norm.weight": sd["lm_head.norm.weight"],
           "lm_head.weight": sd["lm_head.linear.weight"]}
    for k, v in sd.items():
        if k.startswith("decoder.layers.0."):
            out["midlayer." + k[len("decoder.layers.0."):]] = v
    if n != c.vocab_size:  # a reduced vocabulary: the mapping vLLM and SGLang read (module docstring)
        out["d2t"] = (sd["d2t"].long() - torch.arange(n)).contiguous()  # offsets: target id - draft id
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[sd["d2t"].long()] = True
        out["t2d"] = t2d
    elif not torch.equal(sd["d2t"].long(), torch.arange(n)):  # the whole vocabulary in another order: no engine reads it
        raise MMSpecError("this eagle3 head scores the whole vocabulary in another order than the target's; vLLM "
                          "and SGLang read a draft-to-target mapping only for a reduced vocabulary: retrain it")
    cfg = {"architectures": [EAGLE3_ARCH], **_base_config(c, sd["fc.weight"].dtype), "draft_vocab_size": n,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers), "use_aux_hidden_state": True},
           "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.feature_layers]}  # vLLM: the state BEFORE layer j
    return cfg, out


def _eagle_files(head: FeatureHead, embedding: torch.Tensor) -> tuple[dict, dict]:
    c, H = head.config, head.config.hidden_size
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    w = sd["fc.weight"]  # [H, 2H] over [feature; embedding] -> EAGLE's [embedding; feature]
    out = {"fc.weight": torch.cat([w[:, H:], w[:, :H]], dim=1).contiguous(), "fc.bias": sd["fc.bias"],
           "embed_tokens.weight": embedding.detach().cpu().to(w.dtype).contiguous()}
    for k, v in sd.items():
        if k.startswith("decoder.layers."):
            out[k[len("decoder."):]] = v
    cfg = {"architectures": [EAGLE_ARCH], **_base_config(c, w.dtype), "bias": True}
    return cfg, out


def export_head(head: FeatureHead, out, fmt: str = "eagle3", *, target=None) -> Path:
    """Write ``head`` as an EAGLE-3 (``fmt="eagle3"``: SGLang, vLLM, SpecForge, speculators'
    converter) or EAGLE-1/2 (``fmt="eagle"``: SafeAILab's EaModel, SGLang's EAGLE) directory at
    ``out``. ``target`` (an HF model or adapter) is needed for ``eagle``: EAGLE-1/2's loader reads
    the token embedding from the head file. Refuses a non-empty ``out``; writes atomically."""
    _check_exportable(head, fmt)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MMSpecError(f"'{out}' exists and is not empty; export into a new directory (nothing was written)")
    embedding = None
    if fmt == "eagle":
        if target is None:
            raise MMSpecError("an EAGLE-1/2 export carries the target's token embedding (EAGLE's loader reads it "
                              "from the head file): pass the target (--target DIR)")
        adapter, tc = _target_info(target)
        if tc.hidden_size != head.config.hidden_size or adapter.vocab_size != head.config.vocab_size:
            raise MMSpecError("this target is not the head's (width or vocabulary differ); pass the target the "
                              "head was trained for")
        embedding = adapter.model.get_input_embeddings().weight
    cfg, tensors = _eagle3_files(head) if fmt == "eagle3" else _eagle_files(head, embedding)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=str(out.parent)))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if fmt == "eagle3":
            from safetensors.torch import save_file

            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(tensors, str(tmp / "pytorch_model.bin"))
        for f in tmp.iterdir():  # readable by others: a serving container often runs as another user
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp made it 0700
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
