"""The synthetic world: determinism, disjoint splits, prompts vs images, facts vs pixels,
the tokenizer's special layout and the processor's image-token expansion."""

from __future__ import annotations

import numpy as np
import pytest

from mmspec.errors import MMSpecError
from mmspec.prompt import IMAGE_MARKER
from mmspec.world import (
    FAMILIES,
    IMAGE_SIZE,
    N_IMAGES,
    SPLITS,
    bundled_examples,
    generate_samples,
    iter_all,
    make_sample,
)
from mmspec.world.core import split_of
from mmspec.world.render import CELL, CHART_BASELINE, CHART_UNIT, COLOURS, PLURAL, POSITIONS, SHAPES, bar_slots

N = 40  # samples per family in the content checks


@pytest.fixture(scope="module")
def samples() -> dict[str, list]:
    return {fam: generate_samples(fam, "train", N) for fam in FAMILIES}


@pytest.fixture(scope="module")
def tokenizer():
    from mmspec.world.tokenizer import train_tokenizer

    return train_tokenizer(vocab_size=1024, n_per_family=60)


def _image_bytes(sample) -> list[bytes]:
    return [im.tobytes() for im in sample.images]


def _mask(img, colour: str) -> np.ndarray:
    return (np.asarray(img) == np.array(COLOURS[colour], dtype=np.uint8)).all(-1)  # [H, W] bool


def test_contract_names():
    assert list(FAMILIES) == ["chartqa", "textvqa", "vqav2", "hallusionbench",
                              "spot_the_diff", "iedit", "pororosv", "vist"]
    assert list(N_IMAGES.values()) == [1, 1, 1, 1, 2, 2, 5, 5]
    assert SPLITS == ("train", "val", "test")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deterministic_and_index_dependent(family):
    a, b = make_sample(family, "val", 3, seed=7), make_sample(family, "val", 3, seed=7)
    assert _image_bytes(a) == _image_bytes(b)
    assert (a.prompt, a.answer, a.facts, a.captions, a.uid) == (b.prompt, b.answer, b.facts, b.captions, b.uid)
    assert a.uid == f"{family}-val-3"
    c = make_sample(family, "val", 4, seed=7)
    d = make_sample(family, "val", 3, seed=8)
    assert _image_bytes(a) != _image_bytes(c) or a.answer != c.answer
    assert _image_bytes(a) != _image_bytes(d) or a.answer != d.answer


def test_generate_and_iter_agree_with_make_sample():
    got = generate_samples("vqav2", "test", 3, start=5)
    assert [s.uid for s in got] == ["vqav2-test-5", "vqav2-test-6", "vqav2-test-7"]
    assert got[1].answer == make_sample("vqav2", "test", 6).answer
    first = list(iter_all("train", 2))
    assert [s.family for s in first[:8]] == list(FAMILIES)
    assert len(first) == 16
    # per-family counts: unnamed families get none, short ones drop out of the interleaving
    mixed = [s.uid for s in iter_all("train", {"vist": 1, "chartqa": 3})]
    assert mixed == ["vist-train-0", "chartqa-train-0", "chartqa-train-1", "chartqa-train-2"]
    with pytest.raises(MMSpecError, match="unknown family 'chart'"):
        list(iter_all("train", {"chart": 1}))


@pytest.mark.parametrize("family", ["chartqa", "textvqa", "iedit", "vist"])
def test_splits_are_disjoint_in_content(family):
    seen: dict[str, set] = {}
    for split in SPLITS:
        keys = set()
        for s in generate_samples(family, split, 25):
            keys.add((s.prompt, tuple(sorted(s.facts.items())), tuple(s.captions)))
        seen[split] = keys
    assert not seen["train"] & seen["test"]
    assert not seen["train"] & seen["val"]
    assert not seen["val"] & seen["test"]


def test_spec_split_assignment_is_roughly_80_10_10():
    from mmspec.world.core import derive_rng

    fam = FAMILIES["vqav2"]
    counts = {s: 0 for s in SPLITS}
    for i in range(1000):
        counts[split_of(fam.name, fam.draw_spec(derive_rng(0, "probe", "x", i)))] += 1
    assert 700 < counts["train"] < 900 and 50 < counts["val"] < 150 and 50 < counts["test"] < 150


