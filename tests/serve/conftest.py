"""What the in-process server tests share: a tiny decoder and its processor (the app under test
builds its service on it; the scheduler is each test's own double or the real one)."""

import pytest

from helpers.tiny import make_llava, make_processor, make_tokenizer, noisy_copy


@pytest.fixture(scope="module")
def decoder():
    from mmspec import SpecDecoder

    tok = make_tokenizer()
    target = make_llava(0)
    return SpecDecoder(target, noisy_copy(target, 1), tok), make_processor(tok)
