import warnings

import pytest
import torch

from helpers.tiny import make_llama, make_llava, make_tokenizer, noisy_copy

torch.set_num_threads(1)  # tiny models: threads only add contention


@pytest.fixture(scope="session")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target():
    return make_llava(0)


@pytest.fixture(scope="session")
def draft_shared(target):
    """Noisy copy of the target's LM; same vision tower (vision-feature reuse path)."""
    return noisy_copy(target, 1)


@pytest.fixture(scope="session")
def draft_small():
    """A smaller LLaVA with its own vision tower and a 2x2 patch grid (4 tokens per image)."""
    return make_llava(7, hidden=32, layers=1, patch=16, vision_hidden=16)


@pytest.fixture(scope="session")
def draft_text():
    """A text-only causal LM draft (text and caption views)."""
    return make_llama(11)


def _ours(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return "/transformers/" in f or "/mmspec/" in f


@pytest.fixture(autouse=True)
def no_deprecations_in_generate(monkeypatch):
    """Any FutureWarning or DeprecationWarning that transformers or mmspec raises inside
    SpecDecoder.generate fails the test: the next API rename is caught the day it is
    announced, not the day it is removed. Other warnings pass through unchanged."""
    from mmspec.decoder import SpecDecoder

    orig = SpecDecoder.generate

    def checked(self, *args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = orig(self, *args, **kwargs)
        bad = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning)) and _ours(w.filename)]
        for w in caught:
            if w not in bad:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if bad:
            raise AssertionError("deprecated API used inside SpecDecoder.generate: "
                                 + "; ".join(f"{w.filename}:{w.lineno}: {w.message}" for w in bad))
        return out

    monkeypatch.setattr(SpecDecoder, "generate", checked)
    yield
