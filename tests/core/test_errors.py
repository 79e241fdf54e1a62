"""Each bad input gets a clear MMSpecError that names the problem and the fix."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.tiny import (
    VOCAB,
    make_llava,
    make_prompt,
    make_qwen,
    make_tokenizer,
    noisy_copy,
    qwen_inputs,
    swapped_tokenizer,
)
from mmspec import MMSpecError, SpecDecoder
from mmspec.drafting.tree import TreeSpec
from mmspec.drafting.views import parse_views
from mmspec.heads import build_head
from mmspec.inputs import frame_prompt, load_images
from mmspec.models.captioner import FixedCaptioner
from mmspec.models.substitute import build_substitute_encoder
from mmspec.substitutes import Substitute, make_substitute


def test_wrong_number_of_images(target, draft_shared, tok):
    ids, pv = make_prompt(2, 16)
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    with pytest.raises(MMSpecError, match=r"2 image slot\(s\) but 1 image\(s\)"):
        dec.generate(ids, pv[:1])
    with pytest.raises(MMSpecError, match=r"but 0 image"):
        dec.generate(ids, None)


def test_prompt_slots_vs_images():
    with pytest.raises(MMSpecError, match=r"1 <image> slot\(s\) but 2 image"):
        frame_prompt("USER: <image> what is this? ASSISTANT:", 2)
    assert frame_prompt("what is this?", 2) == "USER: <image> <image> what is this? ASSISTANT:"


def test_different_vocabularies(target, tok):
    other = make_llava(3, vocab=VOCAB + 50)
    with pytest.raises(MMSpecError, match="different vocabularies"):
        SpecDecoder(target, other, tok)


def test_tokenizer_not_the_targets(tok):
    small = make_llava(3, vocab=40)
    with pytest.raises(MMSpecError, match="tokenizer has 96 tokens"):
        SpecDecoder(small, small, tok)


def test_caption_view_without_captioner(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match="caption view needs a captioner"):
        SpecDecoder(target, draft_shared, tok, views="MTC")


def test_vision_view_with_text_only_draft(target, draft_text, tok):
    with pytest.raises(MMSpecError, match="needs a vision-language draft"):
        SpecDecoder(target, draft_text, tok, views="MT")


def test_prompt_past_context_length(tok):
    t = make_llava(0)
    t.config.text_config.max_position_embeddings = 64
    ids, pv = make_prompt(2, 16)
    with pytest.raises(MMSpecError, match="exceeds the target's context length of 64"):
        SpecDecoder(t, t, tok).generate(ids, pv, max_new_tokens=40)


def test_unreadable_and_missing_image(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png at all")
    with pytest.raises(MMSpecError, match="cannot read .*broken.png.* as an image"):
        load_images([bad])
    with pytest.raises(MMSpecError, match="image file not found"):
        load_images([tmp_path / "nope.png"])
    good = tmp_path / "ok.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(good)
    assert load_images([good])[0].size == (8, 8)


@pytest.mark.parametrize("spec,msg", [("XYZ", "unknown view"), ("pooled:abc", "pooled:N"), ("pooled:0", "whole number >= 1"), ("MM", "listed twice")])
def test_bad_view_names(spec, msg):
    with pytest.raises(MMSpecError, match=msg):
        parse_views(spec)


def test_view_spellings():
    names = lambda s: [v.name for v in parse_views(s)]
    assert names("MTCP") == ["multimodal", "text", "caption", "pooled"]
    assert names(["multimodal", "text-only", "pooled:9"]) == ["multimodal", "text", "pooled:9"]
    assert names("M,pooled:4") == ["multimodal", "pooled:4"]


def test_unreachable_pool_size(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match=r"pooled:9 is not reachable from the draft's 4x4"):
        SpecDecoder(target, draft_shared, tok, views="pooled:9")


def test_bad_weights_and_gamma(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match="one weight per view"):
        SpecDecoder(target, draft_shared, tok, views="MT", weights=[1.0])
    with pytest.raises(MMSpecError, match="gamma"):
        SpecDecoder(target, draft_shared, tok, gamma=0)


def test_batch_of_prompts_rejected(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16)
    with pytest.raises(MMSpecError, match="one prompt at a time"):
        SpecDecoder(target, draft_shared, tok).generate(ids.repeat(2, 1), pv)


def test_missing_model_path():
    with pytest.raises(MMSpecError, match="does not exist"):
        SpecDecoder("./no/such/model", "./no/such/draft", None)


def test_weighted_ensemble_still_exact(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=1)
    ref = target.generate(input_ids=ids, pixel_values=pv, do_sample=False, max_new_tokens=15)[0, ids.shape[1]:]
    dec = SpecDecoder(target, draft_shared, tok, views="MTC", weights=[3, 1, 0.5],
                      captioner=FixedCaptioner(["w9 w8"]))
    assert dec.generate(ids, pv, max_new_tokens=15).token_ids == ref.tolist()


def test_logits_processors_in_generation_config_are_refused(tok):
    t = make_llava(0)
    t.generation_config.repetition_penalty = 1.3
    with pytest.raises(MMSpecError, match="repetition_penalty"):
        SpecDecoder(t, t, tok)
    t.generation_config.repetition_penalty = 1.0
    SpecDecoder(t, t, tok)  # neutral value is fine


@pytest.mark.parametrize("args, phrase", [
    (["--captioner", "some/captioner"], "--captioner applies to --target/--draft checkpoints"),
    (["--captioner-prompt", "<CAPTION>"], "--captioner-prompt applies to --target/--draft checkpoints"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--target", "t", "--draft", "d", "--prompt", "x", "--captioner-prompt", "<CAPTION>"],
     "--captioner-prompt was given without --captioner"),
])
def test_generate_refuses_flags_the_embedded_default_would_ignore(args, phrase):
    """Without --target the embedded pack is used: a flag it cannot honour is an error, not ignored."""
    from typer.testing import CliRunner

    from mmspec.cli import app

    r = CliRunner().invoke(app, ["generate", "--max-new-tokens", "2", *args])
    assert r.exit_code == 2 and phrase in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("kw, phrase", [
    ({"captioner": "c"}, "--captioner applies to --target/--draft checkpoints"),
    ({"target": "t", "draft": "d", "captioner_prompt": "p"}, "without --captioner"),
    ({"draft": "d"}, "--draft needs --target"),
    ({"dtype": "float8"}, "unknown dtype"),
])
def test_bench_config_refuses_flags_it_would_ignore(kw, phrase, tmp_path):
    """`mmspec bench run` checks the same model flags as `generate`, before any model loads."""
    from mmspec.bench.config import BenchConfig

    with pytest.raises(MMSpecError, match=phrase):
        BenchConfig(out_dir=tmp_path, **kw)


def test_bad_sampling_options(target, draft_shared, tok):
    """Sampling options transformers would refuse or read otherwise are refused, not reinterpreted."""
    ids, pv = make_prompt(1, 16)
    dec = SpecDecoder(target, draft_shared, tok)
    for kw, msg in (({"temperature": -0.5}, "temperature must be a finite number >= 0"),
                    ({"temperature": float("nan")}, "temperature must be a finite number"),
                    ({"temperature": 1.0, "top_k": -1}, "top_k must be a whole number >= 0"),
                    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
                    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
                    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1")):
        with pytest.raises(MMSpecError, match=msg):
            dec.generate(ids, pv, **kw)
    with pytest.raises(MMSpecError, match="finite"):
        SpecDecoder(target, draft_shared, tok, views="MT", weights=[1.0, float("nan")])


def test_degenerate_prompts(target, draft_shared, tok):
    """A one-token prompt and an all-zero attention mask are refused with what to pass instead."""
    import torch

    ids, pv = make_prompt(1, 16)
    dec = SpecDecoder(target, draft_shared, tok, views="T")
    with pytest.raises(MMSpecError, match="the prompt has 1 token; .* at least 2"):
        dec.generate(ids[:, :1], None)
    with pytest.raises(MMSpecError, match="attention_mask is all zeros"):
        dec.generate(ids, pv, attention_mask=torch.zeros_like(ids))


def test_draft_prompt_past_its_context_length(tok):
    """The draft's own context limit is checked per view, naming views with fewer image tokens."""
    target = make_llava(0)
    short = make_llava(1)
    short.config.text_config.max_position_embeddings = 40
    ids, pv = make_prompt(2, 16)  # 32 image tokens + text
    with pytest.raises(MMSpecError, match="multimodal view's draft prompt .* context length of 40"):
        SpecDecoder(target, short, tok, views="M").generate(ids, pv, max_new_tokens=8)


