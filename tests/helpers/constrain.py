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


@torch.inference_mode()
def constrained_sequence_probs(target, ids, pv, compiled, eos: int = 2, n_new: int = 3) -> dict:
    """P(x1..x_n_new) under the target with each step's p masked to the grammar's legal tokens
    (renormalised), EOS ending a sequence early: exactly, by enumeration over a tiny vocabulary
    (``helpers.reference.exact_sequence_probs`` with the grammar's mask)."""
    import xgrammar as xgr

    from helpers.tiny import IMG

    V = target.config.text_config.vocab_size
    feats = torch.cat(list(target.get_image_features(pixel_values=pv).pooler_output))
    bm = xgr.allocate_token_bitmask(1, V)

    def next_probs(prefix):
        full = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], 1) if prefix else ids
        emb = target.get_input_embeddings()(full)
        emb[0, : ids.shape[1]][ids[0] == IMG] = feats
        logits = target(inputs_embeds=emb).logits[0, -1]
        m = xgr.GrammarMatcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        m.fill_next_token_bitmask(bm)
        allowed = torch.tensor([(int(bm[0, i // 32]) >> (i % 32)) & 1 for i in range(V)], dtype=torch.bool)
        return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)

    seqs, probs, frontier = [], [], [((), 1.0)]
    for _ in range(n_new):
        new = []
        for prefix, pr in frontier:
            p = next_probs(list(prefix))
            for t in range(V):
                seq, q = prefix + (t,), pr * float(p[t])
                if q == 0:
                    seqs.append(seq), probs.append(0.0)
                elif t == eos or len(seq) == n_new:
                    seqs.append(seq), probs.append(q)
                else:
                    new.append((seq, q))
        frontier = new
    return dict(zip(seqs, probs))
