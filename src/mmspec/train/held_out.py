"""The held-out τ that ``mmspec train head`` keeps its best head by: the engine itself drafts with
the head being trained, on a few prompts the training never sees, and reports τ and acceptance by
depth (:func:`mmspec.heads.check.measure`, what ``mmspec check head`` measures).

Owns: :class:`HeldOut` (the evaluator: a head in, its held-out τ out), :class:`Evaluations`
(when to evaluate during training, which evaluation is the best, and telling the caller to keep a
new best head), and the held-out clips of a Video-LLaVA target (:func:`world_clip_prompts`: the
embedded world's test split; its image prompts are :func:`mmspec.heads.check.world_prompts`).
Knows nothing of the loop's internals or of files: :func:`mmspec.train.head.train_head` hands
:meth:`Evaluations.after_step` to :func:`mmspec.train.loop.fit` and saves what it is told to keep.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.heads.check import CalibrationPrompt, measure
from mmspec.heads.model import FeatureHead
from mmspec.train.loop import hold_sigint

EVAL_TOKENS = 32  # new tokens per held-out prompt: a few dozen blocks over 4 prompts


@dataclass
class HeldOut:
    """Measures a head being trained: ``HeldOut(...)(head)`` -> {"tau", "acceptance_by_depth",
    "tokens", "prompts", "gamma"}, greedy, a chain of ``gamma`` (the depth it is trained to draft)."""

    target: Any  # the target model, as training holds it (its device and dtype)
    tokenizer: Any
    processor: Any
    prompts: list[CalibrationPrompt]
    gamma: int = 5
    max_new_tokens: int = EVAL_TOKENS

    def __call__(self, head: FeatureHead) -> dict:
        """A copy of ``head`` in the target's dtype (as a saved head is loaded) drafts the prompts;
        the training's RNG is left as it was."""
        from mmspec.decoder import SpecDecoder

        p = next(self.target.parameters())
        h = copy.deepcopy(head)
        for w in h.parameters():
            w.grad = None
            w.requires_grad_(False)
        h = h.to(device=p.device, dtype=p.dtype).eval()
        devices = [p.device] if p.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            dec = SpecDecoder(self.target, h, self.tokenizer, processor=self.processor, gamma=self.gamma,
                              prefix_cache_mb=0, cuda_graphs=False)
            tau, acc, tokens = measure(dec, self.prompts, self.max_new_tokens)
        return {"tau": round(tau, 4), "acceptance_by_depth": [round(a, 4) for a in acc], "tokens": tokens,
                "prompts": len(self.prompts), "gamma": self.gamma}


def world_clip_prompts(target, processor, families: list[str], n: int) -> list[CalibrationPrompt]:
    """``n`` of the world's test clips for a Video-LLaVA target, the trained video families in turn,
    each the prompt alone as :func:`mmspec.train.head.world_video_sequences` encodes it."""
    from mmspec.world import make_video_sample
    from mmspec.world.processor import clip_inputs, clip_layout

    vid, n_frames, per_frame = clip_layout(target)
    out = []
    for i in range(n):
        s = make_video_sample(families[i % len(families)], "test", i // len(families))
        x = clip_inputs(s, processor.tokenizer, processor.image_processor, vid, n_frames, per_frame)
        out.append(CalibrationPrompt(s.prompt, inputs={"input_ids": x["input_ids"][None],
                                                       "pixel_values_videos": x["pixel_values_videos"]}))
    return out


class Evaluations:
    """Held-out evaluations of a head being trained: every ``every_s`` training seconds (None: only
    at the end) and once at the end, each stored in its step's history record as ``held_out``
    (so a resumed run knows the best so far). A new best by τ (as high or higher: of equal ones the
    later, more trained head) is handed to ``keep(history)``; an evaluation that fails is reported once and
    ends the evaluations (the training goes on; the last head is kept). Under DDP the main rank
    evaluates and the decision is broadcast, the ranks waiting for it together."""

    def __init__(self, evaluate: Callable[[FeatureHead], dict], head: FeatureHead, every_s: float | None,
                 keep: Callable[[list[dict]], None], log: Callable[[str], None], rank: int = 0, world: int = 1):
        self.evaluate, self.head, self.every_s, self.keep, self.log = evaluate, head, every_s, keep, log
        self.rank, self.world = rank, world
        self.failed = False

    @staticmethod
    def best(history: list[dict]) -> dict | None:
        """The history record of the best evaluation (the last of equal τ), None before any."""
        best = None
        for h in history:
            if "held_out" in h and (best is None or h["held_out"]["tau"] >= best["held_out"]["tau"]):
                best = h
        return best

    def _due(self, history: list[dict]) -> bool:
        if self.failed or self.every_s is None:
            return False
        last = next((h["seconds"] for h in reversed(history) if "held_out" in h), 0.0)
        return history[-1]["seconds"] - last >= self.every_s

    def after_step(self, step: int, history: list[dict]) -> None:
        """:func:`mmspec.train.loop.fit`'s hook, on every rank."""
        due = self._due(history) if self.rank == 0 else False
        if self.world > 1:
            import torch.distributed as dist

            flag = torch.tensor([int(due)], device=self.head.fc.weight.device)
            dist.broadcast(flag, 0)
            due = bool(flag.item())
        if due and self.rank == 0:
            self.run(history)
        if due and self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def finish(self, history: list[dict]) -> None:
        """The evaluation at the end (main rank), unless the last step has one."""
        if history and not self.failed and "held_out" not in history[-1]:
            self.run(history)

    def run(self, history: list[dict]) -> None:
        record = history[-1]
        before = self.best(history)
        try:
            r = self.evaluate(self.head)
        except Exception as e:  # noqa: BLE001 - a long run must not die of its evaluation: say so and go on
            self.failed = True
            self.log(f"held-out evaluation failed at step {record['step']} ({type(e).__name__}: {e}); training goes "
                     "on without evaluations")
            return
        better = before is None or r["tau"] >= before["held_out"]["tau"]
        with hold_sigint():  # the record says "best" only with the head it names kept
            record["held_out"] = r
            if better:
                self.keep(history)
        self.log(f"held-out tau {r['tau']:.2f} at step {record['step']} (acceptance by depth "
                 + " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"])
                 + (": the best so far, kept)" if better else f"; the best is {before['held_out']['tau']:.2f} "
                    f"at step {before['step']})"))
