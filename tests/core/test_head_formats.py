"""EAGLE-1/2 and EAGLE-3 head checkpoints (SafeAILab, SpecForge, SGLang, vLLM, speculators):
export -> import gives identical draft logits; checkpoints written by hand in those projects'
layouts (their tensor names, their config fields) load and score what an independent, written-out
EAGLE forward scores; imported heads decode losslessly (chain and tree); heads that do not fit the
target are refused with a clear error before anything is written or built."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from helpers.tiny import make_llama, make_llava, make_prompt
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.heads import build_head, load_head
from mmspec.heads.formats import detect_format, export_head, load_external_head

H, NH, NKV, HD, FF, V, N_LAYERS = 64, 4, 2, 16, 128, 96, 8  # tiny.make_llava(layers=8)'s text model


@pytest.fixture(scope="module")
def deep():
    """A tiny target deep enough for three distinct EAGLE-3 feature layers (1, 3, 4 by default)."""
    return make_llava(21, layers=N_LAYERS)


def _randomise(head, seed: int = 0):
    """Every weight random (norms too), so a swapped tensor name cannot hide behind a ones vector."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if p.dim() > 1 else 1.0))
    return head


def _reference(target, ids, pv, n):
    out = target.generate(input_ids=ids, pixel_values=pv, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


def _inputs(target, head, n: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, n, head.config.feature_size, generator=g, dtype=torch.float64)
    ids = torch.randint(5, V, (1, n), generator=g)
    return feats, target.get_input_embeddings()(ids).detach()


def _draft_logits(head, target, feats, embeds):
    pos = torch.arange(feats.shape[1])[None]
    with torch.no_grad():
        h = head(head.fused(feats), embeds, position_ids=pos)
        return head.logits(h, target.get_output_embeddings())  # [1, n, V]


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["eagle3", "eagle"])
def test_export_then_import_gives_identical_draft_logits(deep, tmp_path, fmt):
    vocab = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(4))[:40].tolist()))
    head = _randomise(build_head(deep, fmt, seed=2, draft_vocab=vocab if fmt == "eagle3" else None))
    out = export_head(head, tmp_path / "out", fmt, target=deep)
    assert detect_format(out) == fmt
    back = load_external_head(out, deep)
    feats, embeds = _inputs(deep, head)
    a, b = _draft_logits(head, deep, feats, embeds), _draft_logits(back, deep, feats, embeds)
    assert torch.equal(a, b)
    assert back.config.feature_layers == head.config.feature_layers
    if fmt == "eagle3":
        assert torch.isinf(a[..., [i for i in range(V) if i not in set(vocab.tolist())]]).all()


