"""Tests of mmspec.train: masking, stage freezing, loss going down, pooling maths, checkpoints.

Tiny models built from configs and a tiny fake world (coloured squares), so most tests need
neither the synthetic world package nor trained assets; the CLI and whole-recipe tests use the
world (no trained assets). All run in seconds on CPU.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoProcessor,
    CLIPImageProcessor,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

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
    from mmspec.train.data import example_from_sample
    from mmspec.world import make_sample
    from mmspec.world.tokenizer import train_tokenizer

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
    from transformers import AutoProcessor
    from typer.testing import CliRunner

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


def test_stage_cli_family_samples(tmp_path, monkeypatch):
    """--family-samples FAMILY=N sets that family's training samples (0 drops it), is recorded in the
    stage history, and a misspelt family or count is refused before any work."""
    import json
    from collections import Counter

    from typer.testing import CliRunner

    import mmspec.train.data as data
    from mmspec.cli import app

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

    for weights in ({"fact_weight": 2.0}, {"cue_weight": 2.0}):
        with pytest.raises(MMSpecError, match="fast tokenizer"):
            Encoder(Slow(), **weights)


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

    import mmspec.train.data as data
    from mmspec.cli import app

    seen: dict = {}
    real_stream = data.batch_stream

    def spy(examples, encoder, *a, **k):
        seen["fact_weight"], seen["cue_weight"] = encoder.fact_weight, encoder.cue_weight
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
    for flag in ("--fact-weight", "--cue-weight"):
        for value in ("0", "inf"):
            bad = CliRunner().invoke(app, base + [flag, value, "--out", str(tmp_path / "x")])
            assert bad.exit_code != 0 and f"{flag} must be" in bad.output and not (tmp_path / "x").exists()
        bad = CliRunner().invoke(app, base + [flag, "2", "--captioner", "--out", str(tmp_path / "x")])
        assert bad.exit_code != 0 and "--captioner" in bad.output and not (tmp_path / "x").exists()


def _image_caption_batches(examples: list[Example], size: int) -> list[tuple[list, list[str]]]:
    """(images, captions) reading batches of the examples' first images, in order."""
    return [([ex.images[0] for ex in examples[i:i + size]], [ex.captions[0] for ex in examples[i:i + size]])
            for i in range(0, len(examples), size)]


def _assert_only_the_tower_changed(model, before: dict) -> None:
    after = model.state_dict()
    assert all(torch.equal(v, before[k]) for k, v in after.items() if not k.startswith("model.vision_tower.")), \
        "a reading objective changed more than the vision tower"
    assert any(not torch.equal(v, before[k]) for k, v in after.items() if k.startswith("model.vision_tower."))


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
