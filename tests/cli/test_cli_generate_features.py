"""Every feature reachable from `mmspec generate`: heads (`--head`, `--draft HEAD_DIR`), the one tree
notation (`--tree 6x4x16`), other families with the processor's whole output and chat template,
`--video`; and every bad option refused in one line before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from helpers.tiny import make_processor, noisy_copy, save_checkpoints
from mmspec import MMSpecError
from mmspec.cli import app

runner = CliRunner()
V, IMAGE, VIDEO = 96, 3, 6


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables and titles in full, whatever the terminal the tests run in."""
    from rich.console import Console

    import mmspec.cli.common

    monkeypatch.setattr(mmspec.cli.common, "console", Console(width=400))


def invoke(*args):
    r = runner.invoke(app, ["generate", *map(str, args)], env={"COLUMNS": "250"})
    return r, " ".join(r.output.replace("│", " ").split())


def refused(args, phrase):
    r, out = invoke(*args)
    assert r.exit_code == 2 and phrase in out and "Traceback" not in out, r.output
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target, draft_shared, tok):
    """A tiny LLaVA-1.5 target + draft with its processor, two images, an eagle and an eagle3 head."""
    from mmspec.heads import build_head

    root = save_checkpoints(tmp_path_factory.mktemp("feat"), target, draft_shared, tok)
    build_head(target, "eagle", seed=1).save(root / "eagle")
    build_head(target, "eagle3", seed=2).save(root / "eagle3")
    return root


def base(ckpt, *extra):
    return ["--target", ckpt / "target", "--image", ckpt / "img0.png", "--prompt", "w5 w6 w7",
            "--max-new-tokens", "10", "--dtype", "float64", *extra]


# ------------------------------------------------------------------------------------ heads
@pytest.mark.parametrize("flag", ["--head", "--draft"])
def test_generate_drafts_with_a_head_directory(ckpt, flag):
    r, out = invoke(*base(ckpt, flag, ckpt / "eagle", "--tree", "3x2x4"))
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out and "dynamic(depth 3, top-2, 4 nodes" in out


def test_tree_auto_is_named_once_in_the_title(ckpt):
    """Issue 61 item 8: the title said "M+tree:auto: auto: chain(γ=5) | ...". It also says how many
    CPU threads ran (issue 61 item 9), beside the speed-up."""
    r, out = invoke(*base(ckpt, "--draft", ckpt / "draft", "--tree", "auto", "--threads", "1"))
    assert r.exit_code == 0, r.output
    assert "M+tree:auto: chain(γ=5) | dynamic(" in out and ", chosen per step," in out and "auto: auto" not in out
    assert "CPU threads: 1 (--threads)" in out and "identical to target.generate yes" in out