def test_images_match_slots_and_facts_are_stated(samples):
    for family, ss in samples.items():
        for s in ss:
            assert len(s.images) == N_IMAGES[family] == s.prompt.count(IMAGE_MARKER)
            assert len(s.captions) == N_IMAGES[family]
            assert all(im.mode == "RGB" and im.size == (IMAGE_SIZE, IMAGE_SIZE) for im in s.images)
            assert s.prompt.endswith("ASSISTANT:")
            assert (s.question is not None) == (N_IMAGES[family] == 1)
            assert s.facts, s.uid
            for key, value in s.facts.items():
                assert value in s.answer, (s.uid, key, value, s.answer)
            assert " a orange" not in s.answer and " a igloo" not in s.answer, s.answer
            if family in ("pororosv", "vist"):
                for cap in s.captions[:4]:
                    assert f": {cap}" in s.prompt


def test_hallucination_cues_are_the_deciding_sentence():
    """An exists answer's cue is the sentence that commits its verdict (training weighs it): it
    names the asked object, then decides with its next word, and agrees with the true answer."""
    import re

    seen = set()
    for s in generate_samples("hallusionbench", "train", 60):
        if "count" in s.facts:
            assert s.cues == ()
            continue
        (cue,) = s.cues
        assert cue in s.answer and cue.endswith(".")
        asked = re.search(r"an? (\w+ \w+)(?: in (?:the image|this picture))?\?$", s.question).group(1)
        m = re.fullmatch(r"(?:Looking for|Checking for|Searching the image for) an? (\w+ \w+): (yes|no), .+\.", cue)
        assert m is not None, cue
        assert m.group(1) == asked and m.group(2) == s.facts["answer"].lower(), (cue, s.question, s.facts)
        assert s.answer.index(cue) > s.answer.index(". ")  # after the scene sentence
        seen.add(s.facts["answer"])
    assert seen == {"Yes", "No"}
    assert all(s.cues == () for s in generate_samples("vqav2", "train", 10))


def test_answers_vary_in_phrasing(samples):
    for family, ss in samples.items():
        # strip the facts so only the wording is compared
        shapes = set()
        for s in ss:
            text = s.answer
            for v in sorted(s.facts.values(), key=len, reverse=True):
                text = text.replace(v, "#")
            shapes.add(text.split(" ")[0] + " " + text.split(" ")[-1])
        assert len({s.answer for s in ss}) > N * 0.8, family
        assert len(shapes) >= 3, (family, shapes)


def test_chart_bars_have_the_stated_values(samples):
    checked = 0
    for s in samples["chartqa"]:
        if "value" not in s.facts or "colour" not in s.facts:
            continue
        mask = _mask(s.images[0], s.facts["colour"])
        height = int(mask.any(1).sum())
        assert height == int(s.facts["value"]) * CHART_UNIT, s.uid
        xs = np.nonzero(mask.any(0))[0]
        assert any(x0 == xs.min() and x1 == xs.max() for x0, x1 in bar_slots(len(s.captions[0].split(","))))
        assert mask[CHART_BASELINE].any()
        checked += 1
    assert checked >= 5


def _cells_with(img, colour: str) -> set[int]:
    mask = _mask(img, colour)
    cells = set()
    for cell in range(9):
        r, c = divmod(cell, 3)
        if mask[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL].sum() > 40:
            cells.add(cell)
    return cells


def test_vqav2_pixels_agree_with_facts(samples):
    checked = 0
    for s in samples["vqav2"]:
        img, f = s.images[0], s.facts
        if "count" in f and "colour" in f:
            assert len(_cells_with(img, f["colour"])) == int(f["count"]), s.uid
            checked += 1
        elif "position" in f:
            assert POSITIONS.index(f["position"]) in _cells_with(img, f["colour"]), s.uid
            checked += 1
        elif "colour" in f:
            assert _mask(img, f["colour"]).sum() > 100, s.uid
            checked += 1
    assert checked >= 10


