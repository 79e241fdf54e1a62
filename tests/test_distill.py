"""Tests of draft distillation data (mmspec.train.distill, `mmspec train answers`, `stage --answers`).

A tiny random LLaVA on the synthetic world (no trained assets): the batched answers must be
what a lone ``target.generate`` call returns, a rerun must resume without redoing or losing a
sample, and a stage must train on exactly the ids in the file.
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
from mmspec.train.distill import AnswerSource, generate_answers, read_answers, with_answers
from mmspec.train.pack import _samples, world_tokenizer_and_processor
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
    for s in _samples("train", FEW, 0):
        ex = example_from_sample(s)
        ids = tuple(tok(" " + ex.answer, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
        want = enc.encode(ex, "multimodal")
        got = enc.encode(Example(ex.prompt, "", ex.images, ex.captions, ex.family, ex.facts, ex.cues, ids))
        assert (got.input_ids, got.labels, got.weights) == (want.input_ids, want.labels, want.weights)
        checked += want.weights is not None and max(want.weights) > 1
    assert checked >= 10  # the weights were really compared, not None == None
    ex = example_from_sample(_samples("train", FEW, 0)[0])
    open_ended = enc.encode(Example(ex.prompt, "", ex.images, answer_ids=(7, 8, 9)), "text")
    assert open_ended.labels[-3:] == [7, 8, 9] and tok.eos_token_id not in open_ended.labels
    short = Encoder(tok, max_answer_tokens=2).encode(Example(ex.prompt, "", ex.images, answer_ids=(7, 8, 9, 2)))
    assert [t for t in short.labels if t != -100] == [7, 8]


@pytest.fixture(scope="module")
def shipped():
    """The shipped target: its answers depend on the image, unlike a random model's."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path

    path = default_path() / "target"
    return LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def test_batched_answers_are_lone_generate_and_a_rerun_resumes(shipped, tmp_path):
    model, proc = shipped
    samples = _samples("train", FEW, 0)
    lengths = {s.uid: proc(text=s.prompt, images=list(s.images), return_tensors="pt")["input_ids"].shape[1]
               for s in samples}
    model.generation_config.eos_token_id = proc.tokenizer(",", add_special_tokens=False)["input_ids"][0]
    try:
        want = {s.uid: lone_answer(model, proc, s, 16) for s in samples}
        in_one_call = Counter((lengths[u], len(v)) for u, v in want.items())  # rows that end at different steps
        assert len({n for _, n in in_one_call} - {16}) >= 2 and any(
            len({n for (L2, n) in in_one_call if L2 == L}) > 1 for L, _ in in_one_call)
        path = tmp_path / "answers.jsonl"
        src = AnswerSource("t0", 0, 16)
        c1 = generate_answers(model, proc, samples[:2], path, src, batch_size=4, progress=False)
        assert c1 == {"samples": 2, "already_there": 0, "written": 2}
        with path.open("a") as f:
            f.write('{"uid": "chartqa-train-4", "answer_')  # a run killed mid-row
        c2 = generate_answers(model, proc, samples, path, src, batch_size=4, progress=False)
        assert c2 == {"samples": len(samples), "already_there": 2, "written": len(samples) - 2}
        rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses again
        assert len(rows) == len({r["uid"] for r in rows}) == len(samples)
        got = read_answers(path, src)
        assert {u: list(v) for u, v in got.items()} == want
        assert generate_answers(model, proc, samples, path, src, progress=False)["written"] == 0
        with pytest.raises(MMSpecError, match="not AnswerSource"):
            generate_answers(model, proc, samples, path, AnswerSource("t0", 1, 16), progress=False)
        with pytest.raises(MMSpecError, match="seed 0, not 3"):
            read_answers(path, seed=3)
        with pytest.raises(MMSpecError, match="lacks 1 of"):
            with_answers([example_from_sample(s) for s in samples + _samples("val", {"vqav2": 1}, 0)],
                         samples + _samples("val", {"vqav2": 1}, 0), got)
    finally:
        model.generation_config.eos_token_id = proc.tokenizer.eos_token_id


def test_answers_cli_then_stage_trains_on_the_file(world, tmp_path, monkeypatch):
    """`train answers` writes one row per training sample and resumes; `train stage --answers`
    trains on those ids and records the file; another seed or more samples are refused."""
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
    rows = {json.loads(line)["uid"]: json.loads(line)["answer_ids"] for line in answers.read_text().splitlines()}

    import mmspec.train.data as data

    seen = {}
    real_stream = data.batch_stream

    def spy(examples, *a, **k):
        seen.update({ex.answer_ids: ex for ex in examples})
        return real_stream(examples, *a, **k)

    monkeypatch.setattr(data, "batch_stream", spy)
    stage = ["train", "stage", "--init", str(tmp_path / "t"), "--steps", "1", "--batch-size", "4",
             "--n-train-per-family", "1", "--no-bf16", "--answers", str(answers), "--out", str(tmp_path / "d")]
    r = CliRunner().invoke(app, stage)
    assert r.exit_code == 0, r.output
    assert set(seen) == {tuple(v) for v in rows.values()}  # every example answers with the file's ids
    meta = json.loads((tmp_path / "d" / "mmspec.json").read_text())["stages"][-1]["answers"]
    assert meta["file"] == "a.jsonl" and meta["max_new_tokens"] == 4 and len(meta["target"]) == 16
    for extra, phrase in ((["--seed", "1"], "seed 0, not 1"), (["--n-train-per-family", "2"], "lacks 8 of the 16"),
                          (["--captioner"], "drop one")):
        bad = CliRunner().invoke(app, stage[:-2] + extra + ["--out", str(tmp_path / "x")])
        assert bad.exit_code == 2 and phrase in bad.output and "Traceback" not in bad.output, bad.output
        assert not (tmp_path / "x").exists()
    missing = CliRunner().invoke(app, stage[:-4] + ["--answers", str(tmp_path / "none.jsonl"), "--out",
                                                    str(tmp_path / "x")])
    assert missing.exit_code == 2 and "train answers" in missing.output
