"""The speed scripts (perf/speed.py, perf/gpu_shapes.py, perf/video_speed.py's report) on tiny
random models, on CPU.

These check code paths and report files, not speed: timings of tiny models under a test runner
mean nothing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.scripts import load_script
from helpers.tiny import (
    make_llava,
    make_processor,
    make_prompt,
    make_tokenizer,
    noisy_copy,
    swapped_tokenizer,
)
from mmspec.bench.backend import BenchModels

ROOT = Path(__file__).resolve().parents[2]


class _Captioner:
    def caption(self, images):
        return ["w7 w8"] * len(images)


@pytest.fixture(scope="module")
def speed():
    return load_script("speed")


def _tiny_prompts(speed, n_images=(1, 2)):
    out = []
    for n in n_images:
        ids, pv = make_prompt(n, 16, seed=n)  # [1, L], [n, 3, 32, 32]
        out.append(speed.SpeedPrompt(f"tiny-{n}img", {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                       "pixel_values": pv}))
    return out


def test_speed_run_on_tiny_models(speed, tmp_path):
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, _Captioner(), source="tiny")
    cfg = speed.SpeedConfig(max_new_tokens=10, repeats=2, latency_repeats=1, device="cpu", out=str(tmp_path),
                            command="test", step_rounds=2)
    res = speed.run(cfg, models=models, prompts=_tiny_prompts(speed), log=lambda s: None)

    assert res["identical"], res["mismatches"]
    sm = res["summary"]
    assert sm["systems"] == ["target", "assisted", "mmspec_M", "mmspec_MTC", "mmspec_M+tree"]  # no GPU: no M(eager)
    assert all(sm["ratio_row_over_col"][n][n] == pytest.approx(1.0) for n in sm["systems"])
    assert 1.0 <= sm["tau"]["mmspec_M"] <= cfg.gamma + 1 and sm["tau"]["target"] is None
    assert sm["tau"]["mmspec_M+tree"] >= 1.0
    # every system ran every prompt in every repeat, in a rotated order
    raw = res["raw"]
    assert len(raw) == 5 * 2 * 2
    first_slots = {(x["repeat"], x["prompt"]): x["system"] for x in raw if x["slot"] == 0}
    assert len(set(first_slots.values())) > 1
    eng = res["engine"]
    assert eng["T_p_s"] > 0 and set(eng["T_q_s"]) >= {"1", "3", "4"}
    assert "engine_efficiency" in eng["efficiency"]["mmspec_MTC"]
    step = eng["draft_step"]  # the engine's own step, 4 views vs M, on every prompt
    assert step["views"] == "MTCP" and len(step["per_prompt"]) == 2
    for x in step["per_prompt"]:
        assert set(x["step_s"]) == {"M", "MTCP"} and all(t > 0 for t in x["step_s"].values())
        assert x["ratio"] == pytest.approx(x["step_s"]["MTCP"] / x["step_s"]["M"])
    assert eng["draft_step_views_over_1"] == pytest.approx(statistics.median(x["ratio"] for x in step["per_prompt"]))
    assert res["progress"] == "done" and "errors" not in res
    b = res["breakdown"]["mmspec_MTC"]
    parts = b["parts_s"]
    assert parts["draft_forward"] > 0 and parts["target_forward"] > 0 and parts["verify_other"] > 0
    assert b["calls"]["draft_forward"] > 0 and b["calls"]["target_forward"] > 0
    # the forwards are inside the clock's phases, and the pieces add up to generate's total
    assert parts["draft_forward"] <= b["phases_s"]["draft"] and parts["target_forward"] <= b["phases_s"]["verify"]
    assert sum(parts.values()) == pytest.approx(b["total_s"], rel=1e-6)
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved["machine"]["torch"] == torch.__version__ and saved["config"]["command"] == "test"
    assert "tokens/s" in (tmp_path / "speed.md").read_text()


def test_speed_with_emulated_graphs(speed, tmp_path):
    """--graphs emulate: the mmspec systems on fixed shapes as on a GPU (the M(eager) system beside
    them), and the draft-step probe on a static decoder's engine."""
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, _Captioner(), source="tiny")
    cfg = speed.SpeedConfig(max_new_tokens=6, repeats=1, latency_repeats=1, device="cpu", out=str(tmp_path),
                            command="test", step_rounds=1, ensemble="MT", trees=(), step_views="MT", profile=False,
                            graphs="emulate")
    res = speed.run(cfg, models=models, prompts=_tiny_prompts(speed, (1,)), log=lambda s: None)
    assert res["identical"] and "errors" not in res, res.get("errors")
    assert res["summary"]["systems"] == ["target", "assisted", "mmspec_M", "mmspec_MT", "mmspec_M(eager)"]
    engines = {x["system"]: x["stats"]["engine"] for x in res["raw"] if x["stats"]}
    assert engines == {"mmspec_M": "static", "mmspec_MT": "static", "mmspec_M(eager)": "eager"}  # emulated graphs
    assert res["engine"]["draft_step"]["per_prompt"][0]["step_s"]["MT"] > 0


