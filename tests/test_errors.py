"""Each bad input gets a clear MMSpecError that names the problem and the fix."""

import pytest
from PIL import Image

from mmspec import MMSpecError, SpecDecoder
from mmspec.inputs import frame_prompt, load_images
from mmspec.models.captioner import FixedCaptioner
from mmspec.views import parse_views
from tiny import VOCAB, make_llava, make_prompt


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


@pytest.mark.parametrize("spec,msg", [("XYZ", "unknown view"), ("pooled:abc", "pooled:N"), ("MM", "listed twice")])
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
