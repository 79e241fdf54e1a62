"""A head for every family the library decodes, trained on the user's own conversations: each
family's processor and chat template build the sequences (loss on the assistant turns only),
a few steps make a head that drafts better than untrained on held-out conversations, decoding
with it equals ``target.generate`` exactly, its EAGLE-3 export reloads with identical draft
logits; bad records are counted and skipped, a file with none usable is refused."""

from __future__ import annotations

import pytest
import torch

from helpers.conversations import FAMILIES, FRAMES, VIDEO_FAMILIES, conversations, family_pair, write_jsonl, write_media
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.heads import build_head
from mmspec.train.conversations import (
    Conversation,
    conversation_sequence,
    conversation_sequences,
    draft_vocabulary,
    render,
)
from mmspec.train.head import HeadTrainConfig, first_step_acceptance, train_head


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_media(root, frames=8)
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_for_every_family(family, tok, media, tmp_path):
    from mmspec.heads.formats import export_head, load_external_head

    target, proc = family_pair(family, tok)
    video = family in VIDEO_FAMILIES
    frames = FRAMES.get(family, 8)
    data = write_jsonl(tmp_path / "train.jsonl", conversations(12, video, seed=1))
    held = write_jsonl(tmp_path / "held.jsonl", conversations(4, video, seed=2))
    kw = dict(max_length=1000, n_frames=frames,
              mm_token_types=(3, 6) if family.startswith("qwen") else None, log=lambda s: None)
    seqs, report = conversation_sequences(proc, data, media, **kw)
    held_seqs, _ = conversation_sequences(proc, held, media, **kw)
    assert report.used == 12 and not report.skipped
    s = seqs[0]
    assert s.loss_mask.sum() < s.input_ids.shape[0] / 2  # assistant turns only
    assert not torch.isin(s.input_ids[s.loss_mask], torch.tensor([3, 6])).any()  # never a placeholder

    head = build_head(target, "eagle3", feature_layers=(0, 1, 2), seed=0)
    before = first_step_acceptance(head, target, held_seqs)
    cfg = HeadTrainConfig(variant="eagle3", out=str(tmp_path / "head"), steps=25, batch_size=4, lr=3e-3, warmup=2,
                          ttt_depth=2, progress=False, checkpoint_every=1000)
    train_head(target, seqs, cfg, head=head, log=lambda s: None)
    after = first_step_acceptance(head, target, held_seqs)
    assert after > before, (before, after)

    # greedy decoding with the trained head: exactly the target's output
    conv = Conversation("q", [("user", "<image> <image> " + ("<video> " if video else "") + "w12 w13")],
                        ["img0.png", "img1.png"], ["clip0"] if video else [])
    from PIL import Image

    from mmspec.inputs import load_video

    prompt = render(proc, conv.turns, True)
    imgs = [Image.open(media / f).convert("RGB") for f in conv.images]
    vids = [load_video(media / "clip0", frames)] if video else None
    enc = dict(proc(text=prompt, images=imgs, videos=vids, return_tensors="pt"))
    ids = enc.pop("input_ids")
    enc.pop("attention_mask")
    head.eval()
    res = SpecDecoder(target, head, tok).generate(ids, **enc, max_new_tokens=12)
    ref = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          **enc)
    assert res.token_ids == ref[0, ids.shape[1]:].tolist()

    # EAGLE-3 export, read back: the same draft logits
    out = export_head(head, tmp_path / "eagle3", "eagle3")
    back = load_external_head(out, target)
    feats = torch.randn(1, 5, 3 * 64, dtype=torch.float64)
    emb = target.get_input_embeddings()(torch.tensor([[10, 11, 12, 13, 14]]))
    pos = torch.arange(5)[None]
    lm = target.get_output_embeddings()
    with torch.no_grad():
        a = head.logits(head(head.fused(feats), emb, position_ids=pos), lm)
        b = back.logits(back(back.fused(feats), emb, position_ids=pos), lm)
    assert torch.equal(a, b)


def test_a_processor_that_ignores_the_media_is_refused(tok, media, tmp_path):
    """A processor that takes ``videos=`` (or ``images=``) and makes nothing of it (Video-LLaVA's
    directory read as a LlavaProcessor where torchvision is missing) left the ``<video>`` marker one
    token and dropped the clip: every record was "used" and the head trained on text alone."""

    class Ignoring:  # the tokenizer alone, as such a processor is for the media it ignores
        tokenizer, chat_template = tok, None

        def __call__(self, text, return_tensors="pt", **media):
            return dict(tok(text, return_tensors=return_tensors))

    path = write_jsonl(tmp_path / "v.jsonl", conversations(2, True, seed=4))
    with pytest.raises(MMSpecError, match="made no pixel_values_videos .* does not read videos"):
        conversation_sequences(Ignoring(), path, media, max_length=1000, log=lambda s: None)
    path = write_jsonl(tmp_path / "i.jsonl", conversations(2, False, seed=4))
    with pytest.raises(MMSpecError, match="made no pixel values .* does not read images"):
        conversation_sequences(Ignoring(), path, media, max_length=1000, log=lambda s: None)