def test_a_failing_probe_keeps_the_timed_results(speed, tmp_path, monkeypatch):
    """An optional probe that raises is recorded under ``errors``; what came before it, and the
    probes after it, are written (the report of the 2026-11-27 GPU pass was lost this way)."""
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, source="tiny")
    def flaky(cfg, decs, prompts):
        raise RuntimeError("The expanded size of the tensor (96) must match the existing size (167)")

    monkeypatch.setattr(speed, "measure_draft_step", flaky)
    cfg = speed.SpeedConfig(max_new_tokens=4, repeats=2, latency_repeats=1, device="cpu", out=str(tmp_path),
                            command="test", step_rounds=1, ensemble="M", trees=(), step_views="MT")
    res = speed.run(cfg, models=models, prompts=_tiny_prompts(speed, (1,)), log=lambda s: None)
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert list(saved["errors"]) == ["draft step"] and "expanded size" in saved["errors"]["draft step"]
    assert saved["identical"] and len(saved["raw"]) == 3 * 2 and saved["progress"] == "done"
    assert "T_p_s" in saved["engine"] and "draft_step" not in saved["engine"]  # what came before it is kept
    assert set(saved["breakdown"]) == {"mmspec_M"}  # the probe after the failing one still ran
    assert "draft step failed" in (tmp_path / "speed.md").read_text()
    assert res["errors"] == saved["errors"]


def test_speed_saves_after_each_repeat(speed, tmp_path, monkeypatch):
    """A run stopped during its second timed repeat has the first one on disk."""
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, source="tiny")
    seen = []
    real = speed.write_report

    def write_then_stop(result, out):
        real(result, out)
        seen.append(result["progress"])
        if result["progress"].startswith("timed repeat 1"):
            raise KeyboardInterrupt  # the step's timeout, as far as the report can tell
    monkeypatch.setattr(speed, "write_report", write_then_stop)
    cfg = speed.SpeedConfig(max_new_tokens=4, repeats=2, device="cpu", out=str(tmp_path), command="test",
                            ensemble="M", trees=())
    with pytest.raises(KeyboardInterrupt):
        speed.run(cfg, models=models, prompts=_tiny_prompts(speed, (1,)), log=lambda s: None)
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved["progress"] == "timed repeat 1 of 2; probes to come" and len(saved["raw"]) == 3
    assert saved["summary"]["tokens_per_s"]["mmspec_M"] > 0
    assert "partial report" in (tmp_path / "speed.md").read_text()


def test_speed_loads_the_embedded_pack_in_the_dtype_asked(speed):
    """--dtype bfloat16 on the embedded pack loads it in bfloat16 (the GPU pass's "bf16" step
    of 2026-11-27 ran the pack in float32: the flag was ignored for it)."""
    models = speed.load_models(speed.SpeedConfig(dtype="bfloat16"), torch.device("cpu"))
    assert {next(m.parameters()).dtype for m in (models.target, models.draft)} == {torch.bfloat16}