def test_help_says_a_head_is_a_draft():
    out = " ".join(runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "--head" in out and "mmspec train head" in out and "--draft HEAD_DIR" in out


@pytest.mark.parametrize("extra, phrase", [
    (["--views", "MT"], "--views MT does not apply to a head"),
    (["--captioner", "x"], "--captioner does not apply to a head"),
    (["--weights", "1"], "--weights does not apply to a head"),
])
def test_a_head_takes_no_views_or_captioner(ckpt, extra, phrase):
    refused(base(ckpt, "--head", ckpt / "eagle", *extra), phrase)


def test_a_captioner_without_a_caption_view_is_refused(ckpt):
    refused(base(ckpt, "--draft", ckpt / "draft", "--views", "MT", "--captioner", ckpt / "draft"),
            "--captioner is read by the caption view (C) only")


def test_model_flags_name_a_head_or_a_directory_without_a_model(ckpt, tmp_path):
    refused(["--target", ckpt / "eagle", "--draft", ckpt / "draft", "--prompt", "w5"],
            "--target '" + str(ckpt / "eagle") + "' is a draft head directory (mmspec_head.json), not a model; pass it as --head")
    (tmp_path / "nothing").mkdir()
    refused(["--target", ckpt / "target", "--draft", tmp_path / "nothing", "--prompt", "w5"],
            "is not a model directory (no config.json); pass the directory save_pretrained() wrote, or a draft head")


def test_draft_and_head_together_are_refused(ckpt):
    refused(base(ckpt, "--head", ckpt / "eagle", "--draft", ckpt / "draft"), "--draft and --head both give the draft")


@pytest.mark.parametrize("damage, phrase", [
    ("json", "is not valid JSON"),
    ("incomplete", "missing hidden_size"),
    ("unknown", "unknown colour"),
    ("safetensors", "cannot read"),
    ("noweights", "has no model.safetensors"),
])
def test_a_damaged_head_directory_is_one_clear_error(ckpt, tmp_path, target, damage, phrase):
    import shutil

    from mmspec.heads import load_head

    head = tmp_path / "h"
    shutil.copytree(ckpt / "eagle", head)
    cfg = head / "mmspec_head.json"
    raw = json.loads(cfg.read_text())
    if damage == "json":
        cfg.write_text(cfg.read_text()[:40])
    elif damage == "incomplete":
        cfg.write_text(json.dumps({k: v for k, v in raw.items() if k != "hidden_size"}))
    elif damage == "unknown":
        cfg.write_text(json.dumps({**raw, "colour": "red"}))
    elif damage == "safetensors":
        (head / "model.safetensors").write_bytes(b"not safetensors at all")
    else:
        (head / "model.safetensors").unlink()
    out = refused(base(ckpt, "--head", head), phrase)
    assert "mmspec train head" in out
    with pytest.raises(MMSpecError, match=phrase):
        load_head(head, target)


# ------------------------------------------------------------------------------------ trees
def test_specdecoder_takes_the_shape_notation(target, draft_shared, tok):
    from mmspec import SpecDecoder
    from mmspec.drafting.tree import TreeSpec

    dec = SpecDecoder(target, draft_shared, tok, tree="6x4x16")
    assert dec.tree == TreeSpec("dynamic", depth=6, topk=4, budget=16)


@pytest.mark.parametrize("args, phrase", [
    (["--tree", "dynamic", "--stop-below", "0.3"], "--stop-below (dynamic draft length) applies to chains only"),
    (["--tree", "dynamic", "--tree-depth", "0"], "--tree-depth must be a whole number >= 1"),
    (["--tree", "dynamic", "--tree-budget", "0"], "--tree-budget must be a whole number >= 1"),
    (["--tree", "dynamic", "--tree-topk", "0"], "--tree-topk must be a whole number >= 1"),
    (["--tree", "0x4x16"], "the depth in tree '0x4x16' must be >= 1"),
    (["--tree-depth", "4"], "--tree-depth needs --tree dynamic"),
    (["--tree-budget", "8"], "--tree-budget needs --tree dynamic"),
    (["--tree-children", "views"], "--tree-children 'views' shapes a tree's children"),
    (["--tree", "6x4x16", "--tree-depth", "3"], "--tree 6x4x16 already sets depth, top-k and budget"),
    (["--tree", "[[0],[1]]", "--tree-topk", "2"], "a static tree's paths fix its shape"),
    (["--tree", "dynamic", "--gamma", "3"], "--gamma is a chain's length"),
    (["--tree", "bushy"], "DEPTHxTOPKxBUDGET such as '6x4x16'"),
])
def test_tree_options_are_never_silently_ignored(args, phrase):
    out = refused(["--max-new-tokens", "2", *args], phrase)
    assert "None" not in out and "tree_" not in out  # CLI words, not Python's


# ------------------------------------------------------------------------ numbers, paths, devices
@pytest.mark.parametrize("args, phrase", [
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--frames", "0"], "--frames must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--top-k", "5"], "--top-k filters sampling"),
    (["--temperature", "1", "--top-k", "-1"], "--top-k: top_k must be a whole number >= 0"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--prompt", "w5", "--image", "nope.png"], "image file not found: 'nope.png'"),
    (["--prompt", "w5", "--video", "nope"], "video not found: 'nope'"),
    (["--prompt", "w5", "--head", "nope"], "--head 'nope' is not a directory"),
    (["--seed", "3"], "--seed seeds sampling"),
    (["--views", "MT", "--weights", "1,2,3"], "--weights gives 3 weight(s) for 2 view(s)"),
    (["--views", "MX"], "--views MX:"),
    (["--frames", "4"], "--frames sets the frames taken from each --video; there is none"),
    (["--stop-below", "1.5"], "--stop-below must be a probability in (0, 1)"),
    (["--temperature", "1", "--seed", "-1"], "--seed must be >= 0"),
    (["--views", "MT", "--weights", "1,-1"], "each weight must be a finite number >= 0"),
    (["--prompt", "w5", "--image", "."], "--image '.' is a directory, not an image file"),
    (["--cuda-graphs", "on"], "--cuda-graphs on needs a CUDA device (--device cuda), not 'cpu'"),
])
def test_bad_numbers_and_paths_are_refused_before_loading(args, phrase, monkeypatch):
    import mmspec.cli.generate as gen

    monkeypatch.setattr(gen, "load_models", lambda *a, **k: pytest.fail("a model loaded for a bad option"))
    refused(["--max-new-tokens", "2", *args], phrase)


def test_cuda_on_a_cpu_only_torch_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(["--device", "cuda", "--max-new-tokens", "2"], "has no CUDA GPU; use --device cpu")


def test_a_target_without_a_processor_is_one_clear_error(ckpt, tmp_path, target, monkeypatch):
    import mmspec.models.loading as loading

    target.save_pretrained(tmp_path / "bare")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded without a processor"))
    out = refused(["--target", tmp_path / "bare", "--draft", ckpt / "draft", "--prompt", "w5"],
                  "has no processor or tokenizer")
    assert "processor.save_pretrained" in out


def test_qwen_without_torchvision_says_which_extra(tmp_path, monkeypatch):
    """Qwen2-VL's video processor imports torchvision: one line naming the extra, not an ImportError."""
    import transformers

    from helpers.tiny import make_tokenizer
    from mmspec.models.loading import load_processor

    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (d / "preprocessor_config.json").write_text("{}")
    make_tokenizer().save_pretrained(d)

    def no_torchvision(*a, **k):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it was not found")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_torchvision)
    with pytest.raises(MMSpecError) as e:
        load_processor(str(d))
    assert str(e.value) == "Qwen2-VL's processor needs torchvision: pip install 'mmspec[qwen]' (or torchvision)"
    r, out = invoke("--target", d, "--draft", d, "--prompt", "w5")
    assert r.exit_code == 2 and "pip install 'mmspec[qwen]'" in out and "Traceback" not in out
    (d / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    with pytest.raises(MMSpecError, match=r"LLaVA-OneVision's processor needs torchvision: pip install 'mmspec\[video\]'"):
        load_processor(str(d))


# ------------------------------------------------------------------------ other families, video
def _llava_next(seed=0):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       image_size=16, patch_size=4),
        text_config=LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0),
        image_token_index=IMAGE, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]]))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.double().eval()


