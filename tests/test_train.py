"""Tests of mmspec.train: masking, stage freezing, loss going down, pooling maths, checkpoints.

Tiny models built from configs and a tiny fake world (coloured squares), so most tests need
neither the synthetic world package nor trained assets; the CLI, probe and reading-stream tests
use the world (no trained assets). All run in seconds on CPU.
"""

from __future__ import annotations

from dataclasses import replace

import math
import random

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoProcessor, CLIPImageProcessor, LlavaForConditionalGeneration,
                          LlavaProcessor, PreTrainedTokenizerFast)

from mmspec.errors import MMSpecError
from mmspec.train.config import StageConfig, build_llava, model_size
from mmspec.train.data import IGNORE, Encoder, Example, batch_stream, collate
from mmspec.train.pooling import pool_patches, pooled_image_features, vision_patch_features
from mmspec.train.recipe import batch_loss, lr_at, train_stage

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
WORDS = ["USER:", "ASSISTANT:", "what", "color", "is", "the", "square", "?", ".", "it", "and",
         "compare", "images", "a"] + list(COLORS)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "<image>", "\n"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>", "\n"]})
    assert fast.convert_tokens_to_ids("<image>") == 4 and fast("\n", add_special_tokens=False)["input_ids"] == [5]
    return fast


@pytest.fixture(scope="module")
def processor(tokenizer) -> LlavaProcessor:
    image_processor = CLIPImageProcessor(size={"shortest_edge": 96}, crop_size={"height": 96, "width": 96})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=12,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def fake_examples(n: int, seed: int = 0, n_images: int = 1) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        names = [rng.choice(list(COLORS)) for _ in range(n_images)]
        images = tuple(Image.new("RGB", (96, 96), COLORS[c]) for c in names)
        prompt = "USER: " + " ".join(["<image>"] * n_images) + " what color is the square ? ASSISTANT:"
        answer = "it is " + " and ".join(names) + " ."
        out.append(Example(prompt, answer, images, tuple(f"a {c} square" for c in names), "fake"))
    return out


@pytest.fixture()
def model(tokenizer) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    return build_llava(model_size("tiny"), tokenizer)


