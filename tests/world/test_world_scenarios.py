"""The world's scenario variants (mmspec.world.scenarios): deterministic, split-safe, built from
their base family's samples of the same split, and the images transformed as named."""

import numpy as np
import pytest

from mmspec import MMSpecError
from mmspec.world import FAMILIES, make_sample
from mmspec.world.scenarios import SCENARIOS, SECOND_STORY, generate_scenario_samples, make_scenario_sample


def pixels(img):
    return np.asarray(img.convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_deterministic_and_well_formed(name):
    a, b = make_scenario_sample(name, "test", 3), make_scenario_sample(name, "test", 3)
    assert a.uid == b.uid == f"{name}-test-3" and a.prompt == b.prompt
    assert all((pixels(x) == pixels(y)).all() for x, y in zip(a.images, b.images))
    assert len(a.images) == SCENARIOS[name].n_images == a.prompt.count("<image>")
    assert a.prompt.startswith("USER: ") and a.prompt.endswith(" ASSISTANT:")
    assert name not in FAMILIES  # kept out of the tokenizer corpus and the recipes
    assert [s.uid for s in generate_scenario_samples(name, "val", 2, start=5)] == [f"{name}-val-5", f"{name}-val-6"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_built_from_the_same_split(name):
    """Each scenario sample is its base family's sample of the same split and index (vist_long
    also the story at index + SECOND_STORY): the families' split guarantee carries over."""
    sc = SCENARIOS[name]
    for split in ("train", "test"):
        s = make_scenario_sample(name, split, 1)
        base = make_sample(sc.base, split, 1)
        assert base.answer in s.prompt or s.answer == base.answer
        if name == "vist_long":
            second = make_sample("vist", split, 1 + SECOND_STORY)
            assert s.answer == second.answer and base.answer in s.prompt
            assert s.prompt.endswith(second.prompt[len("USER: "):])


def test_transforms():
    base = make_sample("vqav2", "test", 0)
    inv = make_scenario_sample("vqav2_inverted", "test", 0)
    assert (pixels(inv.images[0]) == 255 - pixels(base.images[0])).all()
    assert inv.answer == base.answer and inv.prompt == base.prompt
    scr = make_scenario_sample("vqav2_scrambled", "test", 0)
    w, h = base.images[0].size
    assert (pixels(scr.images[0]) == np.roll(pixels(base.images[0]), (h // 2, w // 2), axis=(0, 1))).all()
    fol = make_scenario_sample("followup", "test", 0)
    assert fol.prompt == f"{base.prompt} {base.answer} USER: {base.question} ASSISTANT:"
    assert fol.images[0].tobytes() == base.images[0].tobytes()


def test_unknown_scenario():
    with pytest.raises(MMSpecError, match="unknown scenario"):
        make_scenario_sample("vqav2_upside_down", "test", 0)
