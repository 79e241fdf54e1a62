"""MMSpec in the bench (``-d mmspec=PATH[:SPLIT]``): a small split written here in MMSpec's exact
schema (``mmspec.jsonl`` rows ``id``, ``image`` under ``images/``, ``turns``, ``category``,
``topic``; the world's images), read as published; every turn asked after the target's own answers
and checked against the target's own greedy output (tiny float64 LLaVA models), MAT per category,
the prefix cache's reuse on turns 2+, the batched pass by turn, bad rows, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.bench_data import FakeBackend, read_jsonl
from mmspec.bench.backend import BenchModels, HFBackend
from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo
from mmspec.bench.datasets import load_dataset
from mmspec.bench.mmspec_report import mmspec_metrics
from mmspec.bench.report import render_report
from mmspec.bench.runner import BenchInterrupted, run_bench
from mmspec.errors import MMSpecError
from mmspec.prompt import llava_chat
from mmspec.world import make_sample

# (id, world family, topic, category, turns): two categories, 2-3 turns, as MMSpec's rows put them
GOOD = [("img_000001", "vqav2", "general vqa", "Cattle in a field", 2),
        ("img_000002", "chartqa", "chart understanding", "Bar chart", 3),
        ("img_000003", "vqav2", "general vqa", "Shapes", 3),
        ("img_000004", "chartqa", "chart understanding", "Line of bars", 2)]


def write_split(root: Path, split: str = "test", bad: bool = False) -> Path:
    """``root/{split}/mmspec.jsonl`` + ``images/``; with ``bad``, three bad rows among the good ones."""
    folder = root / split
    lines = []
    for k, (uid, family, topic, category, n_turns) in enumerate(GOOD):
        s = make_sample(family, "test", k)
        rel = f"{topic.replace(' ', '_')}/{uid}.png"
        (folder / "images" / rel).parent.mkdir(parents=True, exist_ok=True)
        s.images[0].save(folder / "images" / rel)
        turns = [s.question, "What else is in the image?", "Describe the image."][:n_turns]
        lines.append({"id": uid, "image": rel, "turns": turns, "category": category, "topic": topic})
        if bad and k == 1:
            lines += [{"id": "gone", "image": "general_vqa/gone.png", "turns": ["Q?"], "category": "x", "topic": "general vqa"},
                      {"id": "noturns", "image": rel, "category": "x", "topic": "general vqa"},
                      {"id": "escape", "image": "../x.png", "turns": ["Q?"], "category": "x", "topic": "general vqa"},
                      {"id": "absolute", "image": str((folder / "images" / rel).resolve()), "turns": ["Q?"],
                       "category": "x", "topic": "general vqa"}]
    (folder / "mmspec.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def tiny_models() -> BenchModels:
    from transformers import CLIPImageProcessor, LlavaProcessor

    from helpers.tiny import make_llava, make_tokenizer, noisy_copy

    tok = make_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"height": 32, "width": 32},
                                                             crop_size={"height": 32, "width": 32}),
                          tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token="<image>")
    target = make_llava(0)  # float64: no greedy argmax on a near-tie
    return BenchModels(target, noisy_copy(target, 1), tok, proc, source="tiny-random")


def test_split_read_as_published_bad_rows_named_the_rest_goes_on(tmp_path):
    root = write_split(tmp_path / "MMSpec", bad=True)
    samples, report = load_dataset("mmspec", root, 100)  # the default split: test
    assert [s.uid for s in samples] == [g[0] for g in GOOD]
    assert [s.dataset for s in samples] == ["mmspec/general_vqa", "mmspec/chart_vqa"] * 2  # topic names the task
    assert samples[1].questions[0] == make_sample("chartqa", "test", 1).question and len(samples[1].questions) == 3
    assert samples[0].prompt == llava_chat(samples[0].questions[:1], ()) and samples[0].turn == 1
    assert report.skipped == {"image not found": 1, "no turns": 1, "image path outside images/": 2}
    file = root / "test" / "mmspec.jsonl"
    gone, noturns, escape, absolute = report.errors
    assert gone.startswith(f"{file}:3 (id 'gone'): image file 'general_vqa/gone.png' not found")
    assert noturns.startswith(f"{file}:4 (id 'noturns'): no 'turns'")
    assert escape.startswith(f"{file}:5 (id 'escape'): image path '../x.png' leaves the split's images/ folder")
    assert absolute.startswith(f"{file}:6 (id 'absolute'): image path '/") and "leaves" in absolute
    few, _ = load_dataset("mmspec", root, 1)  # -n counts per category
    assert [s.uid for s in few] == ["img_000001", "img_000002"]
    nxt = samples[1].next_turn(" Forty. ")
    assert (nxt.uid, nxt.turn, nxt.answers) == ("img_000002/t2", 2, ("Forty.",))
    assert nxt.prompt == llava_chat(samples[1].questions[:2], ("Forty.",)) and nxt.images == samples[1].images
    assert nxt.next_turn("x").uid == "img_000002/t3" and not nxt.next_turn("x").has_next


def test_missing_split_or_path_is_refused_before_anything_is_made(tmp_path):
    root = write_split(tmp_path / "MMSpec", split="testmini")
    assert [s.uid for s in load_dataset("mmspec", root, 9, "testmini")[0]] == [g[0] for g in GOOD]
    with pytest.raises(MMSpecError, match=r"has no MMSpec split 'test'.*its splits: testmini.*-d mmspec=.*:SPLIT"):
        load_dataset("mmspec", root, 9)
    assert load_dataset("mmspec", root / "testmini", 9)[0]  # a split's own folder
    out = tmp_path / "out"
    for spec in (f"mmspec={root}", f"mmspec={tmp_path / 'nowhere'}:test", "mmspec"):
        cfg = BenchConfig(out_dir=out, methods=("M",), datasets=(DatasetSpec.parse(spec),), progress=False, latency=False)
        with pytest.raises(MMSpecError, match="MMSpec|mmspec"):
            run_bench(cfg, backend=FakeBackend(), rank=RankInfo())
        assert not out.exists()
    bad = tmp_path / "bad" / "test"
    bad.mkdir(parents=True)
    (bad / "mmspec.jsonl").write_text('{"id": "a", "image": "../a.png", "turns": ["Q?"]}\n')
    with pytest.raises(MMSpecError, match=r"no usable MMSpec rows.*first: .*mmspec.jsonl:1 \(id 'a'\)"):
        load_dataset("mmspec", tmp_path / "bad", 9)


def test_protocol_defaults_and_what_the_fingerprint_keeps():
    cfg = BenchConfig(methods=("M",), datasets=(DatasetSpec("mmspec", Path("x")), DatasetSpec("chartqa")))
    assert cfg.new_tokens_for("mmspec/general_vqa") == 1024 and cfg.new_tokens_for("chartqa") == 128
    assert cfg.result_values()["protocol_new_tokens"] == {"mmspec": 1024}
    set64 = BenchConfig(methods=("M",), max_new_tokens=64, datasets=cfg.datasets)
    assert set64.new_tokens_for("mmspec/text_vqa") == 64 and "protocol_new_tokens" not in set64.result_values()
    plain = BenchConfig(methods=("M",))  # no MMSpec: the fingerprint of the old default (128) is kept
    assert plain.fingerprint() == BenchConfig(methods=("M",), max_new_tokens=128).fingerprint()
    be = HFBackend(tiny_models(), cfg, torch.device("cpu"))  # the tiny target: 1,024 positions
    s = load_dataset("conversation", None, 1)[0][0]
    s.dataset = "mmspec/general_vqa"
    assert be.new_tokens(s, 100) == 1024 - 100 - 64 and be.new_tokens(s, 10_000) == 1
    assert HFBackend(tiny_models(), set64, torch.device("cpu")).new_tokens(s, 10_000) == 64  # never cut


def _run(tmp_path, methods=("M", "lookup"), **kw) -> tuple[BenchConfig, list[dict]]:
    root = write_split(tmp_path / "MMSpec")
    cfg = BenchConfig(out_dir=tmp_path / "out", methods=methods, datasets=(DatasetSpec.parse(f"mmspec={root}"),),
                      n_samples=2, max_new_tokens=6, progress=False, latency=False, **kw)
    run_bench(cfg, backend=HFBackend(tiny_models(), cfg, torch.device("cpu")), rank=RankInfo())
    return cfg, read_jsonl(cfg.out_dir / "results.rank0.jsonl")


def test_every_turn_is_the_targets_own_after_its_own_answers(tmp_path):
    cfg, rows = _run(tmp_path, methods=("M", "M+tree", "lookup"))
    base = {r["uid"]: r for r in rows if r["kind"] == "baseline"}
    assert sorted(base) == sorted(["img_000001", "img_000001/t2", "img_000002", "img_000002/t2", "img_000002/t3",
                                   "img_000003", "img_000003/t2", "img_000003/t3", "img_000004", "img_000004/t2"])
    questions = {r["id"]: r["turns"] for r in map(json.loads, (tmp_path / "MMSpec/test/mmspec.jsonl").open())}
    t3 = base["img_000002/t3"]  # asked after the target's own answers to turns 1 and 2
    answers = (base["img_000002"]["text"].strip(), base["img_000002/t2"]["text"].strip())
    assert t3["prompt"] == llava_chat(questions["img_000002"], answers) and t3["turn"] == 3
    spec = [r for r in rows if r["kind"] == "spec"]
    assert len(spec) == 3 * len(base) and all(r["identical"] for r in spec)  # every turn: the target's own
    later = [r for r in spec if r["turn"] > 1 and r["method"] == "M"]
    assert all(r["stats"]["prompt_tokens_reused"] > 0 for r in later)  # the earlier turns came from the cache
    m = mmspec_metrics(rows)
    assert m["categories"] == ["general_vqa", "chart_vqa"]
    overall = m["cells"]["M"]["overall"]
    assert overall["identical"] == overall["checked"] == 10 and overall["samples"] == 4
    assert 0 < overall["reused_share"] <= 1 and 1 <= overall["mat"] <= cfg.gamma + 1
    tokens = sum(b["n_emitted"] for r in spec if r["method"] == "M" for b in r["stats"]["blocks"])
    blocks = sum(len(r["stats"]["blocks"]) for r in spec if r["method"] == "M")
    assert overall["mat"] == pytest.approx(tokens / blocks)  # MAT = τ, pooled over every turn
    text = render_report(cfg.out_dir).read_text()
    assert "## MMSpec" in text and "| M | " in text and "VIOLATED" not in text
    assert "mmspec/general_vqa (MMSpec)" in text and "Avg MMSpec" in text  # beside the IbED layout, a group apart
    assert "## Conversations" not in text  # MMSpec's turns are in its own section
    assert (cfg.out_dir / "upset_mmspec_general_vqa.png").is_file()  # a category's plot: no "/" in its file name


def test_batched_pass_by_turn_with_its_own_cache(tmp_path):
    cfg, rows = _run(tmp_path, methods=("M",), batch_sizes=(1, 2))
    outs = [r for r in rows if r["kind"] == "batch_out" and r["batch_size"] == 2]
    by_batch: dict[int, set[int]] = {}
    for r in outs:
        by_batch.setdefault(r["batch_index"], set()).add(r["turn"])
    assert all(len(t) == 1 for t in by_batch.values())  # a batch never mixes turns
    assert [min(t) for _, t in sorted(by_batch.items())] == [1, 1, 2, 2, 3]  # 4 turn-1s, 4 turn-2s, 2 turn-3s
    assert all(r["identical_to_solo"] for r in outs if r["method"] == "M")
    first = [r for r in outs if r["method"] == "M" and r["turn"] == 1]
    assert all(r["stats"]["prompt_tokens_reused"] < r["input_len"] // 2 for r in first)  # not the B = 1 pass's cache
    assert any(r["stats"]["prompt_tokens_reused"] > 0 for r in outs if r["method"] == "M" and r["turn"] > 1)
    text = render_report(cfg.out_dir).read_text()
    assert "| M | " in text and "B = 2" in text
    be = HFBackend(tiny_models(), cfg, torch.device("cpu"))
    be.begin_pass(1)
    b1 = be._decoder("M", reuse=True)
    be.begin_pass(2)  # a new pass: its own decoder, the last pass's dropped with its cache
    assert be._decoder("M", reuse=True) is not b1 and not any(k.endswith("\0b1") for k in be._decoders)


def test_interrupted_run_resumes_every_turn(tmp_path):
    root = write_split(tmp_path / "MMSpec")
    cfg = BenchConfig(out_dir=tmp_path / "out", methods=("M",), datasets=(DatasetSpec.parse(f"mmspec={root}"),),
                      progress=False, latency=False)
    with pytest.raises(BenchInterrupted):
        run_bench(cfg, backend=FakeBackend(fail_after=5), rank=RankInfo())
    kept = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    assert [r["uid"] for r in kept] == ["img_000001", "img_000001", "img_000001/t2", "img_000001/t2", "img_000002"]
    explicit = BenchConfig(**{**cfg.__dict__, "max_new_tokens": 1024})  # the same limit, said: other results
    with pytest.raises(MMSpecError, match=r"protocol_new_tokens: \{'mmspec': 1024\} there, None now"):
        run_bench(explicit, backend=FakeBackend(), rank=RankInfo())
    again = run_bench(cfg, backend=FakeBackend(), rank=RankInfo())
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    assert again.skipped == 5 and len(rows) == 2 * 10 and len({(r["kind"], r["uid"]) for r in rows}) == 20
    assert {r["uid"] for r in rows} >= {"img_000002/t3", "img_000003/t3", "img_000004/t2"}


def test_a_checkpoints_chat_template_renders_the_history(tmp_path):
    """A processor with a chat template (a real checkpoint's) renders every turn through it: the images
    in the first user turn, the target's answers as assistant turns; without one, LLaVA-1.5's format."""
    models = tiny_models()
    be = HFBackend(models, BenchConfig(methods=("M",)), torch.device("cpu"))
    s = load_dataset("mmspec", write_split(tmp_path / "MMSpec"), 1)[0][1]
    t2 = s.next_turn("Forty.")
    assert be.prompt(t2) == t2.prompt == llava_chat(s.questions[:2], ("Forty.",))
    models.processor.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert be.prompt(t2) == f"<|user|><image>{s.questions[0]}<|assistant|>Forty.<|user|>{s.questions[1]}<|assistant|>"
    assert be._inputs(t2)["input_ids"].shape[1] > 0  # the processor reads the rendered prompt


def test_report_puts_b1_from_the_one_at_a_time_rows_beside_the_batched_ones():
    from mmspec.bench.mmspec_report import mmspec_section
    from mmspec.stats import BlockRecord, GenerationStats

    def spec(uid, turn, wall, reused):
        st = GenerationStats(gamma=5, views=("M",), blocks=[BlockRecord(5, 2, 3), BlockRecord(5, 0, 1)],
                             prompt_tokens_reused=reused)
        return {"kind": "spec", "dataset": "mmspec/text_vqa", "uid": uid, "method": "M", "turn": turn,
                "input_len": 40, "token_ids": [1, 2, 3, 4], "wall_s": wall, "stats": st.to_dict()}

    rows = [{"kind": "baseline", "dataset": "mmspec/text_vqa", "uid": u, "method": "", "token_ids": [1, 2, 3, 4],
             "wall_s": 1.0, "turn": t} for u, t in (("a", 1), ("a/t2", 2))]
    rows += [spec("a", 1, 0.5, 0), spec("a/t2", 2, 0.5, 30)]
    rows += [{"kind": "batch", "dataset": "mmspec", "uid": "b8/0", "method": who, "batch_size": 8, "new_tokens": 80,
              "wall_s": wall, "latency_s": [wall]} for who, wall in (("target", 2.0), ("M", 1.0))]
    text = "\n".join(mmspec_section(rows))
    assert "| M | 2.00 / 2.00x | 2.00 / 2.00x |" in text  # MAT (4 tokens / 2 blocks) / speed-up, then overall
    assert "| M | 1 | 2 | 2/2 | 1 | 40 | 30 | 75.0% |" in text  # the turn-2+ reuse share
    assert "| Method | B = 1 (one at a time) | B = 8 |" in text and "| M | 2.00x (τ 2.00; 2/2) | 2.00x" in text
