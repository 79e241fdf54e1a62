"""Benchmark loaders on parquet fixtures written in the lmms-lab schemas and hub snapshot
layouts: which split is read, the prompts lmms-eval and the IbED authors' code build for a
llava-hf LLaVA-1.5 target, and the interleave bench read row group by row group."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.bench_data import (
    CHARTQA,
    HALLUSION,
    INTERLEAVE_ROWS,
    TEXTVQA,
    chartqa_rows,
    color_of,
    hallusion_rows,
    interleave_rows,
    textvqa_rows,
    write_chartqa,
    write_hallusion,
    write_interleave,
    write_rows,
    write_snapshot,
)
from mmspec.bench.config import BenchConfig, DatasetSpec, method_views
from mmspec.bench.datasets import load_dataset, load_real
from mmspec.errors import MMSpecError

INSTRUCTION = "For the following question, provide a detailed explanation of your reasoning leading to the answer."


def _textvqa_snapshot(root):
    """lmms-lab/textvqa as snapshot_download leaves it: train in two shards, validation, and an
    unlabelled test split, side by side in data/."""
    return write_snapshot(root, {"train": [textvqa_rows("train", range(0, 3)), textvqa_rows("train", range(3, 5))],
                                 "validation": [textvqa_rows("validation", range(100, 104))],
                                 "test": [textvqa_rows("test", range(200, 204))]}, TEXTVQA)


# --------------------------------------------------------------------------- splits
def test_snapshot_reads_only_the_default_split(tmp_path):
    samples, _ = load_real("textvqa", _textvqa_snapshot(tmp_path / "textvqa"), n=10)
    assert [s.uid for s in samples] == ["100", "101", "102", "103"]  # validation only: no test rows mixed in
    assert [s.reference for s in samples] == ["word100", "word101", "word102", "word103"]


def test_asked_split_reads_all_its_shards_in_order(tmp_path):
    root = _textvqa_snapshot(tmp_path / "textvqa")
    samples, _ = load_real("textvqa", root, n=10, split="train")
    assert [s.uid for s in samples] == ["0", "1", "2", "3", "4"]
    assert [s.uid for s in load_real("textvqa", root, n=2, split="test")[0]] == ["200", "201"]


def test_each_benchmark_has_its_own_default_split(tmp_path):
    # VQAv2 validation (its test split has no answers), ChartQA test, HallusionBench image
    write_snapshot(tmp_path / "vqa", {"validation": [textvqa_rows("validation", range(7, 9))],
                                      "test": [textvqa_rows("test", range(1, 3))]}, TEXTVQA)
    assert [s.uid for s in load_real("vqav2", tmp_path / "vqa", n=5)[0]] == ["7", "8"]
    write_snapshot(tmp_path / "chart", {"test": [chartqa_rows(2)], "train": [chartqa_rows(3, start=50)]}, CHARTQA)
    assert [s.reference for s in load_real("chartqa", tmp_path / "chart", n=5)[0]] == ["0", "1"]
    write_snapshot(tmp_path / "hb", {"image": [hallusion_rows("image")], "non_image": [hallusion_rows("non_image")]},
                   HALLUSION)
    samples, report = load_real("hallusionbench", tmp_path / "hb", n=10)
    assert len(samples) == 4 and not report.skipped  # the non_image split's rows are not read
    with pytest.raises(MMSpecError, match=r"no usable hallusionbench samples \(skipped: \{'no image"):
        load_real("hallusionbench", tmp_path / "hb", n=10, split="non_image")


def test_parquet_converter_layout_split_folders(tmp_path):
    """The hub's refs/convert/parquet layout names the split by folder: default/image/0000.parquet."""
    write_rows(tmp_path / "hb" / "default" / "image" / "0000.parquet", hallusion_rows("image"), HALLUSION)
    write_rows(tmp_path / "hb" / "default" / "non_image" / "0000.parquet", hallusion_rows("non_image"), HALLUSION)
    samples, report = load_real("hallusionbench", tmp_path / "hb", n=10)
    assert len(samples) == 4 and not report.skipped


