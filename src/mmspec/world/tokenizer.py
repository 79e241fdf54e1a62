"""The world's tokenizer: a byte-level BPE trained on the world's own train-split text.

Owns the special-token layout every world model shares (``<pad>``=0, ``<s>``=1, ``</s>``=2,
``<unk>``=3, ``<image>``=4), a LLaMA-style bos added by the post-processor, and the guarantee
the text-only drafting view relies on: ``"\\n"`` is exactly one token. Byte-level BPE with no
normalisation, so ``decode(encode(text))`` gives back ``text`` exactly. The chat roles (``USER``,
`` ASSISTANT``) come out as one token each: every prompt writes them, so they are among the
first merges (tested), as in LLaMA-family tokenizers, where they are not special tokens either.
The video families' text uses only words this tokenizer already holds whole (tested), so it is
trained on the image families alone and its ids never move; a video model appends one token,
``<video>``, at the end of the vocabulary (:func:`add_video_token`). Knows nothing about images.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mmspec.world import iter_all

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IMAGE)  # ids 0..4, in this order
VIDEO = "<video>"  # not trained in: add_video_token appends it after the last id
MODEL_MAX_LENGTH = 2048


def _corpus(n_per_family: int, seed: int) -> Iterator[str]:
    for sample in iter_all("train", n_per_family, seed):
        yield sample.prompt
        yield sample.answer
        yield from sample.captions
    # every line break pattern the views produce, so "\n" merges stay stable
    yield "\n"


def train_tokenizer(vocab_size: int = 2048, n_per_family: int = 400, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the BPE on ``n_per_family`` train samples of each family (a few seconds on CPU)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Split "\n" off on its own before byte-level splitting so it can never merge with spaces.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(n_per_family, seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"{t} should have id {i}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        extra_special_tokens={"image_token": IMAGE},
    )
    return fast


def newline_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The single token id of ``"\\n"`` (the text view's image replacement)."""
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f'"\\n" encodes to {len(ids)} tokens; the text view needs exactly one')
    return ids[0]


def add_video_token(tokenizer: PreTrainedTokenizerFast) -> int:
    """Append ``<video>`` (:data:`mmspec.prompt.VIDEO_MARKER`) to ``tokenizer`` as one special token
    and return its id: ``len(tokenizer)`` before the call, so every existing id keeps its meaning
    and a trained model only needs one more embedding row. A tokenizer that has it already is
    left as it is (its id is returned). In place, like ``tokenizer.add_tokens``."""
    if VIDEO not in tokenizer.get_vocab():
        tokenizer.add_tokens([VIDEO], special_tokens=True)
    return tokenizer.convert_tokens_to_ids(VIDEO)


__all__ = ["SPECIAL_TOKENS", "MODEL_MAX_LENGTH", "VIDEO", "add_video_token", "train_tokenizer", "newline_id"]
