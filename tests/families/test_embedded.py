"""The shipped embedded pack: present, loads with the network blocked, stays within the size
budget, and decodes losslessly with SpecDecoder for every view and ensemble on 1-, 2- and 5-image
world samples."""

import socket

import pytest

from helpers.tiny import NetworkBlocked, block_network
from mmspec.embedded import ROLES, default_path


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No network for this module (the pack must load from the package alone)."""
    with block_network():
        yield


@pytest.fixture(scope="module")
def pack(offline):
    from mmspec.embedded import load_embedded

    return load_embedded()


def test_pack_is_present():
    """The pack is committed to git: a missing file is a broken checkout or install, not a skip."""
    root = default_path()
    missing = [f"{role}/{name}" for role in ROLES for name in ("config.json", "model.safetensors")
               if not (root / role / name).is_file()]
    assert not missing, f"embedded pack incomplete under {root}: missing {', '.join(missing)} (broken install?)"


def test_network_is_blocked():
    """The guard is live in this module (so the loading and decoding tests really ran offline)."""
    with pytest.raises(NetworkBlocked, match=r"create_connection\(\('example.com', 80\)\)"):
        socket.create_connection(("example.com", 80))
    with pytest.raises(NetworkBlocked, match="huggingface.co"):
        socket.getaddrinfo("huggingface.co", 443)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        with pytest.raises(NetworkBlocked, match="93.184.215.14"):
            sock.connect(("93.184.215.14", 443))


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
