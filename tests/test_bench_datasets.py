"""Benchmark loaders on small parquet fixtures written in the lmms-lab schemas."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures_bench import write_chartqa, write_hallusion, write_interleave
from mmspec.bench.config import DatasetSpec, method_views
from mmspec.bench.datasets import load_dataset, load_real, story_captions
from mmspec.errors import MMSpecError
from mmspec.prompt import TEMPLATES


def test_single_image_parquet(tmp_path):
    path = write_chartqa(tmp_path / "chartqa.parquet", n=4)
    samples, report = load_real("chartqa", path, n=3)
    assert len(samples) == 3 and not report.skipped
    s = samples[0]
    assert s.dataset == "chartqa" and s.n_images == 1 and s.reference == "0"
    assert s.prompt == TEMPLATES["chartqa"].replace("[QUESTION]", "What is the value of bar 0?")
    assert s.images[0].mode == "RGB" and s.images[0].size == (16, 16)


def test_parquet_directory_and_textvqa_template(tmp_path):
    (tmp_path / "data").mkdir()
    write_chartqa(tmp_path / "data" / "validation-00000-of-00001.parquet", n=2)
    samples, _ = load_real("textvqa", tmp_path, n=5)
    assert [s.prompt.count("<image>") for s in samples] == [1, 1]


def test_hallusionbench_skips_null_images(tmp_path):
    samples, report = load_real("hallusionbench", write_hallusion(tmp_path / "h.parquet"), n=10)
    assert [s.uid for s in samples] == ["q0", "q2"]
    assert report.skipped == {"no image (text-only question)": 1}
    assert samples[0].reference == "no"


@pytest.mark.parametrize("name,n_img", [("spot_the_diff", 2), ("iedit", 2), ("pororosv", 5), ("vist", 5)])
def test_interleave_subtasks(tmp_path, name, n_img):
    path = write_interleave(tmp_path / "interleave.parquet")
    samples, report = load_real(name, path, n=10)
    assert len(samples) == 1
    s = samples[0]
    assert s.n_images == n_img == s.prompt.count("<image>")
    assert "[CAPTION]" not in s.prompt and "[QUESTION]" not in s.prompt
    if name == "pororosv":
        assert "Caption #1: Pororo wakes up <image> Caption #2: He eats." in s.prompt
    if name == "vist":
        assert report.skipped == {"3 images, template needs 5": 1}


def test_story_captions_fallback_without_labels():
    q = "<image> a dog runs <image> it jumps <image> it sleeps <image> it wakes <image>"
    assert story_captions(q) == ["a dog runs", "it jumps", "it sleeps", "it wakes"]
    assert story_captions("<image> only one") is None


def test_save_to_disk_directory(tmp_path):
    import datasets  # in the test extra: the save_to_disk path must not silently skip
    write_chartqa(tmp_path / "c.parquet", n=2)
    ds = datasets.Dataset.from_parquet(str(tmp_path / "c.parquet"))
    ds = ds.cast_column("image", datasets.Image())
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    samples, _ = load_real("chartqa", tmp_path / "saved", n=2)
    assert len(samples) == 2 and samples[1].images[0].size == (16, 16)


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
    with pytest.raises(MMSpecError, match="unknown method"):
        method_views("MX")
    assert method_views("MTCP") == ("M", "T", "C", "P")
    assert method_views("multimodal+pooled:36") == ("multimodal", "pooled:36")
    assert DatasetSpec.parse("ChartQA=/x/y.parquet").name == "chartqa"


def test_embedded_world_family():
    pytest.importorskip("mmspec.world")
    samples, _ = load_dataset("vist", None, 2)
    assert len(samples) == 2 and samples[0].n_images == 5 == samples[0].prompt.count("<image>")
    assert samples[0].uid != samples[1].uid and samples[0].reference


def test_cli_reports_a_missing_dataset_clearly(tmp_path):
    from typer.testing import CliRunner

    from mmspec.bench.cli import bench_app

    res = CliRunner().invoke(bench_app, ["run", "--out", str(tmp_path / "o"), "--dataset",
                                         f"chartqa={tmp_path / 'missing.parquet'}", "--no-progress",
                                         "--backend", "fixtures_bench:make_fake_backend"])
    assert res.exit_code == 2 and "missing.parquet does not exist" in res.output


def test_interleave_list_image_column_and_conversations(tmp_path):
    from fixtures_bench import png_bytes

    img = {"bytes": png_bytes((1, 2, 3)), "path": "a.png"}
    conv = [{"from": "human", "value": "<image> Caption#1: a. <image> Caption#2: b. <image> "
             "Caption#3: c. <image> Caption#4: d. <image> Caption#5:"}, {"from": "gpt", "value": "e"}]
    path = tmp_path / "il.parquet"
    pq.write_table(pa.table({"sample_id": [7], "sub_task": ["PororoSV"], "conversations": [conv],
                             "image": [[img] * 5]}), path)
    (s,), _ = load_real("pororosv", path, n=1)
    assert s.uid == "7" and s.n_images == 5 and "Caption #4: d <image> Caption #5:" in s.prompt
