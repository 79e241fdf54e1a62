"""Structured outputs, measured: speculative constrained decoding vs the target's own constrained
decoding, beside the unconstrained speed-up on the same images, in ONE run (docs/structured.md).

On the embedded pack (``mmspec.load_embedded``) and the world's test samples, for each of the
bounded schemas below (enums of the world's words, integers in a range, arrays with ``maxItems``,
strings with ``maxLength``: a chart's label and value, a diff's changes, a caption's objects, ...):

- ``target``: ``target.generate(do_sample=False)``, the unconstrained reference;
- ``target+c``: the same with xgrammar's transformers logits processor (the target's own
  constrained decoding, the lossless reference under the constraint);
- each mmspec method (``--methods``: ``M`` a draft model, ``M+lookup`` with prompt lookup beside it,
  ``lookup``), unconstrained and constrained.

Every prompt runs every system back to back (round-robin, the order rotated per prompt and repeat).
Checks, per constrained answer: equal to ``target+c`` token for token, parses as JSON, validates
(``jsonschema``) and ends with EOS (finish "stop"); exit 1 if any fails. Reports per method the
constrained speed-up (mmspec+c ÷ target+c, time) beside the unconstrained one (mmspec ÷ target),
tau, the share of forced tokens per request (``stats.forced_share``) and of those that rode as
forced tails (``stats.tail_share``; ``--ablate-tails``: each constrained request also run with the
tails and the chain stop off, the before of a before/after in one run), and, at batch size
``--batch`` (8), the host's grammar work (tree masks, draft masks, advancing the matchers, forced
tokens) as a share of the batch's wall time.

Wall and CPU seconds (``time.process_time``: on a loaded machine it moves less) are both
recorded. Writes ``--out`` (JSON) and prints a table. ``python perf/constrained_speed.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import torch

from mmspec.world.render import COLOUR_NAMES, SHAPES
from mmspec.world.single import CHART_LABELS

COLOURS, SHAPE_NAMES, LABELS = list(COLOUR_NAMES), list(SHAPES), list(CHART_LABELS)
OBJECT = {"type": "object", "properties": {"colour": {"enum": COLOURS}, "shape": {"enum": SHAPE_NAMES}},
          "required": ["colour", "shape"]}
INT9 = {"type": "integer", "minimum": 0, "maximum": 9}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


# (family, sample index, schema): at least ten bounded schemas over the world's images
SCHEMAS: list[tuple[str, int, dict]] = [
    ("chartqa", 0, obj(label={"enum": LABELS}, value=INT9)),
    ("chartqa", 1, obj(labels={"type": "array", "items": {"enum": LABELS}, "maxItems": 3},
                       highest={"enum": LABELS})),
    ("chartqa", 2, obj(colour={"enum": COLOURS}, value=INT9)),
    ("vqav2", 0, obj(count=INT9, colour={"enum": COLOURS})),
    ("vqav2", 1, obj(objects={"type": "array", "items": OBJECT, "maxItems": 4})),
    ("textvqa", 0, obj(colour={"enum": COLOURS}, word={"type": "string", "maxLength": 8})),
    ("hallusionbench", 0, obj(answer={"enum": ["Yes", "No"]}, count=INT9)),
    ("spot_the_diff", 0, obj(changes={"type": "array", "maxItems": 2, "items": obj(
        object={"type": "string", "maxLength": 16}, change={"type": "string", "maxLength": 16})})),
    ("iedit", 0, obj(before={"enum": SHAPE_NAMES}, after={"enum": SHAPE_NAMES})),
    ("vist", 0, obj(caption={"type": "string", "maxLength": 40})),
    ("pororosv", 0, obj(objects={"type": "array", "items": OBJECT, "maxItems": 3},
                        caption={"type": "string", "maxLength": 24})),
]


@contextmanager
def grammar_timer():
    """Wall seconds spent in the grammar's host work (every hook the engine calls), summed."""
    from mmspec.constrain import proposals, state
    from mmspec.engine import step

    spent = [0.0]
    saved = []

    def timed(owner, name):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        saved.append((owner, name, fn))
        setattr(owner, name, wrapper)

    timed(step, "constrained_tree")
    timed(state.DraftMask, "mask")
    timed(state.RowGrammar, "accept")
    timed(proposals.ConstrainedProposer, "propose")
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextmanager
def tails_off():
    """Constrained steps as before the forced tails (``--ablate-tails``): no tail nodes, no chain
    that stops drafting where the grammar forces the rest."""
    from mmspec.constrain.state import RowGrammar
    from mmspec.engine import step

    saved = step.FORCED_TAIL, RowGrammar.forced_count
    step.FORCED_TAIL, RowGrammar.forced_count = 0, lambda self, path, need: 0
    try:
        yield
    finally:
        step.FORCED_TAIL, RowGrammar.forced_count = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="M,M+lookup", help="comma-separated: M, M+lookup, lookup")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes before the first case and the batch probe")
    ap.add_argument("--batch", type=int, default=8, help="batch size of the grammar-work probe (0: skip)")
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS), help="how many of the schemas to run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ablate-tails", action="store_true",
                    help="also run each constrained request with the forced tails and the chain stop off (before/after)")
    ap.add_argument("--out", default="constrained_speed.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import xgrammar as xgr

    from mmspec import SpecDecoder, load_embedded
    from mmspec.constrain import Constraint
    from mmspec.inputs import processor_inputs
    from mmspec.provenance import machine_info, now
    from mmspec.world import make_sample

    m = load_embedded()
    target, tok = m.target, m.tokenizer
    decs = {}
    for meth in args.methods.split(","):
        if meth == "M":
            decs[meth] = SpecDecoder(target, m.draft, tok, views="M")
        elif meth == "M+lookup":
            decs[meth] = SpecDecoder(target, m.draft, tok, views="M", model_free="lookup")
        elif meth == "lookup":
            decs[meth] = SpecDecoder(target, "lookup", tok)
        else:
            raise SystemExit(f"unknown method {meth!r}; use M, M+lookup, lookup")
    compiler = next(iter(decs.values())).grammar_compiler
    N = args.max_new_tokens
    rows, bad = [], []
    cases = SCHEMAS[:args.schemas]
    for i, (family, index, schema) in enumerate(cases):
        s = make_sample(family, "test", index)
        inp = processor_inputs(m.processor, s.prompt, s.images)
        c = Constraint("json_schema", schema=schema)
        grammar = compiler.compile(c)
        times: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        out: dict[str, dict] = {}

        def run_target(constrained: bool, inp=inp, grammar=grammar):
            procs = [xgr.contrib.hf.LogitsProcessor(grammar)] if constrained else None
            t0 = time.perf_counter()
            ids = target.generate(**inp, do_sample=False, max_new_tokens=N, logits_processor=procs)
            return time.perf_counter() - t0, ids[0, inp["input_ids"].shape[1]:].tolist()

        systems = [("target", lambda: run_target(False)), ("target+c", lambda: run_target(True))]
        for name, dec in decs.items():
            for constrained in (False, True):
                def run(dec=dec, constrained=constrained, inp=inp, c=c):
                    t0 = time.perf_counter()
                    r = dec.generate(**inp, max_new_tokens=N, constraint=c if constrained else None)
                    return time.perf_counter() - t0, r
                systems.append((name + ("+c" if constrained else ""), run))
            if args.ablate_tails:  # the same constrained request with the forced tails and the chain stop off
                def run_off(dec=dec, inp=inp, c=c):
                    with tails_off():
                        t0 = time.perf_counter()
                        r = dec.generate(**inp, max_new_tokens=N, constraint=c)
                        return time.perf_counter() - t0, r
                systems.append((name + "+c-notails", run_off))
        for rep in range(0 if i else -args.warmup, args.repeats):  # the first case starts with untimed warm-up passes
            k = (i + rep) % len(systems)
            for name, fn in systems[k:] + systems[:k]:
                c0 = time.process_time()
                sec, res = fn()
                if rep >= 0:
                    times.setdefault(name, []).append(sec)
                    cpu.setdefault(name, []).append(time.process_time() - c0)
                out[name] = res
        ref_c, ref = out["target+c"], out["target"]
        row = {"family": family, "index": index, "schema": schema, "tokens_c": len(ref_c), "tokens": len(ref),
               "target_s": statistics.median(times["target"]), "target_c_s": statistics.median(times["target+c"]),
               "target_cpu_s": statistics.median(cpu["target"]), "target_c_cpu_s": statistics.median(cpu["target+c"])}
        text = tok.decode(ref_c, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = ref_c[-1] in decs[next(iter(decs))].eos_ids
        except (ValueError, jsonschema.ValidationError):
            valid = False
        row["answer"], row["valid"] = text, valid
        if not valid:
            bad.append(f"{family}-{index}: not a valid finished answer: {text!r}")
        for name in decs:
            r, rc = out[name], out[name + "+c"]
            if args.ablate_tails and out[name + "+c-notails"].token_ids != ref_c:
                bad.append(f"{family}-{index} {name} without tails: output differs from the target's own")
            if r.token_ids != ref or rc.token_ids != ref_c:
                bad.append(f"{family}-{index} {name}: output differs from the target's own")
            row[name] = {"s": statistics.median(times[name]), "c_s": statistics.median(times[name + "+c"]),
                         "cpu_s": statistics.median(cpu[name]), "c_cpu_s": statistics.median(cpu[name + "+c"]),
                         "tau": r.stats.tau, "tau_c": rc.stats.tau, "forced_share": rc.stats.forced_share,
                         "tail_share": rc.stats.tail_share,
                         "speedup": row["target_s"] / statistics.median(times[name]),
                         "speedup_c": row["target_c_s"] / statistics.median(times[name + "+c"])}
            if args.ablate_tails:
                off = out[name + "+c-notails"]
                row[name].update(c_notails_s=statistics.median(times[name + "+c-notails"]), tau_c_notails=off.stats.tau,
                                 speedup_c_notails=row["target_c_s"] / statistics.median(times[name + "+c-notails"]))
        rows.append(row)
        print(f"{family}-{index}: valid={valid} " + " ".join(
            f"{n}: x{row[n]['speedup']:.2f} free, x{row[n]['speedup_c']:.2f} constrained, forced "
            f"{row[n]['forced_share']:.0%}, in tails {row[n]['tail_share']:.0%}" for n in decs), flush=True)

    summary = {}
    for name in decs:
        summary[name] = {
            "speedup_free": sum(r["target_s"] for r in rows) / sum(r[name]["s"] for r in rows),
            "speedup_constrained": sum(r["target_c_s"] for r in rows) / sum(r[name]["c_s"] for r in rows),
            "cpu_speedup_free": sum(r["target_cpu_s"] for r in rows) / sum(r[name]["cpu_s"] for r in rows),
            "cpu_speedup_constrained": sum(r["target_c_cpu_s"] for r in rows) / sum(r[name]["c_cpu_s"] for r in rows),
            "tau_free": statistics.mean(r[name]["tau"] for r in rows),
            "tau_constrained": statistics.mean(r[name]["tau_c"] for r in rows),
            "forced_share_mean": statistics.mean(r[name]["forced_share"] for r in rows),
            "tail_share_mean": statistics.mean(r[name]["tail_share"] for r in rows)}
        summary[name]["ratio"] = summary[name]["speedup_constrained"] / summary[name]["speedup_free"]
        if args.ablate_tails:
            off = sum(r["target_c_s"] for r in rows) / sum(r[name]["c_notails_s"] for r in rows)
            summary[name].update(speedup_constrained_notails=off, ratio_notails=off / summary[name]["speedup_free"],
                                 tau_constrained_notails=statistics.mean(r[name]["tau_c_notails"] for r in rows))
        summary[name]["cpu_ratio"] = summary[name]["cpu_speedup_constrained"] / summary[name]["cpu_speedup_free"]
    batch = None
    if args.batch:
        name, dec = next(iter(decs.items()))
        reqs = []
        for j in range(args.batch):
            family, index, schema = cases[j % len(cases)]
            s = make_sample(family, "test", index)
            reqs.append(dict(processor_inputs(m.processor, s.prompt, s.images), max_new_tokens=N,
                             constraint=Constraint("json_schema", schema=schema)))
        for _ in range(args.warmup):
            dec.generate_batch(reqs, max_batch=args.batch)
        with grammar_timer() as spent:
            t0 = time.perf_counter()
            res = dec.generate_batch(reqs, max_batch=args.batch)
            wall = time.perf_counter() - t0
        steps = max(r.stats.n_blocks for r in res)
        batch = {"method": name, "batch": args.batch, "wall_s": wall, "grammar_s": spent[0], "steps": steps,
                 "grammar_share": spent[0] / wall, "grammar_ms_per_step": 1e3 * spent[0] / steps}
        print(f"B={args.batch} ({name}): grammar work {batch['grammar_share']:.1%} of the wall time "
              f"({batch['grammar_ms_per_step']:.1f} ms per step)")
    report = {"when": now(), "machine": machine_info(), "command": " ".join(sys.argv), "args": vars(args),
              "summary": summary, "batch": batch, "rows": rows, "failures": bad}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, sm in summary.items():
        print(f"{name}: free x{sm['speedup_free']:.2f} (tau {sm['tau_free']:.2f}), constrained "
              f"x{sm['speedup_constrained']:.2f} (tau {sm['tau_constrained']:.2f}, forced "
              f"{sm['forced_share_mean']:.0%}, in tails {sm['tail_share_mean']:.0%}): ratio {sm['ratio']:.2f} (CPU seconds: free x{sm['cpu_speedup_free']:.2f}, "
              f"constrained x{sm['cpu_speedup_constrained']:.2f}, ratio {sm['cpu_ratio']:.2f})")
        if args.ablate_tails:
            print(f"{name} without tails: constrained x{sm['speedup_constrained_notails']:.2f} "
                  f"(tau {sm['tau_constrained_notails']:.2f}): ratio {sm['ratio_notails']:.2f}")
    for b in bad:
        print("FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