def test_unusable_checkpoint_directories(tmp_path, target):
    """A directory that is no model, or a config without weights, gets a clear error."""
    from mmspec.models.loading import load_model

    (tmp_path / "empty").mkdir()
    with pytest.raises(MMSpecError, match="not a model directory .* save_pretrained"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(MMSpecError, match="not a model directory"):
        load_model(str(tmp_path / "odd"))
    target.config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(MMSpecError, match="could not load the weights .* model.safetensors"):
        load_model(str(tmp_path / "noweights"))


def test_embedded_pack_without_weights(tmp_path):
    import shutil

    from mmspec.embedded import default_path, load_embedded

    for role in ("target", "draft", "captioner"):
        shutil.copytree(default_path() / role, tmp_path / role, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(MMSpecError, match="target/model.safetensors is missing"):
        load_embedded(path=tmp_path)


@pytest.mark.parametrize("device, msg", [
    ("gpu", "unknown device 'gpu'"),
    ("cuda", "no CUDA GPU"),
    ("cuda:7", "CUDA GPU"),
])
def test_bad_device(device, msg):
    import torch

    from mmspec.models.loading import resolve_device

    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("this machine has a GPU")  # the CPU-only message is what is tested
    with pytest.raises(MMSpecError, match=msg):
        resolve_device(device)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("args, phrase", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--weights", "a,1", "--views", "MT"], "--weights 'a,1' is neither a comma-separated list of numbers nor adaptive"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
])
def test_generate_refuses_bad_numbers_and_devices(args, phrase):
    from typer.testing import CliRunner

    from mmspec.cli import app

    r = CliRunner().invoke(app, ["generate", "--max-new-tokens", "2", *args])
    assert r.exit_code == 2 and phrase in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


def test_demo_and_bench_refuse_zero_new_tokens(tmp_path):
    from typer.testing import CliRunner

    from mmspec.bench.config import BenchConfig
    from mmspec.cli import app

    r = CliRunner().invoke(app, ["demo", "--max-new-tokens", "0"])
    assert r.exit_code == 2 and "--max-new-tokens must be >= 1" in r.output, r.output
    with pytest.raises(MMSpecError, match=r"max_new_tokens \(--max-new-tokens\) must be >= 1"):
        BenchConfig(out_dir=tmp_path, max_new_tokens=0)
    with pytest.raises(MMSpecError, match="temperature must be a finite number >= 0"):
        BenchConfig(out_dir=tmp_path, temperature=-1.0)  # before any row is written
    with pytest.raises(MMSpecError, match=r"pool_tokens \(--pool-tokens\) must be >= 1"):
        BenchConfig(out_dir=tmp_path, pool_tokens=0)


def test_unreadable_bench_images(tmp_path):
    from mmspec.bench.datasets import to_pil
    from mmspec.bench.sources import open_rows

    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "a_dir").mkdir()
    for cell, msg in ((b"not an image", "its image bytes cannot be read as an image"),
                      ({"bytes": b"nope", "path": None}, "cannot be read as an image"),
                      (str(tmp_path / "broken.png"), "broken.png' cannot be read as an image"),
                      (str(tmp_path / "missing.png"), "missing.png' not found"),
                      ("no/such.png", "no/such.png' not found \\(a relative path is read from the directory"),
                      (str(tmp_path / "a_dir"), "a_dir' is a directory, not an image file")):
        with pytest.raises(MMSpecError, match=f"chartqa row 3: .*{msg}"):
            to_pil(cell, "chartqa row 3")
    (tmp_path / "data.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(MMSpecError, match="not a readable parquet file"):
        open_rows(tmp_path / "data.parquet", "test", "chartqa")


def test_relative_bench_image_paths_are_read_from_the_data_sets_directory(tmp_path, monkeypatch):
    """A parquet whose image cells hold relative paths loads from any working directory: the
    paths start at the data set's directory (then the working directory, as before)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from mmspec.bench.datasets import load_real

    data = tmp_path / "ChartQA"
    (data / "imgs").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(data / "imgs" / "a.png")
    rows = {"question": ["What is red?"], "answer": ["a"], "image": [{"bytes": None, "path": "imgs/a.png"}]}
    pq.write_table(pa.table(rows), data / "test.parquet")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for given in (data, data / "test.parquet"):  # a directory of parquet files, or one file
        samples, _ = load_real("chartqa", given, 1)
        assert samples[0].images[0].getpixel((0, 0)) == (200, 10, 10)
    pairs = tmp_path / "bench" / "interleave"  # the interleave bench's image_k columns take the same route
    pairs.mkdir(parents=True)
    pq.write_table(pa.table({"sub_task": ["Spot-the-Diff"], "question": ["<image> <image> What changed?"], "answer": ["x"],
                             "image_0": ["../../ChartQA/imgs/a.png"], "image_1": ["../../ChartQA/imgs/a.png"]}),
                   pairs / "in_domain.parquet")
    samples, _ = load_real("spot_the_diff", pairs / "in_domain.parquet", 1)
    assert [im.getpixel((0, 0)) for im in samples[0].images] == [(200, 10, 10)] * 2
    (elsewhere / "imgs").mkdir()
    Image.new("RGB", (8, 8), (10, 200, 10)).save(elsewhere / "imgs" / "b.png")  # only in the working directory
    pq.write_table(pa.table({**rows, "image": [{"bytes": None, "path": "imgs/b.png"}]}), data / "test.parquet")
    assert load_real("chartqa", data, 1)[0][0].images[0].getpixel((0, 0)) == (10, 200, 10)
    (data / "imgs" / "b.png").mkdir()  # a directory of that name under the data set does not shadow the file
    assert load_real("chartqa", data, 1)[0][0].images[0].getpixel((0, 0)) == (10, 200, 10)
    (data / "imgs" / "a.png").unlink()
    pq.write_table(pa.table(rows), data / "test.parquet")
    with pytest.raises(MMSpecError, match=r"imgs/a.png' not found \(a relative path is read from the data set's "
                                          r"directory, .*ChartQA, then the directory mmspec runs in"):
        load_real("chartqa", data, 1)


def test_text_only_target_is_refused(tok):
    from helpers.tiny import make_llama

    llama = make_llama(0)
    with pytest.raises(MMSpecError, match="not a vision-language model; pass an image-text-to-text"):
        SpecDecoder(llama, llama, tok)


def test_draft_without_the_added_tokens_is_accepted_and_exact():
    """A draft whose vocabulary stops before tokens added on top of the base vocabulary
    (llava-hf: <image>, <pad>) is accepted, and decoding stays lossless; one that stops inside
    the base vocabulary is refused."""
    import torch

    from helpers.tiny import make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens(["<extra_a>", "<extra_b>"], special_tokens=True)  # ids 96, 97
    target = make_llava(0, vocab=VOCAB + 2)
    draft = make_llava(1, vocab=VOCAB, hidden=32)  # scores ids 0..95 only
    ids, pv = make_prompt(1, 16, seed=2)
    ref = target.generate(input_ids=ids, pixel_values=pv, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:]
    res = SpecDecoder(target, draft, tok, views="MT").generate(ids, pv, attention_mask=torch.ones_like(ids),
                                                               max_new_tokens=12)
    assert res.token_ids == ref.tolist()
    with pytest.raises(MMSpecError, match="the draft scores only 90"):
        SpecDecoder(target, make_llava(2, vocab=90), tok)


def test_same_size_other_vocabulary(target, draft_shared, tok):
    """SpecDecoder compares the draft's own tokenizer, where given, id by id with the target's."""
    other = swapped_tokenizer(tok, "w7", "w8")
    with pytest.raises(MMSpecError, match="id 7 is 'w7' in the target's tokenizer but 'w8' in the draft's"):
        SpecDecoder(target, draft_shared, tok, draft_tokenizer=other)
    SpecDecoder(target, draft_shared, tok, draft_tokenizer=make_tokenizer())  # an equal vocabulary passes


def test_vocabulary_check_ignores_added_tokens_and_missing_tokenizers(target, draft_shared, tok, tmp_path, monkeypatch):
    """Tokens added on top of the same base vocabulary may differ (llava-hf's <image> where a
    text draft has its own special token); a weights-only draft directory has no tokenizer to
    compare, even for model types whose AutoTokenizer builds a stand-in (Qwen2: one token); an
    unreadable one is skipped with a warning, not a traceback."""
    from tokenizers import AddedToken
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmspec.models.loading import check_same_vocabulary, load_tokenizer_if_any

    alpha, beta = swapped_tokenizer(tok, "w7", "w7"), swapped_tokenizer(tok, "w7", "w7")  # tok's vocabulary
    alpha.backend_tokenizer.add_special_tokens([AddedToken("<alpha>", special=True, normalized=False)])
    beta.backend_tokenizer.add_special_tokens([AddedToken("<beta>", special=True, normalized=False)])
    assert alpha.convert_ids_to_tokens(VOCAB) == "<alpha>" and beta.convert_ids_to_tokens(VOCAB) == "<beta>"
    check_same_vocabulary(alpha, beta)  # the same id, other added tokens: accepted
    check_same_vocabulary(tok, beta)  # a token added past the target's end: accepted
    with pytest.raises(MMSpecError, match="id 7 is 'w7'"):
        check_same_vocabulary(alpha, swapped_tokenizer(tok, "w7", "w9"))

    qwen = tmp_path / "qwen"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(qwen)
    assert load_tokenizer_if_any(str(qwen)) is None
    from mmspec.models.loading import _has_tokenizer_files

    for name in ("spm.model", "spiece.model", "tokenizer.model"):  # DeBERTa-v2, T5, Llama: sentencepiece files
        (tmp_path / name).write_bytes(b"")
        assert _has_tokenizer_files(str(tmp_path))
        (tmp_path / name).unlink()
    assert not _has_tokenizer_files(str(tmp_path))
    with pytest.raises(MMSpecError, match="has no tokenizer files"):  # asked for by path: it must be there
        SpecDecoder(target, draft_shared, tok, draft_tokenizer=qwen)
    (qwen / "tokenizer.json").write_text("{not json")
    with pytest.warns(UserWarning, match="could not read the draft's tokenizer"):
        assert load_tokenizer_if_any(str(qwen)) is None
    assert load_tokenizer_if_any(str(tmp_path / "typo")) is None  # no warning: loading the weights says it
    # a hub id not in the cache, offline (CI sets HF_HUB_OFFLINE): nothing to compare, no traceback.
    # huggingface_hub reads the variable when it is imported, long before this line: set its
    # constant too, or a run without the variable spends minutes retrying a network it lacks
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert load_tokenizer_if_any("someorg/no-such-draft") is None


def _bench(*args, fake: bool = True):
    """`mmspec bench run ARGS`, by default on the fake backend of the bench tests (no models)."""
    from typer.testing import CliRunner

    from mmspec.cli.bench import bench_app

    backend = ["--backend", "helpers.bench_data:make_fake_backend"] if fake else []
    return CliRunner().invoke(bench_app, ["run", "--no-progress", *backend, *map(str, args)])


def test_bench_out_that_is_a_file_is_refused_before_anything(tmp_path):
    """--out naming a file, or a path under a file: one line, exit 2, nothing touched (was a
    FileExistsError / NotADirectoryError traceback)."""
    taken = tmp_path / "taken.txt"
    taken.write_text("mine\n")
    for out, phrase in ((taken, "is a file, not a directory"),
                        (taken / "sub", "cannot be made: '" + str(taken) + "' is a file")):
        r = _bench("--out", out, "-d", "chartqa", "-n", "1")
        assert r.exit_code == 2 and phrase in " ".join(r.output.split()), r.output  # an exception exits 1
    assert taken.read_text() == "mine\n"


@pytest.mark.parametrize("spec, phrase", [
    ("nosuch", "unknown dataset 'nosuch'"),
    ("chartqa=missing.parquet", "missing.parquet does not exist"),
    ("chartqa,vist=missing", "missing does not exist"),  # the second dataset is checked before the first runs
])
def test_bench_bad_dataset_creates_nothing(tmp_path, spec, phrase):
    """Every dataset is checked before the results directory is made: no empty results file
    that `report` would then render as empty tables."""
    out = tmp_path / "out"
    r = _bench("--out", out, "-d", spec, "-n", "1")
    assert r.exit_code == 2 and phrase in " ".join(r.output.split()), r.output
    assert not out.exists()


def test_report_refuses_a_directory_without_results(tmp_path):
    from typer.testing import CliRunner

    from helpers.bench_data import FakeBackend
    from mmspec.bench.config import BenchConfig, DatasetSpec, RankInfo
    from mmspec.bench.runner import run_bench
    from mmspec.cli.bench import bench_app

    out = tmp_path / "out"
    cfg = BenchConfig(out_dir=out, datasets=(DatasetSpec("chartqa"),), methods=("M",), n_samples=1, progress=False)
    with pytest.raises(KeyboardInterrupt):  # stopped before its first row: no (empty) results file
        run_bench(cfg, backend=FakeBackend(fail_after=0), rank=RankInfo())
    assert out.is_dir() and not (out / "results.rank0.jsonl").exists()
    r = CliRunner().invoke(bench_app, ["report", str(out)])
    assert r.exit_code == 2 and "no results.rank*.jsonl" in r.output, r.output
    (out / "results.rank0.jsonl").write_text("")  # an empty file, as older versions left
    r = CliRunner().invoke(bench_app, ["report", str(out)])
    assert r.exit_code == 2 and "holds no results" in " ".join(r.output.split()), r.output
    assert not (out / "report.md").exists()


def test_generate_refuses_an_empty_prompt():
    """--prompt "" (or only image markers) is refused before any model loads, not answered."""
    from typer.testing import CliRunner

    from mmspec.cli import app

    for prompt in ("", "   ", "<image>"):
        r = CliRunner().invoke(app, ["generate", "--prompt", prompt])
        assert r.exit_code == 2 and "has no text; say what to ask" in " ".join(r.output.split()), r.output


def _online(monkeypatch):
    """As on a user's machine: no HF_HUB_OFFLINE (CI sets it), the hub probe not yet made."""
    from huggingface_hub import constants

    from mmspec.models.loading import hub_reachable

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_reachable.cache_clear()


def test_hub_id_without_network_fails_fast_in_one_line(monkeypatch, tmp_path):
    """A hub id, no network, not in the HF cache: one line within seconds that says it is not a
    local directory and how to download it (transformers retried for 142 s, 30 lines); the same
    for `bench run`, which then creates nothing. With HF_HUB_OFFLINE set, it says so."""
    import time

    from typer.testing import CliRunner

    from helpers.tiny import block_network
    from mmspec.cli import app
    from mmspec.models.loading import hub_reachable, locate

    _online(monkeypatch)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    t0 = time.perf_counter()
    with block_network():
        r = CliRunner().invoke(app, ["generate", "--target", "llava-hf/llava-1.5-7b-hf", "--draft", "mjbooo/lvlm68m",
                                     "--prompt", "What is shown?"])
        b = _bench("--out", tmp_path / "out", "-d", "chartqa", "--target", "llava-hf/llava-1.5-7b-hf",
                   "--draft", "mjbooo/lvlm68m", fake=False)
    assert time.perf_counter() - t0 < 10
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "Retry" not in r.output and r.output.count("error:") == 1, r.output
    assert ("--target 'llava-hf/llava-1.5-7b-hf' is not a local directory, the Hugging Face hub cannot be reached "
            "from here and the Hugging Face cache has no copy; download it once where there is network "
            "(`hf download llava-hf/llava-1.5-7b-hf --local-dir DIR`") in out, out
    assert b.exit_code == 2 and "--target 'llava-hf/llava-1.5-7b-hf' is not a local directory" in " ".join(b.output.split())
    assert not (tmp_path / "out").exists()
    assert not hub_reachable()  # the one probe failed, and is not repeated
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MMSpecError, match="is not a local directory, HF_HUB_OFFLINE is set and the Hugging Face "
                                          "cache has no copy"):
        locate("llava-hf/llava-1.5-7b-hf")


