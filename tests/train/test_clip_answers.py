"""The target's own answers to the world's video clips (`mmspec train answers` on a Video-LLaVA
target, :func:`mmspec.train.distill.generate_clip_answers`) and a head trained on them.

A Video-LLaVA made from the shipped image target (its tower, projector and LM, 2 frames a clip:
what ``mmspec train video`` starts from), so the answers depend on the frames. The batched answers
must be what a lone ``target.generate`` returns, a rerun must resume, and ``train head --answers``
must train on exactly the file's ids after each clip's prompt.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmspec.cli import app
from mmspec.errors import MMSpecError
from mmspec.train.distill import AnswerSource, generate_clip_answers, read_answers
from mmspec.world import make_video_sample
from mmspec.world.processor import clip_inputs, clip_layout

EMBEDDED = Path(__file__).resolve().parents[2] / "src" / "mmspec" / "assets" / "embedded"
CLIPS = [("motion", i) for i in range(4)] + [("order", i) for i in range(3)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(Video-LLaVA target, its processor, its saved directory)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.train.video import build_video_llava, save_video_pair

    proc = AutoProcessor.from_pretrained(EMBEDDED / "target")
    img = LlavaForConditionalGeneration.from_pretrained(EMBEDDED / "target", dtype=torch.float32)
    model, _ = build_video_llava(img, proc.tokenizer, 2)
    out = tmp_path_factory.mktemp("pair") / "target"
    save_video_pair(model, proc.tokenizer, proc.image_processor, out, log=lambda _: None)
    return model.eval(), proc, out


def lone_answer(model, proc, clip, max_new_tokens: int) -> list[int]:
    vid, n_frames, per_frame = clip_layout(model)
    x = clip_inputs(clip, proc.tokenizer, proc.image_processor, vid, n_frames, per_frame)
    ids = x["input_ids"][None]
    new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pixel_values_videos=x["pixel_values_videos"])[0, ids.shape[1]:]
    new = new.tolist()
    eos = model.generation_config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


def test_batched_clip_answers_are_lone_generate_and_a_rerun_resumes(pair, tmp_path):
    model, proc, _ = pair
    clips = [make_video_sample(f, "train", i) for f, i in CLIPS]
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = proc.tokenizer(".", add_special_tokens=False)["input_ids"][-1]
    try:
        want = {c.uid: lone_answer(model, proc, c, 12) for c in clips}
        assert len({tuple(v) for v in want.values()}) >= 4  # the answers differ clip to clip
        assert len(Counter(len(v) for v in want.values())) >= 2  # rows of one call stop at different steps
        path = tmp_path / "answers.jsonl"
        src = AnswerSource("t0", "v0", 0, 12)
        c1 = generate_clip_answers(model, proc, clips[:3], path, src, batch_size=4, progress=False)
        assert c1 == {"samples": 3, "already_there": 0, "written": 3}
        path.write_text(path.read_text()[:-1])  # killed after a whole row but before its newline
        c2 = generate_clip_answers(model, proc, clips[:3], path, src, batch_size=4, progress=False)
        assert c2 == {"samples": 3, "already_there": 2, "written": 1}
        c3 = generate_clip_answers(model, proc, clips, path, src, batch_size=4, progress=False)
        assert c3 == {"samples": len(clips), "already_there": 3, "written": len(clips) - 3}
        assert {u: list(v) for u, v in read_answers(path, src).items()} == want
    finally:
        model.generation_config.eos_token_id = saved_eos


def test_answers_cli_on_a_video_pair_then_the_head_trains_on_them(pair, tmp_path):
    """`train answers --target PAIR` answers the world's clips (video families only) and resumes;
    `world_video_sequences(answers=)` puts the file's ids after each clip's prompt."""
    from mmspec.train.head import world_video_sequences

    model, proc, target = pair
    out = tmp_path / "a.jsonl"
    base = ["train", "answers", "--target", str(target), "--n-train-per-family", "2", "--max-new-tokens", "6",
            "--quiet", "--out", str(out)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert "4 answers written, 0 already there" in r.output
    assert "0 answers written, 4 already there" in CliRunner().invoke(app, base).output
    bad = CliRunner().invoke(app, base + ["--family-samples", "chartqa=1"])
    assert bad.exit_code == 2 and "motion" in bad.output and "Traceback" not in bad.output, bad.output
    rows = {json.loads(line)["uid"]: json.loads(line)["answer_ids"] for line in out.read_text().splitlines()}
    assert set(rows) == {f"{f}-train-{i}" for f in ("motion", "order") for i in range(2)}
    for clip in (make_video_sample("order", "train", 1), make_video_sample("motion", "train", 0)):
        assert rows[clip.uid] == lone_answer(model, proc, clip, 6)
    seqs = world_video_sequences(model, proc, ["motion", "order"], 2, 0, answers=out)
    vid, n_frames, per_frame = clip_layout(model)
    for seq, (f, i) in zip(seqs, [("motion", 0), ("order", 0), ("motion", 1), ("order", 1)], strict=True):
        prompt = clip_inputs(make_video_sample(f, "train", i), proc.tokenizer, proc.image_processor, vid, n_frames,
                             per_frame)["input_ids"]
        assert seq.input_ids.tolist() == prompt.tolist() + rows[f"{f}-train-{i}"]
    with pytest.raises(MMSpecError, match="lacks 2 of the 6 training samples"):  # the fix is named after it
        world_video_sequences(model, proc, ["motion", "order"], 3, 0, answers=out)
