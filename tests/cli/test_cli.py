"""The `mmspec generate` command on checkpoints saved to disk (the one-command path)."""

import pytest
from typer.testing import CliRunner

from helpers.tiny import make_processor, save_checkpoints, swapped_tokenizer
from mmspec import MMSpecError, SpecDecoder
from mmspec.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target, draft_shared, tok):
    root = save_checkpoints(tmp_path_factory.mktemp("ckpt"), target, draft_shared, tok)
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    return root


def invoke(*args):
    return runner.invoke(app, ["generate", *map(str, args)])


def test_generate_two_images_matches_target(checkpoints):
    r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft", "--views", "MT",
               "--image", checkpoints / "img0.png", "--image", checkpoints / "img1.png",
               "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--dtype", "float64")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate" in r.output and "yes" in r.output
    assert "block efficiency tau" in r.output


def test_generate_bad_image_is_a_clear_error(checkpoints):
    r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft",
               "--image", checkpoints / "broken.png", "--prompt", "w5")
    assert r.exit_code == 2
    assert "cannot read" in r.output and "Traceback" not in r.output


def test_generate_slot_mismatch_is_a_clear_error(checkpoints):
    r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft",
               "--image", checkpoints / "img0.png", "--prompt", "USER: <image> <image> w5 ASSISTANT:")
    assert r.exit_code == 2
    assert "2 <image> slot(s) but 1 image(s)" in r.output


def test_generate_caption_view_without_captioner(checkpoints):
    r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft", "--views", "MTC",
               "--image", checkpoints / "img0.png", "--prompt", "w5")
    assert r.exit_code == 2 and "needs a captioner" in r.output


def test_specdecoder_from_local_directories(checkpoints, target):
    """target/draft given as paths: loaded offline through the Auto classes, tokenizer and
    processor from the target's directory."""
    from helpers.tiny import block_network, make_prompt
    from mmspec import SpecDecoder

    with block_network():
        dec = SpecDecoder(str(checkpoints / "target"), str(checkpoints / "draft"), views="MT", dtype="float64")
    assert dec.processor is not None and type(dec.target_model).__name__ == "LlavaForConditionalGeneration"
    ids, pv = make_prompt(1, 16, seed=2)
    ref = target.generate(input_ids=ids, pixel_values=pv, do_sample=False, max_new_tokens=10)[0, ids.shape[1]:]
    assert dec.generate(ids, pv, max_new_tokens=10).token_ids == ref.tolist()


def _assert_pack_present():
    from mmspec.embedded import default_path

    cfg = default_path() / "target" / "config.json"
    assert cfg.is_file(), f"{cfg} is missing: the embedded pack is committed to git, so the install is broken"


def test_demo_on_embedded_pack(monkeypatch):
    """The demo's speed-up is the ratio of medians over --repeats interleaved runs (one run each
    gave 87x and 0.18x on a loaded machine), and the table says so."""
    import mmspec.cli.demo

    _assert_pack_present()
    calls = []
    baseline = mmspec.cli.demo.baseline
    monkeypatch.setattr(mmspec.cli.demo, "baseline", lambda *a: calls.append(1) or baseline(*a))
    r = runner.invoke(app, ["demo", "--families", "textvqa", "--methods", "M,TC", "--max-new-tokens", "8",
                            "--repeats", "2"])
    assert r.exit_code == 0, r.output
    assert "only know mmspec's synthetic world" in r.output and "yes" in r.output and "NO" not in r.output
    out = " ".join(r.output.split())
    assert len(calls) == 2 and "median of 2" in out and "2 interleaved run(s)" in out, out


def test_default_example_is_answered_right(monkeypatch):
    """First impression: the bundled example of `mmspec generate` is one the embedded target
    answers right (test sample 0 got "...tea 1 is the tallest"), by the world's own check: the
    answer's last sentence states the asked fact, and every fact it lists is the sample's."""
    from rich.console import Console

    import mmspec.cli.common
    import mmspec.cli.generate
    from mmspec.train.evaluate import answers_question, states
    from mmspec.world import make_sample

    _assert_pack_present()
    monkeypatch.setattr(mmspec.cli.common, "console", Console(width=400))  # the answer on one line
    r = runner.invoke(app, ["generate", "--no-compare"])
    assert r.exit_code == 0, r.output
    answer = next(line for line in r.output.splitlines() if line.startswith("Answer:"))[len("Answer:"):].strip()
    sample = make_sample(*mmspec.cli.generate.DEFAULT_EXAMPLE)
    assert answers_question(sample, answer), (sample.facts, answer)
    assert all(states(answer, v) for v in sample.facts.values()), (sample.facts, answer)


