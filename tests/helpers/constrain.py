"""Constrained decoding in tests: a character-level tokenizer (the tiny models' words cannot spell
JSON), the target's own constrained decoding (the reference) and validity checks."""

from __future__ import annotations

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers.tiny import WORDS

CHAR_VOCAB = 128
PIECES = ['{"', '":', '","', '"}', '",', ',"', 'true', 'false', 'null', '},', '12', '":"', '"]', '["']


def make_char_tokenizer(vocab: int = CHAR_VOCAB) -> PreTrainedTokenizerFast:
    """Ids 0-4 the tiny models' special words, then every printable ASCII character, then a few
    JSON pieces (several tokenizations of one text, as real vocabularies have), padded with words."""
    words = WORDS[:5] + [chr(c) for c in range(32, 127)] + PIECES
    words += [f"x{i}" for i in range(vocab - len(words))]
    assert len(words) == vocab and len(set(words)) == vocab
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


@torch.inference_mode()
def constrained_reference(target, ids, pv, n: int, compiled) -> list[int]:
    """The target's own greedy decoding under ``compiled`` (an xgrammar CompiledGrammar):
    transformers' generate with xgrammar's logits processor."""
    import xgrammar as xgr

    proc = xgr.contrib.hf.LogitsProcessor(compiled)
    out = target.generate(input_ids=ids, pixel_values=pv, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, logits_processor=[proc])
    return out[0, ids.shape[1]:].tolist()
