"""Feature-level heads (EAGLE, EAGLE-3, MSD) are lossless drafters: greedy output equals
target.generate for every variant, untrained and trained, chain and tree, 1/2/5 images, both
feature-select strategies; heads save and load; training lowers the loss; two DDP processes
train the same weights as one process on the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.head_data import greedy_sequences
from helpers.reference import reference
from helpers.tiny import make_llava, make_prompt
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.heads import VARIANTS, build_head, load_head
from mmspec.train.head import HeadTrainConfig, train_head

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """One head per variant, trained a few dozen steps on the session target (module-scoped)."""
    seqs = greedy_sequences(target)
    out = {}
    for variant in VARIANTS:
        d = tmp_path_factory.mktemp(f"head-{variant}")
        train_head(target, seqs, HeadTrainConfig(variant=variant, out=str(d), steps=60, batch_size=8, lr=3e-3,
                                                 resume=False, progress=False), log=lambda s: None)
        out[variant] = d
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tree", [None, "dynamic", [[0], [1], [0, 0], [0, 1], [0, 0, 0]]])
@pytest.mark.parametrize("n_images", [1, 2, 5])
def test_untrained_heads_are_lossless(target, tok, variant, tree, n_images):
    ids, pv = make_prompt(n_images, 16, seed=n_images)
    dec = SpecDecoder(target, build_head(target, variant, seed=1), tok, tree=tree)
    assert dec.method == variant + ("" if tree is None else "+tree")
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kw", [dict(), dict(tree="dynamic"), dict(tree="dynamic", cuda_graphs="emulate")])
@pytest.mark.parametrize("n_images", [1, 2, 5])
def test_trained_heads_are_lossless_and_draft_something(target, tok, trained, variant, kw, n_images):
    ids, pv = make_prompt(n_images, 16, seed=40 + n_images)
    dec = SpecDecoder(target, str(trained[variant]), tok, **kw)  # loaded from its directory
    res = dec.generate(ids, pv, max_new_tokens=24)
    assert res.token_ids == reference(target, ids, pv, 24)


def test_trained_head_accepts_more_than_an_untrained_one(target, tok, trained):
    taus = {}
    for name, head in (("untrained", build_head(target, "eagle", seed=1)), ("trained", str(trained["eagle"]))):
        dec = SpecDecoder(target, head, tok, tree="dynamic")
        runs = [dec.generate(*make_prompt(1 + i % 2, 16, seed=300 + i), max_new_tokens=24) for i in range(6)]
        taus[name] = sum(r.stats.n_tokens for r in runs) / sum(r.stats.n_blocks for r in runs)
    assert taus["trained"] > taus["untrained"] + 0.15, taus


@pytest.mark.parametrize("variant", ["eagle", "msd"])
def test_full_feature_strategy_target(tok, variant):
    """A target that keeps CLS (17 image tokens per image): features at every image position."""
    target = make_llava(50, strategy="full")
    ids, pv = make_prompt(2, 17, seed=5)
    dec = SpecDecoder(target, build_head(target, variant), tok, tree="dynamic")
    assert dec.generate(ids, pv, max_new_tokens=16).token_ids == reference(target, ids, pv, 16)


def test_save_load_round_trip_and_refusal(target, tmp_path):
    head = build_head(target, "eagle3", seed=3)
    head.save(tmp_path / "h")
    loaded = load_head(tmp_path / "h", target)
    for (k, a), (k2, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert loaded.config.feature_layers == head.config.feature_layers and loaded.config.variant == "eagle3"
    other = make_llava(9, hidden=32)
    with pytest.raises(MMSpecError, match="made for another target"):
        load_head(tmp_path / "h", other)
    with pytest.raises(MMSpecError, match="not a draft head directory"):
        load_head(tmp_path, target)


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_lowers_the_loss(target, variant, tmp_path):
    seqs = greedy_sequences(target, 8)
    train_head(target, seqs, HeadTrainConfig(variant=variant, out=str(tmp_path), steps=12, batch_size=4, lr=3e-3,
                                             resume=False, progress=False), log=lambda s: None)
    hist = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    first, last = sum(h["loss"] for h in hist[:3]) / 3, sum(h["loss"] for h in hist[-3:]) / 3
    assert last < first, (first, last)
    if variant == "msd":  # text-only first, then multimodal (MSD's two stages)
        assert hist[0]["stage"] == "text" and hist[-1]["stage"] == "multimodal"
    if variant == "eagle3":  # training-time test: the unrolled passes are trained too
        assert "ce3" in hist[-1]


def test_resume_continues_from_the_checkpoint(target, tmp_path):
    seqs = greedy_sequences(target, 4)
    cfg = HeadTrainConfig(variant="eagle", out=str(tmp_path), steps=4, batch_size=2, checkpoint_every=2,
                          progress=False)
    train_head(target, seqs, cfg, log=lambda s: None)
    logs = []
    summary = train_head(target, seqs, HeadTrainConfig(**{**cfg.__dict__, "steps": 6}), log=logs.append)
    assert summary["steps"] == 6 and any("resuming" in x and "step 4" in x for x in logs)


def _train_cli(tmp: Path, nproc: int) -> Path:
    out = tmp / f"ddp{nproc}"
    target = ROOT / "src" / "mmspec" / "assets" / "embedded" / "target"
    args = ["-m", "mmspec", "train", "head", "--target", str(target), "--variant", "eagle", "--out", str(out),
            "--families", "chartqa,spot_the_diff", "--samples", "2", "--steps", "2", "--batch-size", "4", "--threads", "1",
            "--fresh"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
               str(29500 + os.getpid() % 1000), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_ddp_processes_train_what_one_process_trains(tmp_path):
    """torchrun --nproc_per_node=2 on gloo: each rank takes half of the same global batch; the
    all-reduced gradient is the one-process gradient, so the weights agree to float tolerance."""
    from safetensors.torch import load_file

    one, two = _train_cli(tmp_path, 1), _train_cli(tmp_path, 2)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
        moved += 1
    assert moved > 0
    assert json.loads((two / "mmspec_head.json").read_text())["trained"]["world_size"] == 2
