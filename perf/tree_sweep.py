"""Token trees against their budget: tau and tokens/s of dynamic trees of several shapes, against
the chain, on the same prompts and models, in ONE interleaved run (the defaults' evidence).

Owns the sweep over (depth, topk, budget) for one view set, plus the comparison of tree
children drawn from the views' mixture against each view's own top tokens (``--views MT``), and
with ``--auto`` the setting ``auto``: ``tree="auto"``, the chain or the device's tree at two
budgets chosen per step by measured tokens/s, with the figures it chose by and its choice.
Every output is checked against the target's greedy output. Writes ``tree_sweep.json``,
``tree_sweep.md`` and ``tree_sweep.png`` (tau and tokens/s against the number of tree nodes),
after each timed repeat (a run stopped part-way keeps the repeats it finished).

Models and prompts are those of ``perf/speed.py`` (the embedded pack by default; ``--target``
/ ``--draft`` for checkpoints). Run ``python perf/tree_sweep.py --help``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mmspec.provenance import machine_info, now
from mmspec.timing import sync


def _load_speed():
    """``perf/speed.py`` (models, prompts, device choice), beside this script, imported by its
    path under the name its own :func:`sibling` uses (perf/ is not a package)."""
    name = "_mmspec_perf_speed"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("speed.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


speed = _load_speed()


@dataclass
class SweepConfig:
    target: str | None = None
    draft: str | None = None
    families: tuple[str, ...] = ("chartqa", "spot_the_diff", "vist")
    n_per_family: int = 2
    split: str = "test"
    max_new_tokens: int = 64
    gamma: int = 5  # the chain's
    views: str = "M"
    shapes: tuple[str, ...] = ("5x2x4", "5x2x8", "5x3x12", "6x4x16", "6x4x24", "6x8x32", "6x8x48", "7x8x64")  # depth x topk x budget
    children: tuple[str, ...] = ("mixture",)  # add "views" to compare an ensemble's proposals
    chains: tuple[str, ...] = ()  # more chains: "8" (gamma 8), "8s0.3" (gamma 8, dynamic draft length stop_below 0.3)
    auto: bool = False  # also tree="auto" (mmspec.engine.policy.SpeculationPolicy)
    repeats: int = 3
    device: str | None = None
    dtype: str = "float32"
    graphs: str = "auto"  # cuda_graphs of every setting: auto (CUDA graphs on a GPU) | emulate (CPU dry runs)
    threads: int | None = None
    out: str = "runs/tree_sweep"
    command: str = ""


def parse_shape(text: str) -> tuple[int, int, int]:
    d, k, b = (int(x) for x in text.lower().split("x"))
    return d, k, b


def decoders(cfg: SweepConfig, models) -> dict[str, object]:
    from mmspec import SpecDecoder

    cap = models.captioner if "C" in cfg.views.upper() else None
    kw = dict(views=cfg.views, captioner=cap, processor=models.processor,
              prefix_cache_mb=0)  # repeats of a prompt are timed from scratch
    if cfg.graphs == "emulate":
        kw["cuda_graphs"] = "emulate"
    out = {f"chain(γ={cfg.gamma})": SpecDecoder(models.target, models.draft, models.tokenizer, gamma=cfg.gamma, **kw)}
    for c in cfg.chains:
        g, _, stop = c.partition("s")
        out[f"chain(γ={g}{', stop<' + stop if stop else ''})"] = SpecDecoder(
            models.target, models.draft, models.tokenizer, **{**kw, "gamma": int(g)},
            stop_below=float(stop) if stop else None)
    for shape in cfg.shapes:
        d, k, b = parse_shape(shape)
        for ch in cfg.children:
            out[f"tree {shape}{'' if ch == 'mixture' else ' ' + ch}"] = SpecDecoder(
                models.target, models.draft, models.tokenizer, tree="dynamic", tree_depth=d, tree_topk=k,
                tree_budget=b, tree_children=ch, **kw)
    if cfg.auto:  # its policy measures from the warm-up on, across every prompt and repeat
        out["auto"] = SpecDecoder(models.target, models.draft, models.tokenizer, tree="auto", gamma=cfg.gamma, **kw)
    return out


def run(cfg: SweepConfig, log: Callable[[str], None] = print, models=None, prompts=None) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    scfg = speed.SpeedConfig(target=cfg.target, draft=cfg.draft, families=cfg.families, n_per_family=cfg.n_per_family,
                             split=cfg.split, device=cfg.device, dtype=cfg.dtype)
    device = speed.pick_device(scfg)
    models = models or speed.load_models(scfg, device)
    prompts = list(prompts) if prompts is not None else speed.load_prompts(scfg, models, device)
    decs = decoders(cfg, models)
    refs = {}
    with torch.inference_mode():
        for p in prompts:
            n_in = int(p.inputs["input_ids"].shape[1])
            out = models.target.generate(**p.inputs, do_sample=False, max_new_tokens=cfg.max_new_tokens)
            refs[p.name] = out[0, n_in:].tolist()
    names = list(decs)

    def go(name: str, p) -> tuple[float, list[int], object]:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = decs[name].generate(p.inputs["input_ids"], pixel_values=p.inputs.get("pixel_values"),
                                      attention_mask=p.inputs.get("attention_mask"), max_new_tokens=cfg.max_new_tokens,
                                      images=p.images, captions=p.captions)
        sync(device)
        return time.perf_counter() - t0, res.token_ids, res.stats

    for name in names:  # warm-up (CUDA graphs are captured here)
        go(name, prompts[0])
    wall = {n: [0.0] * cfg.repeats for n in names}
    toks = {n: [0] * cfg.repeats for n in names}
    blocks = {n: 0 for n in names}
    nodes = {n: 0 for n in names}
    mismatches = []
    result = {"date": now(), "machine": machine_info(str(device)), "config": asdict(cfg), "models": models.source,
              "prompts": [p.name for p in prompts]}
    chain = names[0]
    auto_steps: dict[str, int] = {}

    def save(done: int) -> None:
        tps = {n: [t / w for t, w in zip(toks[n][:done], wall[n][:done])] for n in names}
        rows = [{"setting": n, "tau": toks[n][0] / blocks[n], "tokens_per_s": statistics.median(tps[n]),
                 "nodes_per_block": nodes[n] / blocks[n],
                 "speed_vs_chain": statistics.median(a / b for a, b in zip(tps[n], tps[chain]))} for n in names]
        result.update(identical=not mismatches, mismatches=mismatches, rows=rows, repeats_done=done)
        if "auto" in decs:  # what tree="auto" measured per shape, and what it picked (steps per shape)
            result["auto"] = {"rates": decs["auto"].shape_policy.report(), "steps": auto_steps}
        write(result, cfg.out)

    log(f"{len(names)} settings x {len(prompts)} prompts x {cfg.repeats} repeats on {device}")
    for r in range(cfg.repeats):
        for i, p in enumerate(prompts):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                s, ids, st = go(name, p)
                wall[name][r] += s
                toks[name][r] += len(ids)
                for k, v in st.shapes.items():
                    auto_steps[k] = auto_steps.get(k, 0) + v
                if r == 0:
                    blocks[name] += st.n_blocks
                    nodes[name] += sum(b.n_drafted for b in st.blocks)
                if ids != refs[p.name]:
                    mismatches.append({"setting": name, "prompt": p.name, "repeat": r})
        save(r + 1)
        log(f"  repeat {r + 1}/{cfg.repeats} done")
    log(markdown(result))
    return result


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Token trees against their budget ({res['date']})", "",
             f"- command: `{res['config']['command']}`",
             f"- machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
             f"device {m['device']}{' ' + m['gpu'] if 'gpu' in m else ''}",
             f"- models: {res['models']}; views {res['config']['views']}; prompts: {len(res['prompts'])}; "
             f"repeats {res['config']['repeats']}; max_new_tokens {res['config']['max_new_tokens']}",
             f"- outputs identical to the target's greedy output: **{'YES' if res['identical'] else 'NO'}**",
             *([f"- **partial**: {res['repeats_done']} of {res['config']['repeats']} repeats"]
               if res.get("repeats_done", res["config"]["repeats"]) < res["config"]["repeats"] else []), "",
             "| setting (depth x topk x budget) | nodes / block | τ | tokens/s | vs chain |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['setting']} | {r['nodes_per_block']:.1f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speed_vs_chain']:.2f}x |")
    auto = res.get("auto")
    if auto:
        lines += ["", "`auto` (tree=\"auto\"): steps drafted per shape " + ", ".join(
            f"{k} {v}" for k, v in auto["steps"].items()) + "; measured by the policy (one request at a time):", ""]
        for b, r in auto["rates"].items():
            lines.append(f"- batch {b}: " + ", ".join(f"{k} {v['tokens_per_step']:.2f} tokens / {v['step_ms']:.2f} ms = "
                                                       f"{v['tokens_per_s']:.0f} tokens/s" for k, v in r["shapes"].items())
                         + f"; chosen: **{r['choice']}**")
    return "\n".join(lines) + "\n"


def write(result: dict, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_sweep.json").write_text(json.dumps(result, indent=1))
    (out / "tree_sweep.md").write_text(markdown(result))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    rows = [r for r in result["rows"] if r["setting"].startswith("tree") and " views" not in r["setting"]]
    chain = result["rows"][0]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["nodes_per_block"] for r in rows]
    for ax, key, label in ((axes[0], "tau", "τ (tokens per block, incl. bonus)"), (axes[1], "tokens_per_s", "tokens/s")):
        ax.plot(x, [r[key] for r in rows], "o-", label="dynamic tree")
        for r in rows:
            ax.annotate(r["setting"].removeprefix("tree "), (r["nodes_per_block"], r[key]), fontsize=7)
        ax.axhline(chain[key], color="gray", linestyle="--", label=chain["setting"])
        ax.set_xlabel("draft nodes verified per block")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['config']['views']} on {result['machine']['device']} ({result['date'][:10]})")
    fig.tight_layout()
    fig.savefig(out / "tree_sweep.png", dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> SweepConfig:
    d = SweepConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name in ("target", "draft", "split", "views", "device", "dtype", "out"):
        ap.add_argument("--" + name, default=getattr(d, name))
    ap.add_argument("--graphs", default=d.graphs, choices=("auto", "emulate"),
                    help="auto: CUDA graphs on a GPU; emulate: fixed shapes on the CPU (dry runs)")
    ap.add_argument("--auto", action="store_true", help='also tree="auto": the chain or a tree per step, by measured '
                    "tokens/s (its choice and figures in the report)")
    for name in ("n_per_family", "max_new_tokens", "gamma", "repeats", "threads"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("families", "shapes", "children", "chains"):
        ap.add_argument("--" + name, default=",".join(getattr(d, name)))
    a = ap.parse_args(argv)
    kw = vars(a) | {k: tuple(x for x in getattr(a, k).split(",") if x) for k in ("families", "shapes", "children", "chains")}
    for s in kw["shapes"]:
        try:
            parse_shape(s)
        except ValueError:
            ap.error(f"--shapes takes DEPTHxTOPKxBUDGET items such as 6x4x16, got {s!r}")
    return SweepConfig(**kw, command=" ".join(["python", "perf/tree_sweep.py", *(argv if argv is not None else sys.argv[1:])]))


def main(argv: Sequence[str] | None = None) -> int:
    return 0 if run(parse_args(argv))["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
