"""Speed, measured: the target alone vs transformers assisted generation vs mmspec, in ONE run.

Owns the wall-clock comparison of four systems on the same draft/target pair and the same
prompts, and the engine-efficiency analysis (IbED eq. 2) with a per-piece time breakdown:

- ``target``: ``target.generate(do_sample=False)`` (the reference output).
- ``assisted``: ``target.generate(..., assistant_model=draft, do_sample=False)`` (transformers'
  own speculative decoding, one draft, one view). ``--assisted matched`` (default) fixes the
  draft length to gamma with a constant schedule and no confidence early-exit, like mmspec;
  ``--assisted default`` keeps transformers' defaults (what a user gets without tuning).
- ``mmspec_M``: ``SpecDecoder(views="M")``; ``mmspec_<ENS>``: each ensemble (``--ensemble``, comma-separated methods such as MTC or MT+adaptive);
  ``mmspec_M+tree``: the M view with the device's default dynamic token tree (``--trees``;
  ``M+tree:6x4x16`` sets its shape). On a GPU the mmspec systems run with CUDA graphs (the default
  there) and ``mmspec_M(eager)`` repeats M without them (``--no-eager``).

Noise control: every repeat runs every prompt on every system back to back (round-robin), the
system order rotated each repeat and shifted per prompt, so machine noise hits all systems
alike. One untimed warm-up pass precedes the timed repeats. Summaries are medians over
repeats of per-repeat aggregates (tokens over all prompts / wall over all prompts).

Greedy outputs must be identical token for token to the target's; a mismatch is printed
loudly and the command exits with status 1 (the report is still written).

Results are written as they come (``speed.json`` / ``speed.md`` under ``--out``): after each timed
repeat, after the timed runs, and after each optional probe (latency, draft step on the decoder's
cache and on a DynamicCache, breakdown). A probe that crashes is recorded under ``errors`` and the
run goes on; the command then exits with status 3 (1 wins when outputs differ).

This script knows nothing about the engine's internals beyond public attributes: models load
through the library's own loaders (``mmspec.bench.backend.load_models``, the vocabulary check
included); the breakdown (`perf/breakdown.py`) reads the decoder's own stats clock for one
extra, untimed pass; the draft-step ratio times the engine's own drafting (`perf/draftstep.py`).
Both helpers are imported by their path, beside this file (:func:`sibling`).

Run ``python perf/speed.py --help``. Tests call :func:`run` with tiny random models.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from mmspec.bench.backend import BenchModels
from mmspec.provenance import machine_info, now
from mmspec.timing import sync

SYSTEM_TARGET, SYSTEM_ASSISTED = "target", "assisted"


def sibling(name: str):
    """The script ``perf/<name>.py`` beside this one, imported by its path (perf/ is not a
    package and goes on no ``sys.path``), once per process."""
    mod_name = f"_mmspec_perf_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, Path(__file__).with_name(f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]


# --------------------------------------------------------------------------- configuration
@dataclass
class SpeedConfig:
    """Everything one run needs; the CLI only maps flags onto these fields."""

    target: str | None = None  # local checkpoint dir; None = the embedded pack
    draft: str | None = None
    captioner: str | None = None  # local image-to-text dir (checkpoints only)
    captioner_prompt: str | None = None
    families: tuple[str, ...] = ("chartqa", "spot_the_diff", "vist")  # 1, 2 and 5 images
    n_per_family: int = 2
    split: str = "test"
    max_new_tokens: int = 64
    gamma: int = 5
    ensemble: str = "MTC"
    trees: tuple[str, ...] = ("M+tree",)  # tree systems: VIEWS+tree[:DxKxB] (dynamic tree; empty: none)
    heads: tuple[str, ...] = ()  # feature-level heads, VARIANT=DIR: systems mmspec_VARIANT and mmspec_VARIANT+tree
    eager: bool = True  # with graphs (a GPU, or emulated), also run mmspec M without them
    graphs: str = "auto"  # mmspec systems' cuda_graphs: auto (CUDA graphs on a GPU) | emulate (the CPU, fixed shapes)
    step_views: str = "MTCP"  # the ensemble whose draft step is timed against one view (M)
    step_rounds: int = 30  # interleaved rounds of the draft-step timing
    assisted: str = "matched"  # "matched" (gamma, constant, no early exit) or "default"
    repeats: int = 5
    warmup: bool = True
    latency_repeats: int = 7
    profile: bool = True  # one extra untimed pass with the per-piece timers
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str = "float32"  # of every model, the embedded pack's too (bfloat16: the GPU's losslessness check)
    threads: int | None = None  # torch.set_num_threads
    out: str = "runs/speed"
    command: str = ""  # filled by the CLI: the command line that produced the report


@dataclass
class SpeedPrompt:
    name: str
    inputs: dict[str, torch.Tensor]  # processor output: input_ids [1, L], pixel_values [n, 3, H, W]
    images: list | None = None  # PIL images for the captioner (None: rebuilt from pixel_values)
    captions: list[str] | None = None  # fixed captions (tests); None: the captioner runs


@dataclass
class RunRecord:
    """One timed generation."""

    repeat: int
    prompt: str
    system: str
    slot: int  # position in this prompt's round-robin order
    wall_s: float
    n_tokens: int
    tokens: list[int]
    n_blocks: int | None = None  # mmspec only
    stats: dict | None = None


# --------------------------------------------------------------------------- loading
def pick_device(cfg: SpeedConfig) -> torch.device:
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_models(cfg: SpeedConfig, device: torch.device) -> BenchModels:
    """The embedded pack unless ``--target/--draft`` are given: the library's loading
    (:func:`mmspec.bench.backend.load_models`: flag checks, the vocabulary check, dtype names),
    then everything moved to ``device``."""
    from mmspec.bench.backend import load_models as load_bench_models
    from mmspec.bench.config import BenchConfig

    bench = BenchConfig(target=cfg.target, draft=cfg.draft, captioner=cfg.captioner,
                        captioner_prompt=cfg.captioner_prompt, dtype=cfg.dtype)  # refuses bad flags before loading
    models = load_bench_models(bench)
    for mod in (models.target, models.draft, getattr(models.captioner, "model", None)):
        if mod is not None:
            mod.to(device).eval()
    return models


def load_prompts(cfg: SpeedConfig, models: BenchModels, device: torch.device) -> list[SpeedPrompt]:
    """World samples ``family/split/i`` through the target's processor."""
    from mmspec.world import make_sample

    dtype = next(models.target.parameters()).dtype
    out = []
    for fam in cfg.families:
        for i in range(cfg.n_per_family):
            s = make_sample(fam, cfg.split, i)
            enc = models.processor(text=s.prompt, images=s.images, return_tensors="pt")
            inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
                      for k, v in enc.items() if isinstance(v, torch.Tensor)}
            out.append(SpeedPrompt(s.uid, inputs, list(s.images)))
    return out


