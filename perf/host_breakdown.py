"""Where a steady drafted step's host time goes, per component, at a few batch sizes: what grows
with the rows and what does not (issue 59 item 4).

B requests of ``--new`` tokens on the embedded pack (view M, greedy, EOS off), stepped by a
:class:`~mmspec.batch.BatchScheduler` with ``speculate="always"``; a steady step is one with all B
rows active, no admission and no request ending. Each step's host time is its CPU time minus the
models' forwards inside it (forward hooks, as ``batch_speed.py --engine-time``), split by wrapping
the engine's and scheduler's per-step functions (class attributes of this process only, restored
after; per-step calls, so the wrappers add a few microseconds a step, not a row):

* ``step_maths``: :meth:`Engine._device` less the forwards: drafting, verification and commit
  tensor operations (on the CPU they compute; on a GPU they launch), of which ``model_glue`` is
  the Python around the hooked forwards (``RowForward``, the adapter, transformers' outer
  ``forward``), ``draft`` the drafter's work less its forwards and glue, ``verify`` ``verify_steps``;
* ``plan`` (:meth:`Engine._plan`), ``policy`` (``decide`` + ``record``);
* ``emit``: :meth:`Engine.finish` (the one host read, each row's tokens, limits and record);
  ``events``: the rest of :meth:`BatchScheduler._collect` (text deltas with ``--stream``, events);
* ``other``: the rest of the step (launch bookkeeping, the host read's copy).

``--handoff``: instead, what handing a step's B updates to an asyncio event loop costs the
worker thread (``mmspec serve``'s sinks): one ``call_soon_threadsafe`` per update against
:class:`~mmspec.serve.worker.LoopMailbox` (one wake-up a step), CPU microseconds a step, median.

Times are CPU seconds of the stepping thread (``time.thread_time``): on a loaded machine less noisy
than wall time. Prints one JSON line per B (medians over the steady steps, ms) and one with each
component's fit ``a + b * B`` (least squares over the B given: ``fixed_ms``, ``per_row_ms``).

    PYTHONPATH=src taskset -c 1 python perf/host_breakdown.py --batch 1 8 32 --new 48 --stream
    PYTHONPATH=src taskset -c 1 python perf/host_breakdown.py --batch 1 8 32 --handoff
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import batch_speed as bs  # noqa: E402  (its prompts)

import mmspec  # noqa: E402
from mmspec.batch import BatchScheduler  # noqa: E402
from mmspec.drafting.trees import Drafting  # noqa: E402
from mmspec.engine import step as step_mod  # noqa: E402
from mmspec.engine.policy import SpeculationPolicy  # noqa: E402
from mmspec.engine.scheduler import BatchScheduler as Scheduler  # noqa: E402
from mmspec.runtime.forwards import RowForward  # noqa: E402

CLOCK = time.thread_time
PARTS = ("step_maths", "model_glue", "draft", "verify", "plan", "policy", "emit", "events", "other")


class Clocks:
    """CPU seconds inside the hooked forwards and inside each wrapped function (less forwards)."""

    def __init__(self, *models):
        self.forward = 0.0
        self.parts: dict[str, float] = {}
        self._open: list[float] = []
        self._undo: list = []
        for m in models:
            for mod in list(m.model.children()) + [m.lm_head]:
                self._undo.append(mod.register_forward_pre_hook(lambda *_: self._open.append(CLOCK())).remove)
                self._undo.append(mod.register_forward_hook(self._stop).remove)

    def _stop(self, *_):
        self.forward += CLOCK() - self._open.pop()

    def wrap(self, owner, name: str, part: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            t, fw = CLOCK(), self.forward
            try:
                return f(*args, **kwargs)
            finally:
                self.parts[part] = self.parts.get(part, 0.0) + (CLOCK() - t) - (self.forward - fw)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, f))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def steady_steps(dec, em, B: int, new: int, stream: bool, clocks: Clocks) -> list[dict]:
    """Per steady step: host ms and each component's ms."""
    sched = BatchScheduler(dec, max_batch=B, speculate="always", stream_text=stream)
    for text, ims in bs.prompts(em.processor, B):
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        sched.submit({k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")} | {"max_new_tokens": new})
    out, first = [], True
    while sched.has_work():
        clocks.parts = {}
        t, fw = CLOCK(), clocks.forward
        events = sched.step()
        host = (CLOCK() - t) - (clocks.forward - fw)
        if not first and len(sched._active) == B and not any(ev.finished for ev in events):
            p = clocks.parts
            row = {"host": host, "step_maths": p.get("device", 0.0), "model_glue": p.get("glue", 0.0),
                   "verify": p.get("verify", 0.0), "plan": p.get("plan", 0.0),
                   "policy": p.get("decide", 0.0) + p.get("record", 0.0), "emit": p.get("finish", 0.0)}
            row["draft"] = p.get("draft", 0.0) - p.get("glue_in_draft", 0.0)
            row["events"] = p.get("collect", 0.0) - row["emit"] - p.get("record", 0.0)
            row["other"] = host - row["step_maths"] - row["plan"] - p.get("decide", 0.0) - p.get("collect", 0.0)
            out.append({k: 1e3 * v for k, v in row.items()})
        first = False
    sched.close()
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--stream", action="store_true", help="each event carries its text delta (a server's stream)")
    ap.add_argument("--handoff", action="store_true", help="instead: the worker's cost of handing updates to a loop")
    ap.add_argument("--steps", type=int, default=300, help="--handoff: steps timed per way and B")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also append each line to this JSON-lines file")
    return ap.parse_args(argv)


def handoff(batches: Sequence[int], steps: int, out: str | None) -> None:
    """Worker-thread CPU a step to hand B updates to a running event loop (module docstring)."""
    import asyncio
    import threading

    from mmspec.serve.worker import LoopMailbox

    loop = asyncio.new_event_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    async def drain():
        while True:
            if await inbox.get() is None:
                return

    thread = threading.Thread(target=lambda: loop.run_until_complete(drain()), daemon=True)
    thread.start()
    box = LoopMailbox(loop)
    ways = {"per_update": lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
            "mailbox": lambda item: box.put(inbox, item)}
    for B in batches:
        row = {}
        for name, put in ways.items():
            times = []
            for _ in range(steps):
                t = CLOCK()
                for i in range(B):
                    put((i, "update"))
                times.append(CLOCK() - t)
                time.sleep(0.002)  # the next step's compute: the loop drains meanwhile
            row[name] = round(1e6 * statistics.median(times), 1)
        emit({"B": B, "handoff_us_per_step": row}, out)
    loop.call_soon_threadsafe(inbox.put_nowait, None)
    thread.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.handoff:
        handoff(args.batch, args.steps, args.out)
        return 0
    torch.set_num_threads(args.threads)
    em = mmspec.load_embedded()
    em.target.generation_config.eos_token_id = None
    dec = mmspec.SpecDecoder(em.target, em.draft, em.tokenizer, views="M", prefix_cache_mb=0)
    dec.options = type(dec.options)(**{**dec.options.__dict__, "eos_ids": frozenset()})
    clocks = Clocks(em.target, em.draft)
    E = step_mod.Engine
    for owner, name, part in [(E, "_device", "device"), (E, "_plan", "plan"), (E, "finish", "finish"),
                              (Scheduler, "_collect", "collect"), (SpeculationPolicy, "decide", "decide"),
                              (SpeculationPolicy, "record", "record"), (Drafting, "draft", "draft"),
                              (RowForward, "__call__", "glue")]:
        clocks.wrap(owner, name, part)
    verify = step_mod.verify_steps

    def timed_verify(*a, **k):
        t = CLOCK()
        try:
            return verify(*a, **k)
        finally:
            clocks.parts["verify"] = clocks.parts.get("verify", 0.0) + CLOCK() - t

    step_mod.verify_steps = timed_verify
    draft_forward = RowForward.__call__

    def glue_in_draft(self, *a, **k):  # the drafter's forwards' glue, counted once (in model_glue)
        t, fw = CLOCK(), clocks.forward
        try:
            return draft_forward(self, *a, **k)
        finally:
            if self.name != "target":
                clocks.parts["glue_in_draft"] = clocks.parts.get("glue_in_draft", 0.0) + (CLOCK() - t) - (
                    clocks.forward - fw)

    RowForward.__call__ = glue_in_draft
    lines = []
    try:
        with torch.inference_mode():
            steady_steps(dec, em, 2, 8, args.stream, clocks)  # warm-up
            for B in args.batch:
                steps = steady_steps(dec, em, B, args.new, args.stream, clocks)
                med = {k: round(statistics.median(s[k] for s in steps), 3) for k in ("host",) + PARTS} if steps else {}
                lines.append({"B": B, "steady_steps": len(steps), "stream": args.stream} | {f"{k}_ms": v for k, v in med.items()})
                emit(lines[-1], args.out)
    finally:
        step_mod.verify_steps = verify
        clocks.close()
    usable = [r for r in lines if r["steady_steps"]]
    if len({r["B"] for r in usable}) >= 2:
        Bs = np.array([r["B"] for r in usable], dtype=float)
        fit = {}
        for k in ("host",) + PARTS:
            slope, icpt = np.polyfit(Bs, [r[f"{k}_ms"] for r in usable], 1)
            fit[k] = {"fixed_ms": round(float(icpt), 3), "per_row_ms": round(float(slope), 4)}
        emit({"fit": fit, "stream": args.stream}, args.out)
    return 0


def emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
