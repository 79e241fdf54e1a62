"""Tests of draft distillation data (mmspec.train.distill, `mmspec train answers`, `stage --answers`).

The shipped target on synthetic-world samples: the batched answers must be what a lone
``target.generate`` call returns, and a rerun must resume without redoing or losing a sample. A
tiny random LLaVA for the CLI: a stage must train on exactly the ids the file gives each sample.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from mmspec.cli import app
from mmspec.errors import MMSpecError
from mmspec.train.config import build_llava, model_size
from mmspec.train.data import Encoder, Example, example_from_sample
from mmspec.train.distill import AnswerSource, generate_answers, read_answers, tokenizer_fingerprint, with_answers
from mmspec.train.pack import world_samples, world_tokenizer_and_processor
from mmspec.world import FAMILIES

FEW = {f: 0 for f in FAMILIES} | {"chartqa": 5, "hallusionbench": 5, "spot_the_diff": 3}


@pytest.fixture(scope="module")
def world():
    tok, proc = world_tokenizer_and_processor(0)
    torch.manual_seed(0)
    return build_llava(model_size("tiny"), tok).eval(), proc


def lone_answer(model, proc, sample, max_new_tokens: int) -> list[int]:
    """What one ``target.generate`` call on this sample alone returns, cut after its eos."""
    inputs = proc(text=sample.prompt, images=list(sample.images), return_tensors="pt")
    new = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)[0, inputs["input_ids"].shape[1]:]
    new = new.tolist()
    eos = model.generation_config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


def test_answer_ids_encode_like_the_answer_text():
    """An example given the ids of its own answer text encodes to the same ids, labels and fact /
    cue weights as the text; ids without eos get none appended; the length cut still applies."""
    tok, _ = world_tokenizer_and_processor(0)
    enc = Encoder(tok, fact_weight=4.0, cue_weight=3.0, max_answer_tokens=96)
    checked = 0
    for s in world_samples("train", FEW, 0):
        ex = example_from_sample(s)
        ids = tuple(tok(" " + ex.answer, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
        want = enc.encode(ex, "multimodal")
        got = enc.encode(Example(ex.prompt, "", ex.images, ex.captions, ex.family, ex.facts, ex.cues, ids))
        assert (got.input_ids, got.labels, got.weights) == (want.input_ids, want.labels, want.weights)
        checked += want.weights is not None and max(want.weights) > 1
    assert checked >= 10  # the weights were really compared, not None == None
    ex = example_from_sample(world_samples("train", FEW, 0)[0])
    eos = tok.eos_token_id
    open_ended = enc.encode(Example(ex.prompt, "", ex.images, answer_ids=(7, 8, 9)), "text")
    assert open_ended.labels[-3:] == [7, 8, 9] and eos not in open_ended.labels
    labels = lambda e, ids: [t for t in e.encode(Example(ex.prompt, "", ex.images, answer_ids=ids)).labels  # noqa: E731
                             if t != -100]
    two = Encoder(tok, max_answer_tokens=2)
    assert labels(two, (7, 8, 9, eos)) == [7, 8]  # cut: the answer goes on, no eos
    assert labels(two, [7, 8, eos]) == [7, 8, eos]  # exactly the limit, then its eos; a list as well as a tuple
    assert labels(two, (eos,)) == [eos]


def test_answer_ids_weights_where_a_token_alone_decodes_differently():
    """A tokenizer whose decode joins tokens with spaces: the weights come from decoding growing
    prefixes, and still land on the fact's token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "it", "is", "red", "."]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    ids = tuple(tok("it is red .", add_special_tokens=False)["input_ids"])
    assert "".join(tok.decode([t]) for t in ids) != tok.decode(list(ids))  # the fallback is taken
    enc = Encoder(tok, fact_weight=4.0).encode(Example("<image>", "", (None,), facts=("red",), answer_ids=ids + (2,)))
    assert enc.weights[-5:] == [1.0, 1.0, 4.0, 1.0, 1.0]  # it is RED . </s>


