"""Training a head to the depth it drafts (issue 54): the training-time test unrolled under EAGLE-3's
diagonal mask scores each pass exactly as drafting does (the head fed its own predicted features
through its KV cache); training at depth 5 lowers every depth's loss; the depth is a setting a
resume must match (``--ttt-steps`` its older name)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers.head_data import greedy_sequences
from helpers.tiny import make_prompt
from mmspec.cli import app
from mmspec.heads import VARIANTS, build_head
from mmspec.train.head import HeadTrainConfig, Sequence_, head_settings, train_head
from mmspec.train.ttt import chain_valid, diagonal_mask, unroll

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "src" / "mmspec" / "assets" / "embedded"


def _flat(text: str) -> str:
    return "".join(text.split())


def _drafted(head, feats, embeds, pos, t0: int, depth: int) -> list[torch.Tensor]:
    """The head as drafting runs it on one sequence [1, n, H]: the true slots 0 .. t0 into its KV
    cache, then a chain, each node fed the head's own predicted feature of the one before at the
    next slot -> the predicted feature at slots t0, t0 + 1, ... (depth 0, 1, ...), each [1, H]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=head.decoder.config)
    h = head(feats[:, :t0 + 1], embeds[:, :t0 + 1], cache=cache, position_ids=pos[:, :t0 + 1])[:, -1:]
    out = [h[:, 0]]
    for d in range(1, depth):
        s = t0 + d
        h = head(h, embeds[:, s:s + 1], cache=cache, position_ids=pos[:, s:s + 1])
        out.append(h[:, 0])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_pass_scores_what_drafting_scores_at_that_depth(target, variant):
    """Pass k at slot t equals the node drafted at depth k - 1 of a chain whose last true slot is
    t - (k - 1), for every t and k, padding in the batch: the mask lets pass k see exactly pass 1's
    slots <= t - (k - 1) and its own chain. A plain causal forward on pass k's inputs (the earlier,
    simplified training) does not."""
    head = build_head(target, variant, seed=1)
    H, B, n, K = head.config.hidden_size, 2, 11, 5
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, n, H, generator=g, dtype=torch.float64)
    embeds = torch.randn(B, n, H, generator=g, dtype=torch.float64)
    pos = torch.arange(n)[None].expand(B, -1)
    real = torch.ones(B, n, dtype=torch.bool)
    real[1, 8:] = False  # row 1: 8 slots, right-padded
    with torch.no_grad():
        passes = unroll(head, feats, embeds, None, pos, real, K)
        compared = 0
        for b in range(B):
            L = int(real[b].sum())
            for t0 in range(L):
                chain = _drafted(head, feats[b:b + 1], embeds[b:b + 1], pos[b:b + 1], t0, min(K, L - t0))
                for d, h in enumerate(chain):
                    torch.testing.assert_close(passes[d][b, t0 + d], h[0], rtol=1e-9, atol=1e-10)
                    compared += d > 0
        assert compared > 40
        assert (passes[4] - passes[0]).abs().max() > 1e-3  # the deeper passes read other inputs
        x = torch.cat([feats[:, :1], passes[0][:, :-1]], dim=1)
        plain = head(x, embeds, position_ids=pos, attention_mask=real.long())  # pass 2 without its mask
        assert (plain[0, 3:] - passes[1][0, 3:]).abs().max() > 1e-3