def test_exported_eagle3_files_are_the_engines_layout(deep, tmp_path):
    from safetensors import safe_open

    head = build_head(deep, "eagle3", draft_vocab=torch.arange(10, 50))
    out = export_head(head, tmp_path / "e3", "eagle3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: layer outputs
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM / speculators: the state before layer j
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (V, H, 1)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert names == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
                     "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                     *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                     *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert torch.equal(d2t, torch.full((40,), 10)) and d2t.dtype == torch.int64  # offsets, not ids
    assert t2d.dtype == torch.bool and t2d.sum() == 40 and t2d[10:50].all()


# What the engines' EAGLE-3 loaders read of an exported directory, for the whole and a reduced vocabulary:
# * vLLM, vllm/model_executor/models/llama_eagle3.py (0.32): Eagle3LlamaForCausalLM.__init__ reads
#   config.draft_vocab_size (default: vocab_size) and makes the parameter draft_id_to_target_id ONLY when it
#   differs from the target's vocabulary; load_weights skips "t2d", renames "d2t" to draft_id_to_target_id
#   (a d2t with no such parameter: "There is no module or parameter named 'draft_id_to_target_id'"), keeps
#   "lm_head.*" and prefixes every other name with "model." ("midlayer." -> "layers.0.", q/k/v and gate/up
#   stacked); the config's eagle_config (use_aux_hidden_state, eagle_aux_hidden_state_layer_ids: how many
#   features fc fuses) and target_hidden_size (default hidden_size).
# * SGLang, python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3.__init__ reads
#   config.draft_vocab_size (an attribute: it must be in config.json; None would load the target's lm_head)
#   for lm_head's rows; load_weights turns "d2t" into hot_token_id = d2t + arange (offsets; absent: None,
#   the whole vocabulary), skips "t2d", and loads the names it knows (model.* / lm_head.*), others ignored.
ENGINE_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
                  "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                  *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                  *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


@pytest.mark.parametrize("vocab", ["whole", "reduced"])
def test_exported_eagle3_has_what_vllm_and_sglang_read(deep, tmp_path, vocab):
    """Issue 61.10: a whole-vocabulary export wrote d2t/t2d, which vLLM refuses (its mapping parameter
    exists only for a reduced vocabulary). draft_vocab_size always; the mapping only when reduced."""
    from safetensors import safe_open

    draft_vocab = None if vocab == "whole" else torch.arange(10, 50)
    head = _randomise(build_head(deep, "eagle3", seed=2, draft_vocab=draft_vocab))
    out = export_head(head, tmp_path / "e3", "eagle3")
    cfg = json.loads((out / "config.json").read_text())
    n = V if vocab == "whole" else 40
    assert cfg["draft_vocab_size"] == n and cfg["vocab_size"] == V  # both engines read draft_vocab_size
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * H == 3 * H  # vLLM: fc's input width
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert tensors["lm_head.weight"].shape == (n, H)  # both: lm_head has draft_vocab_size rows
    assert tensors["fc.weight"].shape == (H, 3 * H)
    if vocab == "whole":  # vLLM makes no draft_id_to_target_id: a d2t would fail its load; SGLang: hot_token_id None
        assert set(tensors) == ENGINE_TENSORS
    else:  # vLLM's draft_id_to_target_id and SGLang's hot_token_id - arange: offsets, int64, one per draft token
        assert set(tensors) == ENGINE_TENSORS | {"d2t", "t2d"}
        assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"] + torch.arange(n), torch.arange(10, 50))
    back = load_external_head(out, deep)  # and mmspec reads both back, scoring the same
    feats, embeds = _inputs(deep, head)
    assert torch.equal(_draft_logits(head, deep, feats, embeds), _draft_logits(back, deep, feats, embeds))


def test_a_whole_vocabulary_in_another_order_is_refused_on_export(deep, tmp_path):
    """vLLM and SGLang read no mapping for the whole vocabulary, so a head that scores it permuted
    cannot be written for them: refused, nothing written."""
    head = build_head(deep, "eagle3", draft_vocab=torch.arange(V).flip(0))
    with pytest.raises(MMSpecError, match="scores the whole vocabulary in another order than the target's"):
        export_head(head, tmp_path / "e3", "eagle3")
    assert not (tmp_path / "e3").exists()


def _vllm_python() -> str | None:
    """A Python with vLLM: this one, MMSPEC_VLLM_PYTHON, or the vLLM peer's venv (../shared/peers/vllm-cpu)."""
    import importlib.util
    import os
    import sys
    from pathlib import Path

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    peer = Path(os.environ.get("PEER_DIR", Path.home() / ".cache/mmspec-peer-vllm")) / "venv/bin/python"
    for py in (os.environ.get("MMSPEC_VLLM_PYTHON"), str(peer)):
        if py and Path(py).is_file():
            return py
    return None


@pytest.mark.parametrize("vocab", ["whole", "reduced"])
def test_vllms_own_eagle3_loader_takes_the_export(deep, tmp_path, vocab):
    """vLLM's Eagle3LlamaForCausalLM built for a target of this vocabulary and its load_weights run on
    the exported directory (a vLLM install's own code, in its own process; skipped without vLLM)."""
    import os
    import socket
    import subprocess
    from pathlib import Path

    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (../shared/peers/vllm-cpu/setup.sh builds it; or MMSPEC_VLLM_PYTHON)")
    draft_vocab = None if vocab == "whole" else torch.arange(10, 50)
    out = export_head(build_head(deep, "eagle3", seed=2, draft_vocab=draft_vocab).float(), tmp_path / "e3", "eagle3")
    text = deep.config.text_config  # the target as vLLM reads it: a Llama of the same width, depth and vocabulary
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FF,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "num_hidden_layers": N_LAYERS,
        "vocab_size": text.vocab_size, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32", "tie_word_embeddings": False}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parents[1] / "helpers" / "vllm_eagle3_load.py"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": ""}
    r = subprocess.run([py, str(script), str(tmp_path / "target"), str(out), str(port)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, (r.stdout[-3000:], r.stderr[-3000:])
    got = json.loads(line[len("RESULT "):])
    if vocab == "whole":
        assert got == {"draft_vocab_size": V, "d2t": None}
    else:
        assert got["draft_vocab_size"] == 40 and got["d2t"] == [10] * 40


def test_exported_eagle_files_are_safeailabs_layout(deep, tmp_path):
    out = export_head(build_head(deep, "eagle"), tmp_path / "e1", "eagle", target=deep)
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert "layers.0.input_layernorm.weight" not in sd and "norm.weight" not in sd  # EAGLE-1/2's first layer
    assert sd["fc.weight"].shape == (H, 2 * H) and sd["fc.bias"].shape == (H,)
    assert torch.equal(sd["embed_tokens.weight"], deep.get_input_embeddings().weight)
    assert json.loads((out / "config.json").read_text())["bias"] is True


# --------------------------------------------------------------------------- by-hand checkpoints
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta=10000.0):  # x [n, heads, d], positions 0..n-1
    n, _, d = x.shape
    ang = torch.arange(n, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _attention(x, w, p):  # x [n, in] -> [n, H]: causal GQA with RoPE, written out
    n = x.shape[0]
    q = _rope((x @ w[p + "q_proj.weight"].T).view(n, NH, HD))
    k = _rope((x @ w[p + "k_proj.weight"].T).view(n, NKV, HD)).repeat_interleave(NH // NKV, 1)
    v = (x @ w[p + "v_proj.weight"].T).view(n, NKV, HD).repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, NH * HD) @ w[p + "o_proj.weight"].T


def _mlp(x, w, p):
    return (torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
        @ w[p + "down_proj.weight"].T


def _llama_cfg(**extra):
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": FF, "num_attention_heads": NH,
            "num_key_value_heads": NKV, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
            "max_position_embeddings": 1024, "vocab_size": V, "hidden_act": "silu", **extra}


def _layer_weights(g, prefix: str, width_in: int, input_norm: bool = True) -> dict:
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.2
    w = {prefix + "self_attn.q_proj.weight": r(NH * HD, width_in), prefix + "self_attn.k_proj.weight": r(NKV * HD, width_in),
         prefix + "self_attn.v_proj.weight": r(NKV * HD, width_in), prefix + "self_attn.o_proj.weight": r(H, NH * HD),
         prefix + "mlp.gate_proj.weight": r(FF, H), prefix + "mlp.up_proj.weight": r(FF, H),
         prefix + "mlp.down_proj.weight": r(H, FF), prefix + "post_attention_layernorm.weight": 1 + r(H)}
    if input_norm:
        w[prefix + "input_layernorm.weight"] = 1 + r(H)
    return w


def _eagle3_by_hand(path, *, draft_ids, layer_prefix="midlayer.", seed=0, config=None):
    """An EAGLE-3 head as SpecForge / SGLang store it (layer_prefix "midlayer."), from its tensor names."""
    g = torch.Generator().manual_seed(seed)
    w = _layer_weights(g, layer_prefix, 2 * H)
    w[layer_prefix + "hidden_norm.weight"] = 1 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)
    w["fc.weight"] = 0.2 * torch.randn(H, 3 * H, generator=g, dtype=torch.float64)
    w["norm.weight"] = 1 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)
    w["lm_head.weight"] = torch.randn(len(draft_ids), H, generator=g, dtype=torch.float64)
    w["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    w["t2d"] = t2d
    w["embed_tokens.weight"] = torch.randn(V, H, generator=g, dtype=torch.float64)  # some ship one; the target's is used
    path.mkdir(parents=True)
    save_file({k: v.float() if v.is_floating_point() else v for k, v in w.items()}, str(path / "model.safetensors"))
    cfg = config if config is not None else {
        "architectures": ["LlamaForCausalLMEagle3"], **_llama_cfg(num_hidden_layers=1, draft_vocab_size=len(draft_ids)),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}}
    (path / "config.json").write_text(json.dumps(cfg))
    return {k: v.float().double() if v.is_floating_point() else v for k, v in w.items()}