CHAT = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
        "{% elif c['type'] == 'video' %}<video> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}w40")


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory, tok):
    """A tiny LLaVA-NeXT target and draft (AnyRes: its processor adds image_sizes), with a chat template."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    root = tmp_path_factory.mktemp("next")
    target = _llava_next()
    draft = noisy_copy(target, 1)
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                    image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
                              image_token="<image>", num_additional_image_tokens=1, chat_template=CHAT)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        proc.save_pretrained(root / name)
    import numpy as np

    rng = np.random.default_rng(0)
    for i, size in enumerate([(20, 40), (30, 30)]):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / f"img{i}.png")
    return root


def test_llava_next_with_two_images_uses_the_whole_processor_output_and_chat_template(next_ckpt):
    r, out = invoke("--target", next_ckpt / "target", "--draft", next_ckpt / "draft", "--image",
                    next_ckpt / "img0.png", "--image", next_ckpt / "img1.png", "--prompt", "w5 <image> w6 <image> w7",
                    "--max-new-tokens", "12", "--dtype", "float64", "--views", "MT", "--tree", "3x2x4")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out
    assert "Prompt: w5 <image> w6 <image> w7 w40" in out  # the checkpoint's chat template, markers in place


def test_chat_prompt_parts_follow_the_markers(tok):
    from mmspec.inputs import chat_prompt

    class Proc:
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            self.messages = messages
            return "rendered"

    p = Proc()
    assert chat_prompt(p, "describe", 1, 1) == "rendered"
    assert [c["type"] for c in p.messages[0]["content"]] == ["image", "video", "text"]
    chat_prompt(p, "a <video> b <image>", 1, 1)
    assert [c.get("text", c["type"]) for c in p.messages[0]["content"]] == ["a", "video", "b", "image"]
    assert chat_prompt(make_processor(tok), "w5", 2) == "USER: <image> <image> w5 ASSISTANT:"  # no template


def _video_llava(seed=0):
    from transformers import CLIPVisionConfig, LlamaConfig, VideoLlavaConfig, VideoLlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = VideoLlavaForConditionalGeneration(VideoLlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       image_size=16, patch_size=4),
        text_config=LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0),
        image_token_index=IMAGE, video_token_index=VIDEO, vision_feature_layer=-2,
        vision_feature_select_strategy="default"))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.double().eval()


class FramesProcessor:
    """Video-LLaVA's processor as far as the CLI sees it (transformers' video processors need
    torchvision, absent here): <video> -> one token per frame patch, frames -> pixel_values_videos."""

    chat_template = None
    image_token, video_token = "<image>", "<video>"

    def __init__(self, tok, per_frame: int):
        self.tokenizer, self.per_frame, self.seen = tok, per_frame, []

    def __call__(self, text, images=None, videos=None, return_tensors="pt"):
        import numpy as np

        self.seen.append(text)
        ids = [1]
        for w in text.split():
            ids += [VIDEO] * (self.per_frame * len(videos[0])) if w == "<video>" else [self.tokenizer.convert_tokens_to_ids(w)]
        clips = [np.stack([np.asarray(f.resize((16, 16)), dtype=np.float32).transpose(2, 0, 1) / 255 for f in v])
                 for v in videos]
        ids_t = torch.tensor([ids])
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
                "pixel_values_videos": torch.tensor(np.stack(clips))}


def _processor_files(directory, tok):
    """The files a saved processor leaves (the stand-in processors are handed over in memory)."""
    tok.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text("{}")


@pytest.fixture(scope="module")
def video_ckpt(tmp_path_factory, tok):
    from mmspec.heads import build_head

    root = tmp_path_factory.mktemp("video")
    target = _video_llava()
    noisy = noisy_copy(target, 1, lm_only=False)
    noisy.model.video_tower.load_state_dict(target.model.video_tower.state_dict())
    noisy.model.image_tower.load_state_dict(target.model.image_tower.state_dict())
    target.save_pretrained(root / "target")
    noisy.save_pretrained(root / "draft")
    _processor_files(root / "target", tok)
    build_head(target, "eagle").save(root / "head")
    frames = root / "frames"
    frames.mkdir()
    for i in range(3):
        Image.new("RGB", (24, 24), (60 * i, 100, 255 - 60 * i)).save(frames / f"{i:03d}.png")
    (root / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (root / "empty").mkdir()
    return root


@pytest.mark.parametrize("draft", ["draft", "head"])
def test_video_from_a_frames_directory_matches_the_target(video_ckpt, tok, monkeypatch, draft):
    import mmspec.models.loading as loading

    proc = FramesProcessor(tok, per_frame=17)  # 4x4 patches + CLS per frame
    monkeypatch.setattr(loading, "load_processor", lambda *a, **k: proc)
    r, out = invoke("--target", video_ckpt / "target", "--draft", video_ckpt / draft, "--video",
                    video_ckpt / "frames", "--prompt", "w9 w10", "--max-new-tokens", "10", "--dtype", "float64")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out and proc.seen[-1] == "USER: <video> w9 w10 ASSISTANT:"
    # a head is checked on load for every family; this stand-in processor reads videos only, so the
    # check of the world's image prompts is skipped, saying why (the decode goes on)
    assert ("head check skipped" in out) == (draft == "head") and len(proc.seen) == (2 if draft == "head" else 1), out


def test_video_errors(video_ckpt, ckpt):
    refused(["--target", ckpt / "target", "--draft", ckpt / "draft", "--video", video_ckpt / "frames", "--prompt", "w5"],
            "--video: the target (llava) reads images only")
    refused(["--video", video_ckpt / "frames", "--prompt", "w5"], "the embedded target (LLaVA-1.5) reads images only")
    refused(["--target", video_ckpt / "target", "--draft", video_ckpt / "draft", "--video", video_ckpt / "empty",
             "--prompt", "w5"], "is a directory without frame images")
    refused(["--target", video_ckpt / "target", "--draft", video_ckpt / "draft", "--video", video_ckpt / "frames",
             "--prompt", "<video> <video> w5"], "2 <video> slot(s) but 1 video(s)")


def test_a_video_slot_given_an_image_says_what_the_prompt_has_and_where_the_clip_goes(tmp_path):
    """Issue 61 item 8: `--prompt "<video> hi" --image red.png` said "0 <image> slot(s)", as if the
    <video> were not there."""
    from PIL import Image

    from mmspec.inputs import with_markers

    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    refused(["--prompt", "<video> hi", "--image", tmp_path / "red.png"],
            "the prompt has 0 <image> and 1 <video> slot(s) but 1 image(s) and 0 video(s) were given; a <video> slot "
            "takes a video: pass the clip with --video (a directory of its frames or a video file")
    with pytest.raises(MMSpecError, match=r"1 <image> and 1 <video> slot\(s\) but 1 image\(s\) and 0 video\(s\).*"
                       r"or pass 1 image\(s\) and 1 video\(s\)"):
        with_markers("<image> <video> hi", 1, 0)
    with pytest.raises(MMSpecError, match=r"the prompt has 0 <video> slot\(s\) but 1 video\(s\)"):
        with_markers("<image> hi", 1, 1)
    assert with_markers("hi", 1, 1) == "<image> <video> hi"  # no markers: one each in front


def test_a_video_file_without_a_reader_says_to_pass_frames(video_ckpt):
    import importlib.util

    from mmspec.inputs import load_video

    if importlib.util.find_spec("av") or importlib.util.find_spec("cv2"):
        with pytest.raises(MMSpecError, match="cannot read"):
            load_video(video_ckpt / "clip.mp4")
    else:
        with pytest.raises(MMSpecError, match=r"needs a video reader \(pip install av\); or pass --video a directory"):
            load_video(video_ckpt / "clip.mp4")
    frames = load_video(video_ckpt / "frames", n_frames=2)
    assert len(frames) == 2 and frames[1].getpixel((0, 0)) == (120, 100, 135)  # first and last, in name order


def test_demo_takes_the_same_method_notation():
    """demo's methods are bench's: static trees (commas inside brackets), shapes, suffixes in any order."""
    r = runner.invoke(app, ["demo", "--families", "textvqa", "--methods", "M+tree:[[0],[1],[0,0]],M+relaxed+tree:3x2x4",
                            "--max-new-tokens", "4", "--repeats", "1"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "M+tree:[[0],[1],[0,0]]" in r.output and "M+relaxed+tree:3x2x4" in r.output


def test_a_draft_of_another_family_reads_the_images_through_its_own_processor(next_ckpt, ckpt):
    """LLaVA-NeXT target, LLaVA-1.5 draft (same tokenizer): the draft's processor makes its pixels."""
    r, out = invoke("--target", next_ckpt / "target", "--draft", ckpt / "draft", "--image", next_ckpt / "img0.png",
                    "--image", next_ckpt / "img1.png", "--prompt", "w5 w6", "--max-new-tokens", "10",
                    "--dtype", "float64", "--views", "MP")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out