def test_auto_dtype_is_float32_on_the_cpu(checkpoints, monkeypatch):
    """--dtype auto with --target directories loads float32 on the CPU (a checkpoint saved in fp16
    ran 6x slower in fp16 there); an explicit dtype is kept, and a GPU keeps the checkpoint's own."""
    import torch

    import mmspec.models.loading as loading

    asked = []

    def record(name, *, dtype="auto", device=None):
        asked.append(dtype)
        raise MMSpecError("stop here")

    monkeypatch.setattr(loading, "load_model", record)
    for flag, want in (([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)):
        r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft", "--prompt", "w5", *flag)
        assert r.exit_code == 2 and "stop here" in r.output and asked.pop() == want, r.output
    assert loading.compute_dtype("auto", "cpu") == torch.float32
    assert loading.compute_dtype("auto", "cuda:0") == "auto" and loading.compute_dtype("fp16", "cpu") == torch.float16


def test_readme_python_example_defines_what_it_uses():
    """The README's Python example runs as written once its paths exist: every name it uses is
    imported or assigned in it (it used an undefined `image`)."""
    import ast
    import builtins
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"## Use it from Python\s+```python\n(.*?)```", readme, re.S).group(1)
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= defined, f"the README's Python example uses undefined {sorted(used - defined)}"