def test_breakdown_hooks_are_removed_and_nothing_is_patched(speed):
    import mmspec.engine.step as engine
    from mmspec.drafting.ensemble import EnsembleDrafting

    before = (dict(vars(EnsembleDrafting)), dict(vars(engine)))
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, source="tiny")
    dec = speed.build_decoders(speed.SpeedConfig(ensemble="M"), models)["mmspec_M"]
    profile_breakdown = load_script("breakdown").profile_breakdown

    seen = profile_breakdown(dec, _tiny_prompts(speed, (1,)), 4, torch.device("cpu"))["calls"]
    assert seen["draft_forward"] > 0 and seen["target_forward"] > 0
    assert (dict(vars(EnsembleDrafting)), dict(vars(engine))) == before
    for model in (dec.target.model, dec.draft.model):
        assert not model._forward_pre_hooks and not model._forward_hooks
    assert "forward" not in vars(dec.target) and "forward" not in vars(dec.draft)


def test_breakdown_ranges_show_in_a_profiler(speed):
    """Each hooked forward runs in a record_function range a profiler taken around it lists."""
    target = make_llava(0)
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, source="tiny")
    dec = speed.build_decoders(speed.SpeedConfig(ensemble="M"), models)["mmspec_M"]
    bd = load_script("breakdown")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        calls = bd.profile_breakdown(dec, _tiny_prompts(speed, (1,)), 4, torch.device("cpu"))["calls"]
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(bd.TARGET_RANGE) == calls["target_forward"]
    assert counts.get(bd.DRAFT_RANGE) == calls["draft_forward"]