def _qwen2_5_vl(seed=0):
    """A tiny Qwen2.5-VL (as tests/families/test_families.py builds it): 4 px patches merged 2x2, float64."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, out_hidden_size=64, window_size=16, fullatt_block_indexes=[1])
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=7,
        vision_end_token_id=8))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.double().eval()


class QwenProcessor:
    """Qwen2.5-VL's processor as far as the CLI sees it (the real one needs torchvision, absent
    here): its own image marker, and image_grid_thw / mm_token_type_ids beside the pixels."""

    chat_template = None
    image_token = "<|image_pad|>"

    def __init__(self, tok):
        self.tokenizer, self.seen = tok, []

    def __call__(self, text, images=None, videos=None, return_tensors="pt"):
        import numpy as np

        self.seen.append(text)
        ids, pixels = [1], []
        for w in text.split():
            if w == self.image_token:
                ids += [7] + [IMAGE] * 4 + [8]  # a 4x4 patch grid, merged 2x2
                a = np.asarray(images[len(pixels)].resize((16, 16)), dtype=np.float64) / 255
                pixels.append(torch.tensor(np.concatenate([a, a], -1).reshape(16, 96)))
            else:
                ids.append(self.tokenizer.convert_tokens_to_ids(w))
        ids_t = torch.tensor([ids])
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t), "pixel_values": torch.cat(pixels),
                "image_grid_thw": torch.tensor([[1, 4, 4]] * len(pixels)), "mm_token_type_ids": (ids_t == IMAGE).int()}


def test_qwen2_5_vl_target_with_a_text_only_draft(tmp_path, ckpt, tok, monkeypatch):
    """The Qwen2.5-VL route of the README: a text-only LM (same tokenizer) drafts views T; the
    processor's image_grid_thw and mm_token_type_ids reach both SpecDecoder and target.generate."""
    import mmspec.models.loading as loading
    from helpers.tiny import make_llama

    _qwen2_5_vl().save_pretrained(tmp_path / "qwen")
    _processor_files(tmp_path / "qwen", tok)
    make_llama(11).save_pretrained(tmp_path / "lm")
    proc = QwenProcessor(tok)
    monkeypatch.setattr(loading, "load_processor", lambda *a, **k: proc)
    r, out = invoke("--target", tmp_path / "qwen", "--draft", tmp_path / "lm", "--views", "T", "--image",
                    ckpt / "img0.png", "--image", ckpt / "img1.png", "--prompt", "w9 w10", "--max-new-tokens", "10",
                    "--dtype", "float64", "--tree", "dynamic")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out
    assert proc.seen == ["USER: <|image_pad|> <|image_pad|> w9 w10 ASSISTANT:"]