def test_the_diagonal_mask_and_the_trained_slots_of_each_pass():
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    m = diagonal_mask(real, 3)[:, 0].int()  # [B, 5, 15]: pass 1's keys, pass 2's, pass 3's
    assert m[0, 4].tolist() == [1, 1, 1, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1]
    assert m[0, 1].tolist() == [0] * 5 + [1, 0, 0, 0, 0] + [0, 1, 0, 0, 0]
    assert m[1, 4].tolist() == [1, 1, 1, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1]  # padding never seen
    assert diagonal_mask(real, 1)[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                                           [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    valid = torch.tensor([[False, True, True, True, False, True, True, True, True]])
    ok = chain_valid(valid, 3)
    assert ok[1].int().tolist() == [[0, 0, 1, 1, 0, 0, 1, 1, 1]]  # slots t - 1 and t trained
    assert ok[2].int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("variant", ["eagle3", "eagle"])
def test_training_at_depth_5_lowers_every_depths_loss(target, variant, tmp_path):
    seqs = greedy_sequences(target, 8)
    train_head(target, seqs, HeadTrainConfig(variant=variant, out=str(tmp_path), steps=14, batch_size=4, lr=3e-3,
                                             warmup=2, resume=False, progress=False), log=lambda s: None)
    hist = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    for key in ("loss", "ce", "ce3", "ce5"):
        first, last = sum(h[key] for h in hist[:3]) / 3, sum(h[key] for h in hist[-3:]) / 3
        assert last < first, (key, first, last)
    trained = json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]
    assert trained["ttt_depth"] == 5 and trained["ttt_decay"] == 1.0


HEAD = ["train", "head", "--target", str(EMBEDDED / "target"), "--families", "chartqa", "--samples", "2",
        "--batch-size", "2", "--threads", "1"]


def test_the_depth_is_a_resume_setting_and_ttt_steps_its_older_name(tmp_path):
    assert head_settings(HeadTrainConfig(variant="eagle"))["ttt_depth"] == 5
    assert head_settings(HeadTrainConfig(variant="msd", ttt_depth=2, ttt_decay=0.8))["ttt_decay"] == 0.8
    out = tmp_path / "head"
    r = CliRunner().invoke(app, HEAD + ["--steps", "2", "--ttt-depth", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert torch.load(out / "checkpoints" / "head.pt", weights_only=False)["settings"]["ttt_depth"] == 2
    r = CliRunner().invoke(app, HEAD + ["--steps", "3", "--ttt-depth", "3", "--out", str(out)])
    assert r.exit_code == 2 and re.search(_flat("--ttt-depth 2 there, 3 now"), _flat(r.output)), r.output
    r = CliRunner().invoke(app, HEAD + ["--steps", "3", "--ttt-steps", "2", "--out", str(out)])
    assert r.exit_code == 0 and "atstep2of3" in _flat(r.output), r.output
    trained = json.loads((out / "mmspec_head.json").read_text())["trained"]
    assert trained["ttt_depth"] == 2 and trained["steps"] == 3
    held = trained["held_out"]  # the engine drafted 4 held-out prompts at the end, a chain as deep as trained
    assert held["gamma"] == 2 and len(held["acceptance_by_depth"]) == 2 and held["prompts"] == 4
    assert 1.0 <= held["tau"] <= 3.0 and "held-out tau" in r.output


def test_with_minutes_the_learning_rate_decays_over_the_budget_to_its_floor(tmp_path, monkeypatch):
    """--steps 50000 --minutes M, a budget that ends training long before the steps: the warm-up
    and the cosine run over the budget, so the last step's learning rate is the floor (a tenth of
    --lr); it used to stay at its peak, the cosine planned for 50,000 steps. A fake clock: each
    step takes one second, the budget is 100."""
    import types

    import mmspec.train.head as th
    import mmspec.train.loop as loop

    now = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def one_second(model, target, batch, cfg, features=None):
        now[0] += 1.0
        return getattr(model, "module", model).fc.weight.sum() * 0.0 + 1.0, {}

    monkeypatch.setattr(th, "head_loss", one_second)
    seqs = [Sequence_(make_prompt(1, 16, seed=i)[0][0], make_prompt(1, 16, seed=i)[1]) for i in range(2)]
    from helpers.tiny import make_llava

    summary = train_head(make_llava(0), seqs, HeadTrainConfig(out=str(tmp_path), steps=50_000, minutes=100 / 60,
                                                              batch_size=2, resume=False, progress=False),
                         log=lambda s: None)
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert summary["stopped"] == "budget" and len(lrs) == 100
    # warm-up: the first 5% of the budget, and at least 10 steps (min_warmup_steps), the slower ramp
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3 * 3 / 10)
    assert max(lrs) == pytest.approx(1e-3, rel=1e-2) and 8 <= lrs.index(max(lrs)) <= 10
    assert lrs[-1] == pytest.approx(1e-4, rel=3e-3)  # the floor, when the budget ends
    top = lrs.index(max(lrs))
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1:]))
    assert json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]["schedule"] == "clock"


def _tiny_run(tmp_path, steps: int, **kw) -> HeadTrainConfig:
    return HeadTrainConfig(out=str(tmp_path), steps=steps, batch_size=2, ttt_depth=2, progress=False, **kw)


