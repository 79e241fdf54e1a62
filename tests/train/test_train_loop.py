"""The one training loop (:func:`mmspec.train.loop.fit`) and what every ``train`` command gets from
it: Ctrl-C keeps the finished steps (atomically) and the same command resumes them to the weights
an uninterrupted run ends with; a resume with other settings, or past --steps, is refused naming
each setting; every bad option is refused in one line before anything is loaded or written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mmspec.cli import app
from mmspec.errors import MMSpecError
from mmspec.train.loop import FitConfig, TrainingInterrupted, fit, fmt_loss, lr_factor, write_atomically

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    """Without whitespace or the error box's sides: the console wraps long lines anywhere, paths included."""
    return "".join(text.replace("│", " ").split())
EMBEDDED = ROOT / "src" / "mmspec" / "assets" / "embedded"


# --------------------------------------------------------------------------- the loop itself
def _toy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 1)


def _step(model, info):
    g = torch.Generator().manual_seed(info.step)  # the batch is a function of the step
    x = torch.randn(8, 4, generator=g)
    y = x.sum(-1, keepdim=True)
    return torch.nn.functional.mse_loss(model(x), y), {"n": 8}


def _interrupt_at(k: int):
    def step(model, info):
        if info.step == k:
            raise KeyboardInterrupt
        return _step(model, info)
    return step


def test_ctrl_c_keeps_the_finished_steps_and_a_rerun_ends_where_an_uninterrupted_run_ends(tmp_path):
    cfg = FitConfig(label="toy", steps=8, lr=0.05, warmup_steps=2, checkpoint=tmp_path / "ck.pt",
                    settings={"lr": 0.05}, progress=False)
    a = _toy()
    with pytest.raises(TrainingInterrupted) as e:
        fit(a, _interrupt_at(3), cfg, log=lambda s: None)
    assert e.value.step == 3 and "kept step 3 of 8" in str(e.value) and "same command" in str(e.value)
    state = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert state["step"] == 3 and len(state["history"]) == 3
    logs = []
    res = fit(_toy(), _step, cfg, log=logs.append)  # a fresh model: everything comes from the checkpoint
    assert res.start == 3 and res.steps == 8 and any("at step 3 of 8" in x for x in logs)
    b = _toy()
    ref = fit(b, _step, FitConfig(**{**cfg.__dict__, "checkpoint": None}), log=lambda s: None)
    assert res.losses == ref.losses
    done = _toy()
    fit(done, _step, cfg, log=lambda s: None)  # a third run: nothing to do, the weights come back
    for p, q in zip(done.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_resume_refuses_other_settings_and_a_checkpoint_past_steps(tmp_path):
    cfg = FitConfig(label="toy", steps=4, lr=0.05, checkpoint=tmp_path / "ck.pt", progress=False,
                    settings={"variant": "eagle", "batch_size": 16, "lr": 0.05})
    fit(_toy(), _step, cfg, log=lambda s: None)
    other = FitConfig(**{**cfg.__dict__, "settings": {"variant": "msd", "batch_size": 8, "lr": 0.05}})
    with pytest.raises(MMSpecError, match=r"--batch-size 16 there, 8 now, --variant 'eagle' there, 'msd' now.*--fresh"):
        fit(_toy(), _step, other, log=lambda s: None)
    with pytest.raises(MMSpecError, match=r"4 steps of .*past --steps 2: nothing to do; raise --steps above 4"):
        fit(_toy(), _step, FitConfig(**{**cfg.__dict__, "steps": 2}), log=lambda s: None)
    fit(_toy(), _step, FitConfig(**{**other.__dict__, "resume": False}), log=lambda s: None)  # --fresh


def test_a_save_cut_short_leaves_the_last_checkpoint_whole(tmp_path):
    path = tmp_path / "ck.pt"
    write_atomically(path, lambda tmp: torch.save({"step": 1}, tmp))

    def half_then_interrupt(tmp):
        tmp.write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, half_then_interrupt)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_the_time_budget_saves_and_a_rerun_has_nothing_left(tmp_path):
    cfg = FitConfig(label="toy", steps=10**9, minutes=0.002, lr=0.05, checkpoint=tmp_path / "ck.pt", progress=False)
    logs = []
    res = fit(_toy(), _step, cfg, log=logs.append)
    assert res.stopped == "budget" and res.steps > 0 and any("time budget" in x for x in logs)
    assert torch.load(tmp_path / "ck.pt", weights_only=False)["step"] == res.steps
    assert fit(_toy(), _step, cfg, log=lambda s: None).stopped == "done"