# --------------------------------------------------------------------------- the systems
@contextlib.contextmanager
def _assistant_config(draft, mode: str, gamma: int) -> Iterator[None]:
    """Temporarily give the assistant a matched generation config (restored afterwards)."""
    if mode == "default":
        yield
        return
    if mode != "matched":
        raise SystemExit(f"--assisted must be 'matched' or 'default', got {mode!r}")
    import copy

    saved = draft.generation_config
    gc = copy.deepcopy(saved)
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = gamma, "constant", 0.0
    draft.generation_config = gc
    try:
        yield
    finally:
        draft.generation_config = saved


def uses_graphs(cfg: SpeedConfig, models: BenchModels) -> bool:
    """The mmspec systems run on fixed shapes with (real or emulated) graphs."""
    return cfg.graphs == "emulate" or next(models.target.parameters()).device.type == "cuda"


def build_decoders(cfg: SpeedConfig, models: BenchModels) -> dict[str, Any]:
    """``mmspec_M``, ``mmspec_<ensemble>``, the tree systems, and with graphs ``mmspec_M(eager)``
    (SpecDecoders built once, reused: their CUDA graphs are captured in the warm-up pass)."""
    from mmspec.bench.config import split_methods
    from mmspec.decoder import SpecDecoder

    graphs = {"cuda_graphs": "emulate"} if cfg.graphs == "emulate" else {}

    def make(views: str, **kw):
        cap = models.captioner if "C" in views.upper() else None
        from mmspec.drafting.tree import reads_gamma

        gamma = {"gamma": cfg.gamma} if reads_gamma(kw.get("tree")) else {}  # a tree has a shape of its own
        return SpecDecoder(models.target, models.draft, models.tokenizer, views=views, captioner=cap,
                           processor=models.processor, prefix_cache_mb=0, **(graphs | gamma | kw))  # repeats: no reuse

    out = {"mmspec_M": make("M")}
    for name in split_methods([cfg.ensemble]):  # ensembles in the bench's method notation (MTC, MT+adaptive)
        if f"mmspec_{name}" not in out:
            views, kw = method_system(name)
            out[f"mmspec_{name}"] = make(",".join(views), **kw)
    for name in cfg.trees:
        views, kw = tree_system(name)
        out[f"mmspec_{name}"] = make(",".join(views), **kw)
    for spec in cfg.heads:
        variant, _, path = spec.partition("=")
        for suffix, kw in (("", {"gamma": cfg.gamma}), ("+tree", {"tree": "dynamic"})):
            out[f"mmspec_{variant}{suffix}"] = SpecDecoder(models.target, path, models.tokenizer,
                                                          processor=models.processor, prefix_cache_mb=0,
                                                          **(graphs | kw))
    if cfg.eager and uses_graphs(cfg, models):
        out["mmspec_M(eager)"] = make("M", cuda_graphs=False)
    return out


