"""Tiny randomly initialised models and a tokenizer, built from configs the way transformers
tests itself. Shared by the test modules (import, not a fixture, so helpers can reuse it)."""

from __future__ import annotations

import contextlib
import copy
import socket

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlavaProcessor, LlamaConfig, LlamaForCausalLM, LlavaConfig,
                          LlavaForConditionalGeneration, PreTrainedTokenizerFast)

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
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if lm_only and "vision_tower" in name:
                continue
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp_min(1e-3))
    return draft


def make_llama(seed: int, *, hidden: int = 32, vocab: int = VOCAB, dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).to(dtype).eval()


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