def test_a_time_budget_shows_its_share_and_the_step_on_the_bar(tmp_path, capsys):
    """With --minutes the bar counts the budget's share, so its remaining time is the run's (a
    bar over --steps 100000 promised hours); the step count rides in the postfix."""
    cfg = FitConfig(label="toy", steps=10**9, minutes=0.002, lr=0.05, checkpoint=None, progress=True)
    res = fit(_toy(), _step, cfg, log=lambda s: None)
    err = capsys.readouterr().err
    assert res.stopped == "budget" and "100.0/100%" in err and f"step={res.steps}" in err
    assert "/1000000000" not in err
    assert res.history[-1]["lr"] < 0.05 * 0.05  # every caller's schedule follows the budget: it ends at the floor
    fit(_toy(), _step, FitConfig(label="toy", steps=3, lr=0.05, progress=True), log=lambda s: None)
    assert "3/3" in capsys.readouterr().err  # steps alone: the bar counts steps


def test_schedules_of_the_four_callers():
    recipe = FitConfig(steps=100, warmup_ratio=0.03)
    from mmspec.train.recipe import lr_at

    for p in (0.0, 0.01, 0.03, 0.5, 0.99):  # by steps: step = progress x steps
        assert lr_factor(recipe, round(p * 100), p) == pytest.approx(lr_at(p, 1.0, 0.03))
    head = FitConfig(steps=100, warmup_steps=50, min_lr_ratio=0.1)
    assert lr_factor(head, 0, 0.0) == pytest.approx(1 / 50)
    assert lr_factor(head, 99, 1.0) == pytest.approx(0.1)
    assert lr_factor(FitConfig(steps=10), 5, 0.5) == pytest.approx(0.5)
    assert fmt_loss(7.720273971557617) == "7.72" and fmt_loss(0.0123456) == "0.01235" and fmt_loss(None) == "-"
    for bad in (dict(steps=0), dict(steps=None), dict(steps=5, minutes=-1.0), dict(steps=5, lr=math.nan),
                dict(steps=5, grad_clip=0.0), dict(steps=5, checkpoint_every=0)):
        with pytest.raises(MMSpecError):
            FitConfig(**bad)


def test_a_slow_first_step_does_not_skip_the_warm_up():
    """Issue 61 item 8: `train head --minutes 1.5`'s first step took 17% of the budget, past the
    5% warm-up share: step 1 ran at 1.2e-07, step 2 at the peak. The warm-up lasts at least
    min_warmup_steps (10) steps, whatever the clock says."""
    head = FitConfig(steps=100_000, minutes=1.5, warmup_ratio=0.05, min_lr_ratio=0.1)
    assert lr_factor(head, 0, 0.0) == 0.0
    ramp = [lr_factor(head, s, 0.17 + 0.001 * s) for s in range(1, 9)]
    assert ramp == pytest.approx([(s + 1) / 10 for s in range(1, 9)])  # linear over the first ten steps
    assert lr_factor(head, 10, 0.2) == pytest.approx(lr_factor(FitConfig(steps=100_000, warmup_ratio=0.05,
                                                                         min_lr_ratio=0.1), 10, 0.2))
    short = FitConfig(steps=5, warmup_ratio=0.05)  # a 5-step run: the floor is its share, one step
    assert lr_factor(short, 0, 0.2) == lr_factor(FitConfig(steps=5, warmup_ratio=0.05, min_warmup_steps=1), 0, 0.2)
    with pytest.raises(MMSpecError):
        FitConfig(steps=5, min_warmup_steps=0)


