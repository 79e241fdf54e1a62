"""The constrained-decoding tests' models: a character-level tokenizer (every JSON character a
token, so a grammar's forced runs are long) and a tiny target and draft over its vocabulary,
shared by tests/core/test_constrain.py and test_constrain_tails.py."""

import pytest

from helpers.constrain import CHAR_VOCAB, make_char_tokenizer
from helpers.tiny import make_llava, noisy_copy


@pytest.fixture(scope="session")
def ctok():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def ctarget():
    return make_llava(0, vocab=CHAR_VOCAB)


@pytest.fixture(scope="session")
def cdraft(ctarget):
    return noisy_copy(ctarget, 1)
