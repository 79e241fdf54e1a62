"""Tiny targets of every family with a processor each, and conversation files written for them:
what the head-training tests of ``tests/train/test_train_families.py`` read.

LLaVA-1.5 and LLaVA-NeXT use transformers' own processors (LLaVA-1.5 without a chat template:
mmspec's LLaVA-1.5 frame; NeXT with one). LLaVA-OneVision, Video-LLaVA and Qwen2-VL /
Qwen2.5-VL use :class:`StandIn`, their processor as far as mmspec sees it (transformers' video
processors need torchvision, absent here): each marker expanded to as many placeholder tokens as
the MODEL's own features have, the pixel tensors in the family's layout, and a chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from helpers.tiny import IMAGE, VEND, VIDEO, VSTART, make_llava, make_processor, make_qwen

FAMILIES = ("llava", "llava_next", "llava_onevision", "video_llava", "qwen2_vl", "qwen2_5_vl")
VIDEO_FAMILIES = ("llava_onevision", "video_llava", "qwen2_vl", "qwen2_5_vl")
FRAMES = {"video_llava": 8, "llava_onevision": 2, "qwen2_vl": 2, "qwen2_5_vl": 2}
NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32]]
OV_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]
# user turn w40 ... w42, assistant turn w41 ... w42
CHAT = ("{% for m in messages %}{{ 'w41' if m['role'] == 'assistant' else 'w40' }} {% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image> {% elif c['type'] == 'video' %}<video> {% else %}{{ c['text'] }} "
        "{% endif %}{% endfor %}w42 {% endfor %}{% if add_generation_prompt %}w41 {% endif %}")


def _llava_family(family: str, seed: int = 0, layers: int = 3):
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
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llava_next":
        model = LlavaNextForConditionalGeneration(LlavaNextConfig(
            vision_config=CLIPVisionConfig(**tower), text_config=LlamaConfig(**text), image_token_index=IMAGE,
            vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=NEXT_PINPOINTS))
    elif family == "llava_onevision":
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


class StandIn:
    """A family's processor as mmspec sees it: ``processor(text=, images=, videos=)`` and a chat template."""

    chat_template = CHAT
    image_token, video_token = "<image>", "<video>"

    def __init__(self, tok, family: str, model):
        self.tokenizer, self.family, self.model = tok, family, model

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        import jinja2

        return jinja2.Template(CHAT).render(messages=messages, add_generation_prompt=add_generation_prompt)

    def __call__(self, text, images=None, videos=None, return_tensors="pt"):
        images, videos = list(images or []), list(videos or [])
        img_runs, vid_runs, out = self._media(images, videos)
        ids, i, v = [1], 0, 0
        for w in text.split():
            if w == "<image>":
                ids += img_runs[i]
                i += 1
            elif w == "<video>":
                ids += vid_runs[v]
                v += 1
            else:
                ids.append(self.tokenizer.convert_tokens_to_ids(w))
        if i != len(images) or v != len(videos):
            raise ValueError("markers do not match the media")
        ids_t = torch.tensor([ids])
        out.update(input_ids=ids_t, attention_mask=torch.ones_like(ids_t))
        if self.family.startswith("qwen"):
            out["mm_token_type_ids"] = (ids_t == IMAGE).int() + 2 * (ids_t == VIDEO).int()
        return out

    def _media(self, images, videos):
        core, out, img_runs, vid_runs = self.model.model, {}, [], []
        if self.family.startswith("qwen"):
            def patches(pics):  # 16x16 pictures -> [16 * t, 96] rows, grid (t, 4, 4)
                a = [np.asarray(p.resize((16, 16)), dtype=np.float64) / 255 for p in pics]
                a = a + a[-1:] if len(a) % 2 else a
                rows = [np.concatenate([x, y], -1).reshape(16, 96) for x, y in zip(a[::2], a[1::2])]
                return torch.tensor(np.concatenate(rows)), len(rows)

            if images:
                pv = [patches([im]) for im in images]
                out.update(pixel_values=torch.cat([p for p, _ in pv]), image_grid_thw=torch.tensor([[1, 4, 4]] * len(pv)))
                img_runs = [[VSTART] + [IMAGE] * 4 + [VEND]] * len(images)
            if videos:
                pv = [patches(f) for f in videos]
                out.update(pixel_values_videos=torch.cat([p for p, _ in pv]),
                           video_grid_thw=torch.tensor([[t, 4, 4] for _, t in pv]))
                vid_runs = [[VSTART] + [VIDEO] * (4 * t) + [VEND] for _, t in pv]
            return img_runs, vid_runs, out
        if images and self.family == "llava_onevision":
            from transformers import LlavaOnevisionImageProcessorPil

            ip = LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=OV_PINPOINTS)
            enc = ip(images, return_tensors="pt")
            out.update(pixel_values=enc["pixel_values"].double(), image_sizes=enc["image_sizes"],
                       batch_num_images=torch.tensor([len(images)]))
            feats = core.get_image_features(out["pixel_values"], out["image_sizes"],
                                            batch_num_images=out["batch_num_images"]).pooler_output
            img_runs = [[IMAGE] * f.shape[0] for f in feats]
        elif images:  # video_llava: 16 px images, CLS dropped
            out["pixel_values_images"] = torch.tensor(np.stack(
                [np.asarray(im.resize((16, 16)), dtype=np.float64).transpose(2, 0, 1) / 255 for im in images]))
            img_runs = [[IMAGE] * 16] * len(images)
        if videos:
            clips = torch.tensor(np.stack([np.stack([np.asarray(f.resize((16, 16)), dtype=np.float64).transpose(2, 0, 1)
                                                     / 255 for f in v]) for v in videos]))
            out["pixel_values_videos"] = clips
            feats = core.get_video_features(pixel_values_videos=clips).pooler_output
            n = feats.shape[1] if self.family == "llava_onevision" else feats.numel() // feats.shape[-1] // len(videos)
            vid_runs = [[VIDEO] * n] * len(videos)
        return img_runs, vid_runs, out