def test_a_budget_is_not_overrun_by_a_step_and_a_slow_first_step_warms_up(monkeypatch, tmp_path):
    """A fake clock: the first step takes 15 s of a 90 s budget, the others 10 s. The schedule
    warms up over ten steps (not the one slow step), and no step is started that would end past
    the budget (the last one did: 95 s)."""
    import mmspec.train.loop as loop

    now = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])

    def slow(model, info):
        now[0] += 15.0 if info.step == 0 else 10.0
        return _step(model, info)

    cfg = FitConfig(label="toy", steps=10**6, minutes=1.5, lr=1.0, warmup_ratio=0.05, progress=False,
                    checkpoint=tmp_path / "ck.pt")
    res = fit(_toy(), slow, cfg, log=lambda s: None)
    lrs = [h["lr"] for h in res.history]
    assert res.stopped == "budget" and res.history[-1]["seconds"] <= 90.0 and res.steps == 8, res.history
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.2) and lrs[1:] == sorted(lrs[1:])  # still warming up
    assert fit(_toy(), slow, cfg, log=lambda s: None).stopped == "done"  # 85 s spent: no room for a step

    def first_slow(model, info):  # a loaded CPU: the first step took 76% of the budget, the rest 1 s
        now[0] += 68.0 if info.step == 0 else 1.0
        return _step(model, info)

    now[0] = 0.0
    res = fit(_toy(), first_slow, FitConfig(label="toy", steps=10**6, minutes=1.5, lr=1.0, warmup_ratio=0.05,
                                            progress=False), log=lambda s: None)
    assert res.steps == 23 and res.history[-1]["seconds"] == 90.0  # not stopped after step 1 by its 68 s


# --------------------------------------------------------------------------- the commands
HEAD = ["train", "head", "--target", str(EMBEDDED / "target"), "--families", "chartqa", "--samples", "2",
        "--steps", "5", "--batch-size", "2", "--threads", "1"]


def _weights(d: Path) -> dict:
    return load_file(str(d / "model.safetensors"))


def test_train_head_ctrl_c_keeps_a_usable_head_and_the_same_command_resumes(tmp_path, monkeypatch):
    import mmspec.train.head as th

    real, calls = th.head_loss, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "head"
    monkeypatch.setattr(th, "head_loss", interrupted)
    r = CliRunner().invoke(app, HEAD + ["--out", str(out)])
    assert r.exit_code == 130, r.output
    assert _flat(f"kept step 2 of 5 in {out / 'checkpoints' / 'head.pt'}") in _flat(r.output)
    assert "samecommand" in _flat(r.output)
    assert "note:trainingontheworld'sreferenceanswers" in _flat(r.output)  # --answers is the better data
    assert torch.load(out / "checkpoints" / "head.pt", weights_only=False)["step"] == 2
    assert json.loads((out / "mmspec_head.json").read_text())["trained"]["steps"] == 2  # a usable head
    monkeypatch.setattr(th, "head_loss", real)
    r = CliRunner().invoke(app, HEAD + ["--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "atstep2of5" in _flat(r.output) and "loss " in r.output
    loss = r.output.split("loss ")[-1].split(")")[0]
    assert len(loss.replace(".", "").lstrip("0")) <= 4, loss  # 4 significant digits, not 16
    ref = tmp_path / "ref"
    assert CliRunner().invoke(app, HEAD + ["--out", str(ref)]).exit_code == 0
    a, b = _weights(out), _weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "mmspec_head.json").read_text())["trained"]["steps"] == 5


def test_train_head_resume_refuses_other_settings(tmp_path):
    import re

    out = tmp_path / "head"
    base = HEAD[:-6] + ["--steps", "2", "--batch-size", "2", "--threads", "1", "--out", str(out)]
    assert CliRunner().invoke(app, base).exit_code == 0
    for extra, want in ((["--variant", "msd"], r"--variant 'eagle' there, 'msd' now"),
                        (["--lr", "0.01"], r"--lr 0.001 there, 0.01 now"),
                        (["--samples", "3"], r"--samples 2 there, 3 now")):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 2 and "--fresh" in _flat(r.output), r.output
        assert re.search(_flat(want), _flat(r.output)), r.output
    r = CliRunner().invoke(app, base + ["--steps", "1"])
    assert r.exit_code == 2 and "past--steps1" in _flat(r.output), r.output
    r = CliRunner().invoke(app, base + ["--variant", "msd", "--fresh"])
    assert r.exit_code == 0, r.output


