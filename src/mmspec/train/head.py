"""Training a feature-level head (``mmspec train head``) on the frozen target's own features.

Owns: turning training sequences (prompt + the target's own answer) into batches, the frozen
target's forward that hands over the features the head reads and the distribution it must
match (one forward per batch, features computed on the fly: nothing cached to disk), the
losses, the step function it hands the one loop (:func:`mmspec.train.loop.fit`: AdamW with a
warm-up, a progress bar, a time budget, checkpoints kept on Ctrl-C and resumed, data-parallel
training under ``torchrun --nproc_per_node=N``: DDP, gloo on CPU, NCCL on GPU), the head it
writes (also after Ctrl-C and when the time budget is spent), and the training sequences
(:func:`world_sequences`, :func:`llava_instruct_sequences`).

Losses, per position t (the head saw target feature t and token t + 1, predicts feature t + 1):
* cross-entropy against the TARGET's distribution at t + 1 (soft labels: the head learns what
  the target would say, whatever the sequence says next), all variants;
* training-time test, every variant: ``ttt_depth`` passes unrolled (the depth the head drafts),
  pass k reading the head's own predictions of pass k - 1 under the attention drafting gives it
  (:mod:`mmspec.train.ttt`: EAGLE-3's diagonal mask), each pass against the same target
  distribution; the passes' cross-entropies weighted ``ttt_decay``^(k-1) and normalised (1:
  every depth counts alike); depth 1 is pass 1 alone;
* eagle / msd: + ``reg_weight`` x smooth-L1 between pass 1's predicted and the target's feature
  (EAGLE's feature regression);
* msd: the first ``text_steps`` steps on text-only sequences (images and their slots removed),
  then multimodal ones (MSD's two-stage schedule); with a time budget that ends training first,
  the text stage takes the same share of the budget.
Positions whose next token is an image placeholder carry no loss. Each sequence's loss is its
mean over positions and the batch loss the mean over sequences, so N ranks of b sequences give
exactly the gradient of one process with N x b (the DDP test checks it).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.errors import MMSpecError
from mmspec.heads.model import VARIANTS, FeatureHead, build_head
from mmspec.prompt import VIDEO_MARKER
from mmspec.train.feature_cache import target_features
from mmspec.train.held_out import Evaluations
from mmspec.train.loop import (
    FitConfig,
    FitResult,
    StepInfo,
    TrainingInterrupted,
    fit,
    fmt_loss,
    hold_sigint,
    write_atomically,
)
from mmspec.train.ttt import chain_valid, pass_weights, unroll


@dataclass
class Sequence_:
    """One training sequence: token ids (images expanded), the pixels of its images, and the
    rest of what the family's processor made for it (``mm``: image_sizes, image_grid_thw,
    pixel_values_videos, ...)."""

    input_ids: torch.Tensor  # [L] long
    pixel_values: torch.Tensor | None  # [n_img, ...] or None
    text_only: Sequence_ | None = None  # the same without images (msd's first stage)
    mm: dict[str, torch.Tensor] = field(default_factory=dict)  # the processor's other outputs, batch dim 1 or n
    loss_mask: torch.Tensor | None = None  # [L] bool: tokens of assistant turns (None: every token)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Every model input of this sequence but its ids: pixel_values and ``mm``."""
        return {**({} if self.pixel_values is None else {"pixel_values": self.pixel_values}), **self.mm}