def test_a_head_for_the_embedded_target(tmp_path):
    """`--head DIR` alone drafts for the embedded target (the bundled example)."""
    from mmspec.embedded import load_embedded
    from mmspec.heads import build_head

    build_head(load_embedded().target, "eagle").save(tmp_path / "head")
    r, out = invoke("--head", tmp_path / "head", "--max-new-tokens", "8", "--tree", "dynamic")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out and "eagle+tree" in out


# ------------------------------------------------------------------------------------ lookup / suffix (#44)
@pytest.mark.parametrize("extra", [["--draft", "lookup"], ["--draft", "suffix", "--tree", "3x2x4"],
                                   ["--draft", "DRAFT", "--model-free", "suffix", "--lookup-options", "suffix_mb=8"]])
def test_generate_drafts_with_no_model(ckpt, extra):
    extra = [ckpt / "draft" if x == "DRAFT" else x for x in extra]
    r, out = invoke(*base(ckpt, *extra))
    assert r.exit_code == 0, r.output
    assert "identical to target.generate yes" in out


@pytest.mark.parametrize("extra, phrase", [
    (["--draft", "lookup", "--views", "MT"], "--views MT was given with --draft lookup; views are how a draft model "
     "sees the prompt and lookup has none: drop --views, or pass --draft MODEL_DIR --model-free lookup"),
    (["--draft", "lookup", "--weights", "1"], "--weights was given with --draft lookup"),
    # not "give one per view, e.g. --views MT", which --draft suffix then refuses
    (["--draft", "suffix", "--weights", "1,1"], "--weights was given with --draft suffix, which drafts with no model"),
    (["--draft", "suffix", "--weights", "adaptive"], "--weights was given with --draft suffix"),
    (["--draft", "suffix", "--captioner", "x"], "--captioner was given with --draft suffix"),
    (["--draft", "suffix", "--head", "EAGLE"], "--draft suffix and --head both give the draft"),
    (["--draft", "suffix", "--lookup-options", "suffix_mb=0"], "a suffix budget of 0 keeps no history"),
    (["--draft", "lookup", "--lookup-options", "ngram_max=0"], "ngram_max must be a whole number from 1 to 32"),
    (["--draft", "lookup", "--lookup-options", "ngram_max"], "write KEY=VALUE pairs"),
    (["--draft", "lookup", "--model-free", "suffix"], "--draft lookup already drafts with no model; --model-free "
     "suffix adds a model-free proposal beside a draft model or head: drop --model-free"),
    (["--draft", "DRAFT", "--lookup-options", "ngram_max=3"], "--lookup-options sets the model-free drafters; pass "
     "--draft lookup or --draft suffix (or --model-free lookup|suffix beside a draft), or drop --lookup-options"),
    (["--draft", "lookup", "--lookup-options", "nosuch=3"], "--lookup-options: unknown setting(s) ['nosuch']"),
    (["--draft", "DRAFT", "--model-free", "nosuch"], "--model-free must be one of lookup, suffix"),
    (["--head", "EAGLE", "--weights", "1,1"], "--weights does not apply to a head"),
])
def test_bad_lookup_options_refused_before_loading(ckpt, extra, phrase):
    extra = [ckpt / "draft" if x == "DRAFT" else ckpt / "eagle" if x == "EAGLE" else x for x in extra]
    out = refused(base(ckpt, *extra), phrase)
    assert not any(name in out for name in ("model_free", "lookup_options", "tree_children", "views=")), out