def test_bad_records_are_counted_and_skipped(tok, media, tmp_path):
    target, proc = family_pair("llava_next", tok)
    good = conversations(3, False, seed=3)
    bad = [
        {"id": "m", "images": ["nosuch.png", "img0.png"], "messages": good[0]["messages"]},  # missing image
        {"id": "n", "messages": [{"role": "user", "content": "w5"}]},  # no assistant turn
        {"id": "x", "images": ["img0.png", "broken.png"], "messages": good[0]["messages"]},  # unreadable
        {"id": "l", "images": ["img0.png", "img1.png"],
         "messages": [good[0]["messages"][0], {"role": "assistant", "content": " ".join(["w9"] * 400)}]},  # too long
        "not json",
    ]
    (media / "broken.png").write_text("not a picture")
    path = write_jsonl(tmp_path / "mixed.jsonl", good + bad)
    lines = []
    seqs, report = conversation_sequences(proc, path, media, max_length=200, log=lines.append)
    assert report.used == 3 and report.read == 8
    assert report.skipped == {"missing image": 1, "no assistant turn": 1, "unreadable image": 1,
                              "past the context": 1, "line 8 is not JSON": 1}
    assert "8 conversation(s) read, 3 used, 5 skipped (" in lines[0] and "missing image: 1 (e.g. record m)" in lines[0]
    only_bad = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(MMSpecError, match="no usable conversation: .*missing image: 1"):
        conversation_sequences(proc, only_bad, media, max_length=200, log=lines.append)


def test_llava_instruct_json_in_the_llava_15_frame(tok, media, tmp_path):
    import json

    target, proc = family_pair("llava", tok)
    path = tmp_path / "llava_instruct.json"
    path.write_text(json.dumps(conversations(2, False, seed=4, fmt="llava")))
    seqs, _ = conversation_sequences(proc, path, media, max_length=1000, log=lambda s: None)
    text = tok.decode(seqs[0].input_ids[seqs[0].loss_mask])
    turns = json.loads(path.read_text())[0]["conversations"]
    assert text.split() == (turns[1]["value"] + " </s> " + turns[3]["value"] + " </s>").split()  # answers + eos
    assert render(proc, [("user", "<image>\nw5"), ("assistant", "w6")], False) == "USER: <image>\nw5 ASSISTANT: w6</s>"


def test_draft_vocabulary_follows_the_assistant_tokens(tok, media, tmp_path):
    from mmspec.heads.formats import export_head, load_external_head

    target, proc = family_pair("llava", tok)
    conv = Conversation("a", [("user", "w50 w51"), ("assistant", "w20 w20 w21 w22")])
    seq = conversation_sequence(proc, conv, media, max_length=None)
    vocab = draft_vocabulary([seq], 4, 96)
    assert vocab.tolist() == [2, 20, 21, 22]  # eos ends the turn; the user's words are not counted
    assert draft_vocabulary([seq], 6, 96).tolist() == [0, 1, 2, 20, 21, 22]  # padded with the lowest unused ids
    with pytest.raises(MMSpecError, match="--draft-vocab must be"):
        draft_vocabulary([seq], 0, 96)
    head = build_head(target, "eagle3", feature_layers=(0, 1, 2), draft_vocab=vocab)
    out = export_head(head, tmp_path / "e3", "eagle3")
    from safetensors.torch import load_file

    t = load_file(str(out / "model.safetensors"))
    assert (t["d2t"] + torch.arange(4)).tolist() == [2, 20, 21, 22]  # offsets, as SGLang and vLLM read them
    assert t["t2d"].nonzero().flatten().tolist() == [2, 20, 21, 22]
    assert torch.equal(load_external_head(out, target).d2t, vocab)


