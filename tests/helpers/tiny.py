"""Tiny randomly initialised models and a tokenizer, built from configs the way transformers
tests itself. Shared by the test modules (import, not a fixture, so helpers can reuse it)."""

from __future__ import annotations

import contextlib
import copy
import socket

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

VOCAB = 96
PAD, BOS, EOS, IMG, NL = 0, 1, 2, 3, 4
WORDS = ["<pad>", "<s>", "</s>", "<image>", "\n"]


def make_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = WORDS[:5] + [f"w{i}" for i in range(5, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])  # split "<image><image>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


def swapped_tokenizer(tok, a: str, b: str) -> PreTrainedTokenizerFast:
    """``tok``'s vocabulary with the ids of words ``a`` and ``b`` exchanged: the same size,
    another vocabulary (a draft trained with some other tokenizer); ``a == b`` copies it."""
    vocab = tok.get_vocab()
    words = dict(vocab)
    words[a], words[b] = vocab[b], vocab[a]
    other = make_tokenizer(len(words))
    other.backend_tokenizer.model = models.WordLevel(words, unk_token="<pad>")
    return other


def make_llava(seed: int, *, hidden: int = 64, layers: int = 2, image_size: int = 32, patch: int = 8,
               vision_hidden: int = 32, vocab: int = VOCAB, eos: int = EOS, strategy: str = "default",
               dtype=torch.float64) -> LlavaForConditionalGeneration:
    torch.manual_seed(seed)
    vc = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=2,
                          num_attention_heads=4, image_size=image_size, patch_size=patch,
                          projection_dim=vision_hidden)
    tc = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMG, vision_feature_layer=-2,
                      vision_feature_select_strategy=strategy,  # "full" keeps CLS: one more image token
                      image_seq_length=(image_size // patch) ** 2 + (strategy == "full"))
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # sharpen logits so greedy choices are far from ties
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = PAD
    return model.to(dtype).eval()


def noisy_copy(model, seed: int, scale: float = 0.15, lm_only: bool = True):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)  # CPU draws: the same draft on every device
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if lm_only and "vision_tower" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
            p.add_(noise * scale * p.std().clamp_min(1e-3))
    return draft


def make_llama(seed: int, *, hidden: int = 32, vocab: int = VOCAB, dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).to(dtype).eval()


# placeholder ids of the tiny multimodal families (IMAGE == IMG; Qwen2-VL's vision start / end)
IMAGE, VIDEO, VSTART, VEND = 3, 6, 7, 8


def make_qwen(seed: int, family: str = "qwen2_vl", layers: int = 2):
    """A tiny Qwen2-VL (or Qwen2.5-VL): 4 px patches merged 2x2, ``layers`` decoder layers, float64."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
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


def make_prompt(n_images: int, tokens_per_image: int, seed: int = 0, text_len: int = 6):
    """input_ids [1, L] with image tokens expanded, and pixel_values [n, 3, 32, 32]."""
    g = torch.Generator().manual_seed(seed)
    ids = [BOS]
    for _ in range(n_images):
        ids += torch.randint(5, VOCAB, (text_len,), generator=g).tolist() + [IMG] * tokens_per_image
    ids += torch.randint(5, VOCAB, (text_len,), generator=g).tolist()
    pixel_values = torch.randn(n_images, 3, 32, 32, generator=g, dtype=torch.float64) if n_images else None
    return torch.tensor([ids]), pixel_values


def make_processor(tok, image_size: int = 32, patch: int = 8) -> LlavaProcessor:
    """The target's processor: expands each <image> to (image_size/patch)^2 image tokens."""
    ip = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                               crop_size={"height": image_size, "width": image_size})
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=patch, image_token="<image>",
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


class NetworkBlocked(AssertionError):
    """Raised by :func:`block_network` when code under test tries to reach the network."""


@contextlib.contextmanager
def block_network():
    """Inside: name resolution and every connect except on a Unix socket (loopback TCP included)
    raise NetworkBlocked naming the address, so "loads offline" is checked rather than assumed (HF_HUB_OFFLINE set in a test is
    read too late: huggingface_hub reads it at import). Everything is restored on exit."""

    def refuse(what, address):
        raise NetworkBlocked(f"network access attempted during an offline test: {what}({address!r})")

    orig_connect, orig_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(self, address):
        return orig_connect(self, address) if self.family == socket.AF_UNIX else refuse("socket.connect", address)

    def connect_ex(self, address):
        return orig_connect_ex(self, address) if self.family == socket.AF_UNIX else refuse("socket.connect_ex", address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)
        mp.setattr(socket, "create_connection", lambda address, *a, **k: refuse("socket.create_connection", address))
        mp.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: refuse("socket.getaddrinfo", (host, port)))
        yield


# ---------------------------------------------------------------- exact-distribution tests


def save_checkpoints(root, target, draft, tok):
    """``root/target`` and ``root/draft`` (weights + processor, as save_pretrained writes them) and two
    40x40 images ``root/img0.png`` (red), ``root/img1.png`` (blue): what the CLI tests load."""
    from PIL import Image

    proc = make_processor(tok)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        proc.save_pretrained(root / name)
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (40, 40), colour).save(root / f"img{i}.png")
    return root
