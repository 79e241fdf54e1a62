"""Families beyond LLaVA-1.5 are lossless too: greedy output equals target.generate for tiny
random models of each family built from configs, with 1 and 2 images of different sizes, a
short video, every view, chain and tree. Qwen2-VL / Qwen2.5-VL exercise dynamic resolution and
multimodal RoPE (text after an image is not at position ``past + i``)."""

from __future__ import annotations

import pytest
import torch

from helpers.qwen import qwen_reference
from helpers.tiny import IMAGE, VIDEO, make_llama, make_qwen, noisy_copy, qwen_inputs  # noqa: F401 (re-exported)
from helpers.tiny import VOCAB as V
from mmspec import SpecDecoder
from mmspec.stats import GenerationStats


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


# ---------------------------------------------------------------- the LLaVA families
# LLaVA-NeXT (AnyRes tiles, unpadding, image-newline), LLaVA-OneVision (the same, tiles only for a
# lone image, anyres_max shrinking, pooled video frames) and Video-LLaVA (two towers, <video> frames).
LLAVA_FAMILIES = ("llava_next", "llava_onevision", "video_llava")
NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32]]
OV_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32], [16, 48], [48, 16]]
SIZES = [(20, 40), (30, 30)]  # (height, width): a wide image (3 views) and a square one (5 views)


def make_llava_family(family: str, seed: int = 0):
    """A tiny model of ``family``: 16 px views of 4 px patches (a 4x4 grid), 2 decoder layers, float64."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
        VideoLlavaConfig,
        VideoLlavaForConditionalGeneration,
    )

    torch.manual_seed(seed)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                 patch_size=4)
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llava_next":  # CLIP tower, CLS dropped
        model = LlavaNextForConditionalGeneration(LlavaNextConfig(
            vision_config=CLIPVisionConfig(**tower), text_config=LlamaConfig(**text), image_token_index=IMAGE,
            vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=NEXT_PINPOINTS))
    elif family == "llava_onevision":  # SigLIP tower (no CLS), Qwen2 LM; anyres_max_1 shrinks every tiled grid
        model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
            vision_config=SiglipVisionConfig(**tower), text_config=Qwen2Config(**text), image_token_index=IMAGE,
            video_token_index=VIDEO, vision_feature_layer=-1, vision_feature_select_strategy="full",
            image_grid_pinpoints=OV_PINPOINTS, vision_aspect_ratio="anyres_max_1"))
    else:
        model = VideoLlavaForConditionalGeneration(VideoLlavaConfig(
            vision_config=CLIPVisionConfig(**tower), text_config=LlamaConfig(**text), image_token_index=IMAGE,
            video_token_index=VIDEO, vision_feature_layer=-2, vision_feature_select_strategy="default"))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharp logits: no greedy near-ties
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.double().eval()


def family_draft(target, seed: int = 1, own_tower: bool = False):
    """A noisy copy of the target: its LM, projector and newline perturbed; its vision tower(s) the
    target's (shared features) unless ``own_tower``."""
    draft = noisy_copy(target, seed, lm_only=False)
    if not own_tower:
        for name in ("vision_tower", "image_tower", "video_tower"):
            if hasattr(target.model, name):
                getattr(draft.model, name).load_state_dict(getattr(target.model, name).state_dict())
    return draft


def pictures(n: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*SIZES[k % 2], 3), dtype=np.uint8)) for k in range(n)]


def image_processor(family: str):
    from transformers import LlavaNextImageProcessorPil, LlavaOnevisionImageProcessorPil

    if family == "llava_next":
        return LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                          image_grid_pinpoints=NEXT_PINPOINTS)
    return LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=OV_PINPOINTS)


def family_inputs(family: str, target, n_images: int, video: bool, seed: int = 0, batch_num_images: bool = True):
    """input_ids [1, L] with each <image> / <video> expanded to as many tokens as the MODEL's own
    features have (not the adapter's count), and the pixel inputs: AnyRes images of two sizes
    through the family's image processor, or random ones; a 3-frame random video."""
    g = torch.Generator().manual_seed(seed)
    core, mm, counts = target.model, {}, []
    if n_images and family != "video_llava":
        enc = image_processor(family)(pictures(n_images, seed), return_tensors="pt")
        mm.update(pixel_values=enc["pixel_values"].double(), image_sizes=enc["image_sizes"])
        if family == "llava_onevision" and batch_num_images:
            mm["batch_num_images"] = torch.tensor([n_images])
        extra = {"batch_num_images": mm["batch_num_images"]} if "batch_num_images" in mm else {}
        feats = core.get_image_features(mm["pixel_values"], mm["image_sizes"], **extra).pooler_output
        counts = [f.shape[0] for f in feats]
    elif n_images:
        mm["pixel_values"] = torch.randn(n_images, 3, 16, 16, generator=g, dtype=torch.float64)
        counts = [core.get_image_features(pixel_values=mm["pixel_values"]).pooler_output.shape[1]] * n_images
    ids = [1, 10, 11]
    for k, c in enumerate(counts):
        ids += [IMAGE] * c + [20 + k]
    if video:
        mm["pixel_values_videos"] = torch.randn(1, 3, 3, 16, 16, generator=g, dtype=torch.float64)
        frames = core.get_video_features(pixel_values_videos=mm["pixel_values_videos"]).pooler_output
        ids += [VIDEO] * (frames.shape[1] if family == "llava_onevision" else frames.numel() // frames.shape[-1])
    ids += [12, 13, 14]
    return torch.tensor([ids]), mm


def family_reference(target, ids, mm, n):
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **mm)
    return out[0, ids.shape[1]:].tolist()