def test_compile_seconds_are_reported_apart_from_the_speed_up(ckpt, monkeypatch):
    """Issue 61.5: `generate --compile` printed "speed-up 0.01x", the decode time holding the
    minute of compiling. A stand-in torch.compile that takes 2 s at the first call of each
    forward: the compiling is its own row, the speed-up is given without it (and with it)."""
    import re
    import time

    def slow_first(fn, **kw):
        seen = []

        def call(**inputs):
            if not seen:
                seen.append(1)
                time.sleep(2.0)
            return fn(**inputs)
        return call

    monkeypatch.setattr(torch, "compile", slow_first)
    r, out = invoke(*base(ckpt, "--draft", ckpt / "draft", "--views", "M", "--compile"))
    assert r.exit_code == 0, r.output
    compiling = re.search(r"time: compiling / CUDA-graph capture \(first calls of each shape, within total\) "
                          r"([\d.]+) / ([\d.]+) ms", out)
    assert compiling and float(compiling.group(1)) >= 4000, out  # two forwards (target, draft), 2 s each
    m = re.search(r"speed-up ([\d.]+)x without the ([\d.]+) ms of compiling/capture \(([\d.]+)x with it\)", out)
    assert m and float(m.group(2)) == float(compiling.group(1)), out
    assert float(m.group(1)) > 3 * float(m.group(3)), out  # the one-off seconds no longer swamp the figure
