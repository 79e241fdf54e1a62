"""The world's video families, the DVS event model and the substitute inputs: determinism, disjoint
splits, words the tokenizer holds, facts vs pixels, event counts on hand-built frames, binning of
hand-made streams, and the substitutes' shapes. The image world must stay exactly as it was."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.errors import MMSpecError
from mmspec.events import EventStream, bin_events, event_stats, simulate_dvs
from mmspec.prompt import IMAGE_MARKER, VIDEO_MARKER, VIDEO_QA, fill_template
from mmspec.substitutes import MAKERS, Substitute, make_substitute
from mmspec.world import (
    FAMILIES,
    IMAGE_SIZE,
    SPLITS,
    VIDEO_FAMILIES,
    VIDEO_FPS,
    generate_video_samples,
    iter_all,
    iter_video,
    make_sample,
    make_video_sample,
)
from mmspec.world.core import derive_rng, draw_in_split, split_of
from mmspec.world.render import CELL, COLOURS, POSITIONS
from mmspec.world.video import N_FRAMES

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "src/mmspec/assets/embedded/target"
# sha256 of the text of iter_all(split, 3) over the three splits, taken on main before the video
# families existed: the image samples (and so the tokenizer corpus and every recipe) must not move
IMAGE_WORLD_TEXT_SHA = "219b850441c86c62da694bfc65cf4b8e73b07be24ea08a991e2a2f1325b319ed"
THETA = 0.2


def _frame_bytes(s) -> list[bytes]:
    return [f.tobytes() for f in s.frames]


def _mask(img, colour: str) -> np.ndarray:
    return (np.asarray(img) == np.array(COLOURS[colour], dtype=np.uint8)).all(-1)  # [H, W] bool


# ----------------------------------------------------------------------------- the image world stays


def test_image_world_is_unchanged():
    assert list(FAMILIES) == ["chartqa", "textvqa", "vqav2", "hallusionbench",
                              "spot_the_diff", "iedit", "pororosv", "vist"]
    assert not set(FAMILIES) & set(VIDEO_FAMILIES)
    h = hashlib.sha256()
    for split in SPLITS:
        for s in iter_all(split, 3):
            assert s.family in FAMILIES and not hasattr(s, "frames")
            h.update(json.dumps([s.uid, s.prompt, s.answer, s.facts, s.captions, list(s.cues)]).encode())
    assert h.hexdigest() == IMAGE_WORLD_TEXT_SHA


def test_video_token_is_appended_and_existing_ids_keep_their_meaning():
    from transformers import AutoTokenizer

    from mmspec.world.tokenizer import SPECIAL_TOKENS, VIDEO, add_video_token

    assert VIDEO == VIDEO_MARKER
    tok = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    before, n = dict(tok.get_vocab()), len(tok)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert VIDEO not in before
    vid = add_video_token(tok)
    assert vid == n and len(tok) == n + 1
    after = tok.get_vocab()
    assert all(after[t] == i for t, i in before.items())
    assert add_video_token(tok) == vid and len(tok) == n + 1  # a second call adds nothing
    s = make_video_sample("motion", "test", 0)
    ids = tok.encode(s.prompt, add_special_tokens=False)
    assert ids.count(vid) == 1 and tok.decode(ids) == s.prompt
    image_ids = tok.encode(make_sample("vqav2", "test", 0).prompt, add_special_tokens=False)
    assert vid not in image_ids and image_ids.count(4) == 1


# ----------------------------------------------------------------------------- video samples


def test_video_contract():
    from mmspec.events import DEFAULT_FPS

    assert list(VIDEO_FAMILIES) == ["motion", "order"]
    assert DEFAULT_FPS == VIDEO_FPS  # simulate_dvs(frames) times a world clip as its sample does
    for fam in VIDEO_FAMILIES.values():
        assert fam.n_frames == N_FRAMES == 8
        s = make_video_sample(fam.name, "val", 2)
        assert s.uid == f"{fam.name}-val-2" and s.split == "val" and s.fps == VIDEO_FPS
        assert len(s.frames) == N_FRAMES
        assert all(f.mode == "RGB" and f.size == (IMAGE_SIZE, IMAGE_SIZE) for f in s.frames)
        assert s.prompt == fill_template(VIDEO_QA, question=s.question)
        assert s.prompt.count(VIDEO_MARKER) == 1 and IMAGE_MARKER not in s.prompt
        assert s.prompt.startswith("USER: <video> ") and s.prompt.endswith(f" {s.question} ASSISTANT:")


@pytest.mark.parametrize("family", list(VIDEO_FAMILIES))
def test_deterministic_and_index_dependent(family):
    a, b = make_video_sample(family, "train", 5, seed=3), make_video_sample(family, "train", 5, seed=3)
    assert _frame_bytes(a) == _frame_bytes(b)
    assert (a.uid, a.prompt, a.answer, a.facts, a.key_fact, a.caption) == (
        b.uid, b.prompt, b.answer, b.facts, b.key_fact, b.caption)
    for other in (make_video_sample(family, "train", 6, seed=3), make_video_sample(family, "train", 5, seed=4)):
        assert _frame_bytes(a) != _frame_bytes(other)
    uids = [s.uid for s in generate_video_samples(family, "test", 2, start=4)]
    assert uids == [f"{family}-test-4", f"{family}-test-5"]


def test_iter_video_interleaves():
    uids = [s.uid for s in iter_video("train", {"order": 2, "motion": 1})]
    assert uids == ["order-train-0", "motion-train-0", "order-train-1"]
    assert len(list(iter_video("val", 2))) == 4


@pytest.mark.parametrize("family", list(VIDEO_FAMILIES))
def test_a_clip_belongs_to_one_split(family):
    """A sample is rendered from the spec its split owns, and a spec is the clip alone (no
    question in it): no clip, and so no key fact of a clip, is in two splits."""
    fam = VIDEO_FAMILIES[family]
    specs: dict[str, set[str]] = {}
    for split in SPLITS:
        specs[split] = set()
        for i in range(40):
            spec, rng = draw_in_split(family, fam.draw_spec, split, i, 0)
            assert split_of(family, spec) == split
            assert "question" not in repr(spec) and "kind" not in repr(spec)
            draft = fam.render(spec, rng)
            s = make_video_sample(family, split, i)
            assert [f.tobytes() for f in draft.frames] == _frame_bytes(s) and draft.key_fact == s.key_fact
            specs[split].add(repr(spec))
    assert not specs["train"] & specs["val"] and not specs["train"] & specs["test"] and not specs["val"] & specs["test"]
    counts = Counter(split_of(family, fam.draw_spec(derive_rng(0, "probe", "x", i))) for i in range(1000))
    assert 700 < counts["train"] < 900 and 50 < counts["val"] < 150 and 50 < counts["test"] < 150, counts


def _all_text(s) -> str:
    return " ".join([s.prompt.replace(VIDEO_MARKER, " "), s.answer, s.caption, s.key_fact, *s.facts.values()])


def test_every_word_is_a_whole_word_of_the_world_tokenizer():
    """The video text uses only words the shipped world tokenizer holds as one token each (after a
    space, as they stand in a prompt or an answer), so no retraining moves its ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER / "tokenizer.json"))
    whole: dict[str, bool] = {}
    split_words: Counter = Counter()
    n = 0
    for family in VIDEO_FAMILIES:
        for split in SPLITS:
            for s in generate_video_samples(family, split, 50):
                n += 1
                for w in re.findall(r"[A-Za-z0-9]+", _all_text(s)):
                    if w not in whole:
                        whole[w] = len(tok.encode(" " + w, add_special_tokens=False).ids) == 1
                    if not whole[w] and w != "USER":  # the prompt's first word, written without a space
                        split_words[w] += 1
    assert n == 300 and not split_words, split_words
    assert len(tok.encode(" clip", add_special_tokens=False).ids) > 1  # the check can fail: "clip" is split