@dataclass
class HeadTrainConfig:
    variant: str = "eagle"
    out: str = "runs/head"
    num_layers: int = 1
    steps: int = 1000
    minutes: float | None = None  # a time budget: stop (and save) when it is spent
    batch_size: int = 16  # the GLOBAL batch: split over the ranks
    lr: float = 1e-3
    warmup: int = 50
    reg_weight: float = 1.0  # eagle / msd: feature regression next to the cross-entropy
    ttt_depth: int = 5  # training-time test: passes unrolled = the depth the head drafts (a chain's γ); 1: none
    ttt_decay: float = 1.0  # pass k's loss weighs ttt_decay^(k-1), normalised (1: every depth alike; EAGLE-3: 0.8)
    text_steps: int | None = None  # msd: steps on text-only sequences first (default: a third)
    seed: int = 0
    checkpoint_every: int = 100
    resume: bool = True
    progress: bool = True
    device: str = "cpu"
    cache_features: str | None = None  # a directory: the target's features dumped once, reused every epoch
    cache_max_gb: float = 50.0  # the size limit of that directory; past it, features stay on the fly
    warmup_share: float = 0.05  # with minutes: the warm-up's share of the schedule (in place of warmup's steps)
    eval_every_minutes: float | None = None  # held-out τ every N training minutes (None: a fifth of minutes, or
    # only at the end without them; 0: never); needs train_head's evaluate
    notes: dict = field(default_factory=dict)  # recorded in the head's config (recipe, data)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise MMSpecError(f"unknown head variant {self.variant!r}; use one of {', '.join(VARIANTS)}")
        for name in ("steps", "batch_size", "num_layers", "ttt_depth", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                flag = "layers" if name == "num_layers" else name.replace("_", "-")
                raise MMSpecError(f"--{flag} must be a whole number >= 1, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MMSpecError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):
            raise MMSpecError(f"--minutes must be a finite number > 0, got {self.minutes}")
        if self.text_steps is not None:
            if self.variant != "msd":
                raise MMSpecError(f"--text-steps sizes msd's text-only stage; the {self.variant} head has none: "
                                  "drop --text-steps or use --variant msd")
            if isinstance(self.text_steps, bool) or not isinstance(self.text_steps, int) \
                    or not 0 <= self.text_steps < self.steps:
                raise MMSpecError(f"--text-steps must be a whole number from 0 to --steps - 1 ({self.steps - 1}), "
                                  f"got {self.text_steps!r}: the multimodal stage needs steps too")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise MMSpecError(f"warmup must be a whole number >= 0, got {self.warmup!r}")
        if not (math.isfinite(self.cache_max_gb) and self.cache_max_gb > 0):
            raise MMSpecError(f"--cache-max-gb must be a finite number > 0, got {self.cache_max_gb}")
        if not (math.isfinite(self.reg_weight) and self.reg_weight >= 0):
            raise MMSpecError(f"reg_weight must be a finite number >= 0, got {self.reg_weight}")
        if not 0 <= self.warmup_share < 1:
            raise MMSpecError(f"warmup_share must be in [0, 1), got {self.warmup_share}")
        if self.eval_every_minutes is not None and not (math.isfinite(self.eval_every_minutes)
                                                        and self.eval_every_minutes >= 0):
            raise MMSpecError(f"--eval-every-minutes must be a finite number >= 0 (0: never), got "
                              f"{self.eval_every_minutes}")
        if not (math.isfinite(self.ttt_decay) and self.ttt_decay > 0):
            raise MMSpecError(f"--ttt-decay must be a finite number > 0, got {self.ttt_decay}")


# --------------------------------------------------------------------------- distributed
@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_dist(device: str) -> Dist:
    """torchrun's environment -> a process group (gloo on CPU, NCCL on CUDA), or one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())


# --------------------------------------------------------------------------- batches
PER_TOKEN = ("mm_token_type_ids",)  # processor outputs with one entry per token: padded like the ids


def collate(seqs: Sequence[Sequence_], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids [B, L], attention_mask [B, L], pixel_values | None, every
    other processor output of the family joined over the rows (per-image tensors concatenated in
    row order, per-token ones padded; LLaVA-NeXT's tiles [n, tiles, 3, H, W] padded to the most
    tiles, which the model cuts back by ``image_sizes``) and ``loss_mask`` [B, L] when a row has one."""
    L = max(s.input_ids.shape[0] for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : s.input_ids.shape[0]] = s.input_ids
        mask[b, : s.input_ids.shape[0]] = 1
    out: dict[str, torch.Tensor | None] = {"input_ids": ids, "attention_mask": mask, "pixel_values": None}
    rows = [s.inputs() for s in seqs]
    for key in dict.fromkeys(k for r in rows for k in r):
        if key in PER_TOKEN:
            t = torch.zeros(len(seqs), L, dtype=next(r[key] for r in rows if key in r).dtype)
            for b, r in enumerate(rows):
                if key in r:
                    t[b, : r[key].shape[-1]] = r[key].reshape(-1)
            out[key] = t
            continue
        parts = [r[key] for r in rows if key in r]
        if parts[0].dim() == 5 and key == "pixel_values" and len({p.shape[1] for p in parts}) > 1:
            most = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        out[key] = torch.cat(parts)
    if any(s.loss_mask is not None for s in seqs):
        lm = torch.zeros(len(seqs), L, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n = s.input_ids.shape[0]
            lm[b, :n] = True if s.loss_mask is None else s.loss_mask
        out["loss_mask"] = lm
    return out


@torch.no_grad()
def slot_positions(core: FeatureHead, target, batch: dict) -> torch.Tensor:
    """The head's position ids over a batch's L - 1 slots: slot t at the TARGET's position of token
    t, 3-D [3, B, L - 1] for an M-RoPE head of a Qwen2-VL-family target (as it drafts:
    :mod:`mmspec.heads.positions`), else [B, L - 1] = t."""
    from mmspec.heads.positions import mrope_section
    from mmspec.models.base import adapter_for

    ids = batch["input_ids"]
    B, L = ids.shape
    adapter = adapter_for(target)
    if mrope_section(core.config.rope_parameters) is not None and getattr(adapter, "mrope", False):
        mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "loss_mask") and v is not None}
        pos, _ = adapter.prefill_positions(ids, mm, batch["attention_mask"])
        if pos.dim() == 3:
            return pos[..., : L - 1]
    return torch.arange(L - 1, device=ids.device)[None].expand(B, -1)


def head_loss(head: FeatureHead, target, batch: dict, cfg: HeadTrainConfig, features=None
              ) -> tuple[torch.Tensor, dict]:
    """The batch loss (mean over sequences of each sequence's mean over its positions) and parts.
    ``features``: the target's (logits, features, final state) of the batch, when already at hand
    (:mod:`mmspec.train.feature_cache`); else one target forward computes them."""
    hc = head.config if not hasattr(head, "module") else head.module.config
    core = head.module if hasattr(head, "module") else head
    reg = hc.variant in ("eagle", "msd")
    logits_t, feats, final = features if features is not None else target_features(
        target, batch, hc.feature_layers, final=reg)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    B, L = ids.shape
    nxt = ids[:, 1:]  # [B, L-1] the token after each head input position
    emb = target.get_input_embeddings()(nxt).detach()
    image = (nxt == hc.image_token_id) if (hc.variant == "msd" and hc.image_token_id is not None) else None
    pos = slot_positions(core, target, batch)  # [B, L-1], or [3, B, L-1] on an M-RoPE target
    amask = mask[:, 1:]
    after_img = torch.zeros_like(nxt, dtype=torch.bool)
    if hc.image_token_id is not None:
        after_img[:, :-1] = ids[:, 2:] == hc.image_token_id  # the next token is an image slot: no loss
    valid = amask.bool() & ~after_img  # [B, L-1]
    if batch.get("loss_mask") is not None:  # position t predicts token t + 2: loss where that is an assistant's
        valid[:, :-1] &= batch["loss_mask"][:, 2:]
        valid[:, -1] = False
    p = torch.softmax(logits_t[:, 1:].float(), -1)  # [B, L-1, V] the target's distribution at t + 1
    lm_head = target.get_output_embeddings()
    if core.lm_head is not None:  # eagle3: its own vocabulary; the target's mass on it, renormalised
        p = p[..., core.d2t]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)

    def ce(h, ok):  # h [B, L-1, H] -> [B, L-1]: the cross-entropy at the slots ``ok`` [B, L-1], 0 elsewhere
        x = h[ok]  # [N, H]: only the trained slots reach the vocabulary
        if core.lm_head is not None:
            logits = core.lm_head(x)
        else:  # the target's frozen head, in the head's dtype
            logits = F.linear(x, lm_head.weight.to(x.dtype), None if lm_head.bias is None else lm_head.bias.to(x.dtype))
        out = torch.zeros(ok.shape, dtype=torch.float32, device=h.device)
        out[ok] = -(p[ok] * torch.log_softmax(logits.float(), -1)).sum(-1)
        return out

    def per_seq(x, ok):  # [B, L-1] -> mean over each sequence's slots ``ok``, then over sequences
        v = ok.to(x.dtype)
        return ((x * v).sum(1) / v.sum(1).clamp_min(1.0)).mean()

    dt = core.fc.weight.dtype  # the head trains in float32 (float64 with a float64 target) whatever the target's dtype
    emb = emb.to(dt)
    g = core.fused(feats[:, :-1].to(dt))  # [B, L-1, H]
    passes = unroll(head, g, emb, image, pos, amask.bool(), cfg.ttt_depth)  # ttt_depth x [B, L-1, H]
    parts = {}
    for k, (h, ok) in enumerate(zip(passes, chain_valid(valid, cfg.ttt_depth)), 1):
        parts["ce" if k == 1 else f"ce{k}"] = per_seq(ce(h, ok), ok)
    loss = sum(w * ce_k for w, ce_k in zip(pass_weights(cfg.ttt_depth, cfg.ttt_decay), parts.values()))
    if reg:  # EAGLE's feature regression, on pass 1 (the target's true features in)
        parts["reg"] = per_seq(F.smooth_l1_loss(passes[0], final[:, 1:].to(dt), reduction="none").mean(-1), valid)
        loss = loss + cfg.reg_weight * parts["reg"]
    return loss, {k: float(v.detach()) for k, v in parts.items()}


