"""The one training loop every ``mmspec train`` command runs: :func:`fit`.

Owns: the optimiser (AdamW), the learning-rate schedule (:func:`lr_factor`: warm-up, then cosine
to a floor, on the step count or on the clock), the budgets (steps and/or minutes), gradient
clipping, the progress bar, the loss history, checkpoints (every N steps, on Ctrl-C and when the
time budget is spent; written atomically, so an interrupt during a save never leaves half a
file), resume (refused when the checkpoint was made with other settings, naming each), and
DDP under ``torchrun`` (the caller opens the process group).

A caller brings its maths as a step function ``step_loss(model, info) -> (loss, record)``:
``model`` is the module (wrapped in DDP when it runs under torchrun), ``info`` a
:class:`StepInfo`, ``loss`` a scalar tensor and ``record`` extra fields for the loss history
(which records each step's loss, learning rate and training seconds besides). An ``after_step``
hook (an evaluation) runs after each step off the training clock.
Batches must be a function of ``info.step`` (or the caller fast-forwards its stream on resume)
so that a resumed run sees the batches an uninterrupted one would.

A checkpoint is one file (``torch.save``): the step reached, the seconds spent, the model's
state, the optimiser's, the loss history, the torch RNG and the settings it was trained with.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.errors import MMSpecError

FORMAT = 1  # checkpoint layout version


def fmt_loss(x: float | None) -> str:
    """A loss for people: 4 significant digits (``7.72``, ``0.01234``), ``-`` when there is none."""
    return "-" if x is None else f"{x:.4g}"


def check_schedule(steps: int | None, max_seconds: float | None, name: str = "stage") -> None:
    """Refuse a schedule that could not end or would divide by zero: the one rule every caller of
    :func:`fit` and its configs share. ``steps`` (>= 1) and/or ``max_seconds`` (> 0, finite)."""
    if steps is None and max_seconds is None:
        raise MMSpecError(f"{name}: needs a step count or a time budget (minutes)")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise MMSpecError(f"{name}: needs steps >= 1; got {steps}")
    if max_seconds is not None and not (math.isfinite(max_seconds) and max_seconds > 0):
        raise MMSpecError(f"{name}: needs a time budget > 0; got {max_seconds} s")


@dataclass
class FitConfig:
    """How :func:`fit` optimises. ``steps`` and/or ``minutes`` bound the run (the first reached
    ends it). Learning rate at a step: ``lr x ramp x cosine`` where ``ramp = min(1, (step + 1) /
    warmup_steps)`` (1 without warm-up steps) and the cosine runs from 1 to ``min_lr_ratio`` over
    the schedule's progress, after a linear warm-up from 0 over its first ``warmup_ratio``, which
    also lasts at least ``min_warmup_steps`` steps (at most ``warmup_ratio x steps``): one slow
    first step that spends a budget's warm-up share alone does not skip it (issue 61).
    Progress is the larger of ``step / steps`` and the share of the time budget spent, so a run
    the budget ends ends at the schedule's floor; with a budget, a step that would end past it
    (by the median of the last steps' times, a run's first step left out) is not started, and the
    budget's share is counted at the step's end."""

    label: str = "train"  # the progress bar's label and the messages' subject
    steps: int | None = None
    minutes: float | None = None
    lr: float = 1e-3
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_warmup_steps: int = 10  # with warmup_ratio: the warm-up's fewest steps (capped at warmup_ratio x steps)
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    checkpoint: str | Path | None = None  # a file; None: no checkpoints (and nothing kept on Ctrl-C)
    checkpoint_every: int | None = None  # also save every N steps (Ctrl-C and the budget always save)
    resume: bool = True  # continue from ``checkpoint`` when it exists
    settings: dict = field(default_factory=dict)  # what a resume must match: {option name: value}
    progress: bool = True
    ddp: bool = False  # wrap the model in DistributedDataParallel when a process group of > 1 is open
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        check_schedule(self.steps, None if self.minutes is None else 60.0 * self.minutes, self.label)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise MMSpecError(f"{self.label} needs a learning rate > 0; got {self.lr}")
        if self.warmup_steps < 0 or self.min_warmup_steps < 1 or not 0 <= self.warmup_ratio < 1 \
                or not 0 <= self.min_lr_ratio <= 1:
            raise MMSpecError(f"{self.label}: warm-up steps must be >= 0, the warm-up ratio in [0, 1) and the "
                              f"floor in [0, 1]; got {self.warmup_steps}, {self.warmup_ratio}, {self.min_lr_ratio}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise MMSpecError(f"{self.label}: gradient clipping needs a norm > 0 (or none); got {self.grad_clip}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise MMSpecError(f"{self.label}: checkpoints every {self.checkpoint_every} steps; give a number >= 1")

    @property
    def budget_seconds(self) -> float | None:
        return None if self.minutes is None else 60.0 * self.minutes


def warmup_steps_floor(cfg: FitConfig) -> int:
    """The fewest steps a ``warmup_ratio`` warm-up lasts: ``min_warmup_steps``, at most its share
    of ``steps`` (rounded up); 0 without one."""
    if cfg.warmup_ratio <= 0:
        return 0
    return cfg.min_warmup_steps if cfg.steps is None else min(cfg.min_warmup_steps, math.ceil(cfg.warmup_ratio * cfg.steps))


def lr_factor(cfg: FitConfig, step: int, progress: float) -> float:
    """The learning rate's multiplier at ``step`` (0-based) and schedule ``progress`` in [0, 1]:
    the warm-up goes on while the progress is below ``warmup_ratio`` or fewer than
    :func:`warmup_steps_floor` steps have run (the slower of the two ramps)."""
    progress = min(max(progress, 0.0), 1.0)
    floor = warmup_steps_floor(cfg)
    if cfg.warmup_ratio > 0 and (progress < cfg.warmup_ratio or step + 1 < floor):
        return min(progress / cfg.warmup_ratio, (step + 1) / floor if floor else 1.0)
    rest = (progress - cfg.warmup_ratio) / max(1e-12, 1.0 - cfg.warmup_ratio)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * rest))
    ramp = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    return ramp * cosine


@dataclass
class StepInfo:
    """What a step function is told: the step's 0-based index (= steps finished before it), the
    run's step budget, the share of the whole budget spent (``max(step / steps, seconds /
    budget)``) and the learning rate in use."""

    step: int
    steps: int | None
    progress: float
    lr: float


@dataclass
class FitResult:
    """What :func:`fit` did: steps finished (in all, resumed ones included), where it started,
    seconds spent (in all), why it stopped (``steps``, ``budget`` or ``done``: the checkpoint had
    finished already), the loss history and the checkpoint file."""

    label: str
    steps: int
    start: int
    seconds: float
    stopped: str
    history: list[dict]
    checkpoint: Path | None

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]

    @property
    def final_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`fit`, after the finished steps were saved. ``str()`` is the one line
    to show: what was kept, where, and that the same command resumes."""

    def __init__(self, label: str, step: int, steps: int | None, checkpoint: Path | None):
        super().__init__(label, step, steps, checkpoint)
        self.label, self.step, self.steps, self.checkpoint = label, step, steps, checkpoint

    def __str__(self) -> str:
        of = f" of {self.steps}" if self.steps is not None else ""
        if self.checkpoint is None:
            return f"interrupted: {self.label} stopped at step {self.step}{of}; nothing was kept (no checkpoint)"
        return (f"interrupted: {self.label} kept step {self.step}{of} in {self.checkpoint}; run the same command "
                "to resume (--fresh starts over)")


