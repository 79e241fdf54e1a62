"""The embedded video pair's whole recipe on a tiny budget: ``mmspec train video`` (a Video-LLaVA
built from the embedded image pack, fine-tuned on world clips), ``mmspec train align`` on its
draft, and ``perf/video_speed.py`` on the result (every system's output checked against the
target's greedy output). Checks code paths and files, not quality or speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmspec.cli import app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def video_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("video")
    r = CliRunner().invoke(app, ["train", "video", "--out", str(out), "--samples", "2", "--steps", "2",
                                 "--batch-size", "2", "--minutes", "0.2", "--draft-minutes", "0.1",
                                 "--eval-samples", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    return out


def test_train_video_builds_a_lossless_pair_with_a_report(video_pair):
    from transformers import VideoLlavaForConditionalGeneration

    report = json.loads((video_pair / "video_report.json").read_text())
    assert report["train_clips"] == 4 and report["target_after"]["n"] == 2
    assert set(report["target_after"]["by_family"]) == {"motion", "order"}
    assert report["provenance"]["command"] and report["target_loss"] and report["draft_loss"]
    for role in ("target", "draft"):
        m = VideoLlavaForConditionalGeneration.from_pretrained(video_pair / role)
        assert m.config.video_token_index == m.config.text_config.vocab_size - 1  # <video> appended last


def test_align_then_video_speed_on_the_pair(video_pair, tmp_path):
    enc = tmp_path / "align"
    r = CliRunner().invoke(app, ["train", "align", "--draft", str(video_pair / "draft"), "--out", str(enc),
                                 "--samples", "2", "--steps", "2", "--batch-size", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    run = subprocess.run([sys.executable, str(ROOT / "perf" / "video_speed.py"), "--pair", str(video_pair),
                          "--encoder", str(enc), "--n", "1", "--max-new-tokens", "8", "--repeats", "1",
                          "--out", str(tmp_path / "speed")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]  # 1: an output differs from the target's
    res = json.loads((tmp_path / "speed" / "video_speed.json").read_text())
    assert res["identical"], res["mismatches"]
    assert [x["system"] for x in res["rows"]] == ["target", "mmspec_M", "mmspec_T", "mmspec_E", "mmspec_TE"]
    assert res["rows"][0]["vision_s_per_clip"] > 0  # the target's tower, timed apart
    e = res["draft_encoding_s"]
    assert e["video_tower_and_projector"] > 0 and e["events_encoder_only"] > 0 and e["events_recorded_bin_encode"] > 0
    assert (tmp_path / "speed" / "video_speed.md").read_text().startswith("# Video pair")


def test_a_head_on_the_world_clips_of_the_pair(video_pair, tmp_path):
    """`train head --data world` on a Video-LLaVA target reads the world's video clips the way the
    pair was trained on them (no torchvision needed); decoding with the head is the target's output."""
    from transformers import AutoProcessor, VideoLlavaForConditionalGeneration

    from mmspec import SpecDecoder
    from mmspec.train.head import world_video_sequences
    from mmspec.world import make_video_sample
    from mmspec.world.processor import clip_inputs

    target = VideoLlavaForConditionalGeneration.from_pretrained(video_pair / "target", dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(video_pair / "target")
    seqs = world_video_sequences(target, proc, ["motion", "order"], 2, 0)
    vid = target.config.video_token_index
    assert len(seqs) == 4 and all((s.input_ids == vid).sum() == target.config.video_seq_length for s in seqs)
    assert all(not s.loss_mask[s.input_ids == vid].any() and s.loss_mask.sum() > 20 for s in seqs)
    assert seqs[0].mm["pixel_values_videos"].shape[:2] == (1, 4)

    out = tmp_path / "head"
    r = CliRunner().invoke(app, ["train", "head", "--target", str(video_pair / "target"), "--variant", "eagle3",
                                 "--data", "world", "--samples", "2", "--steps", "2", "--batch-size", "2",
                                 "--out", str(out), "--threads", "1"])
    assert r.exit_code == 0, r.output
    trained = json.loads((out / "mmspec_head.json").read_text())["trained"]
    assert trained["families"] == "motion,order"
    assert trained["held_out"]["prompts"] == 4 and trained["held_out"]["tokens"] > 0  # on the world's test clips
    r = CliRunner().invoke(app, ["train", "head", "--target", str(video_pair / "target"), "--data", "world",
                                 "--families", "chartqa", "--out", str(tmp_path / "h2")])
    assert r.exit_code != 0 and "unknown world video family 'chartqa'" in r.output

    s = make_video_sample("motion", "test", 0)
    per_frame = target.config.video_seq_length // 4
    x = clip_inputs(s, proc.tokenizer, proc.image_processor, vid, 4, per_frame)
    ids = x["input_ids"][None]
    ref = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          pixel_values_videos=x["pixel_values_videos"])[0, ids.shape[1]:].tolist()
    dec = SpecDecoder(target, str(out), proc.tokenizer, gamma=3, prefix_cache_mb=0)
    res = dec.generate(input_ids=ids, pixel_values_videos=x["pixel_values_videos"], max_new_tokens=12)
    assert res.token_ids == ref


def test_the_bench_runs_the_world_clips_on_the_pair(video_pair, tmp_path):
    """`bench run -d motion,order` on the pair: chain, tree and a head on the world's test clips, each
    greedy output checked against the target's own `generate`; per-depth acceptance in the report.
    An image target given a video family is refused naming what it needs."""
    from mmspec.bench.datasets import VIDEO_NAMES
    from mmspec.world import VIDEO_FAMILIES

    assert VIDEO_NAMES == tuple(VIDEO_FAMILIES)
    head = tmp_path / "head"
    r = CliRunner().invoke(app, ["train", "head", "--target", str(video_pair / "target"), "--variant", "eagle3",
                                 "--data", "world", "--samples", "1", "--steps", "1", "--batch-size", "2",
                                 "--eval-every-minutes", "0", "--out", str(head), "--threads", "1"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "bench"
    r = CliRunner().invoke(app, ["bench", "run", "--out", str(out), "--target", str(video_pair / "target"),
                                 "--draft", str(video_pair / "draft"), "-d", "motion,order", "-n", "1",
                                 "--max-new-tokens", "8", "-m", "M,M+tree,eagle3", "--head", f"eagle3={head}",
                                 "--no-latency", "--no-progress", "--threads", "1"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "results.rank0.jsonl").read_text().splitlines()]
    base = {x["uid"]: x["token_ids"] for x in rows if x["kind"] == "baseline"}
    spec = [x for x in rows if x["kind"] == "spec"]
    assert set(base) == {"motion-test-0", "order-test-0"} and len(spec) == 6
    assert all(x["token_ids"] == base[x["uid"]] and len(x["token_ids"]) > 0 for x in spec)
    r = CliRunner().invoke(app, ["report", str(out)])
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    assert "Acceptance rate per draft position" in report and "| motion | eagle3 |" in report
    assert "motion (video)" in report and "Avg video" in report

    r = CliRunner().invoke(app, ["bench", "run", "--out", str(tmp_path / "img"), "-d", "motion", "-n", "1",
                                 "--max-new-tokens", "4", "-m", "M", "--no-latency", "--no-progress", "--threads", "1"])
    assert r.exit_code != 0 and "needs a Video-LLaVA target" in r.output and "Traceback" not in r.output