def method_system(name: str) -> tuple[tuple[str, ...], dict]:
    """An ensemble system in the bench's method notation: ``"MT+adaptive"`` -> (("M", "T"),
    {"weights": ...}); heads have ``--heads``."""
    from mmspec.bench.config import parse_method
    from mmspec.errors import MMSpecError

    try:
        views, kw = parse_method(name)
    except MMSpecError as e:
        raise SystemExit(f"--ensemble: {e}") from None
    if "head" in kw:
        raise SystemExit(f"--ensemble: {name!r} is a head; pass it with --heads VARIANT=DIR")
    return views, kw


def tree_system(name: str) -> tuple[tuple[str, ...], dict]:
    """A tree system in the bench's method notation (README, "Token trees"): ``"MT+tree:6x4x16"``
    -> (("M", "T"), {"tree": "6x4x16"}); ``"M+tree"``: the device's measured dynamic tree."""
    from mmspec.bench.config import parse_method
    from mmspec.errors import MMSpecError

    try:
        views, kw = parse_method(name)
    except MMSpecError as e:
        raise SystemExit(f"--trees: {e}") from None
    if "tree" not in kw or "head" in kw:
        raise SystemExit(f"--trees: a tree system is VIEWS+tree or VIEWS+tree:DxKxB (e.g. M+tree:6x4x16), got {name!r}")
    return views, kw


def make_systems(cfg: SpeedConfig, models: BenchModels, decoders: dict[str, Any],
                 device: torch.device) -> dict[str, Callable[[SpeedPrompt], tuple[list[int], dict | None]]]:
    """name -> fn(prompt) -> (new token ids, mmspec stats dict or None). Untimed wrappers."""

    def hf(assistant):
        def go(p: SpeedPrompt):
            n_in = int(p.inputs["input_ids"].shape[1])
            kw = {"assistant_model": assistant} if assistant is not None else {}
            ctx = _assistant_config(assistant, cfg.assisted, cfg.gamma) if assistant is not None else contextlib.nullcontext()
            with ctx:
                out = models.target.generate(**p.inputs, do_sample=False, max_new_tokens=cfg.max_new_tokens, **kw)
            return out[0, n_in:].tolist(), None  # [n_new]
        return go

    def spec(dec):
        def go(p: SpeedPrompt):
            res = dec.generate(p.inputs["input_ids"], pixel_values=p.inputs.get("pixel_values"),
                               attention_mask=p.inputs.get("attention_mask"), max_new_tokens=cfg.max_new_tokens,
                               images=p.images, captions=p.captions)
            stats = {k: v for k, v in res.stats.to_dict().items() if k != "blocks"}  # per-block list dropped
            return list(res.token_ids), stats
        return go

    systems = {SYSTEM_TARGET: hf(None), SYSTEM_ASSISTED: hf(models.draft)}
    systems.update({name: spec(dec) for name, dec in decoders.items()})
    return systems