def _shape_of(mask: np.ndarray) -> str:
    """Name a flat shape from its pixels alone: fill of its bounding box, and (for the two half-full
    shapes) whether the bottom half holds most of it. Measured over every radius and jitter the
    renderer uses: square 1.0, circle 0.78, cross 0.64-0.68, triangle 0.52 (bottom-heavy, ~2.8x),
    diamond 0.50 (symmetric), star 0.40-0.42."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    h = box.shape[0]
    fill = box.mean()
    if fill > 0.9:
        return "square"
    if fill > 0.72:
        return "circle"
    if fill > 0.58:
        return "cross"
    if fill > 0.46:
        return "triangle" if box[h - h // 2:].sum() > 1.5 * box[:h // 2].sum() else "diamond"
    return "star"


def _objects_in(img) -> dict[int, tuple[str, str]]:
    """cell -> (colour, shape) of the object drawn there, read from the pixels."""
    found = {}
    for colour in COLOURS:
        mask = _mask(img, colour)
        for cell in _cells_with(img, colour):
            r, c = divmod(cell, 3)
            assert cell not in found, f"two colours in cell {cell}"
            found[cell] = (colour, _shape_of(mask[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL]))
    return found


def test_hallusionbench_pixels_agree_with_answers():
    """The Yes/No label (and the stated count) follow from the rendered pixels alone: a renderer or
    generator bug that flipped a label, drew the wrong shape or miscounted fails here."""
    import re

    singular = {p: s for s, p in PLURAL.items()}
    seen = set()
    for s in generate_samples("hallusionbench", "test", 60):
        objs = _objects_in(s.images[0])
        assert objs, s.uid
        # the pixel reader agrees with the scene caption (so a wrong reading cannot pass unnoticed)
        described = re.findall(r"an? (\w+) (\w+) (?:in|at|on) the (top left|top right|bottom left|bottom right"
                               r"|top|bottom|left|right|center)", s.captions[0])
        assert {(POSITIONS.index(p), (c, sh)) for c, sh, p in described} == set(objs.items()), (s.uid, s.captions[0])
        answer = s.facts["answer"]
        assert answer in ("Yes", "No"), s.uid
        m = re.search(r"(?:exactly|show) (\d) (\w+)", s.question)
        if m:  # "Are there exactly 2 diamonds in the image?"
            k, noun = int(m.group(1)), m.group(2)
            shape = singular.get(noun, noun)
            assert shape in SHAPES, s.question
            true = sum(sh == shape for _, sh in objs.values())
            assert s.facts["count"] == str(true), (s.uid, s.question, s.facts)
            assert answer == ("Yes" if true == k else "No"), (s.uid, s.question, s.facts)
            seen.add(("count", answer))
        else:  # "Can you see a red diamond in this picture?"
            colour, shape = re.search(r"an? (\w+) (\w+)(?: in (?:the image|this picture))?\?$", s.question).groups()
            cells = [cell for cell, obj in objs.items() if obj == (colour, shape)]
            assert answer == ("Yes" if cells else "No"), (s.uid, s.question, s.facts, objs)
            if cells:
                assert POSITIONS.index(s.facts["position"]) in cells, (s.uid, s.facts)
            seen.add(("exists", answer))
    assert seen == {("count", "Yes"), ("count", "No"), ("exists", "Yes"), ("exists", "No")}, seen


def test_spot_the_diff_changes_are_visible(samples):
    for s in samples["spot_the_diff"]:
        a, b = (np.asarray(im) for im in s.images)
        assert (a != b).any(), s.uid
        colour = s.facts["detail_1"]
        if colour in COLOURS:  # a recolour: the new colour gains pixels
            assert _mask(s.images[1], colour).sum() > _mask(s.images[0], colour).sum(), s.uid


def test_stories_hide_the_ending_in_frame_five(samples):
    for s in samples["vist"]:
        place_colour = s.facts["place"].split(" ")[0]
        assert _mask(s.images[4], place_colour).sum() > 30, s.uid
        assert all(_mask(im, place_colour).sum() == 0 for im in s.images[:4]), s.uid


def test_make_sample_is_fast():
    import time

    t0 = time.perf_counter()
    generate_samples("chartqa", "train", 50)
    assert (time.perf_counter() - t0) / 50 < 0.02


def test_bundled_examples(tmp_path):
    paths = bundled_examples(tmp_path)
    assert len(paths) == sum(N_IMAGES.values())
    assert all(p.exists() and p.suffix == ".png" for p in paths)


def test_unknown_family_and_split_are_clear_errors():
    from mmspec.errors import MMSpecError

    with pytest.raises(MMSpecError, match="unknown family"):
        make_sample("coco", "train", 0)
    with pytest.raises(MMSpecError, match="unknown split"):
        make_sample("vqav2", "dev", 0)


# ----------------------------------------------------------------------------- tokenizer / processor


def test_tokenizer_special_ids_and_newline(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>", "<image>"])
    assert ids == [0, 1, 2, 3, 4]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    nl = tokenizer.encode("\n", add_special_tokens=False)
    assert len(nl) == 1
    assert tokenizer.encode("\n") == [1, nl[0]]  # bos added like LLaMA
    assert tokenizer.encode("a\n\nb", add_special_tokens=False).count(nl[0]) == 2
    assert tokenizer.image_token == "<image>"
    assert tokenizer.model_max_length == 2048
    # the chat roles are one token each, as every prompt writes them (frequent merges, not specials)
    roles = tokenizer.encode("USER: What? ASSISTANT:", add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(roles)
    assert tokens[:2] == ["USER", ":"] and tokens[-2:] == ["ĠASSISTANT", ":"], tokens


def test_tokenizer_round_trips_and_saves(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    s = make_sample("pororosv", "test", 1)
    text = s.prompt + " " + s.answer + "\n  tabs\tand ünïcode ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids.count(4) == 5
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == tokenizer.encode(text)


def test_processor_expands_images_and_round_trips(tokenizer, tmp_path):
    from transformers import AutoProcessor

    from mmspec.world.processor import build_processor, encode_for_training, training_text

    proc = build_processor(tokenizer)
    s = make_sample("spot_the_diff", "test", 0)
    out = proc(text=s.prompt, images=s.images, return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (2, 3, IMAGE_SIZE, IMAGE_SIZE)  # [n_images, 3, H, W]
    assert int((out["input_ids"] == 4).sum()) == 2 * 64
    proc.save_pretrained(tmp_path)
    again = AutoProcessor.from_pretrained(tmp_path)
    out2 = again(text=s.prompt, images=s.images, return_tensors="pt")
    assert out2["input_ids"].equal(out["input_ids"]) and out2["pixel_values"].equal(out["pixel_values"])

    prompt, answer = training_text(s)
    assert (prompt, answer) == (s.prompt, s.answer)
    enc = encode_for_training(proc, s)
    n_prompt = out["input_ids"].shape[1]
    assert (enc["labels"][0, :n_prompt] == -100).all()
    assert enc["labels"][0, -1].item() == tokenizer.eos_token_id
    assert tokenizer.decode(enc["labels"][0, n_prompt:-1]) == " " + s.answer


@pytest.mark.parametrize("family", ["chartqa", "textvqa", "vqav2", "hallusionbench"])
def test_the_first_fact_is_the_one_the_question_asks(family):
    """`Sample.facts` lists the asked fact first and the reference answer's final sentence gives it
    (for yes/no questions, as the verdict it ends on): question accuracy
    (`mmspec.train.evaluate.answers_question`) scores the target's answers by that convention."""
    from mmspec.train.evaluate import answers_question, final_sentence

    for i in range(60):
        s = make_sample(family, "test", i)
        assert s.question is not None and answers_question(s, s.answer), (s.uid, final_sentence(s.answer), s.facts)


