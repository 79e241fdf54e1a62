"""Lossless greedy: SpecDecoder's tokens equal target.generate(do_sample=False) token for token,
for every view and ensemble, with 1, 2 and 5 images, early EOS and a cut by max_new_tokens."""

import pytest
import torch

from helpers.reference import captions, reference
from helpers.tiny import make_llava, make_prompt, noisy_copy
from mmspec import SpecDecoder

METHODS = ["M", "T", "C", "P", "MT", "MC", "MTC", "MTCP"]


@pytest.mark.parametrize("n_images", [1, 2, 5])
@pytest.mark.parametrize("method", METHODS)
def test_views_and_ensembles_match_target(target, draft_shared, tok, method, n_images):
    ids, pv = make_prompt(n_images, 16, seed=n_images)
    ref = reference(target, ids, pv, 24)
    dec = SpecDecoder(target, draft_shared, tok, views=method, captioner=captions(n_images))
    res = dec.generate(ids, pv, attention_mask=torch.ones_like(ids), max_new_tokens=24)
    assert res.token_ids == ref
    st = res.stats
    assert sum(st.tokens_per_block) == len(ref) and 1.0 <= st.tau <= dec.gamma + 1
    assert st.mean_accepted_length == pytest.approx(st.tau - 1)


@pytest.mark.parametrize("method", ["M", "P", "pooled:1", "MTCP"])
@pytest.mark.parametrize("n_images", [1, 2, 5])
def test_draft_with_own_vision_tower(target, draft_small, tok, method, n_images):
    """Draft with a different vision tower and image-token count (no feature reuse)."""
    ids, pv = make_prompt(n_images, 16, seed=10 + n_images)
    dec = SpecDecoder(target, draft_small, tok, views=method, captioner=captions(n_images))
    assert not dec.reuse_vision
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)


@pytest.mark.parametrize("method", ["T", "C", "TC"])
def test_text_only_draft(target, draft_text, tok, method):
    ids, pv = make_prompt(2, 16, seed=3)
    dec = SpecDecoder(target, draft_text, tok, views=method, captioner=captions(2))
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 7, 13])
def test_limit_cuts_block_exactly(target, draft_shared, tok, max_new):
    ids, pv = make_prompt(1, 16, seed=4)
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    res = dec.generate(ids, pv, max_new_tokens=max_new)
    assert res.token_ids == reference(target, ids, pv, max_new)
    assert len(res.token_ids) == max_new


@pytest.mark.parametrize("eos_at", [0, 3, 8])
@pytest.mark.parametrize("method", ["M", "MTC"])
def test_early_eos(tok, method, eos_at):
    """EOS in the middle of a block: output ends at EOS (included), exactly like generate."""
    base = make_llava(0)
    ids, pv = make_prompt(1, 16, seed=5)
    free = reference(base, ids, pv, 30)
    eos = free[eos_at]
    target = make_llava(0, eos=eos)
    draft = noisy_copy(target, 1)
    ref = reference(target, ids, pv, 30)
    assert ref[-1] == eos and len(ref) == free.index(eos) + 1
    dec = SpecDecoder(target, draft, tok, views=method, captioner=captions(1))
    assert dec.generate(ids, pv, max_new_tokens=30).token_ids == ref


def test_identical_draft_accepts_everything(target, tok):
    """Draft == target: every block accepts all gamma drafts and adds the bonus token."""
    ids, pv = make_prompt(1, 16, seed=6)
    dec = SpecDecoder(target, target, tok, views="M", gamma=4)
    res = dec.generate(ids, pv, max_new_tokens=20)
    assert res.token_ids == reference(target, ids, pv, 20)
    assert res.stats.tokens_per_block == [5, 5, 5, 5]
    assert res.stats.acceptance_by_position() == [1.0] * 4


def test_left_padding_is_ignored(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=8)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    assert dec.generate(padded, pv, attention_mask=mask, max_new_tokens=12).token_ids == reference(target, ids, pv, 12)


def test_caches_are_cropped_not_reprefilled(target, draft_shared, tok):
    """One target prefill, then exactly one target forward per block."""
    calls = []
    hook = target.model.language_model.register_forward_hook(lambda m, a, k, o: calls.append(1), with_kwargs=True)
    try:
        ids, pv = make_prompt(2, 16, seed=9)
        res = SpecDecoder(target, draft_shared, tok, views="M").generate(ids, pv, max_new_tokens=25)
    finally:
        hook.remove()
    assert len(calls) == 1 + res.stats.n_blocks


def test_vision_features_reused(target, draft_shared, tok):
    """Same vision tower: each image is encoded once, not once per model."""
    calls = []
    hooks = [m.model.vision_tower.register_forward_hook(lambda *a: calls.append(1)) for m in (target, draft_shared)]
    try:
        dec = SpecDecoder(target, draft_shared, tok, views="MP")
        assert dec.reuse_vision
        ids, pv = make_prompt(2, 16, seed=2)
        dec.generate(ids, pv, max_new_tokens=5)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 1


@pytest.mark.parametrize("method", ["M", "T", "C", "MTC"])
@pytest.mark.parametrize("draft_strategy", ["full", "default"])
def test_full_feature_strategy_keeps_cls(tok, method, draft_strategy):
    """A target whose vision_feature_select_strategy is "full" has grid**2 + 1 image tokens per
    image (CLS kept); decoding stays lossless with a "full" draft and with a "default" one."""
    from mmspec.errors import MMSpecError

    target = make_llava(50, strategy="full")
    draft = noisy_copy(target, 51) if draft_strategy == "full" else make_llava(52, hidden=32)
    ids, pv = make_prompt(2, 17, seed=5)  # 4x4 patches + CLS
    dec = SpecDecoder(target, draft, tok, views=method, captioner=captions(2))
    assert dec.target.tokens_per_image == 17
    assert dec.generate(ids, pv, max_new_tokens=16).token_ids == reference(target, ids, pv, 16)
    if draft_strategy == "full":
        with pytest.raises(MMSpecError, match="pooled view .* CLS"):
            SpecDecoder(target, draft, tok, views="P")