def segment_captions(n: int):
    from mmspec.models.captioner import FixedCaptioner

    return FixedCaptioner([f"w{10 + i} w{20 + i} w30" for i in range(n)])


FAMILY_CASES = {  # (n_images, video, batch_num_images)
    "llava_next": [(1, False, True), (2, False, True)],
    "llava_onevision": [(1, False, True), (2, False, True), (2, False, False), (0, True, True), (1, True, True)],
    "video_llava": [(1, False, True), (2, False, True), (0, True, True), (1, True, True)],
}
VIEW_TREES = [("M", None), ("T", None), ("C", None), ("P", None), ("MT", "dynamic"), ("MTCP", "dynamic")]


@pytest.fixture(scope="module")
def family_models():
    cache = {}

    def get(family: str, own_tower: bool = False):
        if family not in cache:
            cache[family] = make_llava_family(family)
        key = (family, own_tower)
        if key not in cache:
            cache[key] = family_draft(cache[family], own_tower=own_tower)
        return cache[family], cache[key]

    return get


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("family,n_images,video,bni",
                         [(f, *case) for f in LLAVA_FAMILIES for case in FAMILY_CASES[f]])
@pytest.mark.parametrize("views,tree", VIEW_TREES)
def test_llava_family_matches_target(family_models, references, tok, family, n_images, video, bni, views, tree):
    target, draft = family_models(family)
    ids, mm = family_inputs(family, target, n_images, video, seed=n_images + 2 * video, batch_num_images=bni)
    dec = SpecDecoder(target, draft, tok, views=views, tree=tree, captioner=segment_captions(n_images + video))
    assert dec.reuse_vision  # one tower pass, its states shared with the draft
    res = dec.generate(ids, **mm, max_new_tokens=20)
    key = (family, n_images, video, bni)
    if key not in references:  # target.generate once per prompt, whatever the views
        references[key] = family_reference(target, ids, mm, 20)
    assert res.token_ids == references[key]


@pytest.mark.parametrize("family", LLAVA_FAMILIES)
def test_adapter_places_what_the_models_forward_places(family_models, family):
    """Counts, features (own and from shared tower states) and the prompt's logits: the adapter's
    embeddings, scattered at the placeholders, give exactly the logits of the model's own forward."""
    from mmspec.models.base import adapter_for

    target, _ = family_models(family)
    n_images, video = (2, family != "llava_next")
    ids, mm = family_inputs(family, target, n_images, video, batch_num_images=False)
    ad = adapter_for(target)
    counts = ad.segment_counts(ids[0], mm)
    assert [k for k, _ in counts] == ["image"] * n_images + ["video"] * video
    assert sum(n for _, n in counts) == int((ids == IMAGE).sum() + (ids == VIDEO).sum())
    if family != "video_llava":
        assert counts[0][1] != counts[1][1]  # two sizes, two tilings: the counts differ
    own, shared = ad.encode(mm), ad.encode(mm, ad.vision_states(mm))
    embeds = target.get_input_embeddings()(ids)
    for token, kind in ad.placeholders().items():
        assert [f.shape[0] for f in own[kind]] == [n for k, n in counts if k == kind]
        for a, b in zip(own[kind], shared[kind]):
            assert torch.equal(a, b)
        if own[kind]:
            embeds = embeds.masked_scatter((ids == token)[..., None], torch.cat(own[kind]))
    with torch.no_grad():
        assert torch.equal(target(inputs_embeds=embeds).logits, target(input_ids=ids, **mm).logits)
    pooled = ad.pooled(mm, 4)  # P: the base view's (and a video's time-averaged) grid, 2x2, no tiles, no newline
    assert [f.shape for f in pooled["image"] + pooled.get("video", [])] == [(4, 64)] * (n_images + video)


