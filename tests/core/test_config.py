"""SpecDecoder's options grouped in typed objects (mmspec.config): the same decoder from one
DecoderConfig as from the flat keywords, keywords beside a config override it, an unknown
keyword refused naming the closest."""

import pytest

from helpers.tiny import make_prompt
from mmspec import DecoderConfig, DraftConfig, MMSpecError, SpecDecoder, TreeConfig
from mmspec.config import KEYWORDS


def test_a_config_builds_the_decoder_the_keywords_build(target, draft_shared, tok):
    flat = SpecDecoder(target, draft_shared, tok, views="MT", tree="dynamic", tree_depth=3, tree_topk=2,
                       tree_budget=6, prefix_cache_mb=0)
    cfg = DecoderConfig.of(views="MT", tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6,
                           prefix_cache_mb=0)
    assert cfg.draft == DraftConfig(views="MT") and cfg.tree.tree_budget == 6 and cfg.runtime.prefix_cache_mb == 0
    grouped = SpecDecoder(target, draft_shared, tok, config=cfg)
    assert grouped.config == flat.config
    assert (grouped.tree, grouped.views, grouped.gamma, grouped.method) == (flat.tree, flat.views, flat.gamma,
                                                                           flat.method)
    ids, pv = make_prompt(1, 16, seed=4)
    assert grouped.generate(ids, pv, max_new_tokens=12).token_ids == flat.generate(ids, pv, max_new_tokens=12).token_ids


def test_keywords_beside_a_config_override_its_fields(target, draft_shared, tok):
    cfg = DecoderConfig(tree=TreeConfig(gamma=2, stop_below=0.1))
    dec = SpecDecoder(target, draft_shared, tok, config=cfg, gamma=4)
    assert dec.gamma == 4 and dec.config.tree.stop_below == 0.1
    assert DecoderConfig.of(cfg).keywords()["gamma"] == 2  # the config itself is not changed


def test_unknown_options_are_refused_by_name(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match=r"unknown option 'gama'; did you mean 'gamma'"):
        SpecDecoder(target, draft_shared, tok, gama=3)
    with pytest.raises(MMSpecError, match="config must be a mmspec.DecoderConfig"):
        SpecDecoder(target, draft_shared, tok, config={"gamma": 3})


def test_every_keyword_has_one_group():
    assert len(KEYWORDS) == len(set(KEYWORDS)) == len(DecoderConfig().keywords()) == 25


def test_a_group_of_another_type_is_refused_naming_its_class():
    """DecoderConfig(tree="dynamic") used to fail later with AttributeError ('str' object has no
    attribute 'tree_children'), runtime={"compile": True} with ''dict' object has no attribute
    'prefix_cache_mb''; each group is type-checked and the fix written out."""
    with pytest.raises(MMSpecError, match=r"DecoderConfig\(tree='dynamic'\): tree= takes a TreeConfig, "
                       r"not a str: write tree=mmspec.config.TreeConfig\(tree='dynamic'\), "
                       r"or pass tree='dynamic' to SpecDecoder directly"):
        DecoderConfig(tree="dynamic")
    with pytest.raises(MMSpecError, match=r"runtime= takes a RuntimeConfig, not a dict: "
                       r"write runtime=mmspec.config.RuntimeConfig\(compile=True\), or pass compile=True"):
        DecoderConfig(runtime={"compile": True})
    with pytest.raises(MMSpecError, match=r"acceptance= takes an AcceptanceOptions"):
        DecoderConfig(acceptance="relaxed")
    with pytest.raises(MMSpecError, match=r"draft= takes a DraftConfig, not a str: "
                       r"write draft=mmspec.config.DraftConfig\(\.\.\.\), or pass its keywords"):
        DecoderConfig(draft="model_dir")
    assert DecoderConfig(tree=TreeConfig(tree="dynamic")).tree.tree == "dynamic"