def test_generate_with_no_flags_uses_the_embedded_pack(monkeypatch):
    """`mmspec generate` with no model, prompt or image: the embedded models answer the bundled
    chart-QA sample, say they only know the synthetic world, and match target.generate."""
    from mmspec.world import make_sample

    _assert_pack_present()
    from rich.console import Console

    import mmspec.cli.common
    import mmspec.cli.generate

    monkeypatch.setattr(mmspec.cli.common, "console", Console(width=200))  # a wide table, whatever $COLUMNS says
    r = runner.invoke(app, ["generate", "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.replace("│", " ").split())  # undo rich's wrapping and table borders
    assert "Using the embedded tiny models: they only know mmspec's synthetic world" in out, out
    assert "No prompt given: a bundled chart-QA example" in out, out
    assert make_sample(*mmspec.cli.generate.DEFAULT_EXAMPLE).question in out, out
    assert "tokens 16 " in out, out  # the default max_new_tokens is 128: the flag reached the decoder
    assert "identical to target.generate yes" in out, out


def test_help_pages_reflow_and_keep_angle_bracket_tokens():
    """Every command's help starts with a one-line summary (the command lists show it), and the
    markdown rendering keeps `<image>` rather than dropping it as an HTML tag."""
    from typer.main import get_command

    def commands(cmd, path=()):
        if hasattr(cmd, "commands"):  # a group (typer's own class, not click.Group)
            for name, sub in cmd.commands.items():
                yield from commands(sub, (*path, name))
        else:
            yield path, cmd

    found = list(commands(get_command(app)))
    assert {p for p, _ in found} >= {("generate",), ("demo",), ("bench", "run"), ("train", "stage"), ("train", "answers")}
    for path, cmd in found:
        summary = (cmd.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, f"mmspec {' '.join(path)}: the docstring's first paragraph is not one line"
    out = runner.invoke(app, ["generate", "--help"]).output
    assert "<image>" in out and "<CAPTION>" in out, out


def test_generate_refuses_a_draft_with_a_same_size_other_vocabulary(checkpoints, tmp_path, draft_shared, tok):
    """A draft whose own tokenizer has as many tokens as the target's but other ids (here two
    words swapped) is refused by name before any weights load; one saved without a tokenizer
    (weights only, as many draft checkpoints ship) cannot be compared and is accepted."""
    swapped = swapped_tokenizer(tok, "w5", "w6")
    assert len(swapped) == len(tok) and swapped.get_vocab() != tok.get_vocab()
    other = tmp_path / "other"
    draft_shared.save_pretrained(other)
    make_processor(swapped).save_pretrained(other)
    r = invoke("--target", checkpoints / "target", "--draft", other, "--image", checkpoints / "img0.png",
               "--prompt", "w5", "--max-new-tokens", "4")
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())  # rich wraps lines
    assert "different vocabularies: id 5 is 'w5' in the target's tokenizer but 'w6' in the draft's" in out
    assert "Traceback" not in r.output

    # refused before the weights load: a draft directory with config and tokenizer only
    unweighted = tmp_path / "unweighted"
    draft_shared.config.save_pretrained(unweighted)
    make_processor(swapped).save_pretrained(unweighted)
    r = invoke("--target", checkpoints / "target", "--draft", unweighted, "--image", checkpoints / "img0.png",
               "--prompt", "w5")
    assert r.exit_code == 2 and "different vocabularies" in r.output, r.output
    with pytest.raises(MMSpecError, match="different vocabularies"):  # SpecDecoder given paths, too
        SpecDecoder(checkpoints / "target", unweighted)

    bare = tmp_path / "bare"
    draft_shared.save_pretrained(bare)  # weights and config, no tokenizer files
    r = invoke("--target", checkpoints / "target", "--draft", bare, "--image", checkpoints / "img0.png",
               "--prompt", "w5 w6", "--max-new-tokens", "6", "--dtype", "float64")
    assert r.exit_code == 0, r.output
    assert "identical to target.generate" in r.output


def test_errors_print_token_text_literally(capsys):
    """Error text is not rich markup: a token such as [/INST] in a message prints as written."""
    import typer

    from mmspec.cli.common import fail

    with pytest.raises(typer.Exit):
        fail(MMSpecError("id 7 is '[/INST]' in the target's tokenizer but '[unused0]' in the draft's, then ':x:'"))
    err = " ".join(capsys.readouterr().err.split())
    assert "'[/INST]' in the target's tokenizer but '[unused0]' in the draft's, then ':x:'" in err


def test_generate_prints_prompt_and_answer_literally(checkpoints):
    """A prompt with chat-template brackets prints as written, not as rich markup (which raised
    MarkupError on "[/INST]" after the whole generation had run)."""
    r = invoke("--target", checkpoints / "target", "--draft", checkpoints / "draft", "--image", checkpoints / "img0.png",
               "--prompt", "USER: <image> [INST] w5 [/INST] ASSISTANT:", "--max-new-tokens", "4", "--dtype", "float64")
    assert r.exit_code == 0, r.output
    assert "[INST] w5 [/INST]" in r.output


def test_help_texts_point_the_right_way():
    """Issue 53's words that pointed the wrong way: serve has a key now; demo has no -m; bench's and
    demo's methods include the model-free drafts."""
    def help_of(*args):
        r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        return " ".join(r.output.replace("│", " ").split())

    serve = help_of("serve")
    assert "no authentication" not in serve and "--api-key" in serve
    demo = help_of("demo")
    assert "-m M,eagle" not in demo and "--methods M,eagle,eagle+tree --head eagle=DIR" in demo
    for text in (demo, help_of("bench", "run")):
        assert "lookup / suffix" in text and "M+suffix" in text


def test_options_are_declared_once_across_the_commands():
    """generate, serve and check head take the model, drafting and runtime options from one
    declaration each (mmspec.cli.options): the same help text wherever an option appears, in the
    same --help panel; the groups reach the commands as their dataclasses."""
    import typer.main

    from mmspec.cli.options import ModelFlags, RuntimeFlags, ShapeFlags, ViewFlags

    root = typer.main.get_command(app)
    ctx = root.make_context("mmspec", ["--help"], resilient_parsing=True)

    def params(*path):
        cmd = root
        for name in path:
            cmd = cmd.get_command(ctx, name)
        return {p.name: p for p in cmd.params}

    generate, serve, check = params("generate"), params("serve"), params("check", "head")
    demo, bench, audit = params("demo"), params("bench", "run"), params("audit")
    for group in (ModelFlags, ViewFlags, ShapeFlags, RuntimeFlags):
        for name in group.__dataclass_fields__:
            assert generate[name].help == serve[name].help and generate[name].help, name
            assert generate[name].rich_help_panel == serve[name].rich_help_panel is not None, name
    for name in ShapeFlags.__dataclass_fields__:
        assert check[name].help == generate[name].help, name
    for name in ("threads",):
        assert check[name].help == generate[name].help == demo[name].help == audit[name].help
    assert demo["methods"].help.split(". Default:")[0] == bench["method"].help.split(". Default:")[0]
    assert demo["head"].help.split("(e.g.")[0] == bench["head"].help.split("(e.g.")[0]


def test_flag_defaults_are_the_configs():
    """One story for the options: a flag that sets a SpecDecoder option defaults to mmspec.config's
    value (the deliberate differences: --views' letter M, --check-head on), GenerateOptions to the
    flag groups', serve's flags to ServeConfig's."""
    import inspect
    from dataclasses import fields

    from mmspec.cli.checks import GenerateOptions
    from mmspec.cli.options import ModelFlags, RuntimeFlags, ShapeFlags, ViewFlags
    from mmspec.cli.serve import serve
    from mmspec.config import KEYWORDS, DecoderConfig
    from mmspec.serve.config import ServeConfig

    config = DecoderConfig().keywords()
    shared = {f.name: f.default for g in (ModelFlags, ViewFlags, ShapeFlags, RuntimeFlags) for f in fields(g)}
    mapped = {n: d for n, d in shared.items() if n in KEYWORDS and n != "views"}
    assert {"tree_children", "gamma", "stop_below", "cuda_graphs", "compile", "dtype"} <= set(mapped)
    assert mapped == {n: config[n] for n in mapped}
    assert shared["views"] == "M" and config["views"] == ("multimodal",)
    generate = {f.name: f.default for f in fields(GenerateOptions)}
    assert {n: generate[n] for n in shared} == shared
    serve_defaults = {p.name: p.default.default for p in inspect.signature(serve).parameters.values()
                      if hasattr(p.default, "default")}
    cfg = ServeConfig()
    for flag, field_name in (("max_batch", "max_batch"), ("speculate", "speculate"), ("max_tokens", "max_tokens"),
                             ("shutdown_timeout", "shutdown_timeout_s"), ("max_request_mb", "max_request_mb"),
                             ("max_image_pixels", "max_image_pixels"), ("metrics", "metrics")):
        assert serve_defaults[flag] == getattr(cfg, field_name), flag