def family_pair(family: str, tok):
    """(target, processor) of ``family``: a 3-layer tiny target (EAGLE-3 reads three layers)."""
    if family == "llava":
        return make_llava(0, layers=3), make_processor(tok)
    if family == "llava_next":
        from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

        ip = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
        return _llava_family(family), LlavaNextProcessor(
            image_processor=ip, tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1, chat_template=CHAT)
    model = make_qwen(0, family, layers=3) if family.startswith("qwen") else _llava_family(family)
    return model, StandIn(tok, family, model)


def write_media(root: Path, n_images: int = 6, n_videos: int = 2, frames: int = 8, seed: int = 0) -> None:
    """``root/img{k}.png`` (random pictures of two sizes) and ``root/clip{k}/f{j}.png`` (frames)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    sizes = [(20, 40), (30, 30)]
    for k in range(n_images):
        Image.fromarray(rng.integers(0, 256, (*sizes[k % 2], 3), dtype=np.uint8)).save(root / f"img{k}.png")
    for k in range(n_videos):
        (root / f"clip{k}").mkdir(exist_ok=True)
        for j in range(frames):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / f"clip{k}" / f"f{j}.png")


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10, 40)}" for _ in range(n))


def conversations(n: int, video: bool, seed: int = 0, fmt: str = "sharegpt") -> list[dict]:
    """``n`` two-turn conversations over two images (and a video): ShareGPT records (``images``,
    ``video``, ``messages``) or LLaVA-Instruct ones (``image``, ``conversations``)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        imgs = [f"img{rng.randrange(6)}.png", f"img{rng.randrange(6)}.png"]
        if fmt == "llava":
            out.append({"id": str(i), "image": imgs[0], "conversations": [
                {"from": "human", "value": f"<image>\n{words(rng, 3)}"}, {"from": "gpt", "value": words(rng, 8)},
                {"from": "human", "value": words(rng, 3)}, {"from": "gpt", "value": words(rng, 6)}]})
            continue
        first = "<image> <image> " + ("<video> " if video else "") + words(rng, 3)
        rec = {"id": str(i), "images": imgs, "messages": [
            {"role": "user", "content": first}, {"role": "assistant", "content": words(rng, 8)},
            {"role": "user", "content": words(rng, 3)}, {"role": "assistant", "content": words(rng, 6)}]}
        if video:
            rec["video"] = f"clip{rng.randrange(2)}"
        out.append(rec)
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