@pytest.mark.parametrize("family", LLAVA_FAMILIES)
def test_llava_family_draft_with_its_own_tower(family_models, tok, family):
    target, draft = family_models(family, own_tower=True)
    ids, mm = family_inputs(family, target, 2, family != "llava_next", seed=5)
    dec = SpecDecoder(target, draft, tok, views="MP", tree="dynamic")
    assert not dec.reuse_vision  # each model encodes its own
    assert dec.generate(ids, **mm, max_new_tokens=20).token_ids == family_reference(target, ids, mm, 20)


def test_llava_15_draft_with_its_own_processor_for_a_llava_next_target(family_models, tok):
    """A draft of another family (LLaVA-1.5, the same tokenizer) reads the PIL images through its
    own processor; the target's inputs come from LLaVA-NeXT's processor (its token counts too)."""
    from transformers import LlavaNextProcessor

    from helpers.tiny import make_llava, make_processor

    target, _ = family_models("llava_next")
    proc = LlavaNextProcessor(image_processor=image_processor("llava_next"), tokenizer=tok, patch_size=4,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)
    images = pictures(2, seed=3)
    enc = proc(text=["<s> w10 <image> w11 <image> w12 w13"], images=images, return_tensors="pt")
    ids, mm = enc["input_ids"], {"pixel_values": enc["pixel_values"].double(), "image_sizes": enc["image_sizes"]}
    draft = make_llava(7, hidden=32, layers=1, patch=16, vision_hidden=16)  # 32 px, 2x2 grid: 4 tokens per image
    for views, tree in (("MP", None), ("MTC", "dynamic")):
        dec = SpecDecoder(target, draft, tok, views=views, tree=tree, draft_processor=make_processor(tok, patch=16),
                          captioner=segment_captions(2))
        res = dec.generate(ids, **mm, attention_mask=enc["attention_mask"], images=images, max_new_tokens=20)
        prepared = dec.mm.encode(dec.mm.layout(ids[0], mm), mm, GenerationStats(gamma=5, views=()), images=images)
        assert prepared.draft_inputs["pixel_values"].shape == (2, 3, 32, 32)  # the draft's own processor's output
        assert res.token_ids == family_reference(target, ids, mm, 20)


def test_video_llava_takes_pixel_values_images(family_models, tok):
    """Video-LLaVA's older processors name the images pixel_values_images: taken as pixel_values."""
    from mmspec import MMSpecError

    target, draft = family_models("video_llava")
    ids, mm = family_inputs("video_llava", target, 2, True, seed=7)
    dec = SpecDecoder(target, draft, tok, views="MC", captioner=segment_captions(3))
    legacy = {"pixel_values_images": mm["pixel_values"], "pixel_values_videos": mm["pixel_values_videos"]}
    assert dec.generate(ids, **legacy, max_new_tokens=20).token_ids == family_reference(target, ids, mm, 20)
    with pytest.raises(MMSpecError, match="given twice"):
        dec.generate(ids, mm["pixel_values"], **legacy, max_new_tokens=4)


def test_llava_family_input_errors(family_models, tok):
    from mmspec import MMSpecError

    target, draft = family_models("llava_onevision")
    ids, mm = family_inputs("llava_onevision", target, 1, True, seed=2)
    dec = SpecDecoder(target, draft, tok, views="C", captioner=segment_captions(2))
    with pytest.raises(MMSpecError, match="image_sizes"):
        dec.generate(ids, mm["pixel_values"], pixel_values_videos=mm["pixel_values_videos"], max_new_tokens=4)
    with pytest.raises(MMSpecError, match="one caption per image or video"):
        dec.generate(ids, **mm, captions=["w10"], max_new_tokens=4)
    with pytest.raises(MMSpecError, match="batch_num_images"):
        dec.generate(ids, **{**mm, "batch_num_images": torch.tensor([2])}, max_new_tokens=4)


@pytest.mark.parametrize("family", ["llava_onevision", "video_llava"])
def test_video_pixels_of_the_wrong_rank_are_refused_by_name(family_models, tok, family):
    """pixel_values_videos must be [n_videos, frames, 3, H, W]: frames flattened into the batch
    (a common slip) get an error that names the input and its shape, not a trace from inside."""
    from mmspec import MMSpecError

    target, draft = family_models(family)
    ids, mm = family_inputs(family, target, 0, True, seed=3)
    dec = SpecDecoder(target, draft, tok, views="M")
    flat = mm["pixel_values_videos"].flatten(0, 1)  # [frames, 3, H, W]
    with pytest.raises(MMSpecError, match=r"pixel_values_videos must be \[n_videos, frames, 3, H, W\]"):
        dec.generate(ids, **{**mm, "pixel_values_videos": flat}, max_new_tokens=4)