def test_the_head_of_the_best_held_out_tau_is_saved_and_the_last_beside_it(target, tmp_path):
    """Evaluations every step giving tau 2.0, 3.0, 2.5: --out holds the head of step 2 (its weights,
    its trained record), checkpoints/last the head of step 3; every evaluation is in train_log.jsonl.
    Resumed to step 4 (tau 2.9), the run still knows step 2's 3.0 is the best."""
    from safetensors.torch import load_file

    seqs = [Sequence_(make_prompt(1, 16, seed=i)[0][0], make_prompt(1, 16, seed=i)[1]) for i in range(2)]
    taus, seen = [2.0, 3.0, 2.5, 2.9], []

    def evaluate(head):
        seen.append({k: v.detach().clone() for k, v in head.state_dict().items()})
        return {"tau": taus[len(seen) - 1], "acceptance_by_depth": [0.5, 0.25], "tokens": 9, "prompts": 1, "gamma": 2}

    logs = []
    summary = train_head(target, seqs, _tiny_run(tmp_path, 3, eval_every_minutes=1e-9), evaluate=evaluate,
                         log=logs.append)
    assert len(seen) == 3 and summary["held_out"]["step"] == 2 and summary["held_out"]["tau"] == 3.0

    def same(d: Path, state: dict) -> bool:
        w = load_file(str(d / "model.safetensors"))
        return w.keys() == state.keys() and all(torch.equal(w[k], state[k].to(w[k].dtype)) for k in w)

    last = tmp_path / "checkpoints" / "last"
    assert same(tmp_path, seen[1]) and not same(tmp_path, seen[2]) and same(last, seen[2])
    assert json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]["held_out"]["tau"] == 3.0
    assert json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]["steps"] == 2
    assert json.loads((last / "mmspec_head.json").read_text())["trained"]["steps"] == 3
    hist = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [h["held_out"]["tau"] for h in hist] == [2.0, 3.0, 2.5]
    assert any("kept the eagle head of step 2" in x and "best held-out tau, 3.00" in x for x in logs), logs

    train_head(target, seqs, _tiny_run(tmp_path, 4, eval_every_minutes=1e-9), evaluate=evaluate, log=logs.append)
    assert len(seen) == 4 and same(tmp_path, seen[1]) and same(last, seen[3])


def test_a_failing_evaluation_ends_the_evaluations_not_the_training(target, tmp_path):
    seqs = [Sequence_(make_prompt(1, 16, seed=i)[0][0], make_prompt(1, 16, seed=i)[1]) for i in range(2)]
    calls, logs = [], []

    def broken(head):
        calls.append(1)
        raise RuntimeError("no prompts")

    summary = train_head(target, seqs, _tiny_run(tmp_path, 3, eval_every_minutes=1e-9), evaluate=broken,
                         log=logs.append)
    assert summary["steps"] == 3 and len(calls) == 1 and "held_out" not in summary
    assert any("held-out evaluation failed at step 1 (RuntimeError: no prompts)" in x for x in logs), logs
    assert json.loads((tmp_path / "mmspec_head.json").read_text())["trained"]["steps"] == 3
    assert not (tmp_path / "checkpoints" / "last").exists()


def test_the_held_out_evaluator_is_the_engine_on_world_test_prompts(target, tok):
    """HeldOut drafts with a copy of the head (the training's head and RNG untouched): tau and
    acceptance by depth as `check head` measures them, a chain as deep as asked."""
    from helpers.tiny import make_processor
    from mmspec.heads.check import world_prompts
    from mmspec.train.held_out import HeldOut

    head = build_head(target, "eagle3", seed=2).train()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    rng = torch.random.get_rng_state()
    r = HeldOut(target, tok, make_processor(tok), world_prompts(2, ("chartqa",)), gamma=3, max_new_tokens=8)(head)
    assert r["gamma"] == 3 and len(r["acceptance_by_depth"]) == 3 and r["prompts"] == 2 and 0 < r["tokens"] <= 16
    assert 1.0 <= r["tau"] <= 4.0
    assert torch.equal(torch.random.get_rng_state(), rng) and head.training
    assert all(torch.equal(v, before[k]) for k, v in head.state_dict().items())
