"""End to end on tiny random LLaVA models (real SpecDecoder, real processor, real latency probes):
2 chartqa-schema samples, baseline + M, T, MT; every greedy output must equal the target's. Also
how the bench loads models: from checkpoint dirs, and the embedded pack in the asked dtype."""

from __future__ import annotations

import pytest
import torch

from helpers.bench_data import read_jsonl, write_chartqa
from helpers.tiny import make_llava, make_tokenizer, noisy_copy, swapped_tokenizer
from mmspec.bench.backend import BenchModels, HFBackend
from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo
from mmspec.bench.report import render_report
from mmspec.bench.runner import run_bench

pytest.importorskip("mmspec.decoder")


def tiny_models() -> BenchModels:
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = make_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)  # matched before the space pre-tokenizer
    image_proc = CLIPImageProcessor(size={"height": 32, "width": 32},
                                    crop_size={"height": 32, "width": 32})
    proc = LlavaProcessor(image_processor=image_proc, tokenizer=tok, patch_size=8,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token="<image>")
    target = make_llava(0, dtype=torch.float32)
    draft = noisy_copy(target, 1)
    return BenchModels(target, draft, tok, proc, source="tiny-random")


def test_bench_end_to_end_tiny_llava(tmp_path):
    models = tiny_models()
    data = write_chartqa(tmp_path / "chartqa.parquet", n=2)
    cfg = BenchConfig(out_dir=tmp_path / "out", methods=("M", "T", "MT"), n_samples=2,
                      max_new_tokens=8, datasets=(DatasetSpec("chartqa", data),), progress=False,
                      latency_repeats=1, latency_batch_sizes=(1, 2))
    summary = run_bench(cfg, backend=HFBackend(models, cfg, torch.device("cpu")), rank=RankInfo())
    assert summary.written == 2 * 4 + 1 and summary.latency_written == 1  # + the dataset's latency row
    rows = read_jsonl(cfg.out_dir / "results.rank0.jsonl")
    spec = [r for r in rows if r["kind"] == "spec"]
    assert len(spec) == 6 and all(r["identical"] for r in spec)
    assert all(len(r["accepted"]) == len(r["token_ids"]) for r in spec)
    lat = next(r for r in rows if r["kind"] == "latency")
    assert lat["target_decode_s"] > 0 and set(lat["draft_decode_s"]) == {"1", "2"}
    text = render_report(cfg.out_dir).read_text()
    assert "100%" in text and "VIOLATED" not in text


def test_load_models_from_checkpoint_dirs(tmp_path):
    from mmspec.bench.backend import load_models
    from mmspec.errors import MMSpecError

    m = tiny_models()
    m.target.save_pretrained(tmp_path / "t")
    m.processor.save_pretrained(tmp_path / "t")
    m.draft.save_pretrained(tmp_path / "d")
    loaded = load_models(BenchConfig(target=str(tmp_path / "t"), draft=str(tmp_path / "d"), pool_tokens=4))
    assert type(loaded.target).__name__ == "LlavaForConditionalGeneration"
    assert loaded.pooled_tokens == 4 and loaded.source == "checkpoints"
    assert HFBackend(loaded, BenchConfig(), torch.device("cpu")).resolve_views("MTCP") == (
        "M", "T", "C", "pooled:4")
    with pytest.raises(MMSpecError, match="without --draft"):
        load_models(BenchConfig(target=str(tmp_path / "t")))
    # a draft saved with a tokenizer of the same size but other ids is refused before it loads
    other = swapped_tokenizer(m.tokenizer, "w5", "w6")
    other.save_pretrained(tmp_path / "d")
    with pytest.raises(MMSpecError, match="id 5 is 'w5' in the target's tokenizer but 'w6' in the draft's"):
        load_models(BenchConfig(target=str(tmp_path / "t"), draft=str(tmp_path / "d")))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_embedded_models_load_in_the_asked_dtype(dtype):
    """`bench run --dtype` reaches the embedded pack: target, draft and captioner all come in it."""
    from mmspec.bench.backend import load_models

    loaded = load_models(BenchConfig(dtype=dtype))
    want = getattr(torch, dtype)
    assert loaded.source == "embedded"
    assert loaded.target.dtype == loaded.draft.dtype == loaded.captioner.model.dtype == want


def test_sampling_baseline_samples_the_distribution_spec_samples(tmp_path):
    """With temperature > 0 the baseline is target.generate(do_sample=True) with top_k=0 and
    top_p=1 (transformers would add top_k=50), the unfiltered distribution SpecDecoder samples."""
    from mmspec.bench.datasets import load_dataset

    models = tiny_models()
    seen = {}
    real = models.target.generate

    def spy(**kw):
        seen.update(kw)
        return real(**kw)

    models.target.generate = spy
    (sample,), _ = load_dataset("chartqa", write_chartqa(tmp_path / "c.parquet", n=1), 1)
    cfg = BenchConfig(out_dir=tmp_path / "out", max_new_tokens=3, temperature=0.7, progress=False)
    HFBackend(models, cfg, torch.device("cpu")).baseline(sample)
    assert seen["do_sample"] is True and seen["temperature"] == 0.7
    assert seen["top_k"] == 0 and seen["top_p"] == 1.0
