"""The substitute view (E): the draft reads each video as an event stream (or fewer frames, lower
resolution) through its substitute encoder, while the target reads the real video and verifies:
lossless like every view. Also: the encoder's errors, a recorded event stream, and that
`train align` fits the encoder to the draft's own video features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.qwen import qwen_reference
from helpers.tiny import make_llama, make_qwen, noisy_copy, qwen_inputs
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.models.substitute import build_substitute_encoder, load_substitute_encoder
from mmspec.substitutes import Substitute, make_substitute


def _frames(n: int = 8, size: int = 32, seed: int = 0) -> list:
    """A square moving right across a grey background."""
    out = []
    for t in range(n):
        a = np.full((size, size, 3), 128, dtype=np.uint8)
        x = 2 + 3 * t
        a[10:18, x:x + 8] = 250
        out.append(Image.fromarray(a))
    return out


@pytest.fixture(scope="module")
def pair():
    target = make_qwen(0)
    return target, noisy_copy(target, 1)


def _encoder(draft, kind="events", n_tokens=6):
    sub = make_substitute(_frames(), kind)
    return build_substitute_encoder(kind, sub.tensor, n_tokens, draft.config.text_config.hidden_size).double()


@pytest.mark.parametrize("views", ["E", "ME", "TE", "MTE"])
@pytest.mark.parametrize("tree", [None, "dynamic"])
@pytest.mark.parametrize("n_images", [0, 1])
def test_substitute_view_is_lossless(pair, tok, views, tree, n_images):
    target, draft = pair
    ids, mm = qwen_inputs(n_images, True, seed=5 + n_images)
    dec = SpecDecoder(target, draft, tok, views=views, tree=tree, substitute=_encoder(draft))
    res = dec.generate(ids, **mm, videos=[_frames()], max_new_tokens=20)
    assert res.token_ids == qwen_reference(target, ids, mm, 20)
    assert res.stats.substitute_s > 0


@pytest.mark.parametrize("kind", ["low_fps", "low_res"])
def test_other_substitutes_and_a_text_only_draft(pair, tok, kind):
    """Any substitute kind; and a text-only draft LM reading the aligned event tokens."""
    target, draft = pair
    ids, mm = qwen_inputs(0, True, seed=3)
    dec = SpecDecoder(target, draft, tok, views="E", substitute=_encoder(draft, kind))
    assert dec.generate(ids, **mm, videos=[_frames()], max_new_tokens=16).token_ids == qwen_reference(target, ids, mm, 16)
    text_draft = make_llama(11, hidden=32)
    sub = make_substitute(_frames(), "events")
    enc = build_substitute_encoder("events", sub.tensor, 4, 32).double()
    dec = SpecDecoder(target, text_draft, tok, views="TE", substitute=enc)
    assert dec.generate(ids, **mm, videos=[_frames()], max_new_tokens=16).token_ids == qwen_reference(target, ids, mm, 16)


def test_a_recorded_event_stream_feeds_the_same_view(pair, tok):
    from mmspec.events import EventStream

    target, draft = pair
    rng = np.random.default_rng(0)
    n = 500
    stream = EventStream.from_arrays(t=np.sort(rng.uniform(0, 1.0, n)), x=rng.integers(0, 32, n),
                                     y=rng.integers(0, 32, n), p=rng.choice([-1, 1], n), height=32, width=32,
                                     time_unit="s")
    ids, mm = qwen_inputs(1, True, seed=8)
    dec = SpecDecoder(target, draft, tok, views="ME", substitute=_encoder(draft))
    res = dec.generate(ids, **mm, substitutes=[Substitute.from_events(stream)], max_new_tokens=16)
    assert res.token_ids == qwen_reference(target, ids, mm, 16)


def test_substitute_view_errors(pair, tok, tmp_path):
    target, draft = pair
    with pytest.raises(MMSpecError, match="needs the draft's substitute encoder"):
        SpecDecoder(target, draft, tok, views="E")
    dec = SpecDecoder(target, draft, tok, views="E", substitute=_encoder(draft))
    ids, mm = qwen_inputs(0, True)
    with pytest.raises(MMSpecError, match="pass videos="):
        dec.generate(ids, **mm, max_new_tokens=4)
    with pytest.raises(MMSpecError, match="2 substitutes .* for 1 videos"):
        dec.generate(ids, **mm, videos=[_frames(), _frames()], max_new_tokens=4)
    wrong = build_substitute_encoder("events", make_substitute(_frames(), "events").tensor, 4, 32)
    with pytest.raises(MMSpecError, match="of another width"):
        SpecDecoder(target, draft, tok, views="E", substitute=wrong)
    enc = _encoder(draft)
    enc.save(tmp_path / "e")
    loaded = load_substitute_encoder(tmp_path / "e")
    assert all(torch.equal(a, b) for a, b in zip(enc.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(MMSpecError, match="reads events of 4 steps"):
        enc(make_substitute(_frames(), "events", n_bins=2).tensor.double())


def test_align_fits_the_encoder_to_the_drafts_video_features(tmp_path):
    """Pairs of world clips: their events, and the embedded draft's pooled features of their
    frames; a short fit lowers the loss."""
    import json

    from mmspec.embedded import load_embedded
    from mmspec.train.align import AlignConfig, train_align, world_pairs

    e = load_embedded()
    cfg = AlignConfig(kind="events", out=str(tmp_path / "enc"), n_tokens=4, steps=40, batch_size=8, lr=3e-3,
                      progress=False)
    subs, targets = world_pairs(e.draft, e.processor, cfg, ["motion", "order"], 6)
    assert targets[0].shape == (4, e.draft.config.text_config.hidden_size)
    train_align(subs, targets, cfg, log=lambda s: None)
    hist = json.loads((tmp_path / "enc" / "train_log.json").read_text())
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5
    assert load_substitute_encoder(tmp_path / "enc").config.trained["steps"] == 40