@pytest.mark.parametrize("family", list(VIDEO_FAMILIES))
def test_answers_state_facts_key_fact_and_end_on_the_asked_fact(family):
    from mmspec.train.evaluate import answers_question, final_sentence, states

    asked = Counter()
    for s in generate_video_samples(family, "test", 80):
        assert s.key_fact and states(s.answer, s.key_fact), (s.uid, s.key_fact, s.answer)
        for key, value in s.facts.items():
            assert states(s.answer, value), (s.uid, key, value, s.answer)
        assert answers_question(s, s.answer), (s.uid, final_sentence(s.answer), s.facts)
        assert " a orange" not in s.answer + s.caption and " a orange" not in s.question
        asked[next(iter(s.facts))] += 1
    want = {"motion": {"direction", "start", "end"}, "order": {"first", "second", "last", "count"}}[family]
    assert set(asked) == want, asked


@pytest.mark.parametrize("family", list(VIDEO_FAMILIES))
def test_answers_vary_in_phrasing(family):
    ss = generate_video_samples(family, "train", 60)
    assert len({s.answer for s in ss}) > 50
    wordings, openings = set(), set()
    for s in ss:
        text = s.answer
        for v in sorted([s.key_fact, *s.facts.values()], key=len, reverse=True):
            text = text.replace(v, "#")
        wordings.add(re.sub(r"\b(?:an?|the) [a-z]+ [a-z]+\b", "#", text))  # other shapes' names too
        openings.add(" ".join(text.split(" ")[:4]))
    assert len(wordings) >= 20 and len(openings) >= 3, (len(wordings), openings)