def round_robin(systems: dict[str, Callable], prompts: Sequence[SpeedPrompt], repeats: int, warmup: bool,
                device: torch.device, log: Callable[[str], None] = print,
                on_repeat: Callable[[list[RunRecord], int], None] | None = None) -> list[RunRecord]:
    """Every repeat x prompt runs every system; order rotated by (repeat + prompt index).
    ``on_repeat(records, r)`` after each repeat (the run saves what it has)."""
    names = list(systems)
    if warmup:  # untimed: allocator, kernels, lazy imports
        for name in names:
            systems[name](prompts[0])
    records = []
    for r in range(repeats):
        for i, p in enumerate(prompts):
            shift = (r + i) % len(names)
            for slot, name in enumerate(names[shift:] + names[:shift]):
                sync(device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    tokens, stats = systems[name](p)
                sync(device)
                wall = time.perf_counter() - t0
                records.append(RunRecord(r, p.name, name, slot, wall, len(tokens), tokens,
                                         (stats or {}).get("n_blocks"), stats))
        log(f"  repeat {r + 1}/{repeats} done")
        if on_repeat is not None:
            on_repeat(records, r + 1)
    return records


# --------------------------------------------------------------------------- summary
def check_identical(records: Sequence[RunRecord]) -> list[dict]:
    """Every output vs the target's output on the same prompt and repeat."""
    ref = {(x.repeat, x.prompt): x.tokens for x in records if x.system == SYSTEM_TARGET}
    bad = []
    for x in records:
        want = ref[(x.repeat, x.prompt)]
        if x.tokens != want:
            first = next((j for j, (a, b) in enumerate(zip(x.tokens, want)) if a != b), min(len(x.tokens), len(want)))
            bad.append({"repeat": x.repeat, "prompt": x.prompt, "system": x.system, "first_diff": first,
                        "got_len": len(x.tokens), "want_len": len(want)})
    return bad


def summarise(records: Sequence[RunRecord]) -> dict:
    """Per-system medians over repeats of tokens/s and tau; every pairwise speed ratio."""
    names = list(dict.fromkeys(x.system for x in records))
    repeats = sorted({x.repeat for x in records})
    tps: dict[str, list[float]] = {n: [] for n in names}
    tau: dict[str, float | None] = {}
    for n in names:
        for r in repeats:
            rs = [x for x in records if x.system == n and x.repeat == r]
            tps[n].append(sum(x.n_tokens for x in rs) / max(sum(x.wall_s for x in rs), 1e-12))
        rs = [x for x in records if x.system == n and x.n_blocks]
        tau[n] = sum(x.n_tokens for x in rs) / sum(x.n_blocks for x in rs) if rs else None
    ratios = {a: {b: statistics.median(x / y for x, y in zip(tps[a], tps[b])) for b in names} for a in names}
    loop = {}
    for n in names:  # mmspec: wall split (medians of per-repeat sums)
        rs = [x for x in records if x.system == n and x.stats]
        if rs:
            keys = ("vision_s", "caption_s", "prefill_target_s", "prefill_draft_s", "draft_s", "verify_s", "total_s")
            loop[n] = {k: statistics.median(sum(x.stats.get(k, 0.0) for x in rs if x.repeat == r) for r in repeats)
                       for k in keys}
    return {"systems": names, "tokens_per_s": {n: statistics.median(v) for n, v in tps.items()},
            "tokens_per_s_per_repeat": tps, "tau": tau, "ratio_row_over_col": ratios,
            "mmspec_time_split_s": loop,
            "n_tokens_per_prompt": {x.prompt: x.n_tokens for x in records if x.system == SYSTEM_TARGET}}


# --------------------------------------------------------------------------- engine efficiency
def n_views(system: str) -> int:
    """Rows of the draft batch for ``mmspec_<letters>[+tree][(eager)]`` (one per view letter; a head: 1)."""
    name = system.removeprefix("mmspec_").split("+")[0].removesuffix("(eager)")
    return 1 if name.startswith(("eagle", "msd")) else len(name)


def is_chain(system: str) -> bool:
    """A token-level chain (eq. 2's case): no tree, no head."""
    name = system.removeprefix("mmspec_")
    return "+tree" not in name and not name.startswith(("eagle", "msd"))


def measure_engine(cfg: SpeedConfig, models: BenchModels, prompts: Sequence[SpeedPrompt], summary: dict) -> dict:
    """T_p, T_q(batch), T_V(gamma) per prompt (medians), eq.-2 prediction and engine efficiency."""
    from mmspec.bench.latency import measure_latency, predicted_speedup

    spec = [n for n in summary["systems"] if n.startswith("mmspec_")]
    batches = tuple(sorted({1, 4} | {n_views(n) for n in spec}))
    lat = [measure_latency(models.target, models.draft, p.inputs, cfg.gamma, batches, cfg.latency_repeats)
           for p in prompts]
    t_p = statistics.median(x["target_decode_s"] for x in lat)
    t_v = statistics.median(x["target_verify_s"] for x in lat)
    t_q = {b: statistics.median(x["draft_decode_s"][str(b)] for x in lat) for b in batches}
    t_pre = statistics.median(x["target_prefill_s"] for x in lat)
    base_tps = summary["tokens_per_s"][SYSTEM_TARGET]
    eff = {}
    for n in spec + [SYSTEM_ASSISTED]:
        tau = summary["tau"].get(n)
        measured = summary["ratio_row_over_col"][n][SYSTEM_TARGET]
        if n == SYSTEM_ASSISTED or tau is None or not is_chain(n):  # eq. 2 is the chain's formula
            eff[n] = {"measured_speedup": measured, **({"tau": tau} if tau else {})}
            continue
        pred = predicted_speedup(tau, cfg.gamma, t_q[n_views(n)], t_p, t_v)
        eff[n] = {"tau": tau, "n_views": n_views(n), "measured_speedup": measured, "predicted_speedup": pred,
                  "engine_efficiency": measured / pred}
        split = summary["mmspec_time_split_s"].get(n)
        if split:  # decode-only: mmspec's loop vs the baseline minus its measured prefill
            n_tok = sum(summary["n_tokens_per_prompt"].values())
            base_decode = n_tok / base_tps - t_pre * len(prompts)
            loop_s = split["draft_s"] + split["verify_s"]
            if base_decode > 0 and loop_s > 0:
                eff[n]["decode_only_speedup"] = base_decode / loop_s
                eff[n]["decode_only_efficiency"] = base_decode / loop_s / pred
    return {"T_p_s": t_p, "T_V_s": t_v, "T_q_s": {str(b): t for b, t in t_q.items()}, "T_prefill_s": t_pre,
            "T_q_over_T_p": {str(b): t / t_p for b, t in t_q.items()}, "T_V_over_T_p": t_v / t_p,
            "draft_forward_4_rows_over_1": t_q[4] / t_q[1], "gamma": cfg.gamma, "efficiency": eff,
            "per_prompt": lat}


def step_decoders(cfg: SpeedConfig, models: BenchModels, prompts: Sequence[SpeedPrompt]) -> dict[str, Any]:
    """The decoders whose draft step is timed: M and ``cfg.step_views`` (without C when there is no
    captioner), in the mode of the timed systems (graphs or not)."""
    from mmspec.decoder import SpecDecoder

    views = cfg.step_views.upper()
    if "C" in views and models.captioner is None and not all(p.captions for p in prompts):
        views = views.replace("C", "")  # no captioner: time the views that need none
    graphs = {"cuda_graphs": "emulate"} if cfg.graphs == "emulate" else {}
    return {v: SpecDecoder(models.target, models.draft, models.tokenizer, views=v, gamma=cfg.gamma,
                           captioner=models.captioner if "C" in v else None, processor=models.processor,
                           prefix_cache_mb=0, **graphs)
            for v in dict.fromkeys(["M", views])}


def measure_draft_step(cfg: SpeedConfig, decs: dict[str, Any], prompts: Sequence[SpeedPrompt]) -> dict:
    """The engine's own draft step (feed + mix + pick) for the ensemble of ``decs`` vs the M view
    alone, per prompt, interleaved (`perf/draftstep.py`); the ratio is the IbED claim that an
    in-batch ensemble costs about one draft forward."""
    draft_step_times = sibling("draftstep").draft_step_times
    views = list(decs)[-1]
    per = []
    for p in prompts:
        kw = dict(captions=p.captions, images=p.images, rounds=cfg.step_rounds, max_new_tokens=cfg.max_new_tokens)
        t = draft_step_times(decs, p.inputs["input_ids"], p.inputs.get("pixel_values"), **kw)
        per.append({"prompt": p.name, "step_s": t, "ratio": t[views] / t["M"]})
    return {"views": views, "n_views": len(views), "cache": "the engine's rows",
            "per_prompt": per, "ratio_median": statistics.median(x["ratio"] for x in per),
            "ratio_max": max(x["ratio"] for x in per)}


# --------------------------------------------------------------------------- report
def _fmt(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def markdown(result: dict) -> str:
    sm, m = result["summary"], result["machine"]
    names = sm["systems"]
    lines = [f"# Speed, measured ({result['date']})", "",
             f"- command: `{result['config']['command']}`",
             f"- machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} "
             f"({m['torch_threads']} threads), device {m['device']}{' ' + m['gpu'] if 'gpu' in m else ''}",
             f"- models: {result['models']}; prompts: {len(result['prompts'])}; repeats: {result['config']['repeats']}; "
             f"gamma {result['config']['gamma']}; max_new_tokens {result['config']['max_new_tokens']}; "
             f"assisted: {result['config']['assisted']}",
             f"- outputs identical to the target: **{'YES' if result['identical'] else 'NO'}**"]
    if result.get("progress", "done") != "done":
        lines.append(f"- **partial report** ({result['progress']})")
    lines += [f"- **{name} failed**: `{err.splitlines()[0]}` (the traceback is in speed.json)"
              for name, err in result.get("errors", {}).items()]
    lines += ["", "| system | tokens/s (median) | tau (incl. bonus) | speed-up vs target |", "|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {_fmt(sm['tokens_per_s'][n])} | {_fmt(sm['tau'][n])} | "
                     f"{_fmt(sm['ratio_row_over_col'][n][SYSTEM_TARGET])}x |")
    lines += ["", "Speed ratio, row over column (median over repeats):", "",
              "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        lines.append(f"| {a} | " + " | ".join(_fmt(sm["ratio_row_over_col"][a][b]) for b in names) + " |")
    eng = result.get("engine")
    if eng:
        lines += ["", f"Latency (medians over prompts): T_p {eng['T_p_s'] * 1e3:.2f} ms, "
                      f"T_V({eng['gamma']}) {eng['T_V_s'] * 1e3:.2f} ms (T_V/T_p {eng['T_V_over_T_p']:.2f}), "
                      f"T_q/T_p by batch {', '.join(f'{b}: {v:.3f}' for b, v in eng['T_q_over_T_p'].items())}; "
                      f"bare draft forward, 4 rows / 1 row: {eng['draft_forward_4_rows_over_1']:.2f}x"]
        lines += _draft_step_lines(eng.get("draft_step"))
        lines += ["",
                  "| system | measured speed-up | eq.2 predicted | engine efficiency | decode-only efficiency |",
                  "|---|---|---|---|---|"]
        for n, e in eng["efficiency"].items():
            lines.append(f"| {n} | {_fmt(e['measured_speedup'])} | {_fmt(e.get('predicted_speedup'))} | "
                         f"{_fmt(e.get('engine_efficiency'))} | {_fmt(e.get('decode_only_efficiency'))} |")
    for n, b in (result.get("breakdown") or {}).items():
        lines += ["", f"Time breakdown of {n} (one extra untimed pass, all prompts, {b['total_s']:.3f} s):", "",
                  "| piece | s | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.4f} | {b['share'].get(k, 0) * 100:.1f}% |" for k, v in b["parts_s"].items()]
    if not result["identical"]:
        lines += ["", "## OUTPUT MISMATCH", "", "```", json.dumps(result["mismatches"][:20], indent=1), "```"]
    return "\n".join(lines) + "\n"


def _draft_step_lines(step: dict | None) -> list[str]:
    """The draft-step table of one cache kind (none when that probe did not run)."""
    if not step:
        return []
    views = list(step["per_prompt"][0]["step_s"])
    lines = ["", f"Engine draft step (feed + mix + pick) on {step['cache']} cache, {step['views']} "
                 f"({step['n_views']} views) / M: median over prompts **{step['ratio_median']:.2f}x** "
                 f"(max {step['ratio_max']:.2f}x)", "",
             "| prompt | " + " | ".join(f"{v} step (ms)" for v in views) + " | ratio |", "|---" * (len(views) + 2) + "|"]
    return lines + [f"| {x['prompt']} | " + " | ".join(f"{t * 1e3:.3f}" for t in x["step_s"].values())
                    + f" | {x['ratio']:.2f} |" for x in step["per_prompt"]]


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "speed.json", out / "speed.md"
    for path, text in ((jp, json.dumps(result, indent=1, default=str)), (mp, markdown(result))):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a run killed mid-write leaves the previous report whole
    return jp, mp


# --------------------------------------------------------------------------- entry points
def optional(result: dict, name: str, fn: Callable[[], Any], log: Callable[[str], None]) -> Any:
    """``fn()``, or None when it raises: the error goes to ``result["errors"][name]`` (with its
    traceback) and the log, so a probe's crash never loses what was measured before it."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - an optional probe; the timed results are kept
        result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[:6000]
        log(f"!!! {name} failed ({type(e).__name__}: {str(e)[:300]}); the results before it are kept")
        return None


def run(cfg: SpeedConfig, models: BenchModels | None = None, prompts: Sequence[SpeedPrompt] | None = None,
        log: Callable[[str], None] = print) -> dict:
    """One full measurement; writes ``speed.json`` and ``speed.md`` under ``cfg.out`` after each
    timed repeat and each probe (the module docstring)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg)
    models = models or load_models(cfg, device)
    prompts = list(prompts) if prompts is not None else load_prompts(cfg, models, device)
    decoders = build_decoders(cfg, models)
    systems = make_systems(cfg, models, decoders, device)
    result = {"date": now(), "machine": machine_info(str(device)), "config": asdict(cfg), "models": models.source,
              "prompts": [p.name for p in prompts]}

    def save(records: list[RunRecord], progress: str) -> None:
        mismatches = check_identical(records)
        result.update(identical=not mismatches, mismatches=mismatches, summary=summarise(records),
                      raw=[asdict(x) for x in records], progress=progress)
        write_report(result, cfg.out)

    log(f"{len(systems)} systems x {len(prompts)} prompts x {cfg.repeats} repeats on {device}")
    records = round_robin(systems, prompts, cfg.repeats, cfg.warmup, device, log,
                          on_repeat=lambda recs, r: save(recs, f"timed repeat {r} of {cfg.repeats}; probes to come"))
    save(records, "timed runs done; probes to come")
    log("latency probes (T_p, T_q, T_V) ...")
    result["engine"] = optional(result, "latency probes", lambda: measure_engine(cfg, models, prompts,
                                                                                 result["summary"]), log)
    write_report(result, cfg.out)
    if result["engine"] is not None:
        decs = optional(result, "draft step", lambda: step_decoders(cfg, models, prompts), log) or {}
        log("draft step on the engine's rows ...")
        step = optional(result, "draft step", lambda: measure_draft_step(cfg, decs, prompts), log) if decs else None
        if step is not None:
            result["engine"]["draft_step"] = step
            write_report(result, cfg.out)
        if "draft_step" in result["engine"]:
            result["engine"]["draft_step_views_over_1"] = result["engine"]["draft_step"]["ratio_median"]
    if cfg.profile:
        profile_breakdown = sibling("breakdown").profile_breakdown
        result["breakdown"] = {}
        for n, d in decoders.items():
            if d.head is None:  # a head has no draft model to hook
                b = optional(result, f"breakdown of {n}",
                             lambda d=d: profile_breakdown(d, prompts, cfg.max_new_tokens, device), log)
                if b is not None:
                    result["breakdown"][n] = b
                    write_report(result, cfg.out)
    result["progress"] = "done"
    jp, mp = write_report(result, cfg.out)
    log(markdown(result))
    log(f"wrote {jp} and {mp}")
    if result["mismatches"]:
        log("!" * 72 + f"\n!!! OUTPUTS DIFFER FROM THE TARGET in {len(result['mismatches'])} run(s): "
            f"{result['mismatches'][:3]}\n" + "!" * 72)
    return result


_HELP = {"target": "target checkpoint dir (default: the embedded pack)", "draft": "draft checkpoint dir",
         "trees": "tree systems, comma-separated: VIEWS+tree or VIEWS+tree:DxKxB (empty: none)",
         "eager": "with graphs, also mmspec M without them",
         "graphs": "auto (CUDA graphs on a GPU) | emulate (fixed shapes and emulated capture on the CPU)",
         "heads": "feature-level heads, comma-separated VARIANT=DIR (made by mmspec train head)",
         "captioner": "captioner dir (checkpoints; needed for C views)", "families": "comma-separated world families",
         "ensemble": "ensemble systems, comma-separated, in the bench's method notation (MTC, MT+adaptive)",
         "step_views": "views whose engine draft step is timed against M alone", "assisted": "matched | default",
         "dtype": "float32 | bfloat16 | float16 (checkpoints)", "threads": "torch.set_num_threads"}


def parse_args(argv: Sequence[str] | None = None) -> SpeedConfig:
    """One flag per :class:`SpeedConfig` field (``--no-<flag>`` for the booleans)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(SpeedConfig):
        if f.name == "command":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            ap.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=f"skip {f.name}")
        elif isinstance(f.default, tuple):
            ap.add_argument(flag, default=",".join(f.default), help=_HELP.get(f.name))
        else:
            kind = int if str(f.type).startswith("int") else str  # annotations are strings here
            ap.add_argument(flag, type=kind, default=f.default, help=_HELP.get(f.name))
    a = ap.parse_args(argv)
    if a.assisted not in ("matched", "default"):
        ap.error(f"--assisted must be matched or default, got {a.assisted!r}")
    if a.dtype not in ("float32", "bfloat16", "float16"):
        ap.error(f"--dtype must be float32, bfloat16 or float16, got {a.dtype!r}")
    if a.graphs not in ("auto", "emulate"):
        ap.error(f"--graphs must be auto or emulate, got {a.graphs!r}")
    kw = vars(a) | {"families": tuple(x for x in a.families.split(",") if x),
                    "trees": tuple(x for x in a.trees.split(",") if x),
                    "heads": tuple(x for x in a.heads.split(",") if x)}
    argv = list(argv) if argv is not None else sys.argv[1:]
    return SpeedConfig(**kw, command=" ".join(["python", "perf/speed.py", *argv]))


def main(argv: Sequence[str] | None = None) -> int:
    from mmspec.errors import MMSpecError

    try:
        result = run(parse_args(argv))
    except MMSpecError as e:  # a bad flag or checkpoint: one line, before anything is timed
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if not result["identical"] else 3 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