def test_missing_split_lists_the_splits_there_are(tmp_path):
    root = _textvqa_snapshot(tmp_path / "textvqa")
    with pytest.raises(MMSpecError) as e:
        load_real("textvqa", root, n=1, split="val")
    msg = str(e.value)
    assert "no parquet files of split 'val'" in msg and "its splits: test, train, validation" in msg
    assert f"--dataset textvqa={root}:SPLIT" in msg


def test_single_file_is_read_as_given(tmp_path):
    path = write_chartqa(tmp_path / "chartqa.parquet", n=4)
    samples, report = load_real("chartqa", path, n=3, split="validation")  # a file is the choice: no split applies
    assert [s.reference for s in samples] == ["0", "1", "2"] and not report.skipped
    assert samples[0].images[0].mode == "RGB" and samples[0].images[0].size == (16, 16)


def test_save_to_disk_dataset_dict_split(tmp_path):
    import datasets  # in the test extra: the save_to_disk path must not silently skip

    def ds(rows):
        return datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())

    saved = tmp_path / "saved"
    datasets.DatasetDict({"validation": ds(textvqa_rows("validation", range(100, 102))),
                          "test": ds(textvqa_rows("test", range(200, 202)))}).save_to_disk(str(saved))
    samples, _ = load_real("textvqa", saved, n=5)
    assert [s.uid for s in samples] == ["100", "101"] and samples[1].images[0].size == (16, 16)
    assert [s.uid for s in load_real("textvqa", saved, n=5, split="test")[0]] == ["200", "201"]
    with pytest.raises(MMSpecError, match="has no split 'train' for textvqa; its splits: validation, test"):
        load_real("textvqa", saved, n=5, split="train")


# --------------------------------------------------------------------------- single-image prompts
def test_single_image_prompt_is_the_llava_hf_chat_template(tmp_path):
    """llava-hf renders the image part as "<image>\\n" and the text part (instruction, newline,
    question) followed by a space: newlines where the Appendix C string has spaces."""
    samples, _ = load_real("chartqa", write_chartqa(tmp_path / "c.parquet", n=1), n=1)
    assert samples[0].prompt == f"USER: <image>\n{INSTRUCTION}\nWhat is the value of bar 0? ASSISTANT:"


def test_single_image_question_is_not_stripped(tmp_path):
    rows = [{**chartqa_rows(1)[0], "question": "  Which bar is tallest?\n"}]
    (s,), _ = load_real("chartqa", write_rows(tmp_path / "c.parquet", rows, CHARTQA), n=1)
    assert s.prompt == f"USER: <image>\n{INSTRUCTION}\n  Which bar is tallest?\n ASSISTANT:"


def test_embedded_world_keeps_its_appendix_c_prompts():
    """The shipped embedded models were trained on the spaced template: it must not change."""
    pytest.importorskip("mmspec.world")
    (s,), _ = load_dataset("chartqa", None, 1)
    assert s.prompt.startswith(f"USER: <image> {INSTRUCTION} ") and "\n" not in s.prompt
    samples, _ = load_dataset("vist", None, 2)
    assert samples[0].n_images == 5 == samples[0].prompt.count("<image>") and "Caption #4:" in samples[0].prompt
    assert samples[0].uid != samples[1].uid and samples[0].reference


def test_hallusionbench_skips_null_images_and_names_samples_by_full_key(tmp_path):
    samples, report = load_real("hallusionbench", write_hallusion(tmp_path / "h.parquet"), n=10)
    assert [s.uid for s in samples] == ["VD/illusion/0/0/0", "VS/chart/1/0/0", "VS/chart/1/0/1"]
    assert report.skipped == {"no image (text-only question)": 1}
    assert samples[0].reference == "no"


def test_repeated_ids_get_unique_uids(tmp_path):
    rows = textvqa_rows("validation", [5, 5, 6])
    samples, _ = load_real("textvqa", write_rows(tmp_path / "t.parquet", rows, TEXTVQA), n=5)
    assert [s.uid for s in samples] == ["5", "5@1", "6"]


# --------------------------------------------------------------------------- interleave bench
@pytest.mark.parametrize("name,task", [("spot_the_diff", "Spot-the-Diff"), ("iedit", "IEdit"),
                                       ("pororosv", "PororoSV"), ("vist", "VIST")])
