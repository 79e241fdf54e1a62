import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention

from tiny import make_llama, make_llava, make_tokenizer, noisy_copy  # noqa: E402


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
