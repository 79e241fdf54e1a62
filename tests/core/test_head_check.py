"""The head check (mmspec.heads.check): a good head passes; each fault the field keeps reporting,
planted into that good head, gets the tau-near-1 warning naming it.

The good head is exact by construction on a target built for it: no attention (a position's state
depends on its token alone), orthogonal token embeddings e_x, a last layer that moves the state
far from the first's, and an LM head that maps each token's final feature f_x to a fixed successor
s(x). Then the next feature is linear in each input the head gets: f_(t+1) = A f_t = B e_(x_(t+1)),
and the head outputs K A f - (K - 1) B e + (a constant its embeddings' shared part cancels): it needs the right feature layer, the token embedding and the
features normed once, and drafts every token right when it has them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from helpers.tiny import IMG, make_llava, make_prompt
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.heads import build_head
from mmspec.heads.check import CalibrationPrompt, calibrate, read_prompts

H, V, K = 128, 96, 20


@pytest.fixture(scope="module")
def world():
    """(target, good head, prompts, the final norm's weight)."""
    target = make_llava(7, hidden=H, layers=2, vocab=V)
    g = torch.Generator().manual_seed(0)
    R, _ = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    succ = [5 if x < 5 or x == V - 1 else x + 1 for x in range(V)]  # never EOS: every answer runs full length
    lm = target.model.language_model
    with torch.no_grad():
        z = R[:, V]  # a direction no token's own part uses: every embedding carries it once
        lm.embed_tokens.weight.copy_((H ** 0.5) * R[:, :V].T + z)
        for layer in lm.layers:
            layer.self_attn.o_proj.weight.zero_()  # no mixing across positions: a token's state is its own
        lm.layers[0].mlp.down_proj.weight.mul_(30.0)  # each layer moves the state far: layer 0 != final
        lm.layers[1].mlp.down_proj.weight.mul_(30.0)
        w = torch.rand(H, generator=g, dtype=torch.float64) * 2.5 + 0.3
        lm.norm.weight.copy_(w)
        F = lm(input_ids=torch.arange(V)[None]).last_hidden_state[0].T  # [H, V] f_x, post-norm
        Y = torch.zeros(V, V, dtype=torch.float64)
        for x, y in enumerate(succ):
            Y[y, x] = 8.0
        target.lm_head.weight.copy_(Y @ torch.linalg.pinv(F))  # f_x -> 8 at s(x)
    A = F[:, succ] @ torch.linalg.pinv(F)  # f_x -> f_s(x)
    B = F @ torch.linalg.pinv((H ** 0.5) * R[:, :V])  # e_x -> f_x (and z -> 0)
    M = 10 * K * F[:, 5]  # a constant the embedding's shared part cancels: without it, token 6 every time
    head = build_head(target, "eagle")
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([K * A, -(K - 1) * B - torch.outer(M, z)], dim=1))  # [feature; embedding]
        head.fc.bias.copy_(M)  # K f - (K - 1) f + M - M
        head.decoder.layers[0].self_attn.o_proj.weight.zero_()
        head.decoder.layers[0].mlp.down_proj.weight.zero_()
    prompts = []
    for i in range(3):
        ids, pv = make_prompt(1, 16, seed=300 + i)
        prompts.append(CalibrationPrompt("", (), {"input_ids": ids, "pixel_values": pv}))
    return target, head, prompts, w


def _check(target, head, prompts, tok):
    dec = SpecDecoder(target, head, tok)
    return calibrate(dec, prompts, max_new_tokens=24)


def test_a_good_head_passes(world, tok, tmp_path):
    target, head, prompts, _ = world
    rep = _check(target, head, prompts, tok)
    assert rep.ok and rep.tau > 4, rep.lines()
    assert rep.feature_layers == (-1,) and "held in memory" in rep.layers_from  # not read from any file
    assert rep.acceptance_by_depth[0] > 0.7 and rep.diagnosis.startswith("drafts")
    assert rep.feature_scale == pytest.approx(1.0) and rep.embedding_effect > 0.1  # exact at the answers' positions
    head.save(tmp_path / "h")
    rep = calibrate(SpecDecoder(target, str(tmp_path / "h"), tok), prompts, max_new_tokens=24)
    assert f"recorded in {tmp_path / 'h' / 'mmspec_head.json'}" in rep.layers_from and rep.ok


def test_the_check_measures_the_shape_the_decoder_drafts(world, tok):
    """A server drafting a dynamic tree is measured in that tree, not in a chain: the report names
    the shape, and acceptance by depth runs to the tree's depth."""
    target, head, prompts, _ = world
    dec = SpecDecoder(target, head, tok, tree="4x2x6")
    rep = calibrate(dec, prompts, max_new_tokens=24)
    assert rep.shape == dec.tree.label and rep.shape.startswith("dynamic(depth 4") and "chain" not in rep.lines()[0]
    assert len(rep.acceptance_by_depth) == 4 and rep.ok