def test_hub_id_in_the_hf_cache_loads_offline(monkeypatch, tmp_path, target):
    """A hub id the HF cache holds is read from its snapshot without the network, fast, whether
    or not HF_HUB_OFFLINE is set."""
    from helpers.tiny import block_network
    from mmspec.models.loading import load_model, locate

    cache = tmp_path / "hf-cache"
    snap = cache / "models--someorg--tiny-llava" / "snapshots" / ("0" * 40)
    target.save_pretrained(snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    for offline in (False, True):
        _online(monkeypatch)
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with block_network():
            assert locate("someorg/tiny-llava") == str(snap)
            model = load_model("someorg/tiny-llava", dtype="float64")
        assert type(model).__name__ == "LlavaForConditionalGeneration"


def test_model_path_that_is_a_file(tmp_path, target):
    """--target pointing at a file (config.json, a .safetensors) says "not a directory" and names
    the directory that holds the config (was: "Repo id must be in the form...")."""
    from typer.testing import CliRunner

    from mmspec.cli import app

    target.save_pretrained(tmp_path / "t")
    r = CliRunner().invoke(app, ["generate", "--target", tmp_path / "t" / "config.json", "--draft", tmp_path / "t",
                                 "--prompt", "w5"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "is a file, not a directory; pass the directory save_pretrained() wrote" in out, out
    assert f"(its directory '{tmp_path / 't'}' holds a config.json)" in out, out
    assert "Repo id" not in out


@pytest.mark.parametrize("args, phrase", [
    (["--families", "chartqa,nosuch"], "--families: unknown family 'nosuch'; use some of chartqa, textvqa"),
    (["--methods", "M,XY"], "--methods: unknown method 'XY'"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--methods", "M,MTC+tree@16"], "--methods: 'tree@16' in method 'MTC+tree@16' is the old tree@BUDGET form"),
    (["--methods", "M+tree:6x0x16"], "the top-k in tree '6x0x16' must be >= 1"),
    (["--methods", "eagle+tree"], "drafts with a trained head"),
])
def test_demo_checks_every_name_before_running(monkeypatch, args, phrase):
    """`demo --families chartqa,nosuch` ran all of chartqa before refusing nosuch: every name is
    checked before any model loads."""
    from typer.testing import CliRunner

    import mmspec.cli.demo
    from mmspec.cli import app

    monkeypatch.setattr(mmspec.cli.demo, "load_models", lambda *a: pytest.fail("models loaded before the names were checked"))
    r = CliRunner().invoke(app, ["demo", *args])
    assert r.exit_code == 2 and phrase in " ".join(r.output.split()), r.output


def test_deprecated_transformers_arguments_fail_the_core_tests(target, draft_shared, tok, monkeypatch):
    """The suite's filter (conftest.no_deprecations_in_generate) turns a deprecated argument into a
    failure: passing the cache as past_key_values= (deprecated in transformers 5.24) is caught."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("past_key_values= is deprecated from transformers 5.24 on")
    from mmspec.models.base import ModelAdapter

    dec = SpecDecoder(target, draft_shared, tok, views="M")
    assert dec.target._cache_kw == "cache"
    monkeypatch.setattr(dec.target, "_cache_kw", "past_key_values")
    ids, pv = make_prompt(1, 16, seed=1)
    with pytest.raises(AssertionError, match="deprecated API used inside SpecDecoder.generate.*past_key_values"):
        dec.generate(ids, pv, max_new_tokens=4)
    assert isinstance(dec.target, ModelAdapter)


# --------------------------------------------------------------------------- refused before decoding (issue 36)
def _head(target):
    return build_head(target, "eagle", seed=1)


@pytest.mark.parametrize("kw, msg", [(dict(views="MTC"), "a head drafts alone"), (dict(views="T"), "a head drafts alone"),
                                     (dict(weights=[1.0]), "weights= was given with a feature-level head"),
                                     (dict(captioner=FixedCaptioner(["x"])), "captioner= was given with a feature-level head")])
def test_head_with_token_level_draft_arguments(target, tok, kw, msg):
    """A head drafts alone from the target's features: views, weights, a captioner would be ignored."""
    with pytest.raises(MMSpecError, match=msg):
        SpecDecoder(target, _head(target), tok, **kw)
    assert SpecDecoder(target, _head(target), tok, views="M").method == "eagle"  # the default, spelled out: fine


@pytest.mark.parametrize("bad", [(0.5,), 0.5, (0.6, 0.4, 0.3), "ab", ("x", "y"), (0.5, float("nan"))])
def test_relaxed_thresholds_of_the_wrong_form(target, draft_shared, tok, bad):
    with pytest.raises(MMSpecError, match=r"two probabilities in \(0, 1\], \(vision, text\), e.g. \(0.6, 0.4\)"):
        SpecDecoder(target, draft_shared, tok, acceptance="relaxed", relaxed_thresholds=bad)


def test_relaxed_settings_without_relaxed_acceptance(target, draft_shared, tok):
    for kw in (dict(relaxed_thresholds=(0.9, 0.9)), dict(relaxed_window=8)):
        with pytest.raises(MMSpecError, match="pass acceptance='relaxed' with them"):
            SpecDecoder(target, draft_shared, tok, **kw)


@pytest.mark.parametrize("tree, kw, msg", [([[r] for r in range(VOCAB + 1)], {},
                                            f"child of rank {VOCAB} but the draft proposes from {VOCAB} tokens"),
                                           ([[0]] + [[0, r] for r in range(VOCAB + 4)], {}, f"use child ranks below {VOCAB}"),
                                           ("dynamic", dict(tree_topk=VOCAB + 1), f"tree_topk={VOCAB + 1} is more children")])
def test_tree_wider_than_the_vocabulary(target, draft_shared, tok, tree, kw, msg):
    with pytest.raises(MMSpecError, match=msg):
        SpecDecoder(target, draft_shared, tok, tree=tree, **kw)


@pytest.mark.parametrize("kw, names", [(dict(pixel_values_videos=torch.zeros(1, 4, 3, 32, 32)), "pixel_values_videos"),
                                       (dict(videos=[[Image.new("RGB", (8, 8))] * 2]), "videos"),
                                       (dict(substitutes=[torch.zeros(4, 2, 8, 8)]), "substitutes")])
def test_video_given_to_an_image_only_family(target, draft_shared, tok, kw, names):
    ids, pv = make_prompt(1, 16)
    dec = SpecDecoder(target, draft_shared, tok)
    with pytest.raises(MMSpecError, match=rf"{names} given, but the target \(llava, LlavaForConditionalGeneration\) "
                                          r"reads images only.*Video families: .*qwen2_vl.*video_llava"):
        dec.generate(ids, pv, max_new_tokens=4, **kw)


def _video_pair():
    target = make_qwen(0)
    return target, noisy_copy(target, 1), qwen_inputs(0, True, seed=3)


def _event_encoder(draft):
    frames = [Image.fromarray(np.full((32, 32, 3), 40 * t, dtype=np.uint8)) for t in range(6)]
    sub = make_substitute(frames, "events")
    return build_substitute_encoder("events", sub.tensor, 6, draft.config.text_config.hidden_size).double(), sub, frames


def test_substitutes_of_the_wrong_shape_kind_or_type(tok):
    target, draft, (ids, mm) = _video_pair()
    enc, sub, frames = _event_encoder(draft)
    S, C = sub.tensor.shape[:2]
    dec = SpecDecoder(target, draft, tok, views="ME", substitute=enc)
    expected = rf"the draft's substitute encoder reads \[S, C, H, W\] = \[{S}, {C}, H, W\]"
    for bad in (sub.tensor[0], sub.tensor[None], sub.tensor[:, :1], torch.zeros(S + 1, C, 8, 8)):
        with pytest.raises(MMSpecError, match=rf"substitute 0 has shape {re.escape(str(tuple(bad.shape)))}; " + expected):
            dec.generate(ids, **mm, substitutes=[bad], max_new_tokens=4)
    with pytest.raises(MMSpecError, match="substitute 0 is a list; pass Substitute objects"):
        dec.generate(ids, **mm, substitutes=[[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(MMSpecError, match="of kind 'low_fps' but the draft's substitute encoder reads 'events'"):
        dec.generate(ids, **mm, substitutes=[Substitute("low_fps", sub.tensor, ())], max_new_tokens=4)
    with pytest.raises(MMSpecError, match="takes a list, one entry per <video>"):
        dec.generate(ids, **mm, substitutes=sub, max_new_tokens=4)
    with pytest.raises(MMSpecError, match="both videos= and substitutes= were given"):
        dec.generate(ids, **mm, substitutes=[sub], videos=[frames], max_new_tokens=4)
    assert len(dec.generate(ids, **mm, substitutes=[sub], max_new_tokens=4).token_ids) == 4  # the right one decodes
    with pytest.raises(MMSpecError, match="substitute= was given but no view reads it"):
        SpecDecoder(target, draft, tok, views="M", substitute=enc)


@pytest.mark.parametrize("kw, msg", [(dict(weights=1.0), "weights must be a list of numbers"),
                                     (dict(weights=["a"]), "weights must be a list of numbers"),
                                     (dict(dtype="float16"), "dtype='float16' applies to models given as paths"),
                                     (dict(static_cache="yes"), "static_cache must be True, False or None")])
def test_more_silently_ignored_or_traceback_constructor_arguments(target, draft_shared, tok, kw, msg):
    with pytest.raises(MMSpecError, match=msg):
        SpecDecoder(target, draft_shared, tok, **kw)


@pytest.mark.parametrize("n", [2.5, "8", True])
def test_max_new_tokens_not_a_whole_number(target, draft_shared, tok, n):
    with pytest.raises(MMSpecError, match="max_new_tokens must be >= 1"):
        SpecDecoder(target, draft_shared, tok).generate(*make_prompt(1, 16), max_new_tokens=n)


@pytest.mark.parametrize("kw, argument", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=None), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0, temperature=1), "top_p"),
    (dict(top_k=-2, temperature=1), "top_k"),
])
def test_a_requests_limits_are_checked_in_one_place_naming_the_argument(kw, argument):
    """mmspec.request.decoding: the one check of a request's limits (generate's and the server's);
    the error names the argument, in the caller's words where it gives them."""
    from mmspec.errors import ArgumentError
    from mmspec.request import decoding

    with pytest.raises(ArgumentError) as e:
        decoding(**kw)
    assert e.value.argument == argument and str(e.value).startswith(argument)
    if argument == "max_new_tokens":
        with pytest.raises(ArgumentError, match="^max_tokens must be >= 1") as e:
            decoding(**kw, names={"max_new_tokens": "max_tokens"})
        assert e.value.argument == "max_tokens"
    assert decoding(max_new_tokens=None, sized_later=True).max_new_tokens is None


@pytest.mark.parametrize("kw, msg", [(dict(seed=1.5, temperature=1.0), "seed must be a whole number"),
                                     (dict(seed="7", temperature=1.0), "seed must be a whole number"),
                                     (dict(temperature="hot"), "temperature must be a number >= 0"),
                                     (dict(images=Image.new("RGB", (8, 8))), "images= takes a list of PIL images"),
                                     (dict(captions="a red square"), "captions= takes a list of strings"),
                                     (dict(captions=[3]), "captions= takes a list of strings"),
                                     (dict(logprobs=-1), "logprobs must be a whole number from 0"),
                                     (dict(logprobs=True), "logprobs must be a whole number from 0"),
                                     (dict(logprobs=10**6), "logprobs must be a whole number from 0 to the")])
def test_more_generate_arguments_of_the_wrong_type(target, draft_shared, tok, kw, msg):
    dec = SpecDecoder(target, draft_shared, tok, views="MC", captioner=FixedCaptioner(["x"]))
    with pytest.raises(MMSpecError, match=msg):
        dec.generate(*make_prompt(1, 16), max_new_tokens=4, **kw)


def test_pixel_values_without_their_batch_dimension(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16)
    with pytest.raises(MMSpecError, match=r"pixel_values must be a tensor \[n_images, 3, H, W\].*got \(3, 32, 32\)"):
        SpecDecoder(target, draft_shared, tok).generate(ids, pv[0], max_new_tokens=4)


def test_draft_processor_that_no_view_reads(target, draft_shared, tok):
    with pytest.raises(MMSpecError, match="draft_processor= was given but no view reads the draft's images"):
        SpecDecoder(target, draft_shared, tok, views="T", draft_processor=object())


@pytest.mark.parametrize("kw, msg", [
    (dict(views=None), "views must be view names or letters"), (dict(views=3), "views must be view names or letters"),
    (dict(tree_children="x"), "tree_children 'x' shapes a tree's children; a chain has one per node"),
    (dict(tree="dynamic", tree_children="x"), r"tree children must be one of \('mixture', 'views'\)"),
    (dict(tree="dynamic", tree_budget=0), "tree_budget must be a whole number >= 1"),
    (dict(tree="dynamic", tree_depth=2.5), "tree_depth must be a whole number >= 1"),
    (dict(tree_topk=4), "tree_topk needs tree='dynamic'"),
    (dict(tree_children="views"), "tree_children 'views' shapes a tree's children; a chain has one per node"),
    (dict(tree="dynamic", stop_below=0.5), "stop_below .dynamic draft length. applies to chains only"),
    (dict(tree=[[0], [1]], tree_depth=3), "a static tree's paths fix its shape: drop tree_depth"),
    # issue 61 item 8: gamma beside a tree that is no chain was silently ignored (the CLI refused --gamma)
    (dict(tree="dynamic", gamma=4), r"gamma=4 is a chain's length, but tree='dynamic' is no chain: .*drop gamma"),
    (dict(tree="3x2x4", gamma=5), r"gamma=5 is a chain's length, but tree='3x2x4' is no chain"),  # even the default
    (dict(tree=[[0], [1]], gamma=2), r"gamma=2 is a chain's length, but tree=\[\[0\], \[1\]\] is no chain"),
    (dict(tree=TreeSpec("dynamic", depth=2, topk=2, budget=3), gamma=2), r"gamma=2 is a chain's length, but tree=dynamic"),
    (dict(tree=TreeSpec("chain", depth=3), gamma=4), r"gamma=4 was given with a TreeSpec chain of length 3"),
])
def test_tree_and_view_keywords_that_would_be_ignored_or_crash(target, draft_shared, tok, kw, msg):
    with pytest.raises(MMSpecError, match=msg):
        SpecDecoder(target, draft_shared, tok, **kw)


def test_tree_keywords_that_apply_are_accepted(target, draft_shared, tok):
    SpecDecoder(target, draft_shared, tok, tree="dynamic", tree_depth=2, tree_topk=2, tree_budget=3, tree_children="views")
    SpecDecoder(target, draft_shared, tok, stop_below=0.3)
    SpecDecoder(target, draft_shared, tok, tree=[[0], [1]], tree_children="views")
    # gamma is read by a chain and by tree="auto" (its chain); left out, a chain is 5 long
    assert SpecDecoder(target, draft_shared, tok, gamma=3).tree == TreeSpec("chain", depth=3)
    assert SpecDecoder(target, draft_shared, tok, tree="chain", gamma=2).gamma == 2
    assert SpecDecoder(target, draft_shared, tok, tree="auto", gamma=2).tree_shapes[0] == TreeSpec("chain", depth=2)
    assert SpecDecoder(target, draft_shared, tok).tree == TreeSpec("chain", depth=5)
    assert SpecDecoder(target, draft_shared, tok, tree=TreeSpec("chain", depth=3)).gamma == 3
    assert SpecDecoder(target, draft_shared, tok, tree=TreeSpec("chain", depth=3), gamma=3).gamma == 3


def test_prompt_ids_and_pixels_the_target_cannot_read(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16)
    dec = SpecDecoder(target, draft_shared, tok)
    far = ids.clone()
    far[0, -1] = VOCAB + 7
    for bad_ids, msg in ((far, f"input_ids holds the id {VOCAB + 7}, outside the target's vocabulary of {VOCAB}"),
                         (-ids, "outside the target's vocabulary"),
                         ("hello", "input_ids must be token ids"), (ids.float(), "input_ids must be token ids")):
        with pytest.raises(MMSpecError, match=msg):
            dec.generate(bad_ids, pv, max_new_tokens=4)
    for bad_pv, shape in ((pv[:, :1], "1 x 32 x 32"), (torch.randn(1, 3, 64, 64, dtype=torch.float64), "3 x 64 x 64")):
        with pytest.raises(MMSpecError, match=f"pixel_values holds images of {shape} but this target's vision tower "
                                              "reads 3 x 32 x 32"):
            dec.generate(ids, bad_pv, max_new_tokens=4)
    with pytest.raises(MMSpecError, match=r"image_sizes given, but the target's family \(llava, .*\) does not read it"):
        dec.generate(ids, pv, image_sizes=torch.tensor([[32, 32]]), max_new_tokens=4)