def test_interleave_prompt_is_the_rows_own_question(tmp_path, name, task):
    samples, _ = load_real(name, write_interleave(tmp_path / "in_domain.parquet"), n=10)
    rows = [(q, n_img) for t, q, n_img, _ in INTERLEAVE_ROWS if t == task and q.count("<image>") == n_img]
    assert [s.prompt for s in samples] == [f"USER: {q} ASSISTANT:" for q, _ in rows]
    for s, (_q, n_img) in zip(samples, rows):
        assert s.n_images == n_img == s.prompt.count("<image>")
        assert [im.getpixel((0, 0)) for im in s.images] == [color_of(k) for k in range(n_img)]


def test_interleave_vist_rows_take_as_many_images_as_markers(tmp_path):
    samples, report = load_real("vist", write_interleave(tmp_path / "in_domain.parquet"), n=10)
    assert [s.n_images for s in samples] == [3, 5]
    assert [s.uid for s in samples] == ["5", "6"] and samples[0].reference == "answer 5"
    assert samples[0].prompt.endswith("<image> Caption#3: ASSISTANT:")  # no Caption #4/#5 forced in
    assert report.skipped == {"4 image(s) but 3 <image> marker(s) in the question": 1}


def test_interleave_rows_vary_per_row(tmp_path):
    samples, _ = load_real("iedit", write_interleave(tmp_path / "in_domain.parquet"), n=10)
    assert len(samples) == 2 and samples[0].prompt != samples[1].prompt
    assert samples[1].prompt.startswith("USER: <image><image>\nHow would the first picture")


def test_interleave_picks_rows_on_sub_task_before_reading_images(tmp_path, monkeypatch):
    """Row groups without the task are never read past their sub_task column, and the other
    tasks' image bytes in a group that is read are never decoded (here they are not images)."""
    rows = interleave_rows()
    for r in rows:
        if r["sub_task"] != "VIST":
            r.update({k: {"bytes": b"not an image", "path": "x.png"} for k in r if k.startswith("image_")
                      and r[k] is not None})
    path = write_interleave(tmp_path / "in_domain.parquet", rows, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 4
    groups_read = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **kw):
        groups_read.extend(kw.get("row_groups") or ["all"])
        return real(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    samples, _ = load_real("vist", path, n=10)  # VIST rows 5, 6, 7: groups 2 and 3
    assert [s.uid for s in samples] == ["5", "6"] and groups_read == [2, 3]
    groups_read.clear()
    load_real("vist", path, n=1)  # stops after the first sample: group 3 is not read
    assert groups_read == [2]


def test_interleave_snapshot_root_reads_in_domain(tmp_path):
    root = tmp_path / "LLaVA-NeXT-Interleave-Bench"
    write_interleave(root / "in_domain" / "test-00000-of-00001.parquet")
    other = interleave_rows([("VIST", "<image> Another config's story:", 1, "open-ended")], first_id=900)
    write_interleave(root / "multi_view_in_domain" / "test-00000-of-00001.parquet", other)
    samples, _ = load_real("vist", root, n=10)
    assert [s.uid for s in samples] == ["5", "6"]


def test_interleave_list_image_column_and_conversations(tmp_path):
    from helpers.bench_data import png_bytes

    img = {"bytes": png_bytes((1, 2, 3)), "path": "a.png"}
    question = "<image> Caption#1: a. <image> Caption#2: b. <image> Caption#3:"
    conv = [{"from": "human", "value": question}, {"from": "gpt", "value": "c"}]
    path = tmp_path / "il.parquet"
    pq.write_table(pa.table({"sample_id": [7], "sub_task": ["PororoSV"], "conversations": [conv],
                             "image": [[img] * 3]}), path)
    (s,), _ = load_real("pororosv", path, n=1)
    assert s.uid == "7" and s.n_images == 3 and s.prompt == f"USER: {question} ASSISTANT:"


# --------------------------------------------------------------------------- errors and plumbing
def test_missing_path_is_clear(tmp_path):
    with pytest.raises(MMSpecError, match="does not exist"):
        load_real("chartqa", tmp_path / "nope.parquet", n=1)


def test_missing_column_names_file_column_and_schema(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"query": ["q"], "image": [{"bytes": b"", "path": ""}]}), path)
    with pytest.raises(MMSpecError) as e:
        load_real("vqav2", path, n=1)
    msg = str(e.value)
    assert "bad.parquet" in msg and "'question'" in msg and "struct{bytes" in msg