@torch.no_grad()
def first_step_acceptance(head: FeatureHead, target, seqs: Sequence[Sequence_], batch_size: int = 4) -> float:
    """How often the head's first draft token equals the target's greedy token, fed the target's
    TRUE features (the first step of every block), over the positions a head is trained on (the
    assistant turns of sequences with a ``loss_mask``, else every position before the last)."""
    core = head.module if hasattr(head, "module") else head
    was = core.training
    core.eval()
    hit = total = 0
    dev, dt = next(target.parameters()).device, next(target.parameters()).dtype
    lm_head = target.get_output_embeddings()
    for i in range(0, len(seqs), batch_size):
        batch = {k: (None if v is None else v.to(dev)) for k, v in collate(seqs[i:i + batch_size]).items()}
        for k in ("pixel_values", "pixel_values_videos", "pixel_values_images"):
            if batch.get(k) is not None and batch[k].is_floating_point():
                batch[k] = batch[k].to(dt)
        logits_t, feats, _ = target_features(target, batch, core.config.feature_layers, final=False)
        ids, amask = batch["input_ids"], batch["attention_mask"]
        h = core(core.fused(feats[:, :-1].to(core.dtype)), target.get_input_embeddings()(ids[:, 1:]).to(core.dtype),
                 None, position_ids=slot_positions(core, target, batch), attention_mask=amask[:, 1:])
        draft = core.logits(h, lm_head).argmax(-1)[:, :-1]  # [B, L-2]: position t drafts token t + 2
        want = logits_t[:, 1:-1].argmax(-1)  # the target's greedy token t + 2
        valid = amask[:, 2:].bool()
        if batch.get("loss_mask") is not None:
            valid &= batch["loss_mask"][:, 2:]
        hit += int(((draft == want) & valid).sum())
        total += int(valid.sum())
    core.train(was)
    return hit / max(total, 1)


