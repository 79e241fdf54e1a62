"""``mmspec check head`` for every family the library decodes: the calibration feeds each
family's processor outputs (LLaVA-NeXT's ``image_sizes``, LLaVA-OneVision's ``batch_num_images``,
Video-LLaVA's ``pixel_values_images``, Qwen's ``image_grid_thw`` and ``mm_token_type_ids``) to the
decode and to the feature forward alike, and frames the world's questions with the target's own
chat template; tiny targets of each family built from configs (``helpers.conversations``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from helpers.conversations import FAMILIES, family_pair, write_media
from mmspec import SpecDecoder
from mmspec.heads import build_head
from mmspec.heads.check import calibrate, world_prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_check_runs_on_every_family(family, tok):
    target, proc = family_pair(family, tok)
    head = build_head(target, "eagle")  # untrained: tau near 1, the check says so (a warning, not an error)
    dec = SpecDecoder(target, head, tok, processor=proc)
    prompts = world_prompts(2)  # one image, then two
    rep = calibrate(dec, prompts, max_new_tokens=6, probe=False)
    assert rep.prompts == 2 and rep.tokens == 12 and rep.tau >= 1
    assert rep.feature_scale is not None and rep.feature_scale > 0
    from mmspec.heads.check import prompt_inputs

    inputs, images = prompt_inputs(dec, prompts[1])
    assert len(images) == 2 and (family not in ("llava_next", "llava_onevision") or "image_sizes" in inputs)


def test_world_prompts_frame_as_the_world_for_the_embedded_target():
    from mmspec.embedded import load_embedded
    from mmspec.inputs import chat_prompt
    from mmspec.world import make_sample

    e = load_embedded()
    cp = world_prompts(2)[1]
    s = make_sample("spot_the_diff", "test", 0)
    assert chat_prompt(e.processor, cp.prompt, len(cp.images)) == s.prompt


def test_check_head_command_on_a_llava_next_target(tok, tmp_path):
    """The issue's command: ``check head DIR --target TARGET``, with and without ``--prompts``,
    exited 2 ("LLaVA-NeXT needs image_sizes with pixel_values") before; now it reports (an
    untrained head: tau near 1, exit 1)."""
    from mmspec.cli.app import app

    target, proc = family_pair("llava_next", tok)
    target.save_pretrained(tmp_path / "target")
    proc.save_pretrained(tmp_path / "target")
    build_head(target, "eagle").save(tmp_path / "head")
    write_media(tmp_path / "media", n_images=2, n_videos=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "<image> w12 w13", "images": ["media/img0.png"]}) + "\n")
    for extra in ([], ["--prompts", str(prompts)], ["--tree", "3x2x4"]):
        r = CliRunner().invoke(app, ["check", "head", str(tmp_path / "head"), "--target", str(tmp_path / "target"),
                                     "--max-new-tokens", "6", "--threads", "1", *extra])
        out = " ".join(r.output.split())
        assert r.exit_code == 1 and "head check: tau" in out and "near 1" in out, out
        assert ("(greedy, dynamic(depth 3, top-2, 4 nodes))" if extra[:1] == ["--tree"] else "(greedy, chain(γ=5))") \
            in out, out  # measured in the shape asked for, as the server would draft it