def test_msd_text_stage_is_a_share_of_the_time_budget_when_it_ends_training(target, tmp_path):
    """A --minutes budget that ends training long before --steps: the text-only stage takes its
    share of the budget (it used to be a third of --steps, so the run never saw an image)."""
    from helpers.tiny import IMG, make_prompt
    from mmspec.train.head import HeadTrainConfig, Sequence_, train_head

    seqs = []
    for i in range(4):
        ids, pv = make_prompt(1, 16, seed=i)
        seqs.append(Sequence_(ids[0], pv, text_only=Sequence_(ids[0][ids[0] != IMG], None)))
    train_head(target, seqs, HeadTrainConfig(variant="msd", out=str(tmp_path), steps=100_000, minutes=0.03,
                                             batch_size=2, resume=False, progress=False), log=lambda s: None)
    stages = [json.loads(x)["stage"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert stages[0] == "text" and stages[-1] == "multimodal", stages
    trained = json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]
    assert trained["text_steps"] == stages.count("text")


def _fake_model(tmp_path: Path, model_type: str) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


BAD = [
    # train head
    (["train", "head", "--target", "{T}", "--answers", "{tmp}/none.jsonl"], r"answers file .*none\.jsonl not found"),
    (["train", "head", "--target", "{T}", "--variant", "msd", "--steps", "10", "--text-steps", "10"],
     r"--text-steps must be .* 0 to --steps - 1"),
    (["train", "head", "--target", "{T}", "--text-steps", "2"], r"--text-steps sizes msd's"),
    (["train", "head", "--target", "{T}", "--threads", "0"], r"--threads must be >= 1"),
    (["train", "head", "--target", "{T}", "--minutes", "-1"], r"--minutes must be a finite number > 0"),
    (["train", "head", "--target", "{T}", "--ttt-depth", "0"], r"--ttt-depth must be a whole number >= 1"),
    (["train", "head", "--target", "{T}", "--ttt-decay", "0"], r"--ttt-decay must be a finite number > 0"),
    (["train", "head", "--target", "{T}", "--eval-every-minutes", "-1"], r"--eval-every-minutes must be .* >= 0"),
    (["train", "head", "--target", "{T}", "--eval-prompts", "0"], r"--eval-prompts must be >= 1"),
    (["train", "head", "--target", "{tmp}/nope"], r"--target .*nope not found"),
    (["train", "head", "--target", "{NEXT}"], r"is a 'llava_next' model; .*LLaVA-1\.5.*--data sharegpt"),
    (["train", "head", "--target", "{NEXT}", "--data", "sharegpt:{tmp}/x.json", "--draft-vocab", "8"],
     r"--draft-vocab sizes an EAGLE-3"),
    (["train", "head", "--target", "{T}", "--data", "json:{tmp}/x.json"], r"unknown --data 'json:"),
    (["train", "head", "--target", "{T}", "--data", "sharegpt:{tmp}/x.jsonl"], r"x\.jsonl not found"),
    (["train", "head", "--target", "{T}", "--frames", "0"], r"--frames must be >= 1"),
    (["train", "head", "--target", "{BARE}"], r"--target .* lacks an image processor .* and tokenizer files"),
    (["train", "video", "--target", "{BARE}"], r"--target .* lacks an image processor"),
    (["train", "head", "--target", "{T}", "--families", "motion"], r"unknown world family 'motion'"),
    (["train", "head", "--target", "{T}", "--samples", "0"], r"--samples must be >= 1"),
    (["train", "head", "--target", "{T}", "--variant", "eagle3", "--feature-layers", "6,3,1"],
     r"--feature-layers '6,3,1': an eagle3 head fuses three distinct decoder-layer outputs in ascending order.*"
     r"e\.g\. --feature-layers 1,4,6"),
    (["train", "head", "--target", "{T}", "--variant", "eagle3", "--feature-layers", "1,1,4"], r"ascending order"),
    (["train", "head", "--target", "{T}", "--variant", "eagle3", "--feature-layers", "1,4"], r"ascending order"),
    (["train", "head", "--target", "{T}", "--feature-layers", "0,40"], r"the target has 10 decoder layers"),
    (["train", "head", "--target", "{T}", "--data", "llava-instruct:{tmp}/x.json"], r"x\.json not found"),
    # train video
    (["train", "video", "--samples", "0"], r"--samples must be a whole number >= 1"),
    (["train", "video", "--n-frames", "0"], r"--n-frames must be from 1 to 8"),
    (["train", "video", "--n-frames", "9"], r"--n-frames must be from 1 to 8"),
    (["train", "video", "--steps", "0"], r"--steps must be a whole number >= 1"),
    (["train", "video", "--minutes", "-1"], r"--minutes must be a finite number > 0"),
    (["train", "video", "--draft-minutes", "0"], r"--draft-minutes must be a finite number > 0"),
    (["train", "video", "--target", "{tmp}/nope"], r"--target .*nope not found"),
    (["train", "video", "--draft", "{NEXT}"], r"--draft .* is a 'llava_next' model"),
    (["train", "align", "--draft", "{BARE}"], r"--draft .* lacks an image processor"),
    (["train", "video", "--eval-samples", "0"], r"--eval-samples must be >= 1"),
    # train align
    (["train", "align", "--draft", "{D}", "--samples", "0"], r"--samples must be >= 1"),
    (["train", "align", "--draft", "{D}", "--n-tokens", "7"], r"--n-tokens 7: .*8x8 patch grid.*64, 16, 4, 1"),
    (["train", "align", "--draft", "{D}", "--steps", "0"], r"--steps must be a whole number >= 1"),
    (["train", "align", "--draft", "{D}", "--minutes", "-1"], r"--minutes must be a finite number > 0"),
    (["train", "align", "--draft", "{tmp}/nope"], r"--draft .*nope not found"),
    (["train", "align", "--draft", "{D}", "--families", "chartqa"], r"unknown video family 'chartqa'"),
    # train stage / embedded
    (["train", "stage", "--size", "tiny", "--threads", "0"], r"--threads must be >= 1"),
    (["train", "stage", "--size", "tiny", "--pooled-tokens", "0"], r"--pooled-tokens must be a whole number >= 1"),
    (["train", "stage", "--size", "tiny", "--device", "gpu"], r"--device 'gpu' is not a device"),
    (["train", "embedded", "--threads", "0"], r"--threads must be >= 1"),
    (["train", "embedded", "--steps-scale", "0"], r"--steps-scale must be a finite number > 0"),
    (["train", "embedded", "--n-train-per-family", "0"], r"--n-train-per-family must be a whole number >= 1"),
    (["train", "embedded", "--device", "gpu"], r"--device 'gpu' is not a device"),
    # train answers (issue 61 item 7: a negative count wrote nothing and exited 0; 0 named a flag not given)
    (["train", "answers", "--n-train-per-family", "-3"],
     r"Invalid value for --n-train-per-family: must be a whole number of samples per family >= 0, got -3"),
    (["train", "answers", "--n-train-per-family", "0"],
     r"Invalid value for --n-train-per-family: every family has 0 samples \(--n-train-per-family 0\); "
     r"nothing to answer"),
    (["train", "answers", "--n-train-per-family", "0", "--family-samples", "vist=0"],
     r"Invalid value for --family-samples: every family has 0 samples \(--n-train-per-family 0 "
     r"--family-samples vist=0\)"),
    (["train", "stage", "--size", "tiny", "--n-train-per-family", "-1"],
     r"--n-train-per-family: must be a whole number of samples per family >= 0, got -1"),
]


@pytest.mark.parametrize("args, want", BAD, ids=[" ".join(a[1:4]) + " " + a[-1] for a, _ in BAD])
def test_bad_train_options_are_refused_before_anything_is_written(tmp_path, args, want):
    import re

    subs = {"{T}": str(EMBEDDED / "target"), "{D}": str(EMBEDDED / "draft"), "{tmp}": str(tmp_path)}
    if any("{NEXT}" in a for a in args):
        subs["{NEXT}"] = str(_fake_model(tmp_path, "llava_next"))
    if any("{BARE}" in a for a in args):  # a LLaVA config, no processor
        subs["{BARE}"] = str(_fake_model(tmp_path, "llava"))
    args = [a for a in args]
    for k, v in subs.items():
        args = [a.replace(k, v) for a in args]
    out = tmp_path / "out"
    r = CliRunner().invoke(app, args + ["--out", str(out)])
    assert r.exit_code == 2, r.output
    assert re.search(_flat(want), _flat(r.output)) and "Traceback" not in r.output, r.output
    assert not out.exists()


# --------------------------------------------------------------------------- stage, align, video
def test_train_stage_ctrl_c_keeps_the_steps_and_resumes_to_the_same_weights(tmp_path, monkeypatch):
    import mmspec.train.recipe as recipe

    base = ["train", "stage", "--size", "tiny", "--batch-size", "2", "--n-train-per-family", "1", "--no-bf16",
            "--steps", "4", "--threads", "1"]
    real, calls = recipe.batch_loss, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "s"
    monkeypatch.setattr(recipe, "batch_loss", interrupted)
    r = CliRunner().invoke(app, base + ["--out", str(out)])
    assert r.exit_code == 130 and "keptstep2of4" in _flat(r.output), r.output
    assert torch.load(out / "checkpoints" / "stage.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(recipe, "batch_loss", real)
    r = CliRunner().invoke(app, base + ["--out", str(out), "--lr", "1e-3"])
    assert r.exit_code == 2 and "--fresh" in _flat(r.output)  # another --lr: refused
    r = CliRunner().invoke(app, base + ["--out", str(out)])
    assert r.exit_code == 0 and "atstep2of4" in _flat(r.output), r.output
    assert not (out / "checkpoints").exists()  # the stage is saved: its checkpoint goes
    ref = tmp_path / "ref"
    assert CliRunner().invoke(app, base + ["--out", str(ref)]).exit_code == 0
    a, b = _weights(out), _weights(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_align_ctrl_c_and_resume(tmp_path, monkeypatch):
    import mmspec.train.align as al
    from mmspec.train.align import AlignConfig, train_align

    torch.manual_seed(0)
    subs = [torch.rand(4, 2, 96, 96) for _ in range(6)]  # events: [n_bins, 2, H, W]
    targets = [torch.randn(4, 16) for _ in range(6)]  # [n_tokens, H]
    cfg = AlignConfig(kind="events", out=str(tmp_path / "a"), n_tokens=4, steps=5, batch_size=2, progress=False,
                      notes={"samples": 3})
    real, calls = al.align_loss, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(al, "align_loss", interrupted)
    with pytest.raises(TrainingInterrupted, match="kept step 3 of 5"):
        train_align(subs, targets, cfg, log=lambda s: None)
    monkeypatch.setattr(al, "align_loss", real)
    with pytest.raises(MMSpecError, match="--samples 3 there, 4 now"):
        train_align(subs, targets, AlignConfig(**{**cfg.__dict__, "notes": {"samples": 4}}), log=lambda s: None)
    a = train_align(subs, targets, cfg, log=lambda s: None)
    b = train_align(subs, targets, AlignConfig(**{**cfg.__dict__, "out": str(tmp_path / "b")}), log=lambda s: None)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert json.loads((tmp_path / "a" / "mmspec_substitute.json").read_text())["trained"]["steps"] == 5


def test_train_video_ctrl_c_resumes_and_labels_each_role(tmp_path, monkeypatch):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    import mmspec.train.video as tv
    from mmspec.train.video import VideoTrainConfig, build_video_llava, train_video
    from mmspec.world import make_video_sample
    from mmspec.world.processor import clip_inputs

    proc = AutoProcessor.from_pretrained(EMBEDDED / "target")
    tok, ip = proc.tokenizer, proc.image_processor
    img = LlavaForConditionalGeneration.from_pretrained(EMBEDDED / "draft", dtype=torch.float32)
    model, vid = build_video_llava(img, tok, 2)
    clips = [make_video_sample("motion", "train", i) for i in range(2)]
    data = [clip_inputs(s, tok, ip, vid, 2, 65, answer=s.answer) for s in clips]
    cfg = VideoTrainConfig(out=str(tmp_path / "v"), n_frames=2, samples=2, steps=3, batch_size=1, role="draft",
                           progress=False)
    seen = []
    real_fit, real_batch, calls = tv.fit, tv._batch, []

    def spy(model, step, fcfg, **k):
        seen.append(fcfg.label)
        return real_fit(model, step, fcfg, **k)

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_batch(*a)

    monkeypatch.setattr(tv, "fit", spy)
    monkeypatch.setattr(tv, "_batch", interrupted)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TrainingInterrupted, match="train video draft kept step 1 of 3"):
        train_video(model, data, cfg, tok.pad_token_id, log=lambda s: None)
    assert seen == ["train video draft"]
    monkeypatch.setattr(tv, "_batch", real_batch)
    resumed = train_video(model, data, cfg, tok.pad_token_id, log=lambda s: None)
    model.load_state_dict(state)
    fresh = train_video(model, data, VideoTrainConfig(**{**cfg.__dict__, "resume": False,
                                                          "out": str(tmp_path / "w")}), tok.pad_token_id,
                        log=lambda s: None)
    assert resumed == fresh and len(resumed) == 3


def test_the_video_pairs_processor(tmp_path, monkeypatch):
    """With torchvision, the pair's saved processor is Video-LLaVA's: AutoProcessor gives one whose
    ``videos=`` makes what clip_inputs makes; without it, a one-line error names torchvision and
    clip_inputs stays the way in."""
    from transformers import AutoProcessor

    import mmspec.train.video as tv
    from mmspec.world import make_video_sample
    from mmspec.world.tokenizer import add_video_token

    proc = AutoProcessor.from_pretrained(EMBEDDED / "target")
    tok, ip = proc.tokenizer, proc.image_processor
    vid = add_video_token(tok)
    s = make_video_sample("motion", "test", 0)
    want = tv.clip_inputs(s, tok, ip, vid, 4, 65)
    monkeypatch.setattr(tv, "torchvision_works", lambda: False)
    with pytest.raises(MMSpecError, match="needs a torchvision"):
        tv.video_processor(tok, ip, 12)
    monkeypatch.undo()
    if not tv.torchvision_works():
        pytest.skip("torchvision does not import here: the round trip needs it")
    tv.video_processor(tok, ip, 12).save_pretrained(tmp_path)
    got = AutoProcessor.from_pretrained(tmp_path)
    assert type(got).__name__ == "VideoLlavaProcessor"
    idx = [round(i * (len(s.frames) - 1) / 3) for i in range(4)]
    x = got(text=s.prompt, videos=[[s.frames[i] for i in idx]], return_tensors="pt")
    assert torch.equal(x["input_ids"][0], want["input_ids"])
    torch.testing.assert_close(x["pixel_values_videos"], want["pixel_values_videos"])


def test_train_embedded_ctrl_c_keeps_the_finished_stages_and_resumes(tmp_path, monkeypatch):
    """An interrupted pack keeps each stage's checkpoint; the rerun restores the finished stages
    (nothing trained again), resumes the interrupted one, and clears out/checkpoints when done."""
    import mmspec.train.recipe as recipe
    from mmspec.train.config import RecipeConfig, StageConfig
    from mmspec.train.pack import run_pack

    tiny = lambda name, trainable, **kw: StageConfig(name, trainable, lr=1e-3, steps=2, batch_size=2, **kw)  # noqa: E731
    cfg = RecipeConfig(target_size="tiny", draft_size="tiny-draft", captioner_size="tiny-draft",
                       n_train_per_family=1, n_eval_per_family=1, distill_per_family=0, max_answer_tokens=8,
                       autocast_bf16=False, target_stages=(tiny("target-stage0", "all"),),
                       draft_stages=(tiny("draft-stage1", "projector"),),
                       pooled_stage=tiny("draft-pooled", "projector+lm", pooled_tokens=16),
                       captioner_stages=(tiny("captioner-stage1", "projector"),))
    real, calls = recipe.batch_loss, []

    def interrupted(model, batch, *a, **k):
        if model.training:
            calls.append(1)
            if len(calls) == 4:  # the draft's second step
                raise KeyboardInterrupt
        return real(model, batch, *a, **k)

    out = tmp_path / "pack"
    monkeypatch.setattr(recipe, "batch_loss", interrupted)
    with pytest.raises(TrainingInterrupted, match="draft-stage1 kept step 1 of 2"):
        run_pack(cfg, out, progress=False, log=lambda s: None)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["draft-stage1.pt", "target-stage0.pt"]
    monkeypatch.setattr(recipe, "batch_loss", real)
    logs = []
    run_pack(cfg, out, progress=False, log=logs.append)
    assert any("target-stage0" in x and "finished already" in x for x in logs), logs
    assert any("resuming draft-stage1" in x and "at step 1 of 2" in x for x in logs), logs
    assert not (out / "checkpoints").exists() and (out / "captioner" / "config.json").exists()


def test_a_real_sigint_during_a_save_waits_for_the_save(tmp_path):
    """Ctrl-C (a real SIGINT) that lands while a checkpoint is written is held until the file
    is whole, then raised; one that lands in a step stops training with the steps kept."""
    import os
    import signal

    path = tmp_path / "ck.pt"

    def save(tmp):
        os.kill(os.getpid(), signal.SIGINT)  # delivered now, acted on after the save
        torch.save({"step": 2}, tmp)

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, save)
    assert torch.load(path, weights_only=False) == {"step": 2}

    def signalled(model, info):
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return _step(model, info)

    cfg = FitConfig(label="toy", steps=6, lr=0.05, checkpoint=tmp_path / "real.pt", progress=False)
    with pytest.raises(TrainingInterrupted) as e:
        fit(_toy(), signalled, cfg, log=lambda s: None)
    assert e.value.step in (2, 3) and torch.load(tmp_path / "real.pt", weights_only=False)["step"] == e.value.step


def test_the_head_loss_log_grows_with_each_checkpoint(target, tmp_path, monkeypatch):
    """train_log.jsonl is written at every checkpoint, not only at the end."""
    import mmspec.train.head as th
    from helpers.tiny import make_prompt
    from mmspec.train.head import HeadTrainConfig, Sequence_, train_head

    seqs = [Sequence_(make_prompt(1, 16, seed=i)[0][0], make_prompt(1, 16, seed=i)[1]) for i in range(2)]
    real, seen = th.head_loss, []

    def watch(*a, **k):
        log = tmp_path / "train_log.jsonl"
        seen.append(len(log.read_text().splitlines()) if log.exists() else 0)
        return real(*a, **k)

    monkeypatch.setattr(th, "head_loss", watch)
    train_head(target, seqs, HeadTrainConfig(out=str(tmp_path), steps=5, batch_size=2, checkpoint_every=2,
                                             resume=False, progress=False), log=lambda s: None)
    assert seen == [0, 0, 2, 2, 4]


def test_a_head_checkpoint_of_the_older_layout_is_named_not_ignored(tmp_path):
    out = tmp_path / "head"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "train_state.pt").write_bytes(b"old")
    r = CliRunner().invoke(app, HEAD + ["--out", str(out)])
    assert r.exit_code == 2 and "oldermmspec" in _flat(r.output) and "--fresh" in _flat(r.output), r.output


