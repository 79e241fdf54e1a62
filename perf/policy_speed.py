"""Does speculation pay under load? ``speculate="auto"`` against ``always`` and ``never`` on the
same requests, in one run, on the embedded pack: at fixed batch sizes and on a ragged workload
(requests of different lengths arriving in waves, so the batch size changes every few steps),
with the pack's draft and with a draft that rarely agrees (its weights re-drawn at random). The
issue's goal: ``auto`` >= 0.95x max(``always``, ``never``) everywhere. ``--policy warm`` (the
default): ``auto``'s policy has decoded the same workload once, untimed, before its timed pass (a
server's policy has seen traffic; the decoder keeps it across calls); ``--policy fresh``: its
start-up exploration is inside the timed run. Also each steady step's host time: its wall
minus the models' forwards inside it (admission apart), the median over steps.

    PYTHONPATH=src taskset -c 0 python perf/policy_speed.py --batch 1 8 32 --ragged --new 32 \
        --out runs/policy_speed.jsonl

Prints one JSON line per (draft, workload, mode) and a summary line per (draft, workload) with
``auto_vs_best``; every mode's tokens must equal plain decoding's (``same_as_never``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import batch_speed as bs  # noqa: E402  (its prompts and forward timer)

import mmspec  # noqa: E402
from mmspec.batch import BatchScheduler, SpeculationPolicy  # noqa: E402

MODES = ("always", "never", "auto")


def random_draft(draft, seed: int = 0):
    """The pack's draft with every weight re-drawn (normal, std 0.02): a draft that rarely agrees."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    return draft


def workload(em, B: int | None, new: int, seed: int = 0, ragged_n: int = 48) -> list[tuple[int, dict]]:
    """(the step it arrives at, the request): B requests at step 0, or ragged (B None): ``ragged_n``
    requests of 8 to 3 x ``new`` tokens, four arriving every second step."""
    r = random.Random(seed)
    n = B or ragged_n
    out = []
    for i, (text, ims) in enumerate(bs.prompts(em.processor, n)):
        enc = em.processor(text=text, images=ims or None, return_tensors="pt")
        req = {k: v for k, v in enc.items() if k in ("input_ids", "pixel_values")}
        req["max_new_tokens"] = new if B else r.randint(8, 3 * new)
        out.append((0 if B else 2 * (i // 4), req))
    return out


def run(dec, em, reqs: list[tuple[int, dict]], mode: str, max_batch: int, pol: SpeculationPolicy | None = None) -> dict:
    timer = bs.ForwardTimer(em.target, dec.draft_model)
    pol = pol or SpeculationPolicy(mode, shapes=dec.speculation_policy.shapes)
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=pol, stream_text=False)
    pending = list(reqs)
    rids, done, host = [], {}, []
    t0, step = time.perf_counter(), 0
    try:
        while pending or sched.has_work():
            while pending and pending[0][0] <= step:
                rids.append(sched.submit(pending.pop(0)[1]))
            queued = bool(sched._queue)
            t, f = time.perf_counter(), timer.seconds
            for ev in sched.step():
                if ev.error is not None:
                    raise RuntimeError(ev.error)
                if ev.finished:
                    done[ev.rid] = ev.result
            if not queued:  # a steady step (no admission in it): its host time
                host.append((time.perf_counter() - t) - (timer.seconds - f))
            step += 1
        wall = time.perf_counter() - t0
    finally:
        timer.close()
        sched.close()
    res = [done[r] for r in rids]
    tokens = sum(len(r.token_ids) for r in res)
    drafted = sum(b.n_drafted > 0 for r in res for b in r.stats.blocks)
    blocks = sum(len(r.stats.blocks) for r in res)
    return {"tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "tokens": tokens, "steps": step,
            "drafted_share": round(drafted / max(blocks, 1), 3),
            "host_ms_step_median": round(1e3 * statistics.median(host), 3) if host else None,
            "forward_share": round(timer.seconds / wall, 3), "_ids": [r.token_ids for r in res]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--ragged", action="store_true", help="also the ragged workload (--ragged-n requests in waves)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--ragged-n", type=int, default=48, help="requests in the ragged workload")
    ap.add_argument("--drafts", nargs="+", default=["pack", "random"], choices=("pack", "random"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per mode, interleaved; the fastest is kept")
    ap.add_argument("--policy", default="warm", choices=("warm", "fresh"),
                    help="auto's policy: warm (it has decoded the workload once, untimed, as a server's has seen "
                         "traffic) or fresh (its start-up exploration inside the timed run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: dict) -> None:
        line = json.dumps({k: v for k, v in row.items() if not k.startswith("_")})
        print(line, flush=True)
        if out:
            with out.open("a") as fh:
                fh.write(line + "\n")

    em = mmspec.load_embedded()
    em.target.generation_config.eos_token_id = None
    loads = [(b, b) for b in args.batch] + ([(None, 32)] if args.ragged else [])
    with torch.inference_mode():
        for name in args.drafts:
            draft = em.draft if name == "pack" else random_draft(mmspec.load_embedded().draft)
            dec = mmspec.SpecDecoder(em.target, draft, em.tokenizer, views="M", prefix_cache_mb=0)
            dec.options = type(dec.options)(**{**dec.options.__dict__, "eos_ids": frozenset()})
            run(dec, em, workload(em, 2, 8), "always", 2)  # warm-up
            for B, max_batch in loads:
                reqs = workload(em, B, args.new, ragged_n=args.ragged_n)
                rows = {}
                pols = {}
                if args.policy == "warm":  # what a server's policy knows after a while: one untimed pass
                    pols["auto"] = SpeculationPolicy("auto", shapes=dec.speculation_policy.shapes)
                    run(dec, em, reqs, "auto", max_batch, pols["auto"])
                runs: dict = {m: [] for m in MODES}
                for rep in range(args.repeats):  # interleaved, the order rotated each repeat
                    for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                        runs[mode].append(run(dec, em, reqs, mode, max_batch, pols.get(mode)))
                for mode in MODES:
                    rows[mode] = min(runs[mode], key=lambda r: r["wall_s"])  # the least disturbed repeat
                    rows[mode]["tok_s_repeats"] = [r["tok_s"] for r in runs[mode]]
                    emit({"draft": name, "workload": B or "ragged", "mode": mode, "policy": args.policy if
                          mode == "auto" else None, **rows[mode], "same_as_never": None})
                same = all(r["_ids"] == rows["never"]["_ids"] for m in MODES for r in runs[m])
                best = max(rows["always"]["tok_s"], rows["never"]["tok_s"])
                emit({"draft": name, "workload": B or "ragged", "summary": True, "same_as_never": same,
                      "auto_vs_best": round(rows["auto"]["tok_s"] / best, 3),
                      "auto_vs_always": round(rows["auto"]["tok_s"] / rows["always"]["tok_s"], 3),
                      "auto_vs_never": round(rows["auto"]["tok_s"] / rows["never"]["tok_s"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