def test_interleave_missing_images_column(tmp_path):
    path = tmp_path / "il.parquet"
    pq.write_table(pa.table({"sub_task": ["IEdit"], "question": ["q"]}), path)
    with pytest.raises(MMSpecError, match="image_0"):
        load_real("iedit", path, n=1)


def test_unknown_names():
    with pytest.raises(MMSpecError, match="unknown dataset"):
        load_dataset("mmmu", None, 1)
    with pytest.raises(MMSpecError, match="unknown benchmark"):
        load_dataset("mmmu", "/anywhere", 1)
    with pytest.raises(MMSpecError, match="unknown method"):
        method_views("MX")
    assert method_views("MTCP") == ("M", "T", "C", "P")
    assert method_views("multimodal+pooled:36") == ("multimodal", "pooled:36")


def test_dataset_spec_parses_path_and_split():
    assert DatasetSpec.parse("ChartQA=/x/y.parquet") == DatasetSpec("chartqa", Path("/x/y.parquet"))
    spec = DatasetSpec.parse("textvqa=/data/textvqa:train")
    assert (spec.name, str(spec.path), spec.split) == ("textvqa", "/data/textvqa", "train")
    assert spec.label() == "textvqa=/data/textvqa:train"
    assert DatasetSpec.parse("hallusionbench=/d/hb:non_image").split == "non_image"
    assert DatasetSpec.parse("vist=/d/a:b/c").split is None  # a colon inside the path is no split
    assert DatasetSpec.parse("vist").path is None
    with pytest.raises(MMSpecError, match="NAME=PATH:SPLIT"):
        DatasetSpec.parse("vist=")


def test_unset_split_keeps_old_results_directories_resumable(tmp_path):
    assert BenchConfig(out_dir=tmp_path).fingerprint() == BenchConfig(out_dir=tmp_path, split="test").fingerprint()
    assert BenchConfig(out_dir=tmp_path).fingerprint() != BenchConfig(out_dir=tmp_path, split="val").fingerprint()


def test_runner_reads_each_datasets_split(tmp_path):
    from helpers.bench_data import FakeBackend, read_jsonl
    from mmspec.bench.config import RankInfo
    from mmspec.bench.runner import run_bench

    root = _textvqa_snapshot(tmp_path / "textvqa")
    cfg = BenchConfig(out_dir=tmp_path / "out", methods=("M",), n_samples=2, progress=False, latency=False,
                      datasets=(DatasetSpec("textvqa", root), DatasetSpec("vqav2", root, "train")))
    run_bench(cfg, backend=FakeBackend(), rank=RankInfo())
    rows = [r for r in read_jsonl(cfg.out_dir / "results.rank0.jsonl") if r["kind"] == "baseline"]
    assert [(r["dataset"], r["uid"]) for r in rows] == [("textvqa", "100"), ("textvqa", "101"),
                                                         ("vqav2", "0"), ("vqav2", "1")]
    assert rows[0]["prompt"].startswith("USER: <image>\nFor the following question")


def _run_cli(tmp_path, *dataset):
    from typer.testing import CliRunner

    from mmspec.cli.bench import bench_app

    args = ["run", "--out", str(tmp_path / "o"), "--no-progress", "--no-latency", "-m", "M", "-n", "1",
            "--backend", "helpers.bench_data:make_fake_backend"]
    for d in dataset:
        args += ["--dataset", d]
    return CliRunner().invoke(bench_app, args)


def test_cli_reports_a_missing_dataset_clearly(tmp_path):
    res = _run_cli(tmp_path, f"chartqa={tmp_path / 'missing.parquet'}")
    assert res.exit_code == 2 and "missing.parquet does not exist" in res.output


def test_cli_split_suffix_and_a_missing_split(tmp_path):
    root = _textvqa_snapshot(tmp_path / "textvqa")
    res = _run_cli(tmp_path, f"textvqa={root}:train")
    assert res.exit_code == 0, res.output
    res = _run_cli(tmp_path, f"textvqa={root}:dev")
    assert res.exit_code == 2 and "no parquet files of split 'dev'" in res.output
    assert "its splits: test, train, validation" in res.output
