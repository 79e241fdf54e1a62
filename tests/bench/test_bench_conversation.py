"""Conversations in the bench (turn 2 built from the target's own turn-1 answer, τ per turn and the
turn-2 prefill in the report) and the real backend's batched calls on tiny models."""

from __future__ import annotations

import pytest
import torch

from helpers.bench_data import FakeBackend, read_jsonl, write_chartqa
from mmspec.bench.backend import Generation, HFBackend
from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo
from mmspec.bench.datasets import BenchSample, load_dataset
from mmspec.bench.report import render_report
from mmspec.bench.runner import run_bench
from mmspec.errors import MMSpecError
from mmspec.world import make_conversation


class TurnFake(FakeBackend):
    """Answers "answer of UID"; turn 2's spec rows report 30 reused prompt tokens and a smaller prefill."""

    def baseline(self, sample):
        g = super().baseline(sample)
        g.text = f"answer of {sample.uid}"
        return g

    def spec(self, sample, method):
        g = super().spec(sample, method)
        g.input_len = 40 if sample.turn == 2 else 20
        g.stats["prefill_target_s"] = 0.02 if sample.turn == 2 else 0.1
        if sample.turn == 2:
            g.stats["prompt_tokens_reused"] = 30
        return g


def test_conversation_samples_and_their_second_turn():
    samples, _ = load_dataset("conversation", None, 3)
    c = make_conversation("test", 1)
    s = samples[1]
    assert (s.uid, s.prompt, s.followup, s.turn) == (c.uid, c.prompt1, c.question2, 1)
    t2 = s.next_turn("The word is SLOW.")
    assert t2.uid == f"{c.uid}/t2" and t2.turn == 2 and t2.prompt == c.turn2_prompt("The word is SLOW.")
    assert t2.images == s.images and t2.reference == c.answer2
    with pytest.raises(MMSpecError, match="no follow-up"):
        t2.next_turn("x")
    with pytest.raises(MMSpecError, match="multi-turn family"):
        load_dataset("conversation", __import__("pathlib").Path("/tmp"), 1)
    with pytest.raises(MMSpecError, match=r"'motion' is the embedded world's video family.*-d motion \(no =PATH\)"):
        load_dataset("motion", __import__("pathlib").Path("/tmp"), 1)
    clip = load_dataset("motion", None, 1)[0][0]  # the world's: its clip rides on the sample
    assert clip.video is not None and clip.images == [] and "<video>" in clip.prompt


def test_bench_runs_turn_two_from_the_targets_answer(tmp_path):
    cfg = BenchConfig(out_dir=tmp_path / "out", methods=("M",), n_samples=2, progress=False, latency=False,
                      datasets=(DatasetSpec("conversation"),))
    run_bench(cfg, backend=TurnFake(), rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    assert [(r["kind"], r["uid"], r["turn"]) for r in rows] == [
        ("baseline", "conversation-test-0", 1), ("spec", "conversation-test-0", 1),
        ("baseline", "conversation-test-0/t2", 2), ("spec", "conversation-test-0/t2", 2),
        ("baseline", "conversation-test-1", 1), ("spec", "conversation-test-1", 1),
        ("baseline", "conversation-test-1/t2", 2), ("spec", "conversation-test-1/t2", 2)]
    c = make_conversation("test", 0)
    assert rows[2]["prompt"] == c.turn2_prompt("answer of conversation-test-0")
    text = render_report(cfg.out_dir).read_text()
    assert "## Conversations (two turns)" in text
    # τ 3 both turns; turn-2 prompt 40 tokens, 30 reused; prefill 0.1 / 0.02; fresh est. 0.1/20 x 40 = 0.2
    assert "| conversation | M | 3.00 | 3.00 | 40 | 30.0 | 0.1000 | 0.0200 | 0.2000 | 0.10 | 2/2 |" in text
    again = run_bench(cfg, backend=TurnFake(), rank=RankInfo())  # resumes: turn 2 rebuilt from the rows on disk
    assert again.written == 0 and again.skipped == 8


def tiny_models():
    from transformers import CLIPImageProcessor, LlavaProcessor

    from helpers.tiny import make_llava, make_tokenizer, noisy_copy
    from mmspec.bench.backend import BenchModels

    tok = make_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"height": 32, "width": 32},
                                                             crop_size={"height": 32, "width": 32}),
                          tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token="<image>")
    target = make_llava(0, dtype=torch.float32)
    return BenchModels(target, noisy_copy(target, 1), tok, proc, source="tiny-random")