def test_speed_refuses_a_draft_without_a_target_before_loading(speed, capsys):
    assert speed.main(["--draft", "/nonexistent/draft", "--out", "/nonexistent/out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft needs --target" in err[0]
    assert not Path("/nonexistent/out").exists()


def test_speed_refuses_a_draft_of_another_vocabulary_before_loading(speed, tmp_path, capsys):
    """perf/speed.py loads checkpoints through the library (mmspec.bench.backend): a draft whose
    tokenizer maps ids to other words is refused by name, before any weights load (the
    directories here hold a config and a processor, no weights)."""
    tok = make_tokenizer()
    target = make_llava(0)
    for name, t in (("target", tok), ("draft", swapped_tokenizer(tok, "w5", "w6"))):
        target.config.save_pretrained(tmp_path / name)
        make_processor(t).save_pretrained(tmp_path / name)
    out = tmp_path / "out"
    assert speed.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                       "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different vocabularies: id 5 is 'w5'" in err[0], err
    assert not out.exists()


def test_speed_flags_map_onto_config(speed):
    cfg = speed.parse_args(["--threads", "2", "--gamma", "4", "--families", "vist,iedit", "--no-profile"])
    assert (cfg.threads, cfg.gamma, cfg.families, cfg.profile, cfg.warmup) == (2, 4, ("vist", "iedit"), False, True)
    assert cfg.command.startswith("python perf/speed.py --threads 2")


def test_mismatch_is_reported(speed):
    R = speed.RunRecord
    recs = [R(0, "a", "target", 0, 1.0, 3, [5, 6, 7]), R(0, "a", "mmspec_M", 1, 1.0, 3, [5, 9, 7])]
    bad = speed.check_identical(recs)
    assert bad == [{"repeat": 0, "prompt": "a", "system": "mmspec_M", "first_diff": 1, "got_len": 3, "want_len": 3}]


def test_gpu_shapes_small_cpu(tmp_path):
    gs = load_script("gpu_shapes")
    cfg = gs.parse_args(["--small", "--device", "cpu", "--context", "48", "--gammas", "1,5", "--trees", "8",
                         "--batches", "1,4", "--repeats", "2", "--warmup", "1", "--copy-mib", "4",
                         "--engine-new-tokens", "12", "--engine-repeats", "1", "--engine-noise", "0",
                         "--out", str(tmp_path)])
    res = gs.run(cfg, log=lambda s: None)
    assert set(res["modes"]) == {"eager", "graph"}
    for r in res["modes"].values():
        assert r["T_p"]["s"] > 0 and set(r["T_V_over_T_p"]) == {"1", "5"} and set(r["T_q"]) == {"1", "4"}
        assert set(r["T_V_tree_over_T_p"]) == {"8"}
    # the graph path (static cache, rewound each time, 4-D mask; emulated capture on CPU) computes what eager does
    assert max(res["graph_vs_eager_max_abs_logit_diff"].values()) < 1e-4
    assert res["T_p_floor_weights_s"] > 0
    runs = res["engine"]["runs"]
    assert set(runs) == {f"noise0-{m}-{t}" for m in ("eager", "graph") for t in ("chain", "tree")}
    chain = runs["noise0-eager-chain"]
    assert chain["tau"] == 6.0 and chain["identical_runs"]  # the agreeing pair accepts every draft
    assert 0 < chain["engine_efficiency"] and chain["predicted_speedup"] > 0
    assert (tmp_path / "gpu_shapes.json").exists() and "Fig. 9" in (tmp_path / "gpu_shapes.md").read_text()


def test_gpu_shapes_keeps_going_past_a_failing_section(tmp_path, monkeypatch):
    """A section that raises (here one cache capacity, as an out-of-memory would) is recorded
    under ``errors``; the sections after it run and every engine run is on disk. Also: the
    kernel table on the CPU (aten ops), engine runs in graph mode only."""
    gs = load_script("gpu_shapes")
    real = gs.capacity_time

    def flaky(cfg, target, mode, capacity):
        if capacity == 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return real(cfg, target, mode, capacity)

    monkeypatch.setattr(gs, "capacity_time", flaky)
    saved = []
    real_write = gs.write_report
    monkeypatch.setattr(gs, "write_report", lambda res, out: (saved.append(json.loads(json.dumps(res))),
                                                              real_write(res, out))[1])
    cfg = gs.parse_args(["--small", "--device", "cpu", "--context", "32", "--gammas", "5", "--trees", "8",
                         "--batches", "1", "--repeats", "1", "--warmup", "1", "--copy-mib", "1", "--modes",
                         "eager,graph", "--engine-modes", "graph", "--kernels", "--capacities", "0,256,512",
                         "--engine-new-tokens", "6", "--engine-repeats", "1", "--engine-noise", "0",
                         "--out", str(tmp_path)])
    res = gs.run(cfg, log=lambda s: None)
    assert list(res["errors"]) == ["capacity 256"] and "out of memory" in res["errors"]["capacity 256"]
    assert set(res["capacity"]["T_p"]) == {"36", "512"}  # context + room (32 + 4), and the next one
    assert res["kernels"]["device"] == "cpu" and res["kernels"]["kernels_per_step"] > 0
    assert set(res["engine"]["runs"]) == {"noise0-graph-chain", "noise0-graph-tree"}
    assert "engine_efficiency" in res["engine"]["runs"]["noise0-graph-chain"]
    engine_saves = [len(x.get("engine", {}).get("runs", {})) for x in saved]
    assert 1 in engine_saves and 2 in engine_saves  # each engine run written as it ended
    md = (tmp_path / "gpu_shapes.md").read_text()
    assert "capacity 256 failed" in md and "aten ops" in md
    assert gs.main(["--small", "--device", "cpu", "--context", "16", "--gammas", "1", "--trees", "4",
                    "--batches", "1", "--repeats", "1", "--warmup", "0", "--copy-mib", "1", "--modes", "eager",
                    "--no-engine", "--capacities", "256", "--out", str(tmp_path / "b")]) == 3


def test_gpu_shapes_compile_side_by_side(tmp_path, monkeypatch):
    """``--compile``: T_p compiled beside uncompiled per compile mode, and a ``chain+compile``
    engine run beside the chain, each written as it ends. torch.compile is a pass-through here
    (inductor's minutes are the GPU pass's; tests/core/test_compile.py compiles for real)."""
    gs = load_script("gpu_shapes")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    saved = []
    real_write = gs.write_report
    monkeypatch.setattr(gs, "write_report", lambda res, out: (saved.append(json.loads(json.dumps(res))),
                                                              real_write(res, out))[1])
    cfg = gs.parse_args(["--small", "--device", "cpu", "--context", "32", "--gammas", "5", "--trees", "8",
                         "--batches", "1", "--repeats", "1", "--warmup", "1", "--copy-mib", "1", "--modes", "graph",
                         "--engine-new-tokens", "6", "--engine-repeats", "1", "--engine-noise", "0", "--compile",
                         "--compile-modes", "engine,layers+mmspec-graph", "--out", str(tmp_path)])
    res = gs.run(cfg, log=lambda s: None)
    assert not res.get("errors"), res.get("errors")
    eng = res["compile"]["engine"]
    assert eng["s"] > 0 and eng["plain_s"] > 0 and eng["compile_s"] > 0 and eng["fell_back"] is None
    assert set(res["compile"]) == {"engine", "layers+mmspec-graph"}
    assert {1, 2} <= {len(x["compile"]) for x in saved if "compile" in x}  # each mode written as it ended
    runs = res["engine"]["runs"]
    plain, compiled = runs["noise0-graph-chain"], runs["noise0-graph-chain+compile"]
    assert (plain["engine"], compiled["engine"]) == ("static", "static+compile")
    assert compiled["tau"] == plain["tau"] and compiled["identical_runs"] and compiled["step_s"] > 0
    assert compiled["compile_s"] > 0 and plain["compile_s"] == 0.0
    md = (tmp_path / "gpu_shapes.md").read_text()
    assert "uncompiled" in md and "static+compile (compiled in" in md
    with pytest.raises(SystemExit):
        gs.parse_args(["--compile-modes", "default+mmspec-graph"])


@pytest.mark.parametrize("script", ["speed", "gpu_shapes"])
def test_help(script):
    out = subprocess.run([sys.executable, str(ROOT / "perf" / f"{script}.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--out" in out.stdout


def test_profile_draft_step_runs_on_embedded_pack():
    out = subprocess.run([sys.executable, str(ROOT / "perf" / "profile_draft_step.py"), "--family", "chartqa",
                          "--steps", "2", "--top", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "us self CPU per draft step" in out.stdout
    assert out.stdout.count("aten::") >= 2  # the step's profile table


def test_speed_run_with_a_head(speed, tmp_path):
    from mmspec.heads import build_head

    target = make_llava(0)
    build_head(target, "eagle").save(tmp_path / "h")
    models = BenchModels(target, noisy_copy(target, 1), make_tokenizer(), None, _Captioner(), source="tiny")
    cfg = speed.SpeedConfig(max_new_tokens=8, repeats=1, latency_repeats=1, device="cpu", out=str(tmp_path / "o"),
                            command="test", step_rounds=1, ensemble="M", trees=(), heads=(f"eagle={tmp_path / 'h'}",),
                            profile=False)
    res = speed.run(cfg, models=models, prompts=_tiny_prompts(speed, (1,)), log=lambda s: None)
    assert res["identical"], res["mismatches"]
    assert {"mmspec_eagle", "mmspec_eagle+tree"} <= set(res["summary"]["systems"])
    assert "predicted_speedup" not in res["engine"]["efficiency"]["mmspec_eagle"]  # eq. 2 is not a head's formula


def test_video_speed_report_units_and_the_target_row():
    """The table's header names the unit its cells show (ms per clip), and a figure the target
    has none of reads '-', not 0.0 ms."""
    vs = load_script("video_speed")
    row = {"tokens_per_s": 10.0, "speedup_vs_target": 1.0}
    r = {"date": "d", "command": "c", "machine": {"platform": "p", "cpu_count": 2, "torch": "t"}, "clips": ["a"],
         "identical": True,
         "rows": [{**row, "system": "target", "tau": None, "vision_s_per_clip": 0.0123,
                   "substitute_s_per_clip": None},
                  {**row, "system": "mmspec_E", "tau": 2.5, "vision_s_per_clip": 0.004,
                   "substitute_s_per_clip": 0.002}],
         "draft_encoding_s": {k: 0.001 for k in ("video_tower_and_projector", "events_simulate_bin_encode",
                                                 "events_recorded_bin_encode", "events_encoder_only")}
         | {k: 1.0 for k in ("ratio_events_over_video", "ratio_recorded_over_video", "ratio_encoder_over_video")}}
    lines = vs.markdown(r).splitlines()
    header = next(x for x in lines if x.startswith("| system"))
    assert "ms/clip" in header and " s/clip" not in header
    assert "| target | 10.0 | 1.00x | - | 12.3 | - |" in lines
    assert "| mmspec_E | 10.0 | 1.00x | 2.50 | 4.0 | 2.0 |" in lines