# --------------------------------------------------------------------------- the loop
def _order(n: int, seed: int, epoch: int) -> list[int]:
    idx = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(idx)
    return idx


def _global_batch(step: int, n: int, cfg: HeadTrainConfig) -> list[int]:
    """The example indices of one global batch (the same on every rank; each takes its slice)."""
    start = step * cfg.batch_size
    out = []
    for j in range(start, start + cfg.batch_size):
        epoch, k = divmod(j, n)
        out.append(_order(n, cfg.seed, epoch)[k])
    return out


CHECKPOINT = Path("checkpoints") / "head.pt"  # under --out: what a rerun resumes
NOTED = ("data", "samples", "families", "answers", "world_seed", "draft_vocab", "max_length",
         "feature_layers")  # the data options a resume must match


def head_settings(cfg: HeadTrainConfig) -> dict:
    """The settings a resumed head must share with its checkpoint, by their ``train head`` flags."""
    out = {"variant": cfg.variant, "layers": cfg.num_layers, "batch_size": cfg.batch_size, "lr": cfg.lr,
           "warmup": cfg.warmup, "reg_weight": cfg.reg_weight, "text_steps": cfg.text_steps, "seed": cfg.seed}
    out.update(ttt_depth=cfg.ttt_depth, ttt_decay=cfg.ttt_decay)
    return {**out, **{k: cfg.notes[k] for k in NOTED if k in cfg.notes}}


