"""Families beyond LLaVA-1.5 are lossless too: greedy output equals target.generate for tiny
random models of each family built from configs, with 1 and 2 images of different sizes, a
short video, every view, chain and tree. Qwen2-VL / Qwen2.5-VL exercise dynamic resolution and
multimodal RoPE (text after an image is not at position ``past + i``)."""

from __future__ import annotations

import pytest
import torch

from mmspec import SpecDecoder
from tiny import make_llama, noisy_copy

V = 96
IMAGE, VIDEO, VSTART, VEND = 3, 6, 7, 8


def make_qwen(seed: int, family: str = "qwen2_vl"):
    """A tiny Qwen2-VL (or Qwen2.5-VL): 4 px patches merged 2x2, 2 decoder layers, float64."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    torch.manual_seed(seed)
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    if family == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3, out_hidden_size=64, window_size=16,
                      fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharp logits: no greedy near-ties
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.double().eval()


def qwen_inputs(n_images: int, video: bool, seed: int = 0):
    """input_ids [1, L] with <|vision_start|> <|image_pad|>* <|vision_end|> per image (4x4 or 4x8
    patches: 4 or 8 tokens) and a 2x4x4 video (8 tokens), and the pixel inputs the processor makes."""
    g = torch.Generator().manual_seed(seed)
    ids, pvs, thw = [1, 10, 11], [], []
    for k in range(n_images):
        h, w = (4, 4) if k % 2 == 0 else (4, 8)
        ids += [VSTART] + [IMAGE] * (h * w // 4) + [VEND, 20 + k]
        pvs.append(torch.randn(h * w, 3 * 2 * 4 * 4, generator=g, dtype=torch.float64))
        thw.append([1, h, w])
    mm = {}
    if n_images:
        mm.update(pixel_values=torch.cat(pvs), image_grid_thw=torch.tensor(thw))
    if video:
        t, h, w = 2, 4, 4
        ids += [VSTART] + [VIDEO] * (t * h * w // 4) + [VEND]
        mm.update(pixel_values_videos=torch.randn(t * h * w, 96, generator=g, dtype=torch.float64),
                  video_grid_thw=torch.tensor([[t, h, w]]))
    ids += [12, 13, 14]
    return torch.tensor([ids]), mm


def qwen_reference(target, ids, mm, n):
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                          do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_pair(request):
    target = make_qwen(0, request.param)
    return target, noisy_copy(target, 1)


@pytest.mark.parametrize("n_images,video", [(1, False), (2, False), (0, True), (1, True)])
@pytest.mark.parametrize("views", ["M", "T", "P", "MT", "MTP"])
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_qwen_family_matches_target(qwen_pair, tok, n_images, video, views, tree):
    target, draft = qwen_pair
    ids, mm = qwen_inputs(n_images, video, seed=n_images + 2 * video)
    dec = SpecDecoder(target, draft, tok, views=views, tree=tree)
    res = dec.generate(ids, **mm, max_new_tokens=20)
    assert res.token_ids == qwen_reference(target, ids, mm, 20)


def test_qwen_positions_are_not_past_plus_i(qwen_pair):
    """The reason the engine asks the adapter: after an image, M-RoPE text positions run behind
    the token count (a 4x8 grid takes 8 tokens but advances the position by 4)."""
    from mmspec.models.base import adapter_for

    target, _ = qwen_pair
    ids, mm = qwen_inputs(2, False)
    pos, nxt = adapter_for(target).prefill_positions(ids, mm)
    assert pos.shape == (3, 1, ids.shape[1]) and int(nxt[0]) < ids.shape[1]


def test_text_only_draft_for_a_qwen_target(qwen_pair, tok):
    target, _ = qwen_pair
    ids, mm = qwen_inputs(1, True, seed=9)
    dec = SpecDecoder(target, make_llama(11), tok, views="T", tree="dynamic")
    assert dec.generate(ids, **mm, max_new_tokens=16).token_ids == qwen_reference(target, ids, mm, 16)


def test_qwen_target_with_a_head(qwen_pair, tok):
    from mmspec.heads import build_head

    target, _ = qwen_pair
    ids, mm = qwen_inputs(2, True, seed=4)
    dec = SpecDecoder(target, build_head(target, "eagle"), tok, tree="dynamic")
    assert dec.generate(ids, **mm, max_new_tokens=16).token_ids == qwen_reference(target, ids, mm, 16)