def test_encoder_matches_processor_and_masks_labels(tokenizer, processor):
    ex = fake_examples(1, n_images=2)[0]
    enc = Encoder(tokenizer).encode(ex)
    ref = list(processor(text=ex.prompt, images=list(ex.images))["input_ids"][0])
    assert enc.input_ids[: len(ref)] == ref  # prompt ids exactly as the processor makes them
    assert enc.input_ids.count(4) == 128
    answer = tokenizer(" " + ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert enc.labels == [IGNORE] * len(ref) + answer
    batch = collate([enc, Encoder(tokenizer).encode(fake_examples(1, seed=1)[0])], 0,
                    processor.image_processor, 64)
    img_or_pad = (batch.input_ids == 4) | (batch.attention_mask == 0)
    assert (batch.labels[img_or_pad] == IGNORE).all()
    assert batch.pixel_values.shape == (3, 3, 96, 96)
    # views: text -> one "\n" per image; pooled -> N tokens per image
    assert Encoder(tokenizer).encode(ex, "text").input_ids.count(5) == 2
    assert Encoder(tokenizer).encode(ex, "multimodal", 16).input_ids.count(4) == 32
    assert Encoder(tokenizer).encode(ex, "text").images == ()


def test_pooled_features_exact(model, processor):
    pv = processor.image_processor([ex.images[0] for ex in fake_examples(3)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = torch.stack(model.model.get_image_features(pixel_values=pv).pooler_output)  # [3, 64, H]
        assert torch.equal(pooled_image_features(model, pv, 64), ref)
        feats = vision_patch_features(model, pv)  # [3, 64, C]
        grid = feats.reshape(3, 8, 8, -1)
        manual = grid.reshape(3, 4, 2, 4, 2, -1).mean(dim=(2, 4)).reshape(3, 16, -1)
        torch.testing.assert_close(pool_patches(feats, 16), manual)
        p16 = pooled_image_features(model, pv, 16)
        assert p16.shape == (3, 16, model.config.text_config.hidden_size)
        torch.testing.assert_close(p16, model.model.multi_modal_projector(manual))
    with pytest.raises(MMSpecError):
        pool_patches(feats, 9)


def test_stage1_changes_only_projector(model, tokenizer, processor):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = batch_stream(fake_examples(8), Encoder(tokenizer), processor.image_processor, 4,
                          torch.Generator().manual_seed(0))
    train_stage(model, StageConfig("s1", "projector", lr=1e-2, steps=2, batch_size=4), stream, progress=False)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("model.multi_modal_projector.") for k in changed)


def test_stage2_reduces_loss(model, tokenizer, processor):
    examples = fake_examples(8)
    fixed = collate([Encoder(tokenizer).encode(e) for e in examples], 0, processor.image_processor, 64)
    with torch.no_grad():
        loss0 = float(batch_loss(model, fixed, train_vision=False))
    stream = batch_stream(examples, Encoder(tokenizer), processor.image_processor, 8,
                          torch.Generator().manual_seed(0))
    res = train_stage(model, StageConfig("s2", "projector+lm", lr=1e-2, steps=12, batch_size=8,
                                         warmup_ratio=0.1), stream, progress=False)
    with torch.no_grad():
        loss1 = float(batch_loss(model, fixed, train_vision=False))
    assert res.steps == 12 and loss1 < 0.7 * loss0


def test_batch_stream_workers_cover_each_shard_and_repeat_for_a_seed(tokenizer, processor):
    # 12 examples, each with a distinct answer length so a row identifies its example
    examples = [Example("USER: <image> what color is the square ? ASSISTANT:", " ".join(["it"] * (k + 1)),
                        (Image.new("RGB", (96, 96), (20 * k, 0, 0)),), (), "fake") for k in range(12)]
    enc = Encoder(tokenizer)

    def first(n_batches: int, seed: int) -> list[list[int]]:
        stream = batch_stream(examples, enc, processor.image_processor, 2, torch.Generator().manual_seed(seed),
                              workers=2)
        rows = []
        for _ in range(n_batches):
            b = next(stream)
            assert b.pixel_values.shape == (b.input_ids.shape[0], 3, 96, 96)
            rows.append(sorted(int((row != IGNORE).sum()) - 1 for row in b.labels))  # answer words
        return rows

    run = first(6, seed=0)  # one epoch of both shards: 2 workers x 3 batches of 2
    assert sorted(n for batch in run for n in batch) == list(range(1, 13))
    shard0 = {k + 1 for k in range(0, 12, 2)}  # worker 0 streams examples[0::2]
    assert set(run[0]) <= shard0 and set(run[2]) <= shard0 and not set(run[1]) & shard0  # round-robin
    assert first(6, seed=0) == run
    assert first(6, seed=1) != run
    with pytest.raises(MMSpecError, match="workers"):
        batch_stream(examples, enc, processor.image_processor, 2, torch.Generator(), workers=13)


def test_lr_schedule():
    assert lr_at(0.0, 1.0, 0.03) == 0.0
    assert lr_at(0.03, 1.0, 0.03) == pytest.approx(1.0)
    assert lr_at(1.0, 1.0, 0.03) == pytest.approx(0.0)
    assert 0.4 < lr_at(0.515, 1.0, 0.03) < 0.6
    assert lr_at(0.015, 1.0, 0.03, "constant") == pytest.approx(0.5)  # the same warm-up
    assert lr_at(0.5, 1.0, 0.03, "constant") == lr_at(1.0, 1.0, 0.03, "constant") == 1.0


def test_save_load_roundtrip_offline(model, tokenizer, processor, tmp_path, monkeypatch):
    from mmspec.models.loading import read_sidecar
    from mmspec.train.checkpoint import save_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_checkpoint(model, tmp_path / "m", processor=processor, half=False, meta={"role": "target"})
    loaded = LlavaForConditionalGeneration.from_pretrained(tmp_path / "m")
    proc = AutoProcessor.from_pretrained(tmp_path / "m")
    ex = fake_examples(1)[0]
    inputs = proc(text=ex.prompt, images=list(ex.images), return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)
    assert read_sidecar(tmp_path / "m") == {"role": "target"}


def test_load_embedded_missing_assets(tmp_path, monkeypatch):
    from mmspec.embedded import load_embedded

    with pytest.raises(MMSpecError, match="mmspec train embedded") as own:
        load_embedded(path=tmp_path / "nothing")
    assert "reinstall" not in str(own.value)  # a pack of the user's own: nothing is damaged
    import mmspec.embedded as embedded

    monkeypatch.setattr(embedded, "default_path", lambda: tmp_path / "gone")
    with pytest.raises(MMSpecError, match="install is damaged: reinstall mmspec"):
        load_embedded()  # the shipped pack's place, empty


def test_shared_vision_tower(model, tokenizer):
    draft = build_llava(model_size("tiny-draft"), tokenizer, vision_tower=model.model.vision_tower)
    for (k, a), b in zip(model.model.vision_tower.state_dict().items(),
                         draft.model.vision_tower.state_dict().values()):
        assert torch.equal(a, b), k


def test_world_encoding_matches_world_processor():
    world = pytest.importorskip("mmspec.world.processor")
    from mmspec.world import make_sample
    from mmspec.world.tokenizer import train_tokenizer

    from mmspec.train.data import example_from_sample

    tok = train_tokenizer(n_per_family=20)
    proc = world.build_processor(tok)
    sample = make_sample("spot_the_diff", "train", 0)
    prompt, answer = world.training_text(sample)
    enc = Encoder(tok).encode(example_from_sample(sample))
    full = list(proc(text=prompt + " " + answer, images=sample.images)["input_ids"][0])
    assert enc.input_ids == full + [tok.eos_token_id]  # prompt + " " + answer + eos, as the contract says
    assert enc.labels.count(IGNORE) == len(list(proc(text=prompt, images=sample.images)["input_ids"][0]))


def test_budget_shares_cap_every_stage():
    from mmspec.train.config import RecipeConfig
    from mmspec.train.pack import with_budget

    r = with_budget(RecipeConfig(), minutes=10)
    stages = [*r.target_stages, *r.draft_stages, r.pooled_stage, *r.captioner_stages]
    assert all(s.max_seconds and s.max_seconds > 0 for s in stages)
    assert sum(s.max_seconds for s in stages) <= 600


def test_caption_mix_adds_caption_examples():
    from types import SimpleNamespace

    from mmspec.train.data import CAPTIONER_PROMPT, mix_in_captions

    samples = [SimpleNamespace(images=ex.images, captions=ex.captions) for ex in fake_examples(10, n_images=2)]
    mixed = mix_in_captions(samples, 0.5, seed=0)
    assert len(mixed) == 5 and all(ex.prompt == CAPTIONER_PROMPT and ex.family == "caption" for ex in mixed)
    pool = {(id(img), cap) for s in samples for img, cap in zip(s.images, s.captions)}
    assert all((id(ex.images[0]), ex.answer) in pool for ex in mixed)  # each is one real (image, caption) pair
    assert len({id(ex.images[0]) for ex in mixed}) == 5  # drawn without replacement
    assert [ex.answer for ex in mix_in_captions(samples, 0.5, seed=0)] == [ex.answer for ex in mixed]
    assert len(mix_in_captions(samples, 9.0, seed=0)) == 20  # capped at every image once


def test_stream_mixes_views(tokenizer, processor):
    enc = Encoder(tokenizer)
    stream = batch_stream(fake_examples(64), enc, processor.image_processor, 64, torch.Generator().manual_seed(0),
                          text_view_prob=0.5)
    batch = next(stream)
    n_img_rows = int((batch.input_ids == 4).any(-1).sum())
    assert batch.pixel_values.shape[0] == n_img_rows and 16 <= n_img_rows <= 48  # about half went text-only


def test_stage_cli_mixes_captions_and_views(tmp_path, monkeypatch):
    """`mmspec train stage` with the new mixing flags trains, saves and records them; bad values
    are refused before any work."""
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app

    out = tmp_path / "m"
    args = ["train", "stage", "--size", "tiny", "--trainable", "projector+lm", "--steps", "2", "--batch-size", "4",
            "--n-train-per-family", "1", "--caption-mix", "0.5", "--text-view-prob", "0.3",
            "--caption-view-prob", "0.2", "--no-bf16", "--workers", "2", "--out", str(out)]
    import mmspec.train.data as data

    seen = {}
    real_stream = data.batch_stream

    def spy(examples, *a, **k):
        seen.update(k, n_captions=sum(ex.family == "caption" for ex in examples), n=len(examples))
        return real_stream(examples, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (seen["text_view_prob"], seen["caption_view_prob"]) == (0.3, 0.2)  # the flags reach the data
    assert seen["workers"] == 2
    assert seen["n_captions"] == 4 and seen["n"] == 12  # 8 QA examples (1 per family) + round(0.5 * 8)
    stage = json.loads((out / "mmspec.json").read_text())["stages"][-1]
    assert stage["steps"] == 2 and stage["caption_mix"] == 0.5 and stage["workers"] == 2
    assert (stage["text_view_prob"], stage["caption_view_prob"]) == (0.3, 0.2)
    assert LlavaForConditionalGeneration.from_pretrained(out) is not None
    k = args.index("--workers") + 1
    no = CliRunner().invoke(app, args[:k] + ["-1"] + args[k + 1:-1] + [str(tmp_path / "w")])
    assert no.exit_code != 0 and "--workers" in no.output and not (tmp_path / "w").exists()
    many = CliRunner().invoke(app, args[:k] + ["99"] + args[k + 1:-1] + [str(tmp_path / "w")])  # 12 examples
    assert many.exit_code == 2 and "workers must be between" in many.output and "Traceback" not in many.output
    both = CliRunner().invoke(app, args[:-2] + ["--init", str(out), "--vision-from", str(out), "--out", str(tmp_path / "w")])
    assert both.exit_code == 2 and "give one of them" in both.output and not (tmp_path / "w").exists()
    bad_args = [a if a != "0.3" else "0.9" for a in args[:-1]] + [str(tmp_path / "x")]  # 0.9 + 0.2 > 1
    bad = CliRunner().invoke(app, bad_args)
    assert bad.exit_code != 0 and "sum <= 1" in bad.output and not (tmp_path / "x").exists()


def test_stage_keeps_the_init_or_vision_from_tokenizer_whatever_the_seed(tmp_path, monkeypatch):
    """--seed seeds the data; the token ids must stay the ones the --init model was trained on
    (a tokenizer retrained from another seed gave the shipped target a first loss of 12.8)."""
    from typer.testing import CliRunner
    from transformers import AutoProcessor

    import mmspec.train.data as data
    from mmspec.cli import app
    from mmspec.train.pack import world_tokenizer_and_processor

    base = ["train", "stage", "--size", "tiny", "--steps", "1", "--batch-size", "2", "--n-train-per-family", "1",
            "--no-bf16"]
    first = CliRunner().invoke(app, base + ["--seed", "0", "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    seen = {}
    real_stream = data.batch_stream

    def spy(examples, encoder, *a, **k):
        seen["vocab"] = encoder.tokenizer.get_vocab()
        return real_stream(examples, encoder, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    r = CliRunner().invoke(app, base + ["--seed", "3", "--init", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    init_vocab = AutoProcessor.from_pretrained(tmp_path / "a").tokenizer.get_vocab()
    assert seen["vocab"] == init_vocab
    assert world_tokenizer_and_processor(3)[0].get_vocab() != init_vocab  # so the check above can fail
    assert AutoProcessor.from_pretrained(tmp_path / "b").tokenizer.get_vocab() == init_vocab
    seen.clear()  # a model built on another's tower shares its tokenizer (a draft on its target's)
    r = CliRunner().invoke(app, base + ["--seed", "3", "--vision-from", str(tmp_path / "a"), "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert seen["vocab"] == init_vocab


def test_insertion_plan_spreads_copies():
    from mmspec.train.grow import insertion_plan

    assert insertion_plan(6, 10) == [(0, False), (0, True), (1, False), (2, False), (2, True), (3, False),
                                     (3, True), (4, False), (5, False), (5, True)]
    assert insertion_plan(3, 3) == [(0, False), (1, False), (2, False)]
    assert [src for src, _ in insertion_plan(2, 6)] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="--layers >= 4"):
        insertion_plan(4, 3)


def test_grow_lm_depth_is_exact_and_trainable(model, tokenizer, processor):
    """The grown model computes the same logits and the same greedy tokens (through the KV cache,
    so every new layer has its own cache slot), and its zeroed projections learn from step one."""
    from mmspec.train.grow import grow_lm_depth

    old = model.config.text_config.num_hidden_layers
    grown = grow_lm_depth(model.eval(), old + 3)
    layers = grown.model.language_model.layers
    assert len(layers) == old + 3 and [l.self_attn.layer_idx for l in layers] == list(range(old + 3))
    ex = fake_examples(1, seed=3)[0]
    inputs = processor(text=ex.prompt, images=list(ex.images), return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(grown(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-5)
    gen = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    assert torch.equal(grown.generate(**inputs, **gen), model.generate(**inputs, **gen))
    new = next(l for i, l in enumerate(layers) if not torch.any(l.mlp.down_proj.weight))
    stream = batch_stream(fake_examples(8), Encoder(tokenizer), processor.image_processor, 4,
                          torch.Generator().manual_seed(0))
    train_stage(grown, StageConfig("s2", "projector+lm", lr=1e-2, steps=2, batch_size=4), stream, progress=False)
    assert torch.any(new.mlp.down_proj.weight) and torch.any(new.self_attn.o_proj.weight)


def test_grow_cli_records_and_refuses_shrinking(model, processor, tmp_path):
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app
    from mmspec.train.checkpoint import save_checkpoint

    save_checkpoint(model, tmp_path / "m", processor=processor, half=False, meta={"role": "target"})
    old = model.config.text_config.num_hidden_layers
    r = CliRunner().invoke(app, ["train", "grow", "--init", str(tmp_path / "m"), "--layers", str(old + 1),
                                 "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "g" / "mmspec.json").read_text())
    assert meta["stages"][-1] == {"name": "grow-lm-depth", "from_layers": old, "to_layers": old + 1}
    assert LlavaForConditionalGeneration.from_pretrained(tmp_path / "g").config.text_config.num_hidden_layers == old + 1
    bad = CliRunner().invoke(app, ["train", "grow", "--init", str(tmp_path / "m"), "--layers", "0",
                                   "--out", str(tmp_path / "b")])
    assert bad.exit_code != 0 and f"--layers >= {old}" in bad.output and not (tmp_path / "b").exists()


def test_stage_cli_family_samples(tmp_path, monkeypatch):
    """--family-samples FAMILY=N sets that family's training samples (0 drops it), is recorded in the
    stage history, and a misspelt family or count is refused before any work."""
    import json
    from collections import Counter

    from typer.testing import CliRunner

    from mmspec.cli import app
    import mmspec.train.data as data

    seen: dict = {}
    real_stream = data.batch_stream

    def spy(examples, *a, **k):
        seen["families"] = Counter(ex.family for ex in examples)
        return real_stream(examples, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    out = tmp_path / "m"
    base = ["train", "stage", "--size", "tiny", "--steps", "1", "--batch-size", "2", "--n-train-per-family", "1",
            "--no-bf16"]
    r = CliRunner().invoke(app, base + ["--family-samples", "chartqa=3", "--family-samples", "vist=0",
                                        "--out", str(out)])
    assert r.exit_code == 0, r.output
    fams = seen["families"]
    assert fams["chartqa"] == 3 and "vist" not in fams and fams["textvqa"] == 1 and sum(fams.values()) == 9
    stage = json.loads((out / "mmspec.json").read_text())["stages"][-1]
    assert stage["family_samples"]["chartqa"] == 3 and stage["family_samples"]["vist"] == 0
    for bad_spec in ("chart=3", "chartqa=three", "chartqa"):
        bad = CliRunner().invoke(app, base + ["--family-samples", bad_spec, "--out", str(tmp_path / "x")])
        assert bad.exit_code != 0 and "FAMILY=N" in bad.output and not (tmp_path / "x").exists()
    bad = CliRunner().invoke(app, base + ["--minutes", "0", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "time budget" in bad.output and not (tmp_path / "x").exists()
    none = [a if a != "1" or base[i - 1] != "--n-train-per-family" else "0" for i, a in enumerate(base)]
    bad = CliRunner().invoke(app, none + ["--out", str(tmp_path / "x")])  # every family at 0
    assert bad.exit_code != 0 and "every family has 0 samples" in bad.output and not (tmp_path / "x").exists()


def test_linear_probe_reads_separable_features_and_not_noise():
    """The probe finds a linearly coded class and stays at chance on labels unrelated to the features."""
    from mmspec.train.probe import linear_probe

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (400,), generator=g)
    codes = torch.randn(5, 4, 8, generator=g)
    x = codes[y] + 0.3 * torch.randn(400, 4, 8, generator=g)  # [N, patches, C]
    _, acc = linear_probe(x[:300], y[:300], x[300:], y[300:], 5)
    assert acc > 0.95
    noise = torch.randn(400, 4, 8, generator=g)
    _, acc_noise = linear_probe(noise[:300], y[:300], noise[300:], y[300:], 5)
    assert acc_noise < 0.45


def test_probe_cli_on_a_tiny_model(model, processor, tmp_path):
    """`mmspec train probe --model DIR` runs all three probes on world images and writes JSON."""
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app
    from mmspec.train.checkpoint import save_checkpoint

    save_checkpoint(model, tmp_path / "m", processor=processor, meta={"role": "test"})
    r = CliRunner().invoke(app, ["train", "probe", "--model", str(tmp_path / "m"), "--n-train", "20",
                                 "--n-test", "5", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "p.json").read_text())
    assert set(res) == {"sign_word", "chart_label", "chart_value"}
    assert all(0 <= v["test_acc"] <= 1 and v["n_train"] == 20 for v in res.values())
    bad = CliRunner().invoke(app, ["train", "probe", "--model", str(tmp_path)])
    assert bad.exit_code == 2 and "no config.json" in bad.output and "Traceback" not in bad.output


def test_fact_weight_marks_the_fact_tokens(tokenizer, processor):
    """--fact-weight: the answer tokens that state a fact (whole words, case ignored) get the weight,
    every other answer token and the eos weigh 1, the prompt 0; weight 1 or no facts: no weights."""
    ex = fake_examples(1, seed=3)[0]
    colour = ex.answer.split()[2]
    ex = Example(ex.prompt, ex.answer, ex.images, ex.captions, "fake", facts=(colour.upper(), "colo"))
    enc = Encoder(tokenizer, fact_weight=5.0).encode(ex)
    n_prompt = enc.labels.count(IGNORE)
    assert enc.weights[:n_prompt] == [0.0] * n_prompt
    answer = enc.input_ids[n_prompt:]
    heavy = [tokenizer.decode([t]) for t, w in zip(answer, enc.weights[n_prompt:]) if w == 5.0]
    assert heavy == [colour]  # "colo" is not a whole word of the answer: it weighs nothing extra
    assert all(w == 1.0 for t, w in zip(answer, enc.weights[n_prompt:]) if tokenizer.decode([t]) != colour)
    assert Encoder(tokenizer).encode(ex).weights is None
    assert Encoder(tokenizer, fact_weight=5.0).encode(fake_examples(1)[0]).weights is None  # no facts
    # the world's tokenizer (byte-level BPE, sub-word pieces) marks each fact's pieces too
    from mmspec.train.data import example_from_sample
    from mmspec.train.pack import world_tokenizer_and_processor
    from mmspec.world import generate_samples

    world_tok, _ = world_tokenizer_and_processor(0)
    sample = next(iter(generate_samples("textvqa", "train", 1)))
    wenc = Encoder(world_tok, fact_weight=3.0).encode(example_from_sample(sample))
    heavy_text = "".join(world_tok.decode([t]) for t, w in zip(wenc.input_ids, wenc.weights) if w == 3.0)
    for value in sample.facts.values():
        assert str(value).replace(" ", "") in heavy_text.replace(" ", "")
    n_prompt = wenc.labels.count(IGNORE)
    light = [world_tok.decode([t]) for t, w in zip(wenc.input_ids[n_prompt:], wenc.weights[n_prompt:]) if w == 1.0]
    assert len(light) > len(wenc.input_ids[n_prompt:]) / 2 and wenc.weights[-1] == 1.0  # phrasing and eos weigh 1
    assert not any(str(v).lower() in "".join(light).lower().split() for v in sample.facts.values())
    # a cut answer (no eos) keeps one weight per label; a slow tokenizer is refused up front
    cut = Encoder(world_tok, max_answer_tokens=5, fact_weight=3.0).encode(example_from_sample(sample))
    assert len(cut.weights) == len(cut.labels) == len(cut.input_ids) and cut.input_ids[-1] != world_tok.eos_token_id
    assert cut.weights[-5:] == wenc.weights[n_prompt:n_prompt + 5]

    # an existence answer's cue (its deciding sentence) weighs cue_weight, every word of it;
    # a token in a fact and a cue weighs the larger; cue_weight 1 leaves the weights as they were
    yes = next(s for s in generate_samples("hallusionbench", "train", 40) if s.facts["answer"] == "Yes" and s.cues)
    yenc = Encoder(world_tok, fact_weight=3.0, cue_weight=5.0).encode(example_from_sample(yes))
    cue_text = "".join(world_tok.decode([t]) for t, w in zip(yenc.input_ids, yenc.weights) if w == 5.0)
    assert cue_text.replace(" ", "") == yes.cues[0].replace(" ", "")
    assert any(w == 3.0 for w in yenc.weights)  # "Yes" at the end
    no_cues = Encoder(world_tok, fact_weight=3.0).encode(example_from_sample(yes))
    cueless = replace(example_from_sample(yes), cues=())
    assert no_cues.weights == Encoder(world_tok, fact_weight=3.0).encode(cueless).weights
    assert 5.0 not in no_cues.weights
    only_cues = Encoder(world_tok, cue_weight=2.0).encode(example_from_sample(yes))
    assert set(only_cues.weights) == {0.0, 1.0, 2.0}

    class Slow:
        is_fast = False

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [5]}

    for weights in ({"fact_weight": 2.0}, {"cue_weight": 2.0}, {"answer_weight": 2.0}):
        with pytest.raises(MMSpecError, match="fast tokenizer"):
            Encoder(Slow(), **weights)


def test_answer_weight_marks_the_lookup_after_the_reading():
    """answer_weight weighs every answer token after the first sentence of a single-image answer
    (the step that picks the asked fact out of the reading, which then answers the question),
    nothing of the first sentence, of a multi-image answer or of a caption example; with fact
    weights a token weighs the larger. Distilled answers (ids) get the same weights as the text
    they decode to."""
    from mmspec.train.data import ANSWERED_FAMILIES, Encoder, caption_examples, example_from_sample
    from mmspec.train.evaluate import answers_question
    from mmspec.train.pack import world_tokenizer_and_processor
    from mmspec.world import FAMILIES, generate_samples

    assert set(ANSWERED_FAMILIES) == {name for name, f in FAMILIES.items() if f.n_images == 1}
    tok, _ = world_tokenizer_and_processor(0)
    enc = Encoder(tok, answer_weight=6.0)
    for family in ANSWERED_FAMILIES:
        for sample in generate_samples(family, "train", 3):
            e = enc.encode(example_from_sample(sample))
            n_prompt = e.labels.count(IGNORE)
            answer = list(zip(e.input_ids[n_prompt:-1], e.weights[n_prompt:-1]))  # eos (weight 1) left out
            heavy = "".join(tok.decode([t]) for t, w in answer if w == 6.0)
            light = "".join(tok.decode([t]) for t, w in answer if w == 1.0)
            assert set(e.weights[n_prompt:-1]) == {1.0, 6.0} and e.weights[-1] == 1.0
            first, rest = sample.answer.split(". ", 1)
            assert light.replace(" ", "") == (first + ".").replace(" ", "")  # the reading weighs 1
            assert heavy.replace(" ", "") == rest.replace(" ", "")  # the lookup and the answer weigh 6
            assert answers_question(sample, heavy.strip())  # the weighed part gives the answer
            ids = Encoder(tok, answer_weight=6.0).encode(replace(example_from_sample(sample),
                                                                 answer_ids=(*e.input_ids[n_prompt:],)))
            assert ids.weights == e.weights
    # a token in a fact and in the lookup weighs the larger of the two weights
    chart = generate_samples("chartqa", "train", 1)[0]  # "... box 7. The answer is box 7."
    value = tok(" " + chart.facts["value"], add_special_tokens=False)["input_ids"]
    assert len(value) == 1
    for fact_w, reading_w, lookup_w in ((9.0, 9.0, 9.0), (3.0, 3.0, 6.0)):
        e = Encoder(tok, fact_weight=fact_w, answer_weight=6.0).encode(example_from_sample(chart))
        at = [w for t, w in zip(e.input_ids, e.weights) if t == value[0]]
        assert at == [reading_w, lookup_w]  # in the reading and the final sentence
    for other in ("spot_the_diff", "pororosv"):
        assert enc.encode(example_from_sample(generate_samples(other, "train", 1)[0])).weights is None
    caption = caption_examples(generate_samples("chartqa", "train", 1)[0])[0]
    assert enc.encode(caption).weights is None


def test_answer_weight_on_cut_off_distilled_answers():
    """A distilled answer cut off at max_new_tokens keeps the rule: cut inside its first
    sentence, nothing is weighed (there is no lookup yet); cut inside a later sentence, every
    token after the first sentence's end is, up to the cut."""
    from mmspec.train.data import Encoder, example_from_sample
    from mmspec.train.pack import world_tokenizer_and_processor
    from mmspec.world import generate_samples

    tok, _ = world_tokenizer_and_processor(0)
    enc = Encoder(tok, answer_weight=6.0)
    sample = generate_samples("chartqa", "train", 1)[0]
    full = enc.encode(example_from_sample(sample))
    n_prompt = full.labels.count(IGNORE)
    answer = full.input_ids[n_prompt:-1]  # the answer's ids, eos left out
    first_heavy = full.weights[n_prompt:].index(6.0)  # the first token after the reading
    assert first_heavy >= 3  # so the first cut below falls inside the reading
    for cut in (first_heavy - 3, first_heavy + 4):
        cut_ids = tuple(answer[:cut])
        e = enc.encode(replace(example_from_sample(sample), answer_ids=cut_ids))
        assert e.input_ids[n_prompt:n_prompt + cut] == list(cut_ids)
        if cut < first_heavy:
            assert e.weights is None or set(e.weights[n_prompt:]) == {1.0}
        else:
            assert e.weights[n_prompt:n_prompt + cut] == full.weights[n_prompt:n_prompt + cut]
            assert e.weights[n_prompt + first_heavy - 1] == 1.0 and e.weights[n_prompt + first_heavy] == 6.0


def test_weighted_loss_is_the_weighted_mean(model, tokenizer, processor):
    """batch_loss with loss weights is sum(w * ce) / sum(w); uniform weights give the plain HF loss,
    and eval-style weighted=False ignores the weights."""
    base = fake_examples(3, seed=5)
    examples = [Example(e.prompt, e.answer, e.images, e.captions, "fake", facts=(e.answer.split()[2],))
                for e in base]
    batch = collate([Encoder(tokenizer, fact_weight=4.0).encode(e) for e in examples], 0,
                    processor.image_processor, 64)
    assert batch.loss_weights is not None and batch.loss_weights.shape == batch.labels.shape
    with torch.no_grad():
        plain = float(batch_loss(model, batch, train_vision=False, weighted=False))
        weighted = float(batch_loss(model, batch, train_vision=False))
        feats = pooled_image_features(model, batch.pixel_values, 64, False)
        from mmspec.train.pooling import embed_multimodal

        logits = model(inputs_embeds=embed_multimodal(model, batch.input_ids, feats),
                       attention_mask=batch.attention_mask).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               batch.labels[:, 1:].reshape(-1), reduction="none",
                                               ignore_index=IGNORE).view(3, -1)
        w = batch.loss_weights[:, 1:]
        assert weighted == pytest.approx(float((ce * w).sum() / w.sum()), rel=1e-5)
        assert plain == pytest.approx(float(ce.sum() / (batch.labels[:, 1:] != IGNORE).sum()), rel=1e-5)
        assert weighted != pytest.approx(plain, rel=1e-3)
        batch.loss_weights = (batch.labels != IGNORE).float()
        assert float(batch_loss(model, batch, train_vision=False)) == pytest.approx(plain, rel=1e-5)
    # a batch mixing weighted rows with unweighted ones (caption examples): those weigh 1 on
    # their labels and 0 on the prompt and padding
    mixed = collate([Encoder(tokenizer, fact_weight=4.0).encode(examples[0]), Encoder(tokenizer).encode(base[1])],
                    0, processor.image_processor, 64)
    assert torch.equal(mixed.loss_weights[1], (mixed.labels[1] != IGNORE).float())
    assert mixed.loss_weights[0].max() == 4.0 and (mixed.loss_weights[0][mixed.labels[0] == IGNORE] == 0).all()


def test_stage_cli_fact_weight(tmp_path, monkeypatch):
    """--fact-weight reaches the encoder, is recorded in the stage history, and a value <= 0 is
    refused before any work."""
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app
    import mmspec.train.data as data

    seen: dict = {}
    real_stream = data.batch_stream

    def spy(examples, encoder, *a, **k):
        seen["fact_weight"], seen["cue_weight"] = encoder.fact_weight, encoder.cue_weight
        seen["answer_weight"] = encoder.answer_weight
        seen["weighted"] = sum(encoder.encode(ex).weights is not None for ex in examples)
        return real_stream(examples, encoder, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    out = tmp_path / "m"
    base = ["train", "stage", "--size", "tiny", "--steps", "1", "--batch-size", "2", "--n-train-per-family", "1",
            "--no-bf16"]
    r = CliRunner().invoke(app, base + ["--fact-weight", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert seen["fact_weight"] == 3.0 and seen["weighted"] == 8  # every world answer states its facts
    assert json.loads((out / "mmspec.json").read_text())["stages"][-1]["fact_weight"] == 3.0
    assert seen["cue_weight"] == 1.0  # cues weigh only when asked: the recorded recipes stay reproducible
    r = CliRunner().invoke(app, base + ["--cue-weight", "5", "--out", str(tmp_path / "cw")])
    assert r.exit_code == 0, r.output
    assert seen["cue_weight"] == 5.0 and seen["fact_weight"] == 1.0
    assert json.loads((tmp_path / "cw" / "mmspec.json").read_text())["stages"][-1]["cue_weight"] == 5.0
    assert seen["answer_weight"] == 1.0
    r = CliRunner().invoke(app, base + ["--answer-weight", "7", "--out", str(tmp_path / "aw")])
    assert r.exit_code == 0, r.output
    assert seen["answer_weight"] == 7.0 and seen["weighted"] == 4  # the four single-image answers
    assert json.loads((tmp_path / "aw" / "mmspec.json").read_text())["stages"][-1]["answer_weight"] == 7.0
    for flag in ("--fact-weight", "--cue-weight", "--answer-weight"):
        for value in ("0", "inf"):
            bad = CliRunner().invoke(app, base + [flag, value, "--out", str(tmp_path / "x")])
            assert bad.exit_code != 0 and f"{flag} must be" in bad.output and not (tmp_path / "x").exists()
        bad = CliRunner().invoke(app, base + [flag, "2", "--captioner", "--out", str(tmp_path / "x")])
        assert bad.exit_code != 0 and "--captioner" in bad.output and not (tmp_path / "x").exists()


def test_reproduction_script_uses_only_real_flags():
    """scripts/train-embedded-pack.sh (the one command that reproduces the pack) and the GPU scripts
    it runs name only subcommands and flags that `mmspec train` has, so a renamed flag cannot
    silently break them."""
    import re
    import shlex
    from pathlib import Path

    import typer

    from mmspec.cli import app

    scripts = Path(__file__).parents[1] / "scripts"
    main = (scripts / "train-embedded-pack.sh").read_text()
    called = re.findall(r"^bash scripts/(\S+\.sh)", main, flags=re.M)
    assert called == ["gpu-target-v8.sh", "gpu-pack-v9.sh", "gpu-pack-v9.sh", "train-lookup-target.sh",
                      "distill-drafts.sh", "train-place-target.sh", "distill-drafts.sh"]
    train = typer.main.get_command(app).commands["train"]
    for name in ["train-embedded-pack.sh", *sorted(set(called))]:
        text = (scripts / name).read_text().replace("\\\n", " ")
        for _ in range(2):  # shell arrays, spelled out; twice, as one array may name another
            for array, words in re.findall(r"^\s*(\w+)=\(([^)]*)\)", text, flags=re.M):
                text = text.replace(f'"${{{array}[@]}}"', words.replace("\n", " "))
        for var, value in (('"$T"', "2"), ("$OUT", "/tmp/pack"), ('"$DEV"', "cuda"), ('"$TM"', "4"), ('"$2"', "all"),
                           ('"$SEED"', "71")):
            text = text.replace(var, value)
        commands = [shlex.split(line.split("#")[0].split(" > ")[0])[1:]  # no comment, no output redirection
                    for line in text.splitlines() if line.lstrip().startswith("$M ")]
        assert len(commands) >= 3, name
        for words in commands:
            sub = train.commands.get(words[0])
            assert sub is not None, f"{name}: `mmspec train {words[0]}` does not exist"
            known = {o for p in sub.params for o in (*p.opts, *p.secondary_opts)}
            unknown = [w for w in words[1:] if w.startswith("--") and w not in known]
            assert not unknown, f"{name}: `mmspec train {words[0]}` has no {unknown}"
            sub.make_context(words[0], list(words[1:]))  # values parse, required options are there


def test_reading_head_pools_over_patches():
    """A token one patch votes for scores high after pooling; a token no patch votes for stays low;
    the pooled logit of a token every patch votes for equally is that vote (log-mean-exp)."""
    import math

    from mmspec.train.reading import ReadingHead

    head = ReadingHead(4, 3)
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0], [0, 0, 0, 0]]))
        head.proj.bias.copy_(torch.tensor([-5.0, -5.0, 2.0]))
    feats = torch.zeros(1, 8, 4)  # [B, P, C]
    feats[0, 3, 0] = 1.0  # one patch "says" token 0
    logits = head(feats)[0].tolist()
    assert logits[0] == pytest.approx(5 - math.log(8), abs=1e-3)  # one patch at +5, seven at -5
    assert logits[1] == pytest.approx(-5.0)
    assert logits[2] == pytest.approx(2.0)


def test_caption_bags_are_the_caption_tokens(tokenizer):
    from mmspec.train.reading import caption_bags

    bags = caption_bags(tokenizer, ["a red square", "a blue"], len(tokenizer))
    ids = tokenizer("a red square", add_special_tokens=False)["input_ids"]
    assert bags.shape == (2, len(tokenizer)) and bags[0].sum() == 3 and all(bags[0, i] == 1 for i in ids)
    assert bags[1].nonzero().flatten().tolist() == sorted(tokenizer("a blue", add_special_tokens=False)["input_ids"])
    with pytest.raises(MMSpecError, match="no tokens"):
        caption_bags(tokenizer, [""], len(tokenizer))
    with pytest.raises(MMSpecError, match="does not match"):
        caption_bags(tokenizer, ["a red square"], 5)


def _image_caption_batches(examples: list[Example], size: int) -> list[tuple[list, list[str]]]:
    """(images, captions) reading batches of the examples' first images, in order."""
    return [([ex.images[0] for ex in examples[i:i + size]], [ex.captions[0] for ex in examples[i:i + size]])
            for i in range(0, len(examples), size)]


def _assert_only_the_tower_changed(model, before: dict) -> None:
    after = model.state_dict()
    assert all(torch.equal(v, before[k]) for k, v in after.items() if not k.startswith("model.vision_tower.")), \
        "a reading objective changed more than the vision tower"
    assert any(not torch.equal(v, before[k]) for k, v in after.items() if k.startswith("model.vision_tower."))


def test_reading_trains_only_the_tower_and_learns_to_read(model, tokenizer, processor):
    """On images whose caption names their colour, the reading loss falls and the held-out recall
    of caption words rises; the projector and LM are byte-identical afterwards."""
    import itertools

    from mmspec.train.reading import ReadingConfig, ReadingHead, train_reading, word_recall
    from mmspec.train.pooling import vision_patch_features

    torch.manual_seed(0)
    train = fake_examples(64, seed=1)
    stream = itertools.cycle(_image_caption_batches(train, 16))
    test = fake_examples(32, seed=2)
    images, captions = [ex.images[0] for ex in test], [ex.captions[0] for ex in test]
    head = ReadingHead(model.config.vision_config.hidden_size, len(tokenizer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r0 = word_recall(model, head, tokenizer, processor.image_processor, images, captions)
    res = train_reading(model, head, tokenizer, processor.image_processor, stream,
                        ReadingConfig(lr=3e-3, steps=60, batch_size=16), progress=False)
    r1 = word_recall(model, head, tokenizer, processor.image_processor, images, captions)
    assert res.steps == 60 and res.samples == 60 * 16
    assert sum(res.losses[-5:]) / 5 < 0.5 * sum(res.losses[:5]) / 5
    assert r1["recall"] == 1.0 and r0["recall"] < 0.5 and r1["images"] == 32
    _assert_only_the_tower_changed(model, before)
    # colours are told apart: a red image's bag scores "red" above "blue"
    red = processor.image_processor([Image.new("RGB", (96, 96), COLORS["red"])], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = head(vision_patch_features(model, red))[0]
    assert logits[tokenizer.convert_tokens_to_ids("red")] > logits[tokenizer.convert_tokens_to_ids("blue")]


def test_contrastive_loss_spreads_over_identical_captions():
    """Two images with one caption are each right for either caption column: which of the two
    an image prefers changes nothing, and the loss falls as each image picks its own caption."""
    from mmspec.train.reading import contrastive_loss

    caps = ["x", "x", "y"]
    a = torch.tensor([[6.0, 4.0, 0.0], [4.0, 6.0, 0.0], [0.0, 0.0, 5.0]])
    b = torch.tensor([[4.0, 6.0, 0.0], [6.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
    torch.testing.assert_close(contrastive_loss(a, caps), contrastive_loss(b, caps))
    distinct = ["x", "y", "z"]
    assert contrastive_loss(torch.zeros(3, 3), distinct) == pytest.approx(math.log(3))
    assert contrastive_loss(10 * torch.eye(3), distinct) < 0.01 < contrastive_loss(10 * (1 - torch.eye(3)), distinct)


def test_contrastive_reading_learns_to_match_images_and_captions(model, tokenizer, processor):
    """The contrastive head: loss falls, held-out images pick their own caption among their
    group's, and only the vision tower changes."""
    import itertools

    from mmspec.train.reading import ContrastiveHead, ReadingConfig, caption_retrieval, train_reading

    torch.manual_seed(0)
    train = fake_examples(64, seed=1)
    stream = itertools.cycle(_image_caption_batches(train, 16))
    test = fake_examples(24, seed=2)
    images, captions = [ex.images[0] for ex in test], [ex.captions[0] for ex in test]
    head = ContrastiveHead.for_model(model, len(tokenizer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r0 = caption_retrieval(model, head, tokenizer, processor.image_processor, images, captions, ["fake"] * 24)
    res = train_reading(model, head, tokenizer, processor.image_processor, stream,
                        ReadingConfig(lr=3e-3, steps=60, batch_size=16), progress=False)
    r1 = caption_retrieval(model, head, tokenizer, processor.image_processor, images, captions, ["fake"] * 24)
    # 4 colours in batches of 16: the loss cannot go below the soft targets' entropy, log(same-caption count)
    floor = sum(math.log(caps.count(c)) for i in range(0, 64, 16) for caps in [[e.captions[0] for e in train[i:i + 16]]]
                for c in caps) / 64
    first, last = sum(res.losses[:4]) / 4, sum(res.losses[-4:]) / 4
    assert res.steps == 60 and first > floor + 0.8 and last < floor + 0.15, (floor, first, last)
    assert r1["recall"] == 1.0 and r0["recall"] < 0.6 and r1["images_by_group"] == {"fake": 24}
    _assert_only_the_tower_changed(model, before)
    with pytest.raises(MMSpecError, match="does not match"):
        ContrastiveHead(8, 5).embed_captions(tokenizer, ["a red square"], "cpu")


def test_reading_config_refuses_bad_values():
    from mmspec.train.reading import ReadingConfig

    for bad in ({"lr": 0.0}, {"lr": float("nan")}, {"steps": 0}, {"batch_size": 0}, {"steps": None},
                {"steps": None, "max_seconds": -60.0}, {"max_seconds": 0.0}):
        with pytest.raises(MMSpecError):
            ReadingConfig(**bad)
    assert ReadingConfig(steps=None, max_seconds=60.0).steps is None  # the clock alone decides


def test_reading_with_a_time_budget_only_stops_on_the_clock(model, tokenizer, processor):
    import itertools

    from mmspec.train.reading import ReadingConfig, ReadingHead, train_reading

    ex = fake_examples(4)
    stream = itertools.cycle([([e.images[0] for e in ex], [e.captions[0] for e in ex])])
    head = ReadingHead(model.config.vision_config.hidden_size, len(tokenizer))
    res = train_reading(model, head, tokenizer, processor.image_processor, stream,
                        ReadingConfig(steps=None, max_seconds=1.0, batch_size=4), progress=False)
    assert res.steps > 1 and res.seconds < 30.0  # it stopped on the clock, not on a step count


def test_read_cli_changes_only_the_tower_and_records_the_stage(tmp_path):
    """`mmspec train read` on a saved tiny model: the result loads, only vision-tower tensors
    differ, the stage (with the held-out word recall) is appended to mmspec.json, the LM's stale
    eval is dropped, the init's tokenizer is kept, and bad input is refused with a message before
    any work."""
    import json

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from mmspec.cli import app
    from mmspec.train.checkpoint import save_checkpoint
    from mmspec.train.pack import world_tokenizer_and_processor

    world_tok, world_proc = world_tokenizer_and_processor(0)
    torch.manual_seed(0)
    tiny = build_llava(model_size("tiny"), world_tok)
    save_checkpoint(tiny, tmp_path / "m", processor=world_proc, half=False,
                    meta={"role": "target", "stages": [{"name": "s0"}], "eval": {"loss": 1.0}})
    base = ["train", "read", "--init", str(tmp_path / "m"), "--steps", "3", "--batch-size", "4",
            "--n-train-per-family", "1", "--eval-images", "8", "--no-bf16"]
    r = CliRunner().invoke(app, base + ["--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    assert "held-out caption tokens read" in r.output and "train a stage" in r.output
    meta = json.loads((tmp_path / "r" / "mmspec.json").read_text())
    assert [s["name"] for s in meta["stages"]] == ["s0", "reading"] and "eval" not in meta
    rec = meta["stages"][-1]["val_word_recall"]
    assert meta["stages"][-1]["steps"] == 3 and 0 <= rec["recall"] <= 1 and rec["images"] == 8
    from mmspec.world import FAMILIES

    assert set(rec["by_group"]) == set(FAMILIES) and set(rec["images_by_group"].values()) == {1}
    assert (tmp_path / "r" / "tokenizer.json").read_text() == (tmp_path / "m" / "tokenizer.json").read_text()
    old, new = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "r" / "model.safetensors")
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all("vision_tower" in k for k in changed)
    LlavaForConditionalGeneration.from_pretrained(tmp_path / "r")
    timed = [a for a in base if a not in ("--steps", "3")] + ["--minutes", "0.01", "--eval-images", "0"]
    r = CliRunner().invoke(app, timed + ["--out", str(tmp_path / "t")])  # --minutes alone: the clock decides
    assert r.exit_code == 0, r.output
    stage = json.loads((tmp_path / "t" / "mmspec.json").read_text())["stages"][-1]
    assert stage["steps"] >= 1 and stage["seconds"] < 5 and "val_word_recall" not in stage
    r = CliRunner().invoke(app, base + ["--objective", "contrastive", "--workers", "2", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert "matched to their own caption" in r.output
    stage = json.loads((tmp_path / "c" / "mmspec.json").read_text())["stages"][-1]
    assert stage["objective"] == "image-caption contrastive" and stage["workers"] == 2 and stage["steps"] == 3
    assert stage["val_caption_retrieval"]["images"] == 8 and "val_word_recall" not in stage
    for args, phrase in (([], "no config.json"), (["--lr", "0"], "learning rate"),
                         (["--objective", "clip"], "unknown objective"), (["--workers", "-1"], "--workers"),
                         (["--objective", "contrastive", "--batch-size", "1"], "--batch-size >= 2"),
                         (["--steps", "0"], "steps >= 1"), (["--minutes", "-1"], "time budget"),
                         (["--minutes", "0"], "time budget"), (["--eval-images", "-1"], "--eval-images"),
                         (["--n-train-per-family", "-1"], "--n-train-per-family"),
                         (["--family-samples", "chart=3"], "FAMILY=N")):
        init = str(tmp_path) if not args else str(tmp_path / "m")
        bad_args = ["train", "read", "--init", init, "--out", str(tmp_path / "x"), *args]
        bad = CliRunner().invoke(app, bad_args)
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output
        assert not (tmp_path / "x").exists()


def test_image_caption_stream_mixes_families_in_proportion():
    """Families come in proportion to their counts from the first batch on, each walks its own
    samples in order and wraps at its count, and the stream is a function of the seed."""
    from itertools import islice

    from mmspec.train.reading import image_caption_stream
    from mmspec.world import make_sample

    counts = {"textvqa": 3, "chartqa": 1}
    batches = list(islice(image_caption_stream("train", counts, 10, seed=0), 40))
    captions = [c for _, caps in batches for c in caps]
    signs = [c for c in captions if "sign" in c]
    assert 0.65 < len(signs) / len(captions) < 0.85
    first = [c for c in batches[0][1]]
    assert any("sign" in c for c in first) and any("bar chart" in c for c in first)
    expected = [make_sample("textvqa", "train", i % 3).captions[0] for i in range(len(signs))]
    assert signs == expected
    again = list(islice(image_caption_stream("train", counts, 10, seed=0), 40))
    assert [caps for _, caps in again] == [caps for _, caps in batches]
    with pytest.raises(MMSpecError, match="every family has 0"):
        image_caption_stream("train", {"textvqa": 0}, 4)  # refused when built, not at the first batch
    with pytest.raises(MMSpecError, match=">= 0"):
        image_caption_stream("train", {"textvqa": -1, "chartqa": 2}, 4)


def test_image_caption_stream_workers_split_the_samples():
    """With workers, batches come as pixel values; worker w walks samples w, w + N, ... so the
    two workers' first sign captions are samples 0, 2, 4 and 1, 3, 5."""
    from itertools import islice

    from mmspec.train.pack import world_tokenizer_and_processor
    from mmspec.train.reading import image_caption_stream
    from mmspec.world import make_sample

    ip = world_tokenizer_and_processor(0)[1].image_processor
    batches = list(islice(image_caption_stream("train", {"textvqa": 6}, 3, seed=0, workers=2, image_processor=ip), 2))
    assert all(pv.shape == (3, 3, 96, 96) for pv, _ in batches)
    assert [caps for _, caps in batches] == [[make_sample("textvqa", "train", i).captions[0] for i in (0, 2, 4)],
                                             [make_sample("textvqa", "train", i).captions[0] for i in (1, 3, 5)]]
    torch.testing.assert_close(batches[0][0][0], ip([make_sample("textvqa", "train", 0).images[0]],
                                                    return_tensors="pt")["pixel_values"][0])
    with pytest.raises(MMSpecError, match="image processor"):
        image_caption_stream("train", {"textvqa": 6}, 3, workers=2)


def test_reading_shards_partition_each_family_and_wrap_inside_their_share():
    """Shard w of n walks samples w, w + n, ... of each family and wraps back to w, so the shards
    never overlap, also after a lap; a shard beyond a small family's count reads all of it."""
    from itertools import islice

    from mmspec.train.reading import _batches
    from mmspec.world import make_sample

    index = {make_sample(fam, "train", i).captions[0]: (fam, i) for fam, n in (("textvqa", 5), ("vqav2", 2))
             for i in range(n)}
    seen = []
    for w in range(3):
        caps = [c for _, batch in islice(_batches("train", {"textvqa": 5, "vqav2": 2}, 4, 0, shard=(w, 3)), 6)
                for c in batch]
        seen.append([index[c] for c in caps])
    for w, walk in enumerate(seen):
        signs = [i for fam, i in walk if fam == "textvqa"]
        assert set(signs) == set(range(w, 5, 3)) and signs[:len(set(signs))] == list(range(w, 5, 3))
        objects = {i for fam, i in walk if fam == "vqav2"}
        assert objects <= ({w} if w < 2 else {0, 1})
    assert seen[1] != seen[0]  # each shard draws its own family order


def test_reading_is_reproducible_and_runs_under_bf16(model, tokenizer, processor):
    """The same seed and stream give the same tower (the head starts at zero, no global RNG);
    under bf16 autocast the loss is a finite float32 and the tower still learns."""
    import copy
    import itertools

    from mmspec.train.reading import ReadingConfig, ReadingHead, train_reading

    ex = fake_examples(16, seed=3)
    batches = [([e.images[0] for e in ex[i:i + 8]], [e.captions[0] for e in ex[i:i + 8]]) for i in (0, 8)]
    towers = []
    for bf16 in (False, False, True):
        m = copy.deepcopy(model)
        head = ReadingHead.for_model(m, len(tokenizer))
        assert not head.proj.weight.any()
        res = train_reading(m, head, tokenizer, processor.image_processor, itertools.cycle(batches),
                            ReadingConfig(lr=3e-3, steps=8, batch_size=8), autocast_bf16=bf16, progress=False)
        assert all(math.isfinite(x) for x in res.losses) and res.losses[-1] < res.losses[0]
        towers.append(m.model.vision_tower.state_dict())
    assert all(torch.equal(towers[0][k], towers[1][k]) for k in towers[0])
    assert any(not torch.equal(towers[0][k], towers[2][k]) for k in towers[0])  # bf16 really ran


def test_contrastive_head_keeps_float32_logits_under_bf16(model, tokenizer, processor):
    """Under bf16 autocast the similarity logits are float32 (bf16 would move in steps of about
    0.5 at CLIP's logit scale), and a bf16 run still learns."""
    import copy
    import itertools

    from mmspec.train.pooling import vision_patch_features
    from mmspec.train.reading import ContrastiveHead, ReadingConfig, train_reading

    ex = fake_examples(16, seed=3)
    caps = [e.captions[0] for e in ex]
    pv = processor.image_processor([e.images[0] for e in ex], return_tensors="pt")["pixel_values"]
    torch.manual_seed(0)
    head = ContrastiveHead.for_model(model, len(tokenizer))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head.similarities(vision_patch_features(model, pv), tokenizer, caps)
    assert logits.dtype == torch.float32 and logits.shape == (16, 16)
    m = copy.deepcopy(model)
    batches = itertools.cycle([([e.images[0] for e in ex[i:i + 8]], caps[i:i + 8]) for i in (0, 8)])
    res = train_reading(m, head, tokenizer, processor.image_processor, batches,
                        ReadingConfig(lr=3e-3, steps=8, batch_size=8), autocast_bf16=True, progress=False)
    assert all(math.isfinite(x) for x in res.losses) and res.losses[-1] < res.losses[0]


def test_val_images_weigh_every_family_alike():
    from mmspec.train.reading import val_images
    from mmspec.world import FAMILIES

    images, captions, families = val_images(24)
    assert len(images) == len(captions) == 24 and all(families.count(f) == 3 for f in FAMILIES)
    assert val_images(24)[1] == captions  # deterministic
    with pytest.raises(MMSpecError, match="at least one"):
        val_images(0)


def test_optimise_needs_steps_or_a_clock_and_follows_the_schedule():
    """The shared loop refuses to run unbounded; with steps it runs exactly that many, counts the
    samples step_loss reports, and the loss falls."""
    from mmspec.train.recipe import optimise

    w = torch.nn.Parameter(torch.tensor([3.0]))
    with pytest.raises(MMSpecError, match="step count or a time budget"):
        optimise("x", [w], lambda: ((w ** 2).sum(), 1), 0.1, None, None, 0.0, 0.0, 1.0, progress=False)
    for steps, seconds in ((0, None), (None, 0.0), (None, float("inf")), (5, -1.0)):
        with pytest.raises(MMSpecError):
            optimise("x", [w], lambda: ((w ** 2).sum(), 1), 0.1, steps, seconds, 0.0, 0.0, 1.0, progress=False)
    for bad in ({"steps": 0}, {"max_seconds": 0.0}, {"max_seconds": -60.0}, {"max_seconds": float("nan")}):
        with pytest.raises(MMSpecError):  # the configs refuse it when built, before any work
            StageConfig("x", "projector", lr=0.1, **{"steps": 5, **bad})
    for lr in (0.0, -1e-3, float("nan")):
        with pytest.raises(MMSpecError, match="learning rate"):
            StageConfig("x", "projector", lr=lr, steps=5)
    for bs in (0, -4):
        with pytest.raises(MMSpecError, match="batch size"):
            StageConfig("x", "projector", lr=0.1, steps=5, batch_size=bs)
    res = optimise("x", [w], lambda: ((w ** 2).sum(), 2), 0.5, 40, None, 0.1, 0.0, 10.0, progress=False)
    assert res.steps == 40 and res.samples == 80 and res.losses[-1] < res.losses[0] / 4


def test_embedded_cli_refuses_a_budget_of_zero(tmp_path):
    """`mmspec train embedded --minutes-budget 0` is refused with a message before any work
    (it used to divide by zero in the first stage)."""
    from typer.testing import CliRunner

    from mmspec.cli import app

    r = CliRunner().invoke(app, ["train", "embedded", "--minutes-budget", "0", "--out", str(tmp_path / "p")])
    assert r.exit_code == 2 and "time budget" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "p").exists()


def test_greedy_answer_in_the_caption_view_is_generate_on_the_caption_prompt(model, tokenizer, processor):
    """In the caption view the image is replaced by its caption's tokens and no pixels are read
    (a leaked image token would make embed_multimodal refuse: slots without features): the
    answer equals the LM's own greedy generation from that text prompt."""
    from mmspec.train.recipe import greedy_answer

    ex = fake_examples(1, seed=3)[0]
    enc = Encoder(tokenizer)
    got = greedy_answer(model, enc, processor.image_processor, ex, max_new_tokens=6, view="caption")
    prompt = tokenizer(ex.prompt.replace("<image>", ex.captions[0]))["input_ids"]
    assert 4 not in prompt  # no image token left
    ids = torch.tensor([prompt])
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert got == want[0, ids.shape[1]:].tolist() and len(got) == 6
    with pytest.raises(MMSpecError, match="unknown view"):
        greedy_answer(model, enc, processor.image_processor, ex, max_new_tokens=6, view="pixels")


def test_greedy_answer_in_the_multimodal_view_is_hf_generate(model, tokenizer, processor):
    """The multimodal greedy answer equals HF LLaVA's own generate on the processor's inputs."""
    from mmspec.train.recipe import greedy_answer

    ex = fake_examples(1, seed=4)[0]
    got = greedy_answer(model, Encoder(tokenizer), processor.image_processor, ex, max_new_tokens=6)
    inputs = processor(images=list(ex.images), text=ex.prompt, return_tensors="pt")
    want = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    assert got == want[0, inputs["input_ids"].shape[1]:].tolist()


def test_facts_cli_on_a_tiny_world_model(tmp_path, monkeypatch):
    """`mmspec train facts` answers the test split through either view and writes per-family JSON;
    bad flags are refused with the fix, not a traceback."""
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app
    from mmspec.train.checkpoint import save_checkpoint
    from mmspec.train.pack import world_tokenizer_and_processor

    tok, proc = world_tokenizer_and_processor(0)
    torch.manual_seed(0)
    save_checkpoint(build_llava(model_size("tiny"), tok), tmp_path / "m", processor=proc, meta={"role": "test"})
    for view in ("caption", "multimodal"):
        out = tmp_path / f"{view}.json"
        args = ["train", "facts", "--model", str(tmp_path / "m"), "--n", "2", "--family", "chartqa",
                "--family", "hallusionbench", "--view", view, "--max-new-tokens", "3", "--out", str(out)]
        monkeypatch.setattr("sys.argv", ["/venv/bin/mmspec", *args])
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        rep = json.loads(out.read_text())
        assert rep["view"] == view and set(rep["families"]) == {"chartqa", "hallusionbench"}
        assert rep["provenance"]["command"].startswith("mmspec train facts --model") and "bench_runs" not in rep["provenance"]
        assert all(f["samples"] == 2 and 0 <= f["recall"] <= 1 for f in rep["families"].values())
        assert sum(sum(v.values()) for v in rep["families"]["hallusionbench"]["verdicts"].values()) == 2
    for args, phrase in ((["--view", "pixels"], "unknown view"), (["--family", "charts"], "unknown world"),
                         (["--n", "0"], "at least 1"), (["--model", str(tmp_path)], "no config.json"),
                         (["--max-new-tokens", "0"], "new token"),
                         (["--out", str(tmp_path / "nodir" / "f.json")], "write elsewhere")):
        bad = CliRunner().invoke(app, ["train", "facts", *args])
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output


def test_copy_examples_can_only_be_answered_from_the_prompt():
    """Copy practice: every word is one token, the copy answer repeats the prompt's words, the
    lookup answer is the value paired with the asked key; seeded, and bad arguments refused."""
    import re

    from mmspec.train.data import copy_examples, word_pool
    from mmspec.train.pack import world_tokenizer_and_processor

    tok, _ = world_tokenizer_and_processor(0)
    pool = set(word_pool(tok))
    assert len(pool) > 100 and all(len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in pool)
    exs = copy_examples(tok, 40, seed=5)
    assert [e.prompt for e in exs] == [e.prompt for e in copy_examples(tok, 40, seed=5)]
    assert [e.prompt for e in exs] != [e.prompt for e in copy_examples(tok, 40, seed=6)]
    assert {e.family for e in exs} == {"copy", "lookup"} and all(e.images == () for e in exs)
    enc = Encoder(tok)
    for e in exs:
        if e.family == "copy":
            shown = re.fullmatch(r"USER: Repeat: (.+) ASSISTANT:", e.prompt).group(1)
            assert e.answer == shown and set(shown.split()) <= pool
        else:
            pairs = dict(p.split(" ") for p in re.search(r"Pairs: (.+)\. What", e.prompt).group(1).split(", "))
            key = re.search(r"What goes with (\S+)\?", e.prompt).group(1)
            assert e.answer == f"{key} goes with {pairs[key]}." and e.facts == (pairs[key],)
        ids = enc.encode(e)
        answer = [i for i, lab in zip(ids.input_ids, ids.labels) if lab != -100]
        assert tok.decode(answer, skip_special_tokens=True).strip() == e.answer
    assert {e.family for e in copy_examples(tok, 6, 0, lookup_share=0.0)} == {"copy"}
    assert {e.family for e in copy_examples(tok, 6, 0, lookup_share=1.0)} == {"lookup"}
    assert sum(e.family == "lookup" for e in copy_examples(tok, 20, 0, lookup_share=0.25)) == 5
    assert sum(e.family == "lookup" for e in copy_examples(tok, 100, 0, lookup_share=0.07)) == 7  # floor, no float creep
    assert copy_examples(tok, 2, 0, lookup_share=0.5)[0].family == "copy"
    lists = [e for e in copy_examples(tok, 20, 3, lookup_share=0.25, list_share=0.5) if e.family == "list"]
    assert len(lists) in (9, 10)  # floor(0.5 * 20), or one fewer when a lookup was due at the same example
    for e in lists:  # "f k v, ..." listed as "k is v, ... and k is v." in the prompt's order
        triples = [t.split(" ") for t in re.search(r"Items: (.+)\. List the pairs", e.prompt).group(1).split(", ")]
        said = [f"{k} is {v}" for _, k, v in triples]
        assert e.answer == (", ".join(said[:-1]) + " and " + said[-1] if len(said) > 1 else said[0]) + "."
        assert set(e.facts) == {w for _, k, v in triples for w in (k, v)}
    assert [e.prompt for e in copy_examples(tok, 9, 1, lookup_share=0.0)] == \
        [e.prompt for e in copy_examples(tok, 9, 1, lookup_share=0.0, list_share=0.0)]
    with pytest.raises(MMSpecError, match="min_items"):
        copy_examples(tok, 4, 0, min_items=5, max_items=2)
    for shares in ({"lookup_share": 1.5}, {"lookup_share": 0.6, "list_share": 0.6}, {"list_share": -0.1},
                   {"member_share": 0.5, "list_share": 0.6}, {"member_share": -0.2}):
        with pytest.raises(MMSpecError, match="sum <= 1"):
            copy_examples(tok, 4, 0, **shares)


def test_member_examples_ask_for_a_listed_pair_or_a_near_miss():
    """Membership practice: "Yes" exactly when the asked pair is listed; a "No" asks for a near
    miss that keeps one word of a listed pair; 1-4 pairs; only the verdict is the fact; half and
    half; and the share is floor(member_share * n), after the other kinds."""
    import re

    from mmspec.train.data import MEMBER_ITEMS, copy_examples
    from mmspec.train.pack import world_tokenizer_and_processor

    tok, _ = world_tokenizer_and_processor(0)
    exs = copy_examples(tok, 400, 7, lookup_share=0.0, member_share=1.0)
    assert {e.family for e in exs} == {"member"}
    verdicts, crossed = [], 0
    enc = Encoder(tok, fact_weight=3.0)
    for e in exs:
        asked, listed = re.fullmatch(r"USER: Is there (\S+ \S+)\? Items: (.+)\. ASSISTANT:", e.prompt).groups()
        pairs = [tuple(p.split(" ")) for p in listed.split(", ")]
        a = tuple(asked.split(" "))
        assert MEMBER_ITEMS[0] <= len(pairs) <= MEMBER_ITEMS[1] and len(set(pairs)) == len(pairs)
        verdict = "Yes" if a in pairs else "No"
        assert e.facts == (verdict,) and e.answer.startswith(verdict + ",")
        if verdict == "No":
            assert any((a[0] == p[0]) != (a[1] == p[1]) for p in pairs), (pairs, a)  # one word kept
            crossed += a[0] in {p[0] for p in pairs} and a[1] in {p[1] for p in pairs}
        enc_e = enc.encode(e)
        weighed = [i for i, w in enumerate(enc_e.weights) if w == 3.0]
        assert weighed == [enc_e.labels.index(next(lab for lab in enc_e.labels if lab != -100))]  # the verdict only
        verdicts.append(verdict)
    assert 0.4 < verdicts.count("Yes") / len(verdicts) < 0.6
    # many near misses recombine listed words (never with one pair), so "are both words listed?"
    # does not answer them: 3 in 4 where a list has such a recombination, about 45% of all
    assert crossed > 0.35 * verdicts.count("No")
    mixed = copy_examples(tok, 40, 1, lookup_share=0.25, list_share=0.25, member_share=0.25)
    counts = {k: sum(e.family == k for e in mixed) for k in ("lookup", "list", "member", "copy")}
    assert counts == {"lookup": 10, "list": 9, "member": 9, "copy": 12}  # kinds due at once: the later one waits
    half = copy_examples(tok, 40, 1, lookup_share=0.25, member_share=0.5)
    assert {k: sum(e.family == k for e in half) for k in ("lookup", "member", "copy")} == \
        {"lookup": 10, "member": 19, "copy": 11}
    with pytest.raises(MMSpecError, match="8 distinct"):
        copy_examples(tok, 4, 0, min_items=1, max_items=2, member_share=0.5, pool=list("abcdabcd"))


def test_token_accuracy_counts_the_argmax_hits(model, tokenizer, processor):
    """token_accuracy on labels built to be right at every other labelled position is 1/2 (1 when
    all are right); facts_only counts only the positions the batch weighs above 1."""
    from mmspec.train.pooling import embed_multimodal
    from mmspec.train.recipe import token_accuracy

    enc = Encoder(tokenizer)
    exs = fake_examples(3, seed=1)

    def batch():
        return collate([enc.encode(ex) for ex in exs], tokenizer.pad_token_id, processor.image_processor, 64)

    b = batch()
    feats = pooled_image_features(model, b.pixel_values, 64, train_vision=False)
    with torch.no_grad():
        pred = model(inputs_embeds=embed_multimodal(model, b.input_ids, feats),
                     attention_mask=b.attention_mask).logits[:, :-1].argmax(-1)  # [B, T-1]
    labelled = b.labels[:, 1:] != -100
    order = labelled.flatten().nonzero().flatten()  # labelled positions, row-major
    wrong = (pred + 1) % len(tokenizer)
    flat = torch.where(labelled, pred, b.labels[:, 1:]).flatten()
    flat[order[1::2]] = wrong.flatten()[order[1::2]]  # every other labelled position wrong
    half = batch()
    half.labels[:, 1:] = flat.view_as(pred)
    assert token_accuracy(model, [half]) == pytest.approx(len(order[::2]) / len(order))
    right = batch()
    right.labels[:, 1:] = torch.where(labelled, pred, b.labels[:, 1:])
    assert token_accuracy(model, [right]) == 1.0
    half.loss_weights = torch.ones_like(half.labels, dtype=torch.float)
    w = torch.ones(labelled.numel())
    w[order[::2]] = 2.0  # mark only the right ones as facts
    half.loss_weights[:, 1:] = w.view_as(pred)
    assert token_accuracy(model, [half], facts_only=True) == 1.0
    with pytest.raises(MMSpecError, match="fact_weight"):
        token_accuracy(model, [right], facts_only=True)


def test_reading_examples_look_the_value_up_in_their_own_answer():
    """Reading practice is a world lookup without its image: chart values and scene lookups
    (``reading_scenes`` of them, default half); the prompt names only the key, the answer's reading holds the key with its value
    right after it, and the answer ends on that key and value (the example's one fact)."""
    import random

    from mmspec.train.data import copy_examples, reading_example
    from mmspec.train.evaluate import final_sentence, states
    from mmspec.world.single import CHART_LABELS

    exs = [reading_example(random.Random(i), scene=i % 2 == 0) for i in range(80)]
    charts = [ex for ex in exs if any(f" {lab}?" in ex.prompt or f" {lab} " in ex.prompt for lab in CHART_LABELS)]
    assert len(charts) == 40  # the scene lookups name shapes, colours and positions, not chart labels
    for ex in exs:
        (value,) = ex.facts
        assert ex.family == "reading" and ex.images == () and "<image>" not in ex.prompt
        assert ex.prompt.startswith("USER: ") and ex.prompt.endswith("? ASSISTANT:")
        assert ex.answer.endswith(f" {value}.")
        key_value = final_sentence(ex.answer).rsplit(" is ", 1)[-1].rsplit(" gives ", 1)[-1].rstrip(".")
        key = key_value[: -len(value) - 1]
        assert key and key in ex.prompt, (ex.prompt, key)  # the question names the key
        assert f"{key} {value}" in ex.answer.split(". ")[0], ex.answer  # the reading pairs it with its value
        assert not states(ex.prompt, value)  # only the reading tells the value
    mixed = copy_examples(None, 20, 0, lookup_share=0.0, pool=[f"w{i}" for i in range(30)], reading_share=0.5)
    assert sum(ex.family == "reading" for ex in mixed) == 10
    for scenes, n_charts in ((0.0, 20), (0.25, 15), (1.0, 0)):
        only = copy_examples(None, 20, 1, lookup_share=0.0, pool=[f"w{i}" for i in range(30)], reading_share=1.0,
                             reading_scenes=scenes)
        assert sum("chart" in ex.answer for ex in only) == n_charts, scenes
    with pytest.raises(MMSpecError, match="reading_scenes"):
        copy_examples(None, 20, 1, pool=[f"w{i}" for i in range(30)], reading_share=0.5, reading_scenes=1.5)
    # scene_kinds narrows the scene lookups: only places of objects, the charts untouched
    places = copy_examples(None, 40, 2, lookup_share=0.0, pool=[f"w{i}" for i in range(30)], reading_share=1.0,
                           reading_scenes=0.5, scene_kinds=("position",))
    scenes = [ex for ex in places if "chart" not in ex.answer]
    assert len(scenes) == 20
    assert all(ex.prompt.startswith(("USER: Where is the ", "USER: In which part of the image is the "))
               for ex in scenes), [ex.prompt for ex in scenes]
    # by default all three scene lookup kinds are drawn, and naming all three changes nothing
    default = [reading_example(random.Random(i), scene=True) for i in range(60)]
    assert any(ex.prompt.startswith(("USER: Where is", "USER: In which part")) for ex in default)
    assert any(ex.prompt.startswith(("USER: What colour", "USER: Which colour")) for ex in default)
    assert any(ex.prompt.startswith(("USER: What shape", "USER: Which shape")) for ex in default)
    named = [reading_example(random.Random(i), scene=True, scene_kinds=("colour_of", "position", "shape_at"))
             for i in range(60)]
    assert [ex.answer for ex in named] == [ex.answer for ex in default]
    for bad in (("place",), ()):
        with pytest.raises(MMSpecError, match="scene lookup kinds"):
            copy_examples(None, 20, 1, pool=[f"w{i}" for i in range(30)], reading_share=0.5, scene_kinds=bad)


def test_reading_examples_practise_no_test_chart_or_scene(monkeypatch):
    """Only specs the world's split hash puts in train are practised: here a stand-in hash puts
    every chart whose first bar is egg, and every scene with one object, in train."""
    import random
    import re

    import mmspec.world.core as core
    from mmspec.train.data import reading_example

    def split_of(family, spec):
        return "train" if (spec.labels[0] == "egg" if family == "chartqa" else len(spec.objs) == 1) else "test"

    monkeypatch.setattr(core, "split_of", split_of)
    for i in range(20):
        chart, scene = reading_example(random.Random(i), scene=False), reading_example(random.Random(i), scene=True)
        assert ": egg " in chart.answer, chart.answer
        listing = re.split(r": | I find ", scene.answer.split(". ")[0], maxsplit=1)[1]  # after the head
        assert "," not in listing and " and " not in listing, scene.answer  # one object


def test_final_value_accuracy_scores_only_the_looked_up_value(monkeypatch):
    """A model right on every token scores 1; one right everywhere but the final value scores 0,
    however much of the reading it gets right; an answer that does not end on its fact is refused."""
    import random
    from types import SimpleNamespace

    import mmspec.train.recipe as recipe
    from mmspec.train.data import Encoder, Example, reading_example
    from mmspec.train.pack import world_tokenizer_and_processor

    tokenizer, processor = world_tokenizer_and_processor(0)
    exs = [reading_example(random.Random(i), scene=i % 2 == 0) for i in range(6)]
    enc = Encoder(tokenizer)
    spoil = {"value": False}

    def oracle(model, batch, *a, **k):  # logits[b, t] point at token t + 1, except (spoilt) at the value
        ids = batch.input_ids
        logits = torch.zeros(*ids.shape, len(tokenizer))
        logits[:, :-1].scatter_(-1, ids[:, 1:, None], 1.0)
        if spoil["value"]:
            for b in range(ids.shape[0]):
                n = int(batch.attention_mask[b].sum())
                want = tokenizer(" " + exs[b].facts[0], add_special_tokens=False)["input_ids"]
                logits[b, n - 3 - len(want)] = 0  # the position that predicts the value's first token
                logits[b, n - 3 - len(want), 0] = 1.0
        return SimpleNamespace(logits=logits)

    monkeypatch.setattr(recipe, "batch_forward", oracle)
    model = torch.nn.Linear(1, 1)
    assert recipe.final_value_accuracy(model, enc, processor.image_processor, exs, batch_size=8) == 1.0
    spoil["value"] = True
    assert recipe.final_value_accuracy(model, enc, processor.image_processor, exs, batch_size=8) == 0.0
    bad = Example("USER: What? ASSISTANT:", "It is 5, I think.", (), (), "reading", ("5",))
    with pytest.raises(MMSpecError, match="end on their first fact"):
        recipe.final_value_accuracy(model, enc, processor.image_processor, [bad])


def test_copy_cli_trains_only_the_lm_and_stage_mixes_copy_practice(tmp_path, monkeypatch):
    """`mmspec train copy` changes LM tensors only and records the held-out copy accuracy;
    `stage --copy-mix` adds the practice examples; bad values are refused before any work."""
    import json

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from mmspec.cli import app
    from mmspec.train.checkpoint import save_checkpoint
    from mmspec.train.pack import world_tokenizer_and_processor

    tok, proc = world_tokenizer_and_processor(0)
    torch.manual_seed(0)
    save_checkpoint(build_llava(model_size("tiny"), tok), tmp_path / "m", processor=proc,
                    meta={"role": "target", "stages": [{"name": "s0"}], "eval": {"loss": 1.0}})
    r = CliRunner().invoke(app, ["train", "copy", "--init", str(tmp_path / "m"), "--out", str(tmp_path / "c"),
                                 "--steps", "3", "--batch-size", "4", "--n-examples", "40", "--list-share", "0.25",
                                 "--member-share", "0.25", "--no-bf16"])
    assert r.exit_code == 0, r.output
    assert "held-out copy accuracy" in r.output
    meta = json.loads((tmp_path / "c" / "mmspec.json").read_text())
    stage = meta["stages"][-1]
    assert stage["objective"] == "copy practice" and stage["steps"] == 3 and "eval" not in meta
    assert stage["lookup_share"] == 0.5 and stage["list_share"] == 0.25 and stage["trainable"] == "projector+lm"
    assert stage["member_share"] == 0.25
    by_kind = stage["held_out_accuracy_by_kind"]
    assert set(by_kind) == {"copy", "lookup", "list", "member"} and "  member: " in r.output
    assert all(0 <= v <= 1 for k in by_kind.values() for v in k.values())
    assert all(0 <= v <= 1 for v in stage["held_out_copy_accuracy"].values())
    old, new = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all("language_model" in k or "lm_head" in k for k in changed)
    import mmspec.train.data as data
    import mmspec.train.recipe as recipe

    schedules, real_lr_at = set(), recipe.lr_at
    monkeypatch.setattr(recipe, "lr_at", lambda *a: schedules.add(a[3]) or real_lr_at(*a))
    kinds_given, real_copy_examples = [], data.copy_examples
    monkeypatch.setattr(data, "copy_examples",
                        lambda *a, **k: kinds_given.append(k.get("scene_kinds")) or real_copy_examples(*a, **k))
    r = CliRunner().invoke(app, ["train", "copy", "--init", str(tmp_path / "m"), "--out", str(tmp_path / "rd"),
                                 "--steps", "2", "--batch-size", "4", "--n-examples", "20", "--lookup-share", "0",
                                 "--reading-share", "1", "--schedule", "constant", "--reading-scene-kind", "position",
                                 "--reading-scene-kind", "position", "--no-bf16"])
    assert r.exit_code == 0, r.output
    stage = json.loads((tmp_path / "rd" / "mmspec.json").read_text())["stages"][-1]
    assert stage["reading_share"] == 1.0 and set(stage["held_out_accuracy_by_kind"]) == {"reading"}
    assert stage["schedule"] == "constant" and stage["reading_scenes"] == 0.5
    assert stage["reading_scene_kinds"] == ["position"] and stage["seed"] == 0  # repeats dropped
    assert kinds_given == [["position"], ["position"]]  # the flag reaches the training and held-out examples
    monkeypatch.setattr(data, "copy_examples", real_copy_examples)
    assert schedules == {"constant"}  # the flag reaches the optimiser, not only the record
    monkeypatch.setattr(recipe, "lr_at", real_lr_at)
    with pytest.raises(MMSpecError, match="schedule"):
        real_lr_at(0.5, 1.0, 0.03, "Constant")
    assert "  reading: " in r.output
    for args, phrase in ((["--n-examples", "0"], "--n-examples"), (["--lr", "0"], "learning rate"),
                         (["--lookup-share", "2"], "--lookup-share"), (["--reading-share", "0.6"], "--reading-share"),
                         (["--reading-scenes", "-0.1"], "--reading-scenes"), (["--schedule", "linear"], "schedule"),
                         (["--lookup-share", "0.6", "--list-share", "0.6"], "--list-share"),
                         (["--member-share", "0.6"], "--member-share"),
                         (["--reading-scene-kind", "place"], "shape_at"),
                         (["--reading-scene-kind", "position"], "narrows"),
                         (["--reading-share", "0.5", "--lookup-share", "0", "--reading-scenes", "0",
                           "--reading-scene-kind", "position"], "narrows"),
                         (["--init", str(tmp_path)], "no config.json")):
        base = ["train", "copy", "--init", str(tmp_path / "m"), "--out", str(tmp_path / "x")]
        bad = CliRunner().invoke(app, base + args)
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output
        assert not (tmp_path / "x").exists()

    seen = {}
    real_stream = data.batch_stream

    def spy(examples, *a, **k):
        seen["families"] = [ex.family for ex in examples]
        return real_stream(examples, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    args = ["train", "stage", "--size", "tiny", "--steps", "2", "--batch-size", "4", "--n-train-per-family", "1",
            "--copy-mix", "0.5", "--no-bf16", "--eval", "--out", str(tmp_path / "s")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    fams = seen["families"]
    assert sum(f in ("copy", "lookup") for f in fams) == 4 and len(fams) == 12  # round(0.5 * 8) added
    meta = json.loads((tmp_path / "s" / "mmspec.json").read_text())
    assert meta["stages"][-1]["copy_mix"] == 0.5
    assert meta["eval"]["eval_loss"] > 0 and 0 <= meta["eval"]["recall"] <= 1  # held-out batches and facts ran
    quick = [a for a in args[:-1] if a != "--eval"]
    r = CliRunner().invoke(app, quick + [str(tmp_path / "sm"), "--copy-member-share", "1"])
    assert r.exit_code == 0, r.output
    assert seen["families"].count("member") == 4 and not {"copy", "lookup"} & set(seen["families"])
    assert json.loads((tmp_path / "sm" / "mmspec.json").read_text())["stages"][-1]["copy_member_share"] == 1.0
    for bad_mix, phrase in ((["--copy-mix", "-1"], "--copy-mix"), (["--copy-mix", "1", "--captioner"], "captioner"),
                            (["--copy-member-share", "1.5"], "--copy-member-share"),
                            (["--copy-mix", "0", "--copy-member-share", "0.5"], "give --copy-mix")):
        bad = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "y")] + bad_mix)
        assert bad.exit_code == 2 and phrase in bad.output and not (tmp_path / "y").exists(), bad.output


def test_fixed_batches_keep_order_and_match_collate(tokenizer, processor):
    """Held-out batches: in order, the last one short, each equal to collating the encodings."""
    from mmspec.train.data import fixed_batches

    enc = Encoder(tokenizer)
    exs = fake_examples(5, seed=2)
    got = fixed_batches(exs, enc, processor.image_processor, batch_size=2)
    assert [b.input_ids.shape[0] for b in got] == [2, 2, 1]
    want = collate([enc.encode(ex) for ex in exs[2:4]], tokenizer.pad_token_id, processor.image_processor, 64)
    assert torch.equal(got[1].input_ids, want.input_ids) and torch.equal(got[1].labels, want.labels)
    assert torch.equal(got[1].pixel_values, want.pixel_values)


def test_swap_pack_script_swaps_one_role_and_refuses_a_foreign_tower(tmp_path):
    """scripts/swap-pack.py puts a checkpoint into the pack bit for bit and records it under a new
    key; a taken key, an fp32 checkpoint and a checkpoint whose vision tower is not the shipped one
    are refused before anything changes, also when another role in the same call is fine; a role
    that fails while being staged leaves the pack as it was and no staging folder behind."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    root = Path(__file__).parents[1]
    pack = tmp_path / "src/mmspec/assets/embedded"
    shutil.copytree(root / "src/mmspec/assets/embedded", pack)
    src = tmp_path / "new_pooled"
    shutil.copytree(pack / "draft_pooled", src)
    weights = load_file(src / "model.safetensors")
    lm_key = next(k for k in weights if "vision_tower" not in k and weights[k].is_floating_point())
    weights[lm_key] = weights[lm_key] + 1  # a projector/LM change, the kind the script swaps in
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})

    def swap(key: str, *pairs: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(root / "scripts/swap-pack.py"), key, "a test swap", *pairs],
                              cwd=tmp_path, capture_output=True, text=True)

    def state() -> tuple[bytes, bytes, str]:
        return ((pack / "draft_pooled/model.safetensors").read_bytes(), (pack / "draft/model.safetensors").read_bytes(),
                (pack / "pack_report.json").read_text())

    done = swap("vtest", f"draft_pooled={src}")
    assert done.returncode == 0, done.stderr
    assert torch.equal(load_file(pack / "draft_pooled/model.safetensors")[lm_key], weights[lm_key])
    report = json.loads((pack / "pack_report.json").read_text())
    assert report["vtest"]["note"] == "a test swap" and list(report["vtest"]["models"]) == ["draft_pooled"]
    assert not list(pack.glob(".swap-*"))  # no staging folder left behind

    before = state()
    taken = swap("vtest", f"draft_pooled={src}")
    assert taken.returncode != 0 and "already has 'vtest'" in taken.stderr and state() == before

    wide = tmp_path / "wide"
    shutil.copytree(src, wide)
    save_file({k: v.float() for k, v in weights.items()}, wide / "model.safetensors", metadata={"format": "pt"})
    refused = swap("vwide", f"draft_pooled={wide}")
    assert refused.returncode != 0 and "torch.float32" in refused.stderr and "--half" in refused.stderr
    assert state() == before

    tower_key = next(k for k in weights if "vision_tower" in k and weights[k].is_floating_point())
    weights[tower_key] = weights[tower_key] + 1
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    refused = swap("vtower", f"draft={pack / 'draft'}", f"draft_pooled={src}")  # draft alone would pass
    assert refused.returncode != 0 and "vision tower is not the shipped one" in refused.stderr
    assert state() == before

    broken = tmp_path / "broken"  # passes the checks, fails while staged: after the first role was
    shutil.copytree(wide, broken)
    save_file({k: v for k, v in load_file(pack / "draft_pooled/model.safetensors").items()},
              broken / "model.safetensors", metadata={"format": "pt"})
    (broken / "config.json").write_text("{")
    failed = swap("vbroken", f"draft={pack / 'draft'}", f"draft_pooled={broken}")
    assert failed.returncode != 0 and "not a valid JSON" in failed.stderr  # from staging, not a check
    assert state() == before and not list(pack.glob(".swap-*"))


def test_stage_minutes_alone_let_the_clock_decide(tmp_path, monkeypatch):
    """`stage --minutes M` with no --steps runs on the clock (it used to stop at a hidden 100-step
    default); with neither, the documented 1000 steps."""
    from typer.testing import CliRunner

    import mmspec.train.recipe as recipe
    from mmspec.cli import app

    seen = []

    def spy(model, stage, *a, **k):
        seen.append((stage.steps, stage.max_seconds))
        return recipe.StageResult(stage.name)

    monkeypatch.setattr(recipe, "train_stage", spy)
    base = ["train", "stage", "--size", "tiny", "--batch-size", "2", "--n-train-per-family", "1", "--no-bf16"]
    for extra, want in ((["--minutes", "0.5"], (None, 30.0)), ([], (1000, None)), (["--steps", "7"], (7, None))):
        r = CliRunner().invoke(app, base + extra + ["--out", str(tmp_path / f"m{len(seen)}")])
        assert r.exit_code == 0, r.output
        assert seen[-1] == want


def test_run_pack_makes_every_role_and_distils_the_drafts_on_the_target_answers(tmp_path):
    """The whole recipe on tiny sizes: four loadable roles sharing the target's tower, the draft's
    stage 2 and the pooled draft trained on the saved target's own answers (recorded), the
    target on captions and weighed facts as well."""
    from mmspec.embedded import load_embedded
    from mmspec.train.config import RecipeConfig
    from mmspec.train.pack import run_pack

    tiny = lambda name, trainable, **kw: StageConfig(name, trainable, lr=1e-3, steps=2, batch_size=4, **kw)
    recipe = RecipeConfig(target_size="tiny", draft_size="tiny-draft", captioner_size="tiny-draft",
                          n_train_per_family=2, n_eval_per_family=1, distill_per_family=1, max_answer_tokens=8,
                          autocast_bf16=False,
                          target_stages=(tiny("target-stage0", "all"),),
                          draft_stages=(tiny("draft-stage1", "projector"), tiny("draft-stage2", "projector+lm")),
                          pooled_stage=tiny("draft-pooled", "projector+lm", pooled_tokens=16),
                          captioner_stages=(tiny("captioner-stage1", "projector"),))
    logged: list[str] = []
    report = run_pack(recipe, tmp_path, progress=False, log=logged.append)
    names = [s["name"] for s in report["stages"]]
    assert names == ["target-stage0", "target-answers", "draft-stage1", "draft-stage2", "draft-pooled",
                     "captioner-stage1"]
    answers = report["stages"][1]
    assert answers["samples"] == 8 and answers["max_new_tokens"] == 8
    from mmspec.train.distill import target_fingerprint

    assert answers["target"] == target_fingerprint(tmp_path / "target")  # the saved weights answered
    assert "target: 24 examples, 8 of them image -> caption; fact tokens weigh 4.0x" in "\n".join(logged)
    pack = load_embedded(path=tmp_path)
    tower = lambda m: m.model.vision_tower.state_dict()
    for m in (pack.draft, pack.draft_pooled, pack.captioner_model):
        assert all(torch.equal(v, tower(pack.target)[k]) for k, v in tower(m).items())
    assert pack.pooled_tokens == 16
    with pytest.raises(MMSpecError, match="distill_per_family"):
        RecipeConfig(distill_per_family=-1)
    with pytest.raises(MMSpecError, match="fact_weight"):
        RecipeConfig(fact_weight=0)