def _planted(head, fault: str, w):
    bad = copy.deepcopy(head)
    with torch.no_grad():
        if fault == "layers":  # reads the output of layer N - 2 (pre-norm) for the final state
            bad.config = replace(bad.config, feature_layers=(0,))
        elif fault == "embedding":  # the token embedding missing (read as zeros)
            bad.fc.weight[:, H:] = 0
        elif fault == "norm":  # the final norm applied a second time to the features read
            bad.fc.weight[:, :H] = bad.fc.weight[:, :H] * w / w.pow(2).mean().sqrt()
    return bad


@pytest.mark.parametrize("fault", ["layers", "embedding", "norm"])
def test_each_planted_fault_is_warned_with_its_cause(world, tok, fault):
    target, head, prompts, w = world
    bad = _planted(head, fault, w)
    bad.config = replace(bad.config, trained={"steps": 5000, "batch_size": 16})  # trained long: no excuse
    rep = _check(target, bad, prompts, tok)
    assert not rep.ok and rep.tau < 1.3, rep.lines()
    text = " ".join(rep.warnings)
    assert "near 1" in text
    assert {"layers": "feature-layer ids", "embedding": "token embedding", "norm": "final norm applied twice"}[fault] \
        in text
    found = {"layers": "feature-layer ids look off by one", "embedding": "the token embedding is missing",
             "norm": "a norm applied twice"}
    assert rep.diagnosis.startswith("broken: ") and found[fault] in rep.diagnosis, rep.diagnosis  # the one found
    assert all(v not in rep.diagnosis for k, v in found.items() if k != fault)


@pytest.mark.parametrize("steps", [15, None])
def test_an_under_trained_head_is_called_under_trained_not_broken(world, tok, steps):
    """A head with little or no training drafts nothing and predicts small features; the check says
    it is under-trained (naming the steps it records), not that a norm is applied twice."""
    target, _, prompts, _ = world
    head = build_head(target, "eagle", seed=3)
    if steps is not None:
        head.config = replace(head.config, trained={"steps": steps, "batch_size": 16, "final_loss": 4.5})
    rep = _check(target, head, prompts, tok)
    assert not rep.ok and rep.feature_scale < 0.5, rep.lines()
    assert rep.diagnosis.startswith("under-trained: ") and "norm" not in rep.diagnosis, rep.diagnosis
    assert ("records 15 training steps" if steps else "records no training") in rep.diagnosis
    assert "under-trained" in rep.warnings[0].split("Likely")[0]
    assert any(line.startswith("  trained: " + ("15 steps of 16 sequences, final loss 4.5" if steps else "not recorded"))
               for line in rep.lines())


def test_a_head_that_falls_apart_after_its_first_position_is_called_under_trained_in_depth(world, tok):
    """The head's prediction halved: its argmax at the first position is unchanged (the target's
    feature goes in), but the halved feature it feeds itself sends every deeper position wrong."""
    target, head, prompts, _ = world
    shallow = copy.deepcopy(head)
    with torch.no_grad():
        shallow.fc.weight.mul_(0.5)
        shallow.fc.bias.mul_(0.5)
    rep = _check(target, shallow, prompts, tok)
    assert rep.ok and rep.acceptance_by_depth[0] > 0.7 and rep.acceptance_by_depth[1] < 0.2, rep.lines()
    assert rep.diagnosis.startswith("under-trained in depth") and "falls apart" in rep.diagnosis, rep.diagnosis


def test_calibration_prompts_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(MMSpecError, match="file not found"):
        read_prompts(tmp_path / "none.jsonl")
    f = tmp_path / "p.jsonl"
    f.write_text("{not json\n")
    with pytest.raises(MMSpecError, match="line 1: not JSON"):
        read_prompts(f)
    f.write_text(json.dumps({"images": []}) + "\n")
    with pytest.raises(MMSpecError, match='needs a "prompt" string'):
        read_prompts(f)
    f.write_text(json.dumps({"prompt": "USER: <image> hi ASSISTANT:", "images": ["gone.png"]}) + "\n")
    with pytest.raises(MMSpecError, match="image file not found"):
        read_prompts(f)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    f.write_text(json.dumps({"prompt": "USER: <image> <image> hi ASSISTANT:", "images": ["a.png"]}) + "\n")
    with pytest.raises(MMSpecError, match="line 1: .*image"):
        read_prompts(f)
    f.write_text("\n")
    with pytest.raises(MMSpecError, match="holds no prompts"):
        read_prompts(f)
    f.write_text(json.dumps({"prompt": "USER: <image> hi ASSISTANT:", "images": ["a.png"]}) + "\n")
    assert read_prompts(f)[0].images == (str(tmp_path / "a.png"),)


def test_image_token_constant_is_the_tiny_targets():
    assert IMG == 3