def test_target_batch_is_left_padded_and_cut_at_eos(tmp_path):
    """The target's batched greedy generate over prompts of different lengths: each row equals that
    prompt's solo greedy output (tiny float32 models: no rounding flip), cut at its EOS; padding restored."""
    models = tiny_models()
    data = write_chartqa(tmp_path / "c.parquet", n=3)
    cfg = BenchConfig(out_dir=tmp_path / "o", methods=("M",), n_samples=3, max_new_tokens=10, progress=False)
    samples, _ = load_dataset("chartqa", data, 3)
    samples[1] = BenchSample("long", "chartqa", samples[1].prompt.replace("ASSISTANT", "w7 w8 w9 w10 ASSISTANT"),
                             samples[1].images)
    be = HFBackend(models, cfg, torch.device("cpu"))
    side = models.tokenizer.padding_side
    gens, wall = be.target_batch(samples)
    assert models.tokenizer.padding_side == side and wall > 0
    for s, g in zip(samples, gens):
        assert g.token_ids == be.baseline(s).token_ids
        assert g.wall_s == wall and 2 not in g.token_ids[:-1]
    assert len({g.input_len for g in gens}) == 2  # the longer prompt: its own length, not the padded one


def test_spec_batch_sends_one_request_per_sample(tmp_path):
    from mmspec.stats import GenerationStats

    class Res:
        def __init__(self, ids):
            self.token_ids, self.text, self.stats = ids, "t", GenerationStats(gamma=5, views=("M",))

    class Dec:
        def generate_batch(self, requests, **defaults):
            self.requests, self.defaults = requests, defaults
            return [Res([5, 6, i]) for i in range(len(requests))]

    models = tiny_models()
    data = write_chartqa(tmp_path / "c.parquet", n=2)
    cfg = BenchConfig(out_dir=tmp_path / "o", methods=("M",), n_samples=2, max_new_tokens=7, progress=False)
    samples, _ = load_dataset("chartqa", data, 2)
    be = HFBackend(models, cfg, torch.device("cpu"))
    dec = be._decoders["M"] = Dec()
    gens, _ = be.spec_batch(samples, "M")
    assert [g.token_ids for g in gens] == [[5, 6, 0], [5, 6, 1]] and all(isinstance(g, Generation) for g in gens)
    assert dec.defaults == {"temperature": 0.0, "seed": 0, "max_batch": 2, "speculate": "always"}
    assert [q["max_new_tokens"] for q in dec.requests] == [7, 7]  # each request its own limit
    be._decoders["M+auto"] = dec
    be.spec_batch(samples[:1], "M+auto")
    assert dec.defaults["speculate"] == "auto" and dec.defaults["max_batch"] == 1
    for s, q in zip(samples, dec.requests):
        assert q["input_ids"].shape[0] == 1 and q["pixel_values"].shape[0] == 1 and q["images"] == s.images


def test_conversations_decode_on_a_decoder_that_keeps_its_cache(tmp_path, monkeypatch):
    """A conversation's turns share one decoder with prefix caching on; every other prompt is timed
    from scratch (prefix_cache_mb=0 where SpecDecoder has the option)."""
    import mmspec.decoder

    made = []

    class FakeDecoder:
        def __init__(self, *a, prefix_cache_mb=None, **kw):
            made.append(prefix_cache_mb)

    monkeypatch.setattr(mmspec.decoder, "SpecDecoder", FakeDecoder)
    be = HFBackend(tiny_models(), BenchConfig(methods=("M",), progress=False), torch.device("cpu"))
    plain = be._decoder("M")
    assert be._decoder("M") is plain and made == [0]
    talk = be._decoder("M", reuse=True)
    assert talk is not plain and made == [0, None]  # None: the decoder's default budget