def test_train_head_command_on_a_llava_next_target(tok, media, tmp_path):
    """The command: a saved LLaVA-NeXT target (its processor and chat template beside it), a
    ShareGPT file with a bad record, an EAGLE-3 head with a draft vocabulary, exported for the engines."""
    import json

    from typer.testing import CliRunner

    from mmspec.cli.app import app

    target, proc = family_pair("llava_next", tok)
    target.save_pretrained(tmp_path / "target")
    proc.save_pretrained(tmp_path / "target")
    recs = conversations(6, False, seed=5) + [{"id": "gone", "images": ["nosuch.png", "img0.png"],
                                               "messages": conversations(1, False)[0]["messages"]}]
    data = write_jsonl(tmp_path / "chats.jsonl", recs)
    out = tmp_path / "head"
    r = CliRunner().invoke(app, ["train", "head", "--target", str(tmp_path / "target"), "--variant", "eagle3",
                                 "--data", f"sharegpt:{data}", "--media-dir", str(media), "--feature-layers", "0,1,2",
                                 "--draft-vocab", "40", "--steps", "3", "--batch-size", "2", "--threads", "1",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "7 conversation(s) read, 6 used, 1 skipped (missing image: 1 (e.g. record gone))" in r.output
    saved = json.loads((out / "mmspec_head.json").read_text())
    assert saved["draft_vocab_size"] == 40 and saved["feature_layers"] == [0, 1, 2]
    r = CliRunner().invoke(app, ["export", "head", str(out), "--format", "eagle3", "--out", str(tmp_path / "e3")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["mmspec"]["target_model_type"] == "llava_next"
    # self-distillation by the same target: its answers, as a file train head reads
    answers = tmp_path / "answers.jsonl"
    r = CliRunner().invoke(app, ["train", "answers", "--target", str(tmp_path / "target"), "--data", f"sharegpt:{data}",
                                 "--media-dir", str(media), "--max-new-tokens", "4", "--out", str(answers)])
    assert r.exit_code == 0, r.output
    assert "6 used, 1 skipped" in r.output and len(answers.read_text().splitlines()) == 6


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_an_mrope_head_drafts_at_the_positions_it_was_trained_at(family, tok, media):
    """A Qwen2-VL-family head reads the target's 3-D M-RoPE positions: the drafter's first draft
    after a prompt with two images and a video scores exactly what training scores at that slot,
    and 1-D positions would score otherwise (after an image M-RoPE runs behind the token count)."""
    from mmspec import SpecDecoder
    from mmspec.batch import BatchScheduler
    from mmspec.train.feature_cache import target_features
    from mmspec.train.head import collate, slot_positions

    target, proc = family_pair(family, tok)
    conv = Conversation("q", [("user", "<image> <image> <video> w12 w13"), ("assistant", "w14 w15 w16")],
                        ["img0.png", "img1.png"], ["clip0"])
    seq = conversation_sequence(proc, conv, media, max_length=None, n_frames=2, mm_token_types=(3, 6))
    head = build_head(target, "eagle3", feature_layers=(0, 1, 2), seed=3)
    batch = collate([seq])
    ids = batch["input_ids"]
    L = ids.shape[1]
    logits_t, feats, _ = target_features(target, batch, (0, 1, 2), final=False)
    pos = slot_positions(head, target, batch)
    assert pos.shape == (3, 1, L - 1) and int(pos.max()) < L - 2  # M-RoPE: behind the slot index
    emb = target.get_input_embeddings()(ids[:, 1:])
    with torch.no_grad():
        trained_at = head.logits(head(head.fused(feats[:, :-1]), emb, position_ids=pos,
                                      attention_mask=batch["attention_mask"][:, 1:])[:, -1], target.lm_head)
        flat = head.logits(head(head.fused(feats[:, :-1]), emb, position_ids=torch.arange(L - 1)[None],
                                attention_mask=batch["attention_mask"][:, 1:])[:, -1], target.lm_head)
    mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "loss_mask") and v is not None}
    sched = BatchScheduler(SpecDecoder(target, head, tok, prefix_cache_mb=0), max_batch=1)
    sched.submit(dict(input_ids=ids, max_new_tokens=4, **mm))
    assert sched.admit() == []  # the target's prefill and the head's, as the engine runs them
    engine = sched.engine
    x = engine._input(engine.step_rows(), 1, engine.drafting.span_for(None, engine.width))
    with torch.inference_mode():
        engine.drafting.begin(x.rows, 2)
        drafted = engine.drafting.feed_pending(x)[0, -1]  # the first draft's logits: after the pending token
    assert torch.allclose(drafted, trained_at, atol=1e-9)
    assert not torch.allclose(drafted, flat, atol=1e-3)


def test_cached_features_are_the_target_features_and_reused(tok, media, tmp_path):
    from mmspec.train.feature_cache import FeatureCache, sequence_key, target_features
    from mmspec.train.head import collate

    target, proc = family_pair("qwen2_vl", tok)
    data = write_jsonl(tmp_path / "train.jsonl", conversations(6, True, seed=1))
    seqs, _ = conversation_sequences(proc, data, media, max_length=1000, n_frames=2, mm_token_types=(3, 6),
                                     log=lambda s: None)
    root = tmp_path / "cache"
    cache = FeatureCache(root, target, (0, 1, 2), 2**30)
    batch = collate(seqs[:3])
    keys = [sequence_key(s) for s in seqs[:3]]
    first = cache.features(target, batch, keys)  # computed, written
    again = cache.features(target, batch, keys)  # read back
    assert (cache.misses, cache.hits) == (3, 3) and len(list(root.glob("*.pt"))) == 3
    real = target_features(target, batch, (0, 1, 2), final=True)
    valid = batch["attention_mask"].bool()
    for a, b, c in zip(first, again, real):
        assert torch.equal(a, c) and torch.allclose(b[valid], c[valid], atol=1e-12)

    # a whole run: the first epoch fills it, the next ones read it; a rerun reads everything
    cfg = HeadTrainConfig(variant="eagle3", out=str(tmp_path / "h"), steps=6, batch_size=2, progress=False,
                          ttt_depth=1, cache_features=str(tmp_path / "run-cache"), checkpoint_every=1000)
    head = build_head(target, "eagle3", feature_layers=(0, 1, 2))
    s1 = train_head(target, seqs, cfg, head=head, log=lambda s: None)
    assert s1["cache"]["misses"] == 6 and s1["cache"]["hits"] == 6
    cfg.resume, cfg.out = False, str(tmp_path / "h2")
    s2 = train_head(target, seqs, cfg, head=build_head(target, "eagle3", feature_layers=(0, 1, 2)), log=lambda s: None)
    assert (s2["cache"]["hits"], s2["cache"]["misses"]) == (12, 0)

    # bounded: no room, no files (on the fly every time); another target's cache is refused
    small = FeatureCache(tmp_path / "small", target, (0, 1, 2), 1000)
    small.features(target, batch, keys)
    assert not list((tmp_path / "small").glob("*.pt"))
    other, _ = family_pair("qwen2_5_vl", tok)
    with pytest.raises(MMSpecError, match="holds features made with another target"):
        FeatureCache(root, other, (0, 1, 2), 2**30)


@pytest.mark.parametrize("family", ["video_llava", "qwen2_vl"])
def test_train_answers_regenerates_every_assistant_turn_with_the_target(family, tok, media, tmp_path):
    """Self-distillation for any family: each assistant turn becomes the target's own greedy answer
    (after the turns before it, as the target answered them); a rerun resumes; the file trains a head."""
    import json

    from mmspec.train.conversations import regenerate_answers

    target, proc = family_pair(family, tok)
    frames = FRAMES[family]
    types = (3, 6) if family.startswith("qwen") else None
    recs = conversations(3, True, seed=7) + [{"id": "bad", "messages": [{"role": "user", "content": "w5"}]}]
    data = write_jsonl(tmp_path / "chats.jsonl", recs)
    out = tmp_path / "answers.jsonl"
    lines = []
    counts = regenerate_answers(target, proc, data, media, out, max_new_tokens=6, n_frames=frames,
                                mm_token_types=types, limit=2, log=lines.append)
    assert counts["written"] == 2
    counts = regenerate_answers(target, proc, data, media, out, max_new_tokens=6, n_frames=frames,
                                mm_token_types=types, log=lines.append)  # resumes: only the rest
    assert (counts["written"], counts["used"], counts["skipped"]) == (1, 3, {"no assistant turn": 1})
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    first = rows[0]["messages"]
    # the first answer is exactly target.generate's greedy continuation of the first user turn
    from PIL import Image

    from mmspec.inputs import load_video

    prompt = render(proc, [("user", first[0]["content"])], True)
    imgs = [Image.open(media / f).convert("RGB") for f in recs[0]["images"]]
    enc = dict(proc(text=prompt, images=imgs, videos=[load_video(media / recs[0]["video"], frames)],
                    return_tensors="pt"))
    ids = enc["input_ids"]
    ref = target.generate(**enc, do_sample=False, max_new_tokens=6)[0, ids.shape[1]:].tolist()
    ref = ref[:ref.index(2)] if 2 in ref else ref
    assert first[1]["content"].split() == tok.convert_ids_to_tokens(ref)
    assert first[1]["content"] != recs[0]["messages"][1]["content"]
    seqs, _ = conversation_sequences(proc, out, media, max_length=1000, n_frames=frames, mm_token_types=types,
                                     log=lambda s: None)
    assert len(seqs) == 3