@pytest.mark.parametrize("layers", [2, 3, 5])
def test_train_head_eagle3_chooses_layers_export_accepts_or_refuses_at_the_start(tmp_path, layers):
    """A shallow target: the eagle3 default was [1, 0, 0] on 3 layers, which export then refused.
    Now three ascending layers are chosen (3 layers: 0, 1, 2) and the head exports; a target of
    2 layers has no three, and training is refused before anything loads or is written."""
    from helpers.tiny import make_llava, make_processor, make_tokenizer

    target = make_llava(0, layers=layers, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    make_processor(make_tokenizer()).save_pretrained(tmp_path / "target")
    out = tmp_path / "head"
    r = CliRunner().invoke(app, ["train", "head", "--target", str(tmp_path / "target"), "--variant", "eagle3",
                                 "--families", "chartqa", "--samples", "2", "--steps", "1", "--batch-size", "2",
                                 "--threads", "1", "--out", str(out)])
    if layers == 2:
        assert r.exit_code == 2 and "eagle3headfusestheoutputsofthreedistinct" in _flat(r.output), r.output
        assert not out.exists()
        return
    assert r.exit_code == 0, r.output
    assert json.loads((out / "mmspec_head.json").read_text())["feature_layers"] == ([0, 1, 2] if layers == 3
                                                                                   else [1, 2, 3])
    r = CliRunner().invoke(app, ["export", "head", str(out), "--format", "eagle3", "--out", str(tmp_path / "e3")])
    assert r.exit_code == 0, r.output


def test_default_eagle3_layers_are_three_ascending_at_every_depth():
    from mmspec.heads.model import check_eagle3_layers, default_feature_layers

    for n in range(3, 130):
        check_eagle3_layers(default_feature_layers("eagle3", n), n)
    assert default_feature_layers("eagle3", 32) == (1, 15, 28)  # the engines' own at real depths
    with pytest.raises(MMSpecError, match="the target has 2"):
        check_eagle3_layers(default_feature_layers("eagle3", 2), 2)