def _eagle3_expected(w, feats, embeds, target, p="midlayer."):
    """EAGLE-3's forward written out: fc, [input_norm(e); hidden_norm(f)], the feature as residual."""
    f = feats[0] @ w["fc.weight"].T
    x = torch.cat([_rms(embeds[0], w[p + "input_layernorm.weight"]), _rms(f, w[p + "hidden_norm.weight"])], -1)
    h = f + _attention(x, w, p + "self_attn.")
    h = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    small = _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((feats.shape[1], V), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(small.shape[-1]) + w["d2t"]] = small
    return full


def test_a_specforge_eagle3_checkpoint_scores_what_eagle3_scores(deep, tmp_path):
    ids = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])
    w = _eagle3_by_hand(tmp_path / "sf", draft_ids=ids)
    head = load_external_head(tmp_path / "sf", deep)
    assert head.config.feature_layers == (1, 3, 5) and head.config.draft_vocab_size == 8
    feats, embeds = _inputs(deep, head)
    got = _draft_logits(head, deep, feats, embeds)[0]
    want = _eagle3_expected(w, feats, embeds, deep)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-5)  # float32 RoPE angles


def test_a_speculators_eagle3_checkpoint_loads_as_the_same_head(deep, tmp_path):
    ids = torch.arange(20, 60)
    _eagle3_by_hand(tmp_path / "sf", draft_ids=ids, seed=5)
    spec_cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 40,
                "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
                "transformer_layer_config": _llama_cfg(num_hidden_layers=1),
                "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlavaForConditionalGeneration"]}}}
    _eagle3_by_hand(tmp_path / "sp", draft_ids=ids, seed=5, layer_prefix="layers.0.", config=spec_cfg)
    a, b = load_external_head(tmp_path / "sf", deep), load_external_head(tmp_path / "sp", deep)
    assert detect_format(tmp_path / "sp") == "speculators-eagle3" and b.config.feature_layers == (1, 3, 5)
    feats, embeds = _inputs(deep, a)
    assert torch.equal(_draft_logits(a, deep, feats, embeds), _draft_logits(b, deep, feats, embeds))