def _centroid(img, colour: str) -> tuple[float, float]:
    ys, xs = np.nonzero(_mask(img, colour))
    return float(xs.mean()), float(ys.mean())


def test_motion_pixels_agree_with_the_facts():
    seen = Counter()
    for s in generate_video_samples("motion", "train", 60):
        colour = s.key_fact.split(" ")[0]
        (x0, y0), (x1, y1) = _centroid(s.frames[0], colour), _centroid(s.frames[-1], colour)
        dx, dy = x1 - x0, y1 - y0
        d = s.facts["direction"]
        want = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1), "still": (0, 0)}[d]
        for delta, sign in ((dx, want[0]), (dy, want[1])):
            assert (abs(delta) > CELL * 0.9) if sign else (abs(delta) < 0.5), (s.uid, d, dx, dy)
            assert sign == 0 or np.sign(delta) == sign, (s.uid, d, dx, dy)
        for pos, (x, y) in ((s.facts["start"], (x0, y0)), (s.facts["end"], (x1, y1))):
            assert POSITIONS.index(pos) == int(y // CELL) * 3 + int(x // CELL), (s.uid, pos, x, y)
        seen[d] += 1
    assert set(seen) == {"left", "right", "up", "down", "still"}, seen


def test_order_pixels_agree_with_the_facts():
    for s in generate_video_samples("order", "train", 40):
        names = s.key_fact.replace(" and ", ", ").split(", ")
        colours = [n.split(" ")[0] for n in names]
        assert (np.asarray(s.frames[0]) == 255).all(), s.uid  # the first frame is empty
        first_seen = {c: next(k for k, f in enumerate(s.frames) if _mask(f, c).sum() > 40) for c in colours}
        assert [first_seen[c] for c in colours] == sorted(set(first_seen.values())), (s.uid, first_seen)
        assert colours[0] == s.facts["first"].split(" ")[0] and colours[-1] == s.facts["last"].split(" ")[0]
        present = sum(_mask(s.frames[-1], c).sum() > 40 for c in COLOURS)
        assert present == int(s.facts["count"]) == len(names), s.uid


def test_video_errors_are_clear():
    with pytest.raises(MMSpecError, match="unknown video family 'dance'; use one of motion, order"):
        make_video_sample("dance", "train", 0)
    with pytest.raises(MMSpecError, match="'vqav2' is an image family: use make_sample"):
        make_video_sample("vqav2", "train", 0)
    with pytest.raises(MMSpecError, match="unknown split"):
        make_video_sample("motion", "dev", 0)
    with pytest.raises(MMSpecError, match="index must be >= 0"):
        make_video_sample("order", "train", -1)
    with pytest.raises(MMSpecError, match="unknown video family"):
        list(iter_video("train", {"motion": 1, "chartqa": 1}))
    with pytest.raises(MMSpecError, match="unknown family 'motion'"):
        make_sample("motion", "train", 0)


# ----------------------------------------------------------------------------- DVS events


def _levels(*log_steps: float, base: float = 0.3, eps: float = 1e-2) -> np.ndarray:
    """Intensities in [0, 1] whose log(I + eps) rises by ``log_steps`` (in thresholds) from ``base``."""
    logs = np.log(base + eps) + np.cumsum((0.0,) + log_steps) * THETA
    return np.exp(logs) - eps  # [T]


def test_dvs_emits_one_event_per_threshold_crossed_with_polarity_and_place():
    frames = np.full((2, 3, 4), 0.3)  # [T, H, W] grey
    frames[:, 1, 2] = _levels(2.5)  # brightens by 2.5 thresholds: 2 events, +1
    frames[:, 0, 3] = _levels(-1.2)  # darkens by 1.2 thresholds: 1 event, -1
    frames[:, 2, 0] = _levels(0.9)  # below one threshold: nothing
    st = simulate_dvs(frames, threshold=THETA, fps=10.0)
    assert len(st) == 3 and (st.height, st.width) == (3, 4) and st.window == (0, 100_000)
    assert st.t.dtype == np.int64 and st.p.dtype == np.int8
    rows = sorted(zip(st.x.tolist(), st.y.tolist(), st.p.tolist(), st.t.tolist()))
    # log intensity moves linearly in the step: the crossings of 1 and 2 thresholds out of 2.5
    # lie at 0.4 and 0.8 of the 100 ms interval; 1 out of 1.2 at 5/6 of it
    assert rows == [(2, 1, 1, 40_000), (2, 1, 1, 80_000), (3, 0, -1, 83_333)], rows
    assert (np.diff(st.t) >= 0).all()


def test_dvs_remembers_the_level_of_the_last_event():
    """A pixel compares with the level of its last event, not with the previous frame: small steps
    add up to events, and a fall back by less than a threshold from that level emits nothing."""
    frames = np.full((4, 1, 3), 0.3)  # [T, H, W], one second per frame
    frames[:, 0, 0] = _levels(0.7, 0.7, 0.7)  # 2.1 thresholds in steps of 0.7: events at 1.0 and 2.0
    frames[:, 0, 1] = _levels(1.5, -1.2, 0)  # +1 at 1.0; back to 0.3 is 0.7 below it: nothing
    frames[:, 0, 2] = _levels(1.5, -1.6, 0)  # +1 at 1.0; down to -0.1 crosses 0.0: one -1
    st = simulate_dvs(frames, threshold=THETA, fps=1.0)
    got = list(zip(st.x.tolist(), st.p.tolist(), st.t.tolist()))
    assert got == [(1, 1, 666_667), (2, 1, 666_667), (0, 1, 1_428_571), (2, -1, 1_937_500),
                   (0, 1, 2_857_143)], got


def test_dvs_static_clips_emit_nothing_and_inputs_agree():
    still = next(s for s in generate_video_samples("motion", "train", 20) if s.facts["direction"] == "still")
    assert len(simulate_dvs(still.frames)) == 0
    assert bin_events(simulate_dvs(still.frames), 4).sum() == 0
    moving = next(s for s in generate_video_samples("motion", "train", 20) if s.facts["direction"] == "right")
    st = simulate_dvs(moving.frames)
    assert (st.p > 0).any() and (st.p < 0).any()
    path = np.zeros((IMAGE_SIZE, IMAGE_SIZE), bool)  # where the mover's colour ever is
    colour = moving.key_fact.split(" ")[0]
    for f in moving.frames:
        path |= _mask(f, colour)
    assert path[st.y, st.x].mean() > 0.9  # events fire where the shape passes (edges: a pixel or so off)
    arr = np.stack([np.asarray(f) for f in moving.frames])  # [T, H, W, 3] uint8
    for same in (simulate_dvs(arr), simulate_dvs(torch.from_numpy(arr)), simulate_dvs(arr / 255.0)):
        assert np.array_equal(same.t, st.t) and np.array_equal(same.x, st.x) and np.array_equal(same.p, st.p)
    grey = [f.convert("L") for f in moving.frames]
    assert len(simulate_dvs(grey)) > 0


def test_dvs_rejects_bad_frames():
    with pytest.raises(MMSpecError, match="differ in size"):
        simulate_dvs([Image.new("RGB", (8, 8)), Image.new("RGB", (8, 6))])
    with pytest.raises(MMSpecError, match="differ in size"):
        simulate_dvs([np.zeros((4, 4)), np.zeros((4, 5))])
    with pytest.raises(MMSpecError, match="not a video"):
        simulate_dvs(np.zeros((2, 4, 4, 2)))
    with pytest.raises(MMSpecError, match="no frames"):
        simulate_dvs([])
    with pytest.raises(MMSpecError, match="must be > 0"):
        simulate_dvs(np.zeros((2, 4, 4)), threshold=0)
    with pytest.raises(MMSpecError, match=">= 0"):
        simulate_dvs(-np.ones((2, 4, 4)))


# ----------------------------------------------------------------------------- streams and bins


def test_bin_events_counts_a_hand_made_stream():
    # a recording as cameras write it: seconds, polarity 1/0 (0 = OFF), not quite sorted
    st = EventStream.from_arrays(
        t=[0.0, 0.25, 0.1, 0.5, 0.99, 1.0, 0.6],
        x=[0, 1, 0, 2, 2, 2, 1],
        y=[0, 0, 0, 1, 1, 1, 1],
        p=[1, 0, 1, 1, 0, 0, 1],
        height=2, width=3, time_unit="s",
    )
    assert st.t.tolist() == [0, 100_000, 250_000, 500_000, 600_000, 990_000, 1_000_000]
    assert st.p.tolist() == [1, 1, -1, 1, 1, -1, -1]
    assert st.window == (0, 1_000_000)
    b = bin_events(st, 4)  # slices of 250 ms; the event at the window's end counts in the last
    assert b.shape == (4, 2, 2, 3) and b.dtype == torch.float32 and b.sum() == 7
    expect = torch.zeros(4, 2, 2, 3)
    expect[0, 0, 0, 0] = 2  # t 0 and 100 ms at (x 0, y 0), +1
    expect[1, 1, 0, 1] = 1  # 250 ms at (1, 0), -1
    expect[2, 0, 1, 2] = 1  # 500 ms at (2, 1), +1
    expect[2, 0, 1, 1] = 1  # 600 ms at (1, 1), +1
    expect[3, 1, 1, 2] = 2  # 990 ms and 1 s at (2, 1), -1
    assert torch.equal(b, expect)
    part = bin_events(st, 2, t_range=(250_000, 750_000))  # outside the window: left out
    assert part.sum() == 3 and part[0, 1, 0, 1] == 1 and part[1].sum() == 2
    empty = EventStream(np.zeros(0, np.int64), [], [], [], 5, 7)
    assert len(empty) == 0 and torch.equal(bin_events(empty, 3), torch.zeros(3, 2, 5, 7))


def test_binned_simulated_events_keep_their_time_slice():
    frames = np.full((5, 2, 2), 0.3)
    frames[:, 0, 0] = _levels(0, 0, 0, 1.5)  # crosses one threshold in the last step only
    frames[:, 1, 1] = _levels(-1.5, 0, 0, 0)  # one -1 event in the first step only
    b = bin_events(simulate_dvs(frames, threshold=THETA, fps=4.0), 4)  # 4 steps, 4 slices
    assert b[3, 0, 0, 0] == 1 and b[0, 1, 1, 1] == 1 and b.sum() == 2


def test_event_stream_rejects_malformed_recordings():
    ok = dict(t=np.array([0, 1]), x=np.array([0, 1]), y=np.array([0, 0]), p=np.array([1, -1]), height=2, width=2)
    EventStream(**ok)
    with pytest.raises(MMSpecError, match="outside the 2 x 2 sensor"):
        EventStream(**{**ok, "x": np.array([0, 2])})
    with pytest.raises(MMSpecError, match="must be \\+1 or -1.*from_arrays"):
        EventStream(**{**ok, "p": np.array([1, 0])})
    with pytest.raises(MMSpecError, match="non-decreasing"):
        EventStream(**{**ok, "t": np.array([5, 1])})
    with pytest.raises(MMSpecError, match="differ in length"):
        EventStream(**{**ok, "y": np.array([0])})
    with pytest.raises(MMSpecError, match="integers.*time_unit='s'"):
        EventStream(**{**ok, "t": np.array([0.0, 0.5])})
    with pytest.raises(MMSpecError, match="polarity must be"):
        EventStream.from_arrays([0], [0], [0], [2], 1, 1)
    with pytest.raises(MMSpecError, match="unknown time_unit"):
        EventStream.from_arrays([0], [0], [0], [1], 1, 1, time_unit="min")
    for bad in (np.nan, np.inf):  # named, not "not non-decreasing"
        with pytest.raises(MMSpecError, match=f"the timestamps hold {bad} at event 1 \\(1 event\\(s\\) in all"):
            EventStream.from_arrays([0.0, bad, 2.0], [0, 1, 1], [0, 0, 0], [1, 1, 1], 2, 2, time_unit="s")


def test_structured_recordings_and_stats():
    rec = np.zeros(4, dtype=[("x", "<u2"), ("y", "<u2"), ("p", "<i2"), ("t", "<i8")])  # Metavision's layout
    rec["t"] = [10, 20, 30, 2_000_010]
    rec["x"], rec["y"], rec["p"] = [0, 3, 3, 1], [0, 1, 1, 0], [1, 0, 0, 1]
    st = EventStream.from_structured(rec, height=2, width=4)
    assert st.t.tolist() == [10, 20, 30, 2_000_010] and st.p.tolist() == [1, -1, -1, 1]
    stats = event_stats(st, n_frames=10)
    assert (stats.n_events, stats.n_positive, stats.n_negative) == (4, 2, 2)
    assert stats.duration_s == 2.0 and stats.events_per_second == 2.0
    assert stats.events_per_pixel == 0.5 and stats.active_pixels == 3 / 8
    assert stats.events_per_frame_value == 4 / (10 * 8 * 3)
    with pytest.raises(MMSpecError, match="lacks field"):
        EventStream.from_structured(np.zeros(1, dtype=[("ts", "<i8")]), 1, 1)
    world = event_stats(simulate_dvs(make_video_sample("order", "test", 0).frames), n_frames=N_FRAMES)
    assert 0 < world.events_per_frame_value < 0.1 and world.n_positive == 0  # shapes appear: darker on white


# ----------------------------------------------------------------------------- substitutes


def test_substitutes_have_the_documented_shapes():
    s = make_video_sample("motion", "test", 1)
    ev = make_substitute(s.frames, "events")
    assert ev.kind == "events" and tuple(ev.tensor.shape) == (4, 2, IMAGE_SIZE, IMAGE_SIZE)
    assert torch.equal(ev.tensor, bin_events(simulate_dvs(s.frames), 4))
    assert ev.source_shape == (N_FRAMES, IMAGE_SIZE, IMAGE_SIZE, 3) and ev.size_ratio == 1 / 3
    assert tuple(make_substitute(s.frames, "events", n_bins=2, threshold=0.5).tensor.shape) == (2, 2, 96, 96)

    fps = make_substitute(s.frames, "low_fps")
    assert tuple(fps.tensor.shape) == (2, 3, IMAGE_SIZE, IMAGE_SIZE) and (fps.steps, fps.channels) == (2, 3)
    first_last = torch.from_numpy(np.stack([np.asarray(s.frames[0]), np.asarray(s.frames[-1])])).permute(0, 3, 1, 2)
    assert torch.allclose(fps.tensor * 255, first_last.float(), atol=1e-3)
    assert tuple(make_substitute(s.frames, "low_fps", n_frames=3).tensor.shape) == (3, 3, 96, 96)

    res = make_substitute(s.frames, "low_res", size=24)
    assert tuple(res.tensor.shape) == (N_FRAMES, 3, 24, 24) and res.size_ratio == 1 / 16
    checker = np.zeros((1, 4, 4), np.uint8)
    checker[0, ::2, ::2] = checker[0, 1::2, 1::2] = 255  # area averaging: each 2x2 block is half lit
    assert torch.allclose(make_substitute(checker, "low_res", size=2).tensor, torch.full((1, 1, 2, 2), 0.5))

    rec = EventStream.from_arrays([0, 5], [0, 1], [0, 1], [1, 0], height=2, width=2)
    sub = Substitute.from_events(rec, n_bins=2)
    assert sub.kind == "events" and tuple(sub.tensor.shape) == (2, 2, 2, 2) and sub.size_ratio is None
    assert sub.tensor[0, 0, 0, 0] == 1 and sub.tensor[1, 1, 1, 1] == 1
    assert set(MAKERS) == {"events", "low_fps", "low_res"}


def test_substitute_errors_name_the_fix():
    frames = make_video_sample("order", "test", 0).frames
    with pytest.raises(MMSpecError, match="unknown substitute kind 'depth'; use one of events, low_fps, low_res"):
        make_substitute(frames, "depth")
    with pytest.raises(MMSpecError, match="unknown option.*size.*takes n_frames"):
        make_substitute(frames, "low_fps", size=3)
    with pytest.raises(MMSpecError, match="n_frames must be in 1..8"):
        make_substitute(frames, "low_fps", n_frames=9)
    with pytest.raises(MMSpecError, match="n_bins must be >= 1"):
        make_substitute(frames, "events", n_bins=0)