def text_steps_of(cfg: HeadTrainConfig) -> int:
    """msd's text-only steps at the start (default: a third of --steps); 0 for the other variants."""
    return cfg.text_steps if cfg.text_steps is not None else (cfg.steps // 3 if cfg.variant == "msd" else 0)


def train_head(target, seqs: Sequence[Sequence_], cfg: HeadTrainConfig, *, head: FeatureHead | None = None,
               log: Callable[[str], None] = print, evaluate: Callable[[FeatureHead], dict] | None = None) -> dict:
    """Train (or resume) a head for ``target`` on ``seqs``; saves it under ``cfg.out``. Returns a
    summary (steps done, losses, seconds, the best held-out evaluation). Under torchrun every rank
    calls this. On Ctrl-C the finished steps are kept (checkpoint and the head itself) and
    :class:`TrainingInterrupted` is raised; when ``cfg.minutes`` is spent the head is saved as
    after the last step. With ``cfg.minutes`` the learning rate warms up and decays over the
    budget (or over ``cfg.steps`` if they end training first), reaching its floor at the end.

    ``evaluate(head) -> {"tau", ...}`` (:class:`mmspec.train.held_out.HeldOut`): the head's
    held-out τ every ``cfg.eval_every_minutes`` training minutes and at the end
    (:class:`~mmspec.train.held_out.Evaluations`); ``cfg.out`` then holds the head of the best τ,
    the last one ``out/checkpoints/last``. Without it, ``cfg.out`` holds the last head."""
    if not seqs:
        raise MMSpecError("no training sequences; give the head some data (--samples, --families, --data)")
    dist = init_dist(cfg.device)
    if cfg.batch_size % dist.world:
        raise MMSpecError(f"--batch-size {cfg.batch_size} is the global batch and must split evenly over "
                          f"{dist.world} processes")
    out = Path(cfg.out)
    device = torch.device(cfg.device)
    target = target.to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    if head is None:
        head = build_head(target, cfg.variant, num_layers=cfg.num_layers, seed=cfg.seed)
    head = head.to(device=device, dtype=torch.promote_types(next(target.parameters()).dtype, torch.float32)).train()
    text_steps = text_steps_of(cfg)
    per_rank = cfg.batch_size // dist.world
    pix_dtype = next(target.parameters()).dtype
    cache, keys = None, []
    if cfg.cache_features:
        from mmspec.train.feature_cache import FeatureCache, sequence_key

        cache = FeatureCache(cfg.cache_features, target, head.config.feature_layers, cfg.cache_max_gb * 2**30,
                             main=dist.main)
        keys = [sequence_key(s) for s in seqs]

    def step_loss(model, info: StepInfo) -> tuple[torch.Tensor, dict]:
        idx = _global_batch(info.step, len(seqs), cfg)[dist.rank * per_rank:(dist.rank + 1) * per_rank]
        # msd's text stage: its share of the steps, or of the time budget when that ends training first
        text_stage = info.step < text_steps and info.progress < text_steps / cfg.steps
        items = [seqs[i].text_only if (text_stage and seqs[i].text_only is not None) else seqs[i] for i in idx]
        batch = {k: (v.to(device) if v is not None else None) for k, v in collate(items).items()}
        for k in ("pixel_values", "pixel_values_videos", "pixel_values_images"):
            if batch.get(k) is not None and batch[k].is_floating_point():
                batch[k] = batch[k].to(pix_dtype)
        feats = None
        if cache is not None and not text_stage:
            feats = cache.features(target, batch, [keys[i] for i in idx])
        loss, parts = head_loss(model, target, batch, cfg, feats)
        return loss, {**parts, "stage": "text" if text_stage else "multimodal"}

    clock = cfg.minutes is not None  # a budget: warm up over a share of the schedule, not a step count
    fit_cfg = FitConfig(label=f"train {cfg.variant} head", steps=cfg.steps, minutes=cfg.minutes, lr=cfg.lr,
                        warmup_steps=0 if clock else cfg.warmup, warmup_ratio=cfg.warmup_share if clock else 0.0,
                        min_lr_ratio=0.1, grad_clip=1.0, checkpoint=out / CHECKPOINT,
                        checkpoint_every=cfg.checkpoint_every, resume=cfg.resume, settings=head_settings(cfg),
                        progress=cfg.progress, ddp=True, find_unused_parameters=cfg.variant == "msd")
    evals = None
    if evaluate is not None and cfg.eval_every_minutes != 0:
        every = cfg.eval_every_minutes or (cfg.minutes / 5 if cfg.minutes else None)
        evals = Evaluations(evaluate, head, None if every is None else 60.0 * every,
                            keep=lambda history: _save_head(head, out, _trained(cfg, dist, history)),
                            log=log if dist.main else (lambda s: None), rank=dist.rank, world=dist.world)
    try:
        res = fit(head, step_loss, fit_cfg, log=log if dist.main else (lambda s: None),
                  on_save=lambda step, history: _write_log(out, history),
                  after_step=None if evals is None else evals.after_step)
    except TrainingInterrupted as e:
        if dist.main and e.step > 0:  # the finished steps make a usable head too
            _keep_last(head, out, cfg, dist, _partial(fit_cfg).history, lambda s: None)
        raise
    summary = _summary(res, dist)
    if dist.main:
        if evals is not None and res.stopped != "done":
            evals.finish(res.history)
        _keep_last(head, out, cfg, dist, res.history, log)
        best = Evaluations.best(res.history)
        if best is not None:
            summary["held_out"] = {"step": best["step"], **best["held_out"]}
    if cache is not None:
        summary["cache"] = {"hits": cache.hits, "misses": cache.misses, "bytes": cache.used}
        log(f"feature cache {cfg.cache_features}: {cache.hits} sequence(s) read from it, {cache.misses} computed "
            f"({cache.used / 2**20:.1f} MiB on disk)")
    if dist.world > 1:
        import torch.distributed as tdist

        tdist.barrier()
    return summary


def _partial(fit_cfg: FitConfig) -> FitResult:
    """The checkpoint just saved on Ctrl-C, as a result."""
    state = torch.load(fit_cfg.checkpoint, map_location="cpu", weights_only=False)
    return FitResult(fit_cfg.label, state["step"], 0, state["seconds"], "interrupted", state["history"],
                     Path(fit_cfg.checkpoint))


def _summary(res: FitResult, dist: Dist) -> dict:
    return {"steps": res.steps, "seconds": res.seconds, "world_size": dist.world, "final_loss": res.final_loss,
            "text_steps": sum(h.get("stage") == "text" for h in res.history), "stopped": res.stopped}


def _write_log(out: Path, history: list[dict]) -> None:
    """``out/train_log.jsonl``: one line per finished step (rewritten at each checkpoint)."""
    write_atomically(out / "train_log.jsonl",
                     lambda tmp: tmp.write_text("".join(json.dumps(h) + "\n" for h in history)))


LAST = Path("checkpoints") / "last"  # under --out: the last head, when the held-out τ kept an earlier one


def _trained(cfg: HeadTrainConfig, dist: Dist, history: list[dict]) -> dict:
    """The ``trained`` record of the head after the last step of ``history``."""
    last = history[-1] if history else {}
    return {**cfg.notes, "variant": cfg.variant, "steps": last.get("step", 0), "batch_size": cfg.batch_size,
            "lr": cfg.lr, "seed": cfg.seed, "world_size": dist.world, "final_loss": last.get("loss"),
            "text_steps": sum(h.get("stage") == "text" for h in history), "ttt_depth": cfg.ttt_depth,
            "ttt_decay": cfg.ttt_decay, "schedule": "clock" if cfg.minutes is not None else "steps",
            **({"held_out": last["held_out"]} if "held_out" in last else {})}


def _save_head(head: FeatureHead, where: Path, trained: dict) -> None:
    """``head`` saved as a head directory under ``where`` with its ``trained`` record (Ctrl-C held
    meanwhile: a save is never cut in half)."""
    head.config.trained = trained
    was_training = head.training
    with hold_sigint():
        head.eval().save(where)
    head.train(was_training)


def _keep_last(head: FeatureHead, out: Path, cfg: HeadTrainConfig, dist: Dist, history: list[dict],
               log: Callable[[str], None]) -> None:
    """The head after the last step of ``history``: in ``out``, or, when a held-out evaluation kept
    an earlier (better) head there, in ``out/checkpoints/last`` (which exists only then); and the
    loss history."""
    best = Evaluations.best(history)
    steps = history[-1]["step"] if history else 0
    last_is_best = best is None or best["step"] == steps
    if last_is_best:
        _save_head(head, out, _trained(cfg, dist, history))
        shutil.rmtree(out / LAST, ignore_errors=True)  # an earlier part of the run's last head: not the last now
    else:
        _save_head(head, out / LAST, _trained(cfg, dist, history))
    _write_log(out, history)
    loss = fmt_loss(history[-1]["loss"] if history else None)
    if last_is_best:
        log(f"saved the {cfg.variant} head to {out} ({steps} steps, loss {loss})")
        if best is not None:
            log(f"its held-out tau, {best['held_out']['tau']:.2f}, is the run's best")
    else:
        tau = history[-1].get("held_out", {}).get("tau")
        log(f"kept the {cfg.variant} head of step {best['step']} in {out}: the best held-out tau, "
            f"{best['held_out']['tau']:.2f}" + ("" if tau is None else f" (the last head's: {tau:.2f})")
            + f"; the last head, {steps} steps, in {out / LAST} (loss {loss})")


# --- training sequences (``mmspec train head --data``) ---
# Data (``--data``):
# * ``world`` (default): the embedded world's train split, image families; each sequence is the
#   prompt (through the target's processor) followed by the TARGET's own greedy answer from an
#   answers file made by ``mmspec train answers`` (``--answers``), or, without one, the world's
#   reference answer (the loss still follows the target's distribution at every position).
#   For a Video-LLaVA target (``mmspec train video``'s pair), the world's video clips instead
#   (:func:`world_video_sequences`).
# * ``llava-instruct:FILE.json`` with ``--image-dir DIR``: LLaVA-Instruct conversations (a JSON
#   list of ``{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."},
#   {"from": "gpt", "value": "..."}]}``): the first turn in the LLaVA-1.5 format
#   (``USER: <image>\\n{question} ASSISTANT:``) followed by the answer, images read from DIR.


def _encode(processor, prompt: str, images, continuation_ids, image_token_id) -> Sequence_:
    import torch

    enc = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    cont = torch.as_tensor(list(continuation_ids), dtype=torch.long)
    if image_token_id is not None:
        cont = cont[cont != image_token_id]  # an answer never holds image slots
    ids = torch.cat([enc["input_ids"][0], cont])
    pv = enc.get("pixel_values")
    text_prompt = prompt.replace("<image>\n", "").replace("<image>", "")
    t_enc = processor.tokenizer(text_prompt, return_tensors="pt")
    text_only = Sequence_(torch.cat([t_enc["input_ids"][0], cont]), None)
    return Sequence_(ids, pv, text_only=text_only)


def world_sequences(processor, families: list[str], n: int, seed: int, answers: Path | None,
                    image_token_id) -> list[Sequence_]:
    from mmspec.world import FAMILIES, make_sample

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise MMSpecError(f"unknown world family {unknown[0]!r}; use some of {', '.join(FAMILIES)}")
    samples = [make_sample(f, "train", i, seed) for i in range(n) for f in families]
    answer_ids = _answers_for(answers, samples, seed)
    tok = processor.tokenizer
    out = []
    for s in samples:
        cont = answer_ids.get(s.uid) or tok(" " + s.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(_encode(processor, s.prompt, s.images, cont, image_token_id))
    return out


def world_video_sequences(target, processor, families: list[str], n: int, seed: int,
                          answers: Path | None = None) -> list[Sequence_]:
    """The world's video clips (:data:`mmspec.world.VIDEO_FAMILIES`, train split) for a Video-LLaVA
    target such as ``mmspec train video``'s: each clip's prompt as that pair was trained on
    (:func:`mmspec.world.processor.clip_inputs`: evenly spaced frames, each keeping its CLS token;
    no torchvision needed), the frame count read off the target's ``video_seq_length``, answered
    by the clip's reference answer or, with ``answers``, by the target's own greedy answer
    (``mmspec train answers --target PAIR/target``). The loss covers every token but the video's slots."""
    from mmspec.world import VIDEO_FAMILIES, make_video_sample
    from mmspec.world.processor import clip_inputs, clip_layout

    unknown = [f for f in families if f not in VIDEO_FAMILIES]
    if unknown or not families:
        raise MMSpecError(f"unknown world video family {unknown[0] if unknown else '(none)'!r}; use some of "
                          f"{', '.join(VIDEO_FAMILIES)}")
    vid, n_frames, per_frame = clip_layout(target)
    tok, ip = processor.tokenizer, processor.image_processor
    clips = [make_video_sample(f, "train", i, seed) for i in range(n) for f in families]
    answer_ids = _answers_for(answers, clips, seed)
    out = []
    for s in clips:
        if answers is None:
            x = clip_inputs(s, tok, ip, vid, n_frames, per_frame, answer=s.answer)
            ids = x["input_ids"]
            cont = ids[x["labels"] != -100]
        else:
            x = clip_inputs(s, tok, ip, vid, n_frames, per_frame)
            cont = torch.tensor(answer_ids[s.uid], dtype=torch.long)
            ids = torch.cat([x["input_ids"], cont])
        t_ids = tok(s.prompt.replace(VIDEO_MARKER + " ", "").replace(VIDEO_MARKER, ""), return_tensors="pt")["input_ids"][0]
        out.append(Sequence_(ids, None, text_only=Sequence_(torch.cat([t_ids, cont]), None),
                             mm={"pixel_values_videos": x["pixel_values_videos"]}, loss_mask=ids != vid))
    return out


def _answers_for(answers: Path | None, samples: list, seed: int) -> dict[str, tuple[int, ...]]:
    """uid -> the target's answer ids from an answers file, every sample's (none: {})."""
    if answers is None:
        return {}
    from mmspec.train.distill import read_answers

    got = read_answers(answers, seed=seed, prompts={s.uid: s.prompt for s in samples})
    missing = [s.uid for s in samples if s.uid not in got]
    if missing:
        raise MMSpecError(f"{answers} lacks {len(missing)} of the {len(samples)} training samples (e.g. "
                          f"{missing[0]}); make them with `mmspec train answers` for the same families, "
                          "counts and world seed")
    return got


def llava_instruct_sequences(processor, path: Path, image_dir: Path, n: int, image_token_id) -> list[Sequence_]:
    from PIL import Image

    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise MMSpecError(f"{path} is not a LLaVA-Instruct JSON list of conversations")
    tok = processor.tokenizer
    out = []
    for row in rows[:n]:
        conv = row.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        question = conv[0]["value"]
        images = []
        if row.get("image"):
            f = Path(image_dir) / row["image"]
            if not f.exists():
                raise MMSpecError(f"image {f} of conversation {row.get('id')} not found; --image-dir must hold "
                                  "the images the JSON names (e.g. COCO train2017 for LLaVA-Instruct-150K)")
            images = [Image.open(f).convert("RGB")]
            if "<image>" not in question:
                question = "<image>\n" + question
        prompt = f"USER: {question} ASSISTANT:"
        cont = tok(" " + conv[1]["value"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(_encode(processor, prompt, images, cont, image_token_id))
    if not out:
        raise MMSpecError(f"{path} has no usable conversations (a human turn followed by a gpt turn)")
    return out