def test_lookup_answers_write_each_value_right_after_its_key():
    """A lookup answer reads the image out with each key's value right after it ("hat 5", "star
    blue top left") and ends on the asked key and then its value: the layout a small LM learned to
    look up in, where "hat is 5 ... So the value of hat is" stayed at chance
    (docs/results/lookup-form-2026-11-23/)."""
    import random
    import re

    from mmspec.train.evaluate import final_sentence
    from mmspec.world.single import LOOKUP_ORDER, draw_chart, draw_vqa, render_chart, render_vqa

    rng = random.Random(0)
    seen: dict[str, int] = {}
    for _ in range(200):
        spec = draw_chart(rng)
        draft = render_chart(spec, rng)
        reading = draft.answer.split(". ")[0]
        for lab, val in zip(spec.labels, spec.values):
            assert re.search(rf"\b{lab} {val}\b", reading), (reading, lab, val)
        assert not re.search(r"\bis \d", reading), reading
        if spec.kind == "value":
            la, va = spec.labels[spec.a], spec.values[spec.a]
            assert final_sentence(draft.answer).endswith(f" {la} {va}."), draft.answer
            assert draft.answer.count(". ") == 1, draft.answer  # the lookup follows the reading at once
        seen[spec.kind] = seen.get(spec.kind, 0) + 1
    for _ in range(300):
        spec = draw_vqa(rng)
        draft = render_vqa(spec, rng)
        if spec.kind not in LOOKUP_ORDER:
            continue
        reading = draft.answer.split(". ")[0]
        order = LOOKUP_ORDER[spec.kind]
        for o in spec.objs:
            assert " ".join(getattr(o, a) for a in order) in reading, (reading, o)
        asked = next(o for o in spec.objs if getattr(o, {"colour_of": "shape", "position": "name",
                                                          "shape_at": "position"}[spec.kind]) == spec.target)
        value = {"colour_of": asked.colour, "position": asked.position, "shape_at": asked.shape}[spec.kind]
        assert draft.facts[next(iter(draft.facts))] == value
        assert final_sentence(draft.answer).endswith(f" {spec.target} {value}."), draft.answer
        seen[spec.kind] = seen.get(spec.kind, 0) + 1
    assert seen.get("value", 0) >= 20 and all(seen.get(k, 0) >= 20 for k in LOOKUP_ORDER), seen