@pytest.fixture(scope="module")
def shipped():
    """The shipped target: its answers depend on the image, unlike a random model's."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path

    path = default_path() / "target"
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)  # as `train answers` loads it
    return model.eval(), AutoProcessor.from_pretrained(path)


def test_batched_answers_are_lone_generate_and_a_rerun_resumes(shipped, tmp_path):
    model, proc = shipped
    samples = world_samples("train", FEW, 0)
    lengths = {s.uid: proc(text=s.prompt, images=list(s.images), return_tensors="pt")["input_ids"].shape[1]
               for s in samples}
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = proc.tokenizer(",", add_special_tokens=False)["input_ids"][0]
    try:
        want = {s.uid: lone_answer(model, proc, s, 16) for s in samples}
        in_one_call = Counter((lengths[u], len(v)) for u, v in want.items())  # rows that end at different steps
        assert len({n for _, n in in_one_call} - {16}) >= 2 and any(
            len({n for (L2, n) in in_one_call if L2 == L}) > 1 for L, _ in in_one_call)
        path = tmp_path / "answers.jsonl"
        src = AnswerSource("t0", "v0", 0, 16)
        c1 = generate_answers(model, proc, samples[:3], path, src, batch_size=4, progress=False)
        assert c1 == {"samples": 3, "already_there": 0, "written": 3}
        path.write_text(path.read_text()[:-1])  # killed after a whole row but before its newline
        c2 = generate_answers(model, proc, samples[:3], path, src, batch_size=4, progress=False)
        assert c2 == {"samples": 3, "already_there": 2, "written": 1}  # that row is written again, not lost
        with path.open("a") as f:
            f.write('{"uid": "chartqa-train-4", "answer_')  # killed mid-row
        c3 = generate_answers(model, proc, samples, path, src, batch_size=4, progress=False)
        assert c3 == {"samples": len(samples), "already_there": 3, "written": len(samples) - 3}
        rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses again
        assert len(rows) == len({r["uid"] for r in rows}) == len(samples)
        got = read_answers(path, src)
        assert {u: list(v) for u, v in got.items()} == want
        assert generate_answers(model, proc, samples, path, src, progress=False)["written"] == 0
        with pytest.raises(MMSpecError, match="made with seed 0, not 1: the uids name other world samples"):
            generate_answers(model, proc, samples, path, AnswerSource("t0", "v0", 1, 16), progress=False)
        with pytest.raises(MMSpecError, match="made with target 't0', not 't1': these answers are another"):
            generate_answers(model, proc, samples, path, AnswerSource("t1", "v0", 0, 16), progress=False)
        with pytest.raises(MMSpecError, match="tokenizer 'v0', not 'v1': the ids are tokens of another"):
            read_answers(path, tokenizer="v1")
        with pytest.raises(MMSpecError, match="lacks 1 of"):
            with_answers([example_from_sample(s) for s in samples + world_samples("val", {"vqav2": 1}, 0)],
                         samples + world_samples("val", {"vqav2": 1}, 0), got)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        first = rows[0]
        no_vocab = {k: v for k, v in first.items() if k != "tokenizer"}
        bad = tmp_path / "bad.jsonl"
        for bad_rows, phrase in (
                (rows + [first], "answers chartqa-train-0 a second time"),  # two runs joined
                (rows + [first | {"uid": "x", "target": "t9"}], "made with target 't9', not 't0'"),  # two targets
                ([no_vocab], "has no tokenizer: the file was written by an older")):
            bad.write_text("".join(json.dumps(r) + "\n" for r in bad_rows))
            with pytest.raises(MMSpecError, match=phrase):
                read_answers(bad)
        changed = {s.uid: s.prompt for s in samples} | {samples[0].uid: samples[0].prompt + " (new wording)"}
        with pytest.raises(MMSpecError, match="answered another version of chartqa-train-0"):
            read_answers(path, prompts=changed)
    finally:
        model.generation_config.eos_token_id = saved_eos


def test_with_answers_gives_each_example_its_own_samples_ids():
    samples = world_samples("train", FEW, 0)
    answers = {s.uid: (100 + i, 200 + i) for i, s in enumerate(samples)}
    out = with_answers([example_from_sample(s) for s in samples], samples, answers)
    assert [(ex.prompt, ex.answer_ids) for ex in out] == [(s.prompt, answers[s.uid]) for s in samples]


def test_tokenizer_fingerprint_is_stable_and_tells_vocabularies_apart():
    tok0, _ = world_tokenizer_and_processor(0)
    tok1, _ = world_tokenizer_and_processor(1)
    assert tokenizer_fingerprint(tok0) == tokenizer_fingerprint(world_tokenizer_and_processor(0)[0])
    assert tokenizer_fingerprint(tok0) != tokenizer_fingerprint(tok1)


def test_answers_cli_then_stage_trains_on_the_file(world, tmp_path, monkeypatch):
    """`train answers` writes one row per training sample and resumes; `train stage --answers`
    trains on those ids and records the file; another world seed or more samples are refused,
    another training seed on the same world seed is not."""
    from mmspec.train.checkpoint import save_checkpoint

    model, proc = world
    save_checkpoint(model, tmp_path / "t", processor=proc, meta={"role": "test"})
    answers = tmp_path / "a.jsonl"
    base = ["train", "answers", "--target", str(tmp_path / "t"), "--n-train-per-family", "1",
            "--max-new-tokens", "4", "--quiet", "--out", str(answers)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert "8 answers written, 0 already there" in r.output
    assert "0 answers written, 8 already there" in CliRunner().invoke(app, base).output
    for args, phrase in ((["--max-new-tokens", "0"], "new token"), (["--batch-size", "0"], "prompt per batch"),
                         (["--out", str(tmp_path / "nodir" / "a.jsonl")], "write elsewhere"),
                         (["--target", str(tmp_path)], "no config.json")):
        bad = CliRunner().invoke(app, base + args)
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output
    rows = {json.loads(line)["uid"]: json.loads(line)["answer_ids"] for line in answers.read_text().splitlines()}

    import mmspec.train.data as data

    seen = {}
    real_stream = data.batch_stream
    prompts = {s.uid: s.prompt for s in world_samples("train", 1, 0)}

    def spy(examples, *a, **k):
        seen.update({ex.prompt: ex.answer_ids for ex in examples})
        return real_stream(examples, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    stage = ["train", "stage", "--init", str(tmp_path / "t"), "--steps", "1", "--batch-size", "4",
             "--n-train-per-family", "1", "--no-bf16", "--answers", str(answers), "--out", str(tmp_path / "d")]
    r = CliRunner().invoke(app, stage)
    assert r.exit_code == 0, r.output
    assert seen == {prompts[uid]: tuple(ids) for uid, ids in rows.items()}  # each example: its sample's ids
    meta = json.loads((tmp_path / "d" / "mmspec.json").read_text())["stages"][-1]["answers"]
    assert meta["file"] == "a.jsonl" and meta["max_new_tokens"] == 4 and len(meta["target"]) == 16
    assert (meta["seed"], meta["rows"], meta["tokenizer"]) == (0, 8, tokenizer_fingerprint(proc.tokenizer))
    for extra, phrase in ((["--seed", "1"], "seed 0, not 1"), (["--n-train-per-family", "2"], "lacks 8 of the 16"),
                          (["--captioner"], "drop one")):
        bad = CliRunner().invoke(app, stage[:-2] + extra + ["--out", str(tmp_path / "x")])
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output
        assert not (tmp_path / "x").exists()
    # another training seed on the same samples and answers: --world-seed keeps the samples
    r = CliRunner().invoke(app, stage[:-2] + ["--seed", "1", "--world-seed", "0", "--out", str(tmp_path / "d1")])
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "d1" / "mmspec.json").read_text())["stages"][-1]
    assert (rec["seed"], rec["world_seed"], rec["answers"]["seed"]) == (1, 0, 0)
    missing = CliRunner().invoke(app, stage[:-4] + ["--answers", str(tmp_path / "none.jsonl"), "--out",
                                                    str(tmp_path / "x")])
    assert missing.exit_code == 2 and "train answers" in missing.output
    # a fresh model (no --init) gets a tokenizer fitted for its --seed: not the target's vocabulary
    seed1 = tmp_path / "s1.jsonl"
    r = CliRunner().invoke(app, base[:-1] + [str(seed1), "--world-seed", "1"])  # --seed is the same option
    assert r.exit_code == 0, r.output
    fresh = CliRunner().invoke(app, ["train", "stage", "--size", "tiny", "--steps", "1", "--batch-size", "4",
                                     "--n-train-per-family", "1", "--no-bf16", "--seed", "1", "--answers", str(seed1),
                                     "--out", str(tmp_path / "x")])
    assert fresh.exit_code == 2 and "another vocabulary" in fresh.output and "Traceback" not in fresh.output
    assert not (tmp_path / "x").exists()


def test_every_source_field_has_a_refusal_with_its_fix():
    from dataclasses import fields

    from mmspec.train.distill import _MISMATCH_FIX

    assert set(_MISMATCH_FIX) == {f.name for f in fields(AnswerSource)}
