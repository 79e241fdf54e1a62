"""Batch throughput, quickly: ``SpecDecoder.generate_batch`` against the target's own batched
greedy ``generate`` (left-padded, same prompts, same run) at a few batch sizes, on the
embedded pack. One run per setting (the full sweep with latency percentiles is
``mmspec bench run --batch-size``). Prints one JSON line per (B, system).

    PYTHONPATH=src python perf/batch_speed.py --batch 1 4 8 --new 48
    PYTHONPATH=src python perf/batch_speed.py --batch 1 2 4 8 16 --speculate always never auto --engine-time
    PYTHONPATH=src python perf/batch_speed.py --batch 8 --admission --repeats 3   # prefilled together vs one by one
    PYTHONPATH=src python perf/batch_speed.py --device cuda --batch 1 4 8 16 --engine eager graphs  # the GPU pass

``--engine``: the batched engine on eager ragged caches (``eager``), with fixed shapes run
eagerly (``static``), or with fixed shapes captured as CUDA graphs (``graphs``: on the CPU the
capture is emulated, which times the bookkeeping, not a replay).

``--out FILE``: each row is also appended to FILE (JSON lines) the moment it is measured. A
setting that raises prints a row with its ``error`` and the run goes on (exit status 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

import mmspec
from mmspec.batch import BatchScheduler
from mmspec.world import FAMILIES, make_sample

ENGINES = {"eager": {"cuda_graphs": False}, "static": {"static_cache": True}, "graphs": {"cuda_graphs": True}}
CPU_S = {"last": 0.0}  # the process's CPU seconds of the last timed run: on a loaded machine, less noisy than wall


def prompts(processor, n: int):
    fams = sorted(FAMILIES)
    out = []
    for i in range(n):
        s = make_sample(fams[i % len(fams)], "val", i // len(fams))
        out.append((s.prompt, list(s.images)))
    return out


def target_batched(em, batch, new: int) -> tuple[list[list[int]], float]:
    proc = em.processor
    proc.tokenizer.padding_side = "left"
    texts = [p for p, _ in batch]
    images = [im for _, ims in batch for im in ims]
    enc = proc(text=texts, images=images or None, return_tensors="pt", padding=True).to(em.target.device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = em.target.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    wall = time.perf_counter() - t0
    CPU_S["last"] = time.process_time() - c0
    L = enc["input_ids"].shape[1]
    return [row[L:].tolist() for row in out], wall


def spec_batched(dec, em, batch, new: int, speculate: str, overlap: bool | None = None) -> tuple[list[list[int]], float]:
    """``generate_batch``'s work, driven step by step: all requests submitted, the first step
    (admission: every prefill, then one step) timed apart from the steps after it."""
    reqs = []
    for text, ims in batch:
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        reqs.append({k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")} | {"max_new_tokens": new})
    policy = dec.speculation_policy if speculate == "auto" else speculate
    t0, c0 = time.perf_counter(), time.process_time()
    sched = BatchScheduler(dec, max_batch=len(reqs), speculate=policy, stream_text=False, overlap=overlap)
    rids = [sched.submit(r) for r in reqs]
    done, walls = {}, []
    while sched.has_work():
        t = time.perf_counter()
        for ev in sched.step():  # each step ends with a host read (overlap: of the step before, this one runs on)
            if ev.error is not None:
                raise RuntimeError(ev.error)
            if ev.finished:
                done[ev.rid] = ev.result
        walls.append(time.perf_counter() - t)
    sched.close()
    wall = time.perf_counter() - t0
    CPU_S["last"] = time.process_time() - c0
    res = [done[r] for r in rids]
    CPU_S["steps"] = max(r.stats.n_blocks for r in res)  # the batch's engine steps (all admitted together)
    CPU_S["admit_s"] = walls[0] if walls else 0.0
    CPU_S["step_walls"] = walls[1:]
    longest = max(res, key=lambda r: r.stats.n_blocks)
    CPU_S["device_s"] = [b.draft_s + b.verify_s for b in longest.stats.blocks[1:]]  # graphs: the replay, then the read
    return [r.token_ids for r in res], wall


class ForwardTimer:
    """Seconds spent inside the models' own forwards (every child of ``model.model`` and the LM
    head, for each model given): what is left of a run's wall time is the engine's host work."""

    def __init__(self, *models):
        self.seconds = 0.0
        self.handles = []
        for m in models:
            mods = list(m.model.children()) + [m.lm_head]
            for mod in mods:
                self.handles.append(mod.register_forward_pre_hook(self._start))
                self.handles.append(mod.register_forward_hook(self._stop))
        self._t0 = None

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0

    def close(self):
        for h in self.handles:
            h.remove()


def spec_one_by_one(dec, em, batch, new: int) -> tuple[list[list[int]], float]:
    """The same requests through ``generate``, one after the other (batch 1 on the one engine)."""
    encs = [em.processor(text=text, images=ims or None, return_tensors="pt") for text, ims in batch]
    t0, c0 = time.perf_counter(), time.process_time()
    out = [dec.generate(enc["input_ids"], enc.get("pixel_values"), max_new_tokens=new).token_ids for enc in encs]
    wall = time.perf_counter() - t0
    CPU_S["last"] = time.process_time() - c0
    return out, wall


class OneByOneAdmission(BatchScheduler):
    """Today's scheduler admitting as before issue 42 item 2: every queued request prefilled
    alone (a group of one per prefill forward), all in the same step."""

    def _admit(self, events):
        while self._queue and len(self._active) < self.max_batch:
            rest, self._queue = self._queue, deque([self._queue.popleft()])
            super()._admit(events)
            self._queue = rest


def admission(dec, em, batch, new: int, together: bool) -> dict:
    """The requests arriving together: time to first token (each request's first tokens out,
    from submit; mean) and total, wall and the process's CPU seconds."""
    reqs = []
    for text, ims in batch:
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        reqs.append({k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")} | {"max_new_tokens": new})
    sched = (BatchScheduler if together else OneByOneAdmission)(dec, max_batch=len(reqs))
    t0, c0 = time.perf_counter(), time.process_time()
    for r in reqs:
        sched.submit(r)
    first: dict[int, tuple[float, float]] = {}
    out: dict[int, list[int]] = {}
    while sched.has_work():
        for ev in sched.step():
            out.setdefault(ev.rid, []).extend(ev.new_token_ids)
            if ev.new_token_ids and ev.rid not in first:
                first[ev.rid] = (time.perf_counter() - t0, time.process_time() - c0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"ttft_wall_s": statistics.mean(w for w, _ in first.values()),
            "ttft_cpu_s": statistics.mean(c for _, c in first.values()),
            "total_wall_s": wall, "total_cpu_s": cpu, "tokens": [out[r] for r in sorted(out)]}


def compare_admission(dec, em, B: int, new: int, repeats: int, emit=print) -> None:
    """Prefilled together vs one by one, interleaved ``repeats`` times; medians; one row each."""
    batch = prompts(em.processor, B)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(repeats):
        for together in (False, True):
            runs[together].append(admission(dec, em, batch, new, together))
    same = runs[True][0]["tokens"] == runs[False][0]["tokens"]
    for together, rs in runs.items():
        row = {"B": B, "new": new, "admission": "together" if together else "one by one", "repeats": repeats,
               "same_tokens": same}
        for key in ("ttft_wall_s", "ttft_cpu_s", "total_wall_s", "total_cpu_s"):
            row[key] = round(statistics.median(r[key] for r in rs), 3)
        emit(row)


class Rows:
    """Prints each row as one JSON line and appends it to ``--out`` (if given) at once."""

    def __init__(self, out: str | None):
        self.out, self.errors = out, 0
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text("")

    def emit(self, row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")

    def attempt(self, where: dict, make_row, *args) -> None:
        """Emit ``make_row(*args)`` (unless None); if it raises, a row ``where | {"error": ...}``
        instead, and the run goes on."""
        try:
            row = make_row(*args)
            if row is not None:
                self.emit(row)
        except Exception as e:  # noqa: BLE001 - one setting's failure must not lose the others
            self.errors += 1
            traceback.print_exc()
            self.emit(where | {"error": f"{type(e).__name__}: {str(e)[:500]}"})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--views", default="M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speculate", nargs="+", default=["always"], choices=("always", "never", "auto"))
    ap.add_argument("--one-by-one", action="store_true", help="also decode each batch's requests with generate, one by one")
    ap.add_argument("--engine-time", action="store_true",
                    help="also time the models' forwards inside each mmspec run: forward_s, host_s = wall - forwards, "
                         "engine_efficiency = forward_s / wall_s (the engine adds nothing but its forwards: 1.0)")
    ap.add_argument("--admission", action="store_true",
                    help="instead: B requests arriving together, prefilled together vs one by one (TTFT, total)")
    ap.add_argument("--repeats", type=int, default=3, help="--admission: interleaved repeats (medians)")
    ap.add_argument("--engine", nargs="+", default=["eager"], choices=sorted(ENGINES),
                    help="eager ragged caches, fixed shapes run eagerly (static), or captured as CUDA graphs (graphs)")
    ap.add_argument("--overlap", nargs="+", default=["auto"], choices=("auto", "on", "off"),
                    help="each step launched before the previous one is read (auto: on a GPU); one system per value")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also append each row to this JSON-lines file as it is measured")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = Rows(args.out)
    torch.set_num_threads(args.threads)
    em = mmspec.load_embedded(device=args.device)
    eos = em.target.generation_config.eos_token_id
    em.target.generation_config.eos_token_id = None  # every system decodes exactly --new tokens
    decs = {}
    for engine in args.engine:
        kw = ENGINES[engine]
        if engine == "graphs" and em.target.device.type != "cuda":
            kw = {"cuda_graphs": "emulate"}
        # no prefix cache: each system prefills its prompts as the target's batched generate does
        dec = mmspec.SpecDecoder(em.target, em.draft, em.tokenizer, views=args.views, prefix_cache_mb=0, **kw)
        dec.options = type(dec.options)(**{**dec.options.__dict__, "eos_ids": frozenset()})
        decs[engine] = dec
    dec = decs[args.engine[0]]
    with torch.inference_mode():
        for d in decs.values():  # warm-up (and, with graphs, the first captures)
            spec_batched(d, em, prompts(em.processor, 2), 8, "always")
        target_batched(em, prompts(em.processor, 2), 8)
        for B in args.batch if args.admission else ():
            rows.attempt({"B": B, "admission": "both"}, compare_admission, dec, em, B, args.new, args.repeats,
                         rows.emit)
        for B in () if args.admission else args.batch:
            batch = prompts(em.processor, B)
            ref, wall_t = target_batched(em, batch, args.new)
            cpu_t = CPU_S["last"]
            rows.emit({"B": B, "system": "target.generate", "tok_s": round(B * args.new / wall_t, 1),
                       "wall_s": round(wall_t, 3), "cpu_s": round(cpu_t, 3)})
            base = {"ref": ref, "wall_t": wall_t, "cpu_t": cpu_t}
            for engine, mode, ov in [(e, m, o) for e in decs for m in args.speculate for o in args.overlap]:
                tag = ("" if len(decs) == 1 else f" engine={engine}") + ("" if len(args.overlap) == 1 else f" overlap={ov}")
                system = f"mmspec {args.views} speculate={mode}{tag}"
                rows.attempt({"B": B, "system": system}, spec_row, decs[engine], em, batch, args, mode, system, base,
                             OVERLAP[ov])
            if args.one_by_one:
                system = f"mmspec {args.views} generate one by one"
                rows.attempt({"B": B, "system": system}, one_by_one_row, dec, em, batch, args, system, base)
    em.target.generation_config.eos_token_id = eos
    return 3 if rows.errors else 0


OVERLAP = {"auto": None, "on": True, "off": False}


def spec_row(dec, em, batch, args, mode: str, system: str, base: dict, overlap: bool | None = None) -> dict:
    """One ``generate_batch`` run of ``batch`` against the target's (``base``), as a row."""
    B = len(batch)
    timer = ForwardTimer(em.target, em.draft) if args.engine_time else None
    try:
        got, wall = spec_batched(dec, em, batch, args.new, mode, overlap)
    finally:
        if timer is not None:
            timer.close()
    same = sum(a == b for a, b in zip(got, base["ref"]))
    row = {"B": B, "system": system, "tok_s": round(B * args.new / wall, 1), "wall_s": round(wall, 3),
           "speedup": round(base["wall_t"] / wall, 2), "same_as_target_batched": f"{same}/{B}",
           "cpu_s": round(CPU_S["last"], 3), "cpu_speedup": round(base["cpu_t"] / max(CPU_S["last"], 1e-9), 2)}
    walls = CPU_S["step_walls"]
    row |= {"admit_s": round(CPU_S["admit_s"], 4), "steps": CPU_S["steps"],
            "step_ms_median": round(1e3 * statistics.median(walls), 3) if walls else None}
    if dec.engine == "cuda-graphs" and walls:  # a step's device time: its graph's replay and read (events)
        dev = statistics.median(CPU_S["device_s"])
        row |= {"device_ms_median": round(1e3 * dev, 3),
                "host_share": round(1 - dev / statistics.median(walls), 3)}
    if timer is not None:  # eager forwards (hooks do not see a graph's replay)
        row |= {"forward_s": round(timer.seconds, 3), "host_s": round(wall - timer.seconds, 3),
                "engine_efficiency": round(timer.seconds / wall, 3),
                "host_ms_per_step": round(1e3 * (wall - timer.seconds) / CPU_S["steps"], 2)}
    return row


def one_by_one_row(dec, em, batch, args, system: str, base: dict) -> dict:
    B = len(batch)
    got, wall = spec_one_by_one(dec, em, batch, args.new)
    return {"B": B, "system": system, "tok_s": round(B * args.new / wall, 1), "wall_s": round(wall, 3),
            "speedup": round(base["wall_t"] / wall, 2),
            "same_as_target_batched": f"{sum(a == b for a, b in zip(got, base['ref']))}/{B}",
            "cpu_s": round(CPU_S["last"], 3), "cpu_speedup": round(base["cpu_t"] / max(CPU_S["last"], 1e-9), 2)}


if __name__ == "__main__":
    sys.exit(main())
