"""The shipped embedded pack: loads offline, stays within the size budget, and decodes
losslessly with SpecDecoder for every view and ensemble on 1-, 2- and 5-image world samples."""

import os

import pytest

from mmspec.embedded import default_path

pytestmark = pytest.mark.skipif(not (default_path() / "target" / "config.json").exists(),
                                reason="embedded pack not built (mmspec train embedded)")


@pytest.fixture(scope="module")
def pack():
    from mmspec.embedded import load_embedded

    os.environ["HF_HUB_OFFLINE"] = "1"
    return load_embedded()


def test_pack_size_budget():
    total = sum(p.stat().st_size for p in default_path().rglob("*") if p.is_file())
    assert total <= 40 * 2**20, f"embedded assets are {total / 2**20:.1f} MiB > 40 MiB"


def test_draft_is_10x_smaller_in_its_lm(pack):
    lm = lambda m: sum(p.numel() for n, p in m.named_parameters() if "vision_tower" not in n)
    assert lm(pack.target) >= 10 * lm(pack.draft)  # LM+projector; the vision tower is shared
    assert lm(pack.draft) <= 2_000_000
    assert sum(p.numel() for p in pack.draft.parameters()) < sum(p.numel() for p in pack.target.parameters())


@pytest.mark.parametrize("family", ["chartqa", "spot_the_diff", "vist"])
def test_embedded_decodes_losslessly(pack, family):
    from mmspec import SpecDecoder
    from mmspec.world import make_sample

    s = make_sample(family, "test", 1)
    inputs = pack.processor(text=s.prompt, images=s.images, return_tensors="pt")
    ref = pack.target.generate(**inputs, do_sample=False, max_new_tokens=40)[0, inputs["input_ids"].shape[1]:]
    cap = pack.captioner()
    for method in ["M", "T", "C", f"pooled:{pack.pooled_tokens or 16}", "MTCP"]:
        dec = SpecDecoder(pack.target, pack.draft, pack.tokenizer, views=method, captioner=cap,
                          processor=pack.processor)
        assert dec.reuse_vision  # the draft shares the target's vision tower
        res = dec.generate(**inputs, max_new_tokens=40, images=s.images)
        assert res.token_ids == ref.tolist(), method