def _eagle_by_hand(path, seed=0, layers=1, bin_file=True, config=None):
    """An EAGLE-1/2 head as SafeAILab's cnets1.Model saves it (pytorch_model.bin)."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for i in range(layers):
        w.update(_layer_weights(g, f"layers.{i}.", H, input_norm=i > 0))  # no input norm at layer 0
    w["fc.weight"] = 0.2 * torch.randn(H, 2 * H, generator=g, dtype=torch.float64)
    w["fc.bias"] = 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    w["embed_tokens.weight"] = torch.randn(V, H, generator=g, dtype=torch.float64)
    path.mkdir(parents=True)
    f32 = {k: v.float() for k, v in w.items()}
    torch.save(f32, path / "pytorch_model.bin") if bin_file else save_file(f32, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"],
                                                            **_llama_cfg(num_hidden_layers=layers)}))
    return {k: v.double() for k, v in f32.items()}


def test_a_safeailab_eagle_checkpoint_scores_what_eagle_scores(deep, tmp_path):
    w = _eagle_by_hand(tmp_path / "e1", layers=2)
    head = load_external_head(tmp_path / "e1", deep)
    assert head.config.feature_layers == (-1,) and head.config.num_layers == 2
    feats, embeds = _inputs(deep, head)
    x = torch.cat([embeds[0], feats[0]], -1) @ w["fc.weight"].T + w["fc.bias"]  # EAGLE: [embedding; feature]
    for i in range(2):
        p = f"layers.{i}."
        a = x if i == 0 else _rms(x, w[p + "input_layernorm.weight"])
        x = x + _attention(a, w, p + "self_attn.")
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    want = deep.get_output_embeddings()(x)  # no final norm: the target's LM head on the layer output
    got = _draft_logits(head, deep, feats, embeds)[0]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()  # transformers' RoPE angles are float32


# --------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("fmt", ["eagle3", "eagle"])
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_imported_heads_decode_losslessly(deep, tok, tmp_path, fmt, tree):
    if fmt == "eagle3":
        _eagle3_by_hand(tmp_path / "h", draft_ids=torch.arange(5, V))
    else:
        _eagle_by_hand(tmp_path / "h", bin_file=False)
    dec = SpecDecoder(deep, str(tmp_path / "h"), tok, tree=tree)
    assert dec.head.config.source["format"] == fmt
    ids, pv = make_prompt(2, 16, seed=3)
    assert dec.generate(ids, pv, max_new_tokens=16).token_ids == _reference(deep, ids, pv, 16)


def test_load_head_dispatches_and_a_default_eagle3_reads_the_engines_layers(deep, tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_cfg(num_hidden_layers=1, draft_vocab_size=V)}
    _eagle3_by_hand(tmp_path / "h", draft_ids=torch.arange(V), config=cfg)
    assert load_head(tmp_path / "h", deep).config.feature_layers == (1, 3, 4)  # outputs of 1, N/2-1, N-4
    with pytest.raises(MMSpecError, match="pass the target"):
        load_head(tmp_path / "h")


# --------------------------------------------------------------------------- refusals
def _spec_cfg(**over):
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_cfg(num_hidden_layers=1, draft_vocab_size=8),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}, **over}


@pytest.mark.parametrize("over, match", [
    ({"hidden_size": 32}, r"width 32 vs the target's 64"),
    ({"vocab_size": 128}, r"vocabulary 128 vs the target's 96"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}, r"layers \[1, 3, 9\] of a target with 8"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]}}, r"M-RoPE"),
    ({"mmspec": {"target_model_type": "qwen2_vl"}}, r"exported from a qwen2_vl target, this one is llava"),
    ({"norm_before_residual": True}, r"uses parts .* \(norm_before_residual\)"),
    ({"num_hidden_layers": 2}, r"only one-layer EAGLE-3 heads load"),
])
def test_a_head_that_does_not_fit_is_refused(deep, tmp_path, over, match):
    _eagle3_by_hand(tmp_path / "h", draft_ids=torch.arange(8), config=_spec_cfg(**over))
    with pytest.raises(MMSpecError, match=match):
        load_external_head(tmp_path / "h", deep)


def test_unknown_tensors_and_a_foreign_embedding_are_refused(deep, tmp_path):
    _eagle_by_hand(tmp_path / "e", config={"architectures": ["LlamaForCausalLM"],
                                           **_llama_cfg(num_hidden_layers=1, add_para_norm=True)})
    with pytest.raises(MMSpecError, match=r"uses parts .*add_para_norm"):
        load_external_head(tmp_path / "e", deep)
    _eagle_by_hand(tmp_path / "v", config={"architectures": ["LlamaForCausalLM"], **_llama_cfg(vocab_size=32)})
    with pytest.raises(MMSpecError, match="vocabulary 32 vs the target's 96"):
        load_external_head(tmp_path / "v", deep)
    with pytest.raises(MMSpecError, match="not an EAGLE, EAGLE-3 or mmspec head directory"):
        load_external_head(tmp_path, deep)


def test_export_refuses_before_writing(deep, tmp_path):
    e3 = build_head(deep, "eagle3")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(MMSpecError, match="exists and is not empty"):
        export_head(e3, tmp_path / "full", "eagle3")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]
    with pytest.raises(MMSpecError, match="unknown head format 'medusa'"):
        export_head(e3, tmp_path / "a", "medusa")
    with pytest.raises(MMSpecError, match="cannot be written as EAGLE-1/2"):
        export_head(e3, tmp_path / "b", "eagle", target=deep)
    with pytest.raises(MMSpecError, match="cannot be written as EAGLE-3"):
        export_head(build_head(deep, "msd"), tmp_path / "c", "eagle3")
    with pytest.raises(MMSpecError, match="pass the target"):
        export_head(build_head(deep, "eagle"), tmp_path / "d", "eagle")
    with pytest.raises(MMSpecError, match="three distinct decoder-layer outputs"):
        export_head(build_head(deep, "eagle3", feature_layers=(1, 1, 4)), tmp_path / "e", "eagle3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing else written, no temp left


def test_cli_export_head(deep, tmp_path):
    from mmspec.cli.app import app

    head = build_head(deep, "eagle3", seed=1)
    head.save(tmp_path / "mine")
    runner = CliRunner()
    r = runner.invoke(app, ["export", "head", str(tmp_path / "mine"), "--format", "eagle3", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert detect_format(tmp_path / "o") == "eagle3"
    again = runner.invoke(app, ["export", "head", str(tmp_path / "mine"), "--out", str(tmp_path / "o")])
    said = lambda r: " ".join(r.output.split())
    assert again.exit_code == 2 and "exists and is not empty" in said(again)
    bad = runner.invoke(app, ["export", "head", str(tmp_path / "mine"), "--format", "medusa", "--out", str(tmp_path / "p")])
    assert bad.exit_code == 2 and "--format must be one of eagle3, eagle" in said(bad)
    e1 = runner.invoke(app, ["export", "head", str(tmp_path / "mine"), "--format", "eagle", "--out", str(tmp_path / "q")])
    assert e1.exit_code == 2 and "pass --target DIR" in said(e1) and not (tmp_path / "q").exists()


def test_a_head_saved_before_layer_kinds_still_loads(deep, tmp_path):
    """An mmspec_head.json without "layer" was written when eagle heads ran plain Llama layers."""
    old = build_head(deep, "eagle", layer="llama", seed=4)
    old.save(tmp_path / "old")
    raw = json.loads((tmp_path / "old" / "mmspec_head.json").read_text())
    del raw["layer"]
    (tmp_path / "old" / "mmspec_head.json").write_text(json.dumps(raw))
    back = load_head(tmp_path / "old", deep)
    assert back.config.layer == "llama"
    feats, embeds = _inputs(deep, old)
    assert torch.equal(_draft_logits(old, deep, feats, embeds), _draft_logits(back, deep, feats, embeds))
    raw["variant"] = "eagle3"
    (tmp_path / "old" / "mmspec_head.json").write_text(json.dumps(raw))
    with pytest.raises(MMSpecError, match="saved before mmspec used EAGLE-3's own first layer"):
        load_head(tmp_path / "old", deep)


def test_a_model_directory_is_not_taken_for_a_head(tmp_path):
    """Drafts and targets are directories with a config.json and weights too: not heads."""
    make_llava(3).save_pretrained(tmp_path / "vlm")
    assert detect_format(tmp_path / "vlm") is None
    make_llama(4).save_pretrained(tmp_path / "lm")
    assert detect_format(tmp_path / "lm") is None