# --------------------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def hold_sigint(reraise: bool = True):
    """Hold Ctrl-C while the block runs (a save), then raise it: a save is never cut in half."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if got and reraise:
        raise KeyboardInterrupt


def write_atomically(path: Path, save: Callable[[Path], None], reraise: bool = True) -> None:
    """``save(tmp)`` then rename ``tmp`` to ``path`` (atomic on one file system), Ctrl-C held meanwhile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with hold_sigint(reraise):
        try:
            save(tmp)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def _norm(v):
    return json.dumps(v, sort_keys=True, default=str)


def _flag(name: str) -> str:
    return name if name.startswith("-") or " " in name else "--" + name.replace("_", "-")


def _shown(value) -> str:
    """A setting as the user would have typed it; None is a flag left out (its default)."""
    return "not given (the default)" if value is None else repr(value)


def read_checkpoint(path: str | Path, settings: dict, steps: int | None, minutes: float | None = None,
                    label: str = "training") -> dict | None:
    """The checkpoint at ``path`` (None when there is none), refused when its settings differ
    from ``settings`` (each named, with both values and the fix) or when it is already past
    ``steps``. Reads a file only: call it before loading models, to fail early."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and how to go on
        raise MMSpecError(f"{path} is not a readable mmspec checkpoint ({type(e).__name__}); add --fresh to start "
                          "over") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise MMSpecError(f"{path} is not an mmspec checkpoint of this version; add --fresh to start over")
    saved = state.get("settings", {})
    differ = [k for k in sorted(set(saved) | set(settings)) if _norm(saved.get(k)) != _norm(settings.get(k))]
    if differ:
        parts = ", ".join(f"{_flag(k)} {_shown(saved.get(k))} there, {_shown(settings.get(k))} now" for k in differ)
        raise MMSpecError(f"{path} holds {label} made with other settings ({parts}); resume it with the "
                          f"checkpoint's values, or add --fresh to start over")
    if steps is not None and state["step"] > steps:
        raise MMSpecError(f"{path} holds {state['step']} steps of {label}, past --steps {steps}: nothing to do; "
                          f"raise --steps above {state['step']} to train on, or add --fresh to start over")
    return state


def _save(path: Path, model: torch.nn.Module, opt, step: int, seconds: float, history: list, cfg: FitConfig,
          reraise: bool = True) -> None:
    state = {"format": FORMAT, "label": cfg.label, "step": step, "steps": cfg.steps, "seconds": seconds,
             "model": model.state_dict(), "optimizer": opt.state_dict(), "history": history,
             "settings": cfg.settings, "rng": torch.random.get_rng_state()}
    write_atomically(path, lambda tmp: torch.save(state, tmp), reraise)


# --------------------------------------------------------------------------- the loop
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _wrap(model: torch.nn.Module, cfg: FitConfig) -> torch.nn.Module:
    import torch.distributed as dist

    if cfg.ddp and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=cfg.find_unused_parameters)
    return model


def next_step_seconds(took: list[float]) -> float:
    """What the next step should take: the median of the last five step times (0.0 before any;
    a run's first step is not among them): one slow step does not stop a budget early."""
    recent = sorted(took[-5:])
    return recent[len(recent) // 2] if recent else 0.0


def fit(model: torch.nn.Module, step_loss: Callable[[torch.nn.Module, StepInfo], tuple[torch.Tensor, dict]],
        cfg: FitConfig, *, params: list[torch.nn.Parameter] | None = None,
        log: Callable[[str], None] = print, on_save: Callable[[int, list[dict]], None] | None = None,
        after_step: Callable[[int, list[dict]], None] | None = None) -> FitResult:
    """Train ``params`` (default: ``model``'s parameters that require grad) on ``step_loss`` until
    ``cfg.steps`` or ``cfg.minutes`` is reached, resuming from ``cfg.checkpoint`` when it exists.
    On Ctrl-C: saves the finished steps and raises :class:`TrainingInterrupted`; when the time
    budget is spent: saves and returns (``stopped == "budget"``). ``on_save(step, history)`` runs
    after each checkpoint (the main rank's), e.g. to write the loss log as it grows.
    ``after_step(step, history)`` runs on every rank after each step (an evaluation: it may add
    fields to ``history[-1]``); its time is off the training clock (the budget and the schedule
    count training alone), so under DDP it must keep the ranks together itself. Each history
    record holds the step, its loss, the learning rate and the training seconds at its end."""
    from tqdm.auto import tqdm

    main = _rank() == 0
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    if not params:
        raise MMSpecError(f"{cfg.label}: no parameters to train")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = None if cfg.checkpoint is None else Path(cfg.checkpoint)
    start, before, history = 0, 0.0, []
    state = read_checkpoint(ckpt, cfg.settings, cfg.steps, cfg.minutes, cfg.label) if ckpt and cfg.resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.random.set_rng_state(state["rng"])
        start, before, history = int(state["step"]), float(state["seconds"]), list(state["history"])
        if main:
            log(f"resuming {cfg.label} from {ckpt} at step {start}" + (f" of {cfg.steps}" if cfg.steps else ""))
    budget = cfg.budget_seconds
    t0 = time.perf_counter()
    paused = 0.0  # seconds spent in after_step: not training

    def seconds() -> float:
        return before + time.perf_counter() - t0 - paused

    def progress(step: int, ahead: float = 0.0) -> float:
        """The schedule's progress: the steps' share, or the budget's when ``ahead`` more seconds
        (the next step's) are spent, whichever is larger."""
        p = step / cfg.steps if cfg.steps else 0.0
        return max(p, (seconds() + ahead) / budget) if budget else p

    secs = [float(h.get("seconds", 0.0)) for h in history[-6:]]
    took = [b - a for a, b in zip(secs, secs[1:])]  # step times but a run's first (resumed: the checkpoint's)
    if (cfg.steps is not None and start >= cfg.steps) or (budget is not None and
                                                          before + next_step_seconds(took) > budget):
        if main:
            log(f"{cfg.label}: {ckpt} has finished already ({start} steps); nothing to train")
        return FitResult(cfg.label, start, start, before, "done", history, ckpt)
    wrapped = _wrap(model, cfg)
    # With a time budget the bar follows the schedule's progress (the budget's share or the steps',
    # whichever is ahead), so its remaining time is the run's; steps alone count steps.
    by_share = budget is not None
    bar = tqdm(total=100 if by_share else cfg.steps, initial=round(100 * progress(start), 1) if by_share else start,
               desc=cfg.label, disable=not (cfg.progress and main), unit="%" if by_share else "step",
               dynamic_ncols=True, mininterval=2.0,
               bar_format="{l_bar}{bar}| {n:.1f}/100% [{elapsed}<{remaining}{postfix}]" if by_share else None)
    step, stopped = start, "steps"  # took: the step times (training clock), for the budget's last step
    try:
        while True:
            if cfg.steps is not None and step >= cfg.steps:
                break
            frac = progress(step, next_step_seconds(took))  # the share spent when this step ends
            if budget is not None and (seconds() >= budget or frac > 1.0):
                stopped = "budget"
                if by_share:
                    bar.update(100.0 - bar.n)
                break
            lr = cfg.lr * lr_factor(cfg, step, frac)
            for group in opt.param_groups:
                group["lr"] = lr
            began = seconds()
            loss, record = step_loss(wrapped, StepInfo(step, cfg.steps, frac, lr))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            if step > start + 1:  # a run's first step (caches filled, kernels chosen) is no estimate
                took.append(seconds() - began)
            history.append({"step": step, "loss": float(loss.detach()), "lr": lr, "seconds": seconds(),
                            **(record or {})})
            if after_step is not None:
                t = time.perf_counter()
                after_step(step, history)
                paused += time.perf_counter() - t
            bar.update(min(100.0, round(100 * progress(step), 1)) - bar.n if by_share else 1)
            bar.set_postfix(**({"step": step} if by_share else {}), loss=fmt_loss(history[-1]["loss"]), lr=f"{lr:.1e}",
                            refresh=False)
            if main and ckpt and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 \
                    and (cfg.steps is None or step < cfg.steps):
                _save(ckpt, model, opt, step, seconds(), history, cfg)
                if on_save is not None:
                    on_save(step, history)
    except KeyboardInterrupt:
        bar.close()
        if main and ckpt is not None:
            _save(ckpt, model, opt, step, seconds(), history, cfg, reraise=False)
        raise TrainingInterrupted(cfg.label, step, cfg.steps, ckpt) from None
    finally:
        bar.close()
    spent = seconds()
    if main and stopped == "budget":
        log(f"{cfg.label}: the time budget of {cfg.minutes:g} min is spent (or its next step would pass it) at step {step}"
            + (f" of {cfg.steps}" if cfg.steps else ""))
    if main and ckpt is not None:
        _save(ckpt, model, opt, step, spent, history, cfg)
    return FitResult(cfg.label, step, start, spent, stopped, history, ckpt)
