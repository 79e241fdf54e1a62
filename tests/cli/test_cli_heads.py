"""Every head directory everywhere (issue 45): the one detection (mmspec.heads.directory) behind
generate / serve / bench / demo / export, each kind checked against its target's config before
anything heavy loads; --weights adaptive; exports readable by others; the newcomer's help texts.
"""

from __future__ import annotations

import json
import stat

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from mmspec.cli import app
from mmspec.cli.checks import GenerateOptions, check_decoder, head_variant
from mmspec.errors import MMSpecError
from mmspec.heads.directory import describe_head, head_kind, is_head_dir

runner = CliRunner()
H, V, N = 256, 1347, 10  # the embedded target: width, vocabulary, decoder layers


def _eagle3(d, hidden=H, vocab=V, ids=(1, 4, 6), layout="sglang"):
    d.mkdir()
    t = {"fc.weight": torch.zeros(hidden, 3 * hidden), "d2t": torch.zeros(8, dtype=torch.long)}
    if layout == "speculators":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {"hidden_size": hidden, "vocab_size": vocab},
               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]}
        t["layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    else:
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "vocab_size": vocab,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}
        t["midlayer.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


def _eagle(d, hidden=H):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden, "vocab_size": V, "num_hidden_layers": 1}))
    save_file({"fc.weight": torch.zeros(hidden, 2 * hidden), "layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
              str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("make, kind, variant", [
    (lambda d: _eagle3(d), "eagle3", "eagle3"),
    (lambda d: _eagle3(d, layout="speculators"), "speculators-eagle3", "eagle3"),
    (lambda d: _eagle(d), "eagle", "eagle"),
])
def test_every_kind_is_detected_by_content_and_taken_by_the_cli_checks(tmp_path, make, kind, variant):
    d = make(tmp_path / "downloaded-head")
    assert head_kind(d) == kind and is_head_dir(d)
    assert head_variant(str(d), None) == variant  # against the embedded target's config
    o = check_decoder(GenerateOptions(head=str(d)))  # generate / serve: no "no mmspec_head.json"
    assert o.head == str(d)
    o = check_decoder(GenerateOptions(draft=str(d)))  # --draft HEAD_DIR is --head
    assert o.head == str(d) and o.draft is None


def test_bench_takes_an_eagle3_export(tmp_path):
    from mmspec.bench.config import BenchConfig
    from mmspec.bench.preflight import check_heads

    d = _eagle3(tmp_path / "e3")
    check_heads(BenchConfig(out_dir=str(tmp_path / "o"), methods=("eagle3+tree",), heads=(("eagle3", str(d)),)))
    with pytest.raises(MMSpecError, match="holds an eagle3 head, not an eagle one"):
        check_heads(BenchConfig(out_dir=str(tmp_path / "o"), methods=("eagle",), heads=(("eagle", str(d)),)))


@pytest.mark.parametrize("bad, phrase", [
    ("empty", "is not a draft head directory: it holds neither mmspec_head.json"),
    ("model", "its config.json describes no EAGLE / EAGLE-3 head"),
    ("noweights", "it has a config.json but no weights"),
    ("width", "does not fit the embedded target (width 128 vs the target's 256"),
    ("vocab", "vocabulary 32000 vs the target's 1347"),
    ("layers", "it reads the outputs of layers [1, 4, 12] of a target with 10 decoder layers"),
    ("json", "is not valid JSON"),
    ("weights", "cannot read the weights of the head"),
])
def test_bad_head_directories_are_one_clear_error_before_loading(tmp_path, bad, phrase):
    d = tmp_path / "h"
    if bad == "empty":
        d.mkdir()
    elif bad == "model":
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {}}))
        (d / "model.safetensors").write_bytes(b"x")
    elif bad == "noweights":
        d.mkdir()
        (d / "config.json").write_text("{}")
    elif bad == "width":
        _eagle3(d, hidden=128)
    elif bad == "vocab":
        _eagle3(d, vocab=32000)
    elif bad == "layers":
        _eagle3(d, ids=(1, 4, 12))
    elif bad == "json":
        _eagle3(d)
        (d / "config.json").write_text("{broken")
    elif bad == "weights":
        _eagle3(d)
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(MMSpecError, match="--head .*" if bad != "json" else "not valid JSON") as e:
        check_decoder(GenerateOptions(head=str(d)))
    assert phrase in str(e.value), str(e.value)


def test_describe_reads_no_tensors(tmp_path):
    info = describe_head(_eagle3(tmp_path / "e3"))
    assert (info.kind, info.variant, info.hidden_size, info.feature_layers) == ("eagle3", "eagle3", H, (1, 4, 6))
    assert info.kind_name == "EAGLE-3"


@pytest.mark.parametrize("weights, ok", [("adaptive", True), ("adaptive:loglik", True), ("adaptive:tabed:0.2", True),
                                         ("1,0.5", True), ("adaptive:nosuch", False), ("fast", False)])
def test_weights_adaptive_is_taken_wherever_weights_is(weights, ok):
    from mmspec.drafting.adaptive import AdaptiveWeights

    o = GenerateOptions(views="MT", weights=weights)
    if not ok:
        with pytest.raises(MMSpecError, match="--weights"):
            check_decoder(o)
        return
    o = check_decoder(o)
    assert isinstance(o.weight_list, AdaptiveWeights if weights.startswith("adaptive") else list)
    with pytest.raises(MMSpecError, match="adaptive weights weigh two views or more"):
        check_decoder(GenerateOptions(views="M", weights="adaptive")) if weights == "adaptive" else \
            (_ for _ in ()).throw(MMSpecError("adaptive weights weigh two views or more"))


def test_exports_are_readable_by_others(target, tmp_path):
    from mmspec.heads import build_head
    from mmspec.heads.formats import export_head

    out = export_head(build_head(target, "eagle"), tmp_path / "e", "eagle", target=target)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in out.iterdir())


def test_help_texts_are_complete_and_plain():
    for args in (["train", "head", "--help"], ["generate", "--help"], ["--help"], ["check", "head", "--help"]):
        out = runner.invoke(app, args, env={"COLUMNS": "200"}).output
        assert "<bool>" not in out, args
    out = " ".join(runner.invoke(app, ["train", "head", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "Optimizer steps in all" in out and "Peak learning rate" in out
    out = " ".join(runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "feature-level draft heads" in out


def test_dir_mmspec_lists_the_public_names():
    import mmspec

    assert {"SpecDecoder", "load_embedded", "MMSpecError"} <= set(dir(mmspec))


def test_check_head_refuses_bad_prompts_before_loading(tmp_path):
    d = _eagle3(tmp_path / "e3")
    r = runner.invoke(app, ["check", "head", str(d), "--prompts", str(tmp_path / "none.jsonl")])
    assert r.exit_code == 2 and "file not found" in " ".join(r.output.split())
    r = runner.invoke(app, ["check", "head", str(tmp_path)])
    assert r.exit_code == 2 and "is not a draft head directory" in " ".join(r.output.split())
