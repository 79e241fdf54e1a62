"""Every option more than one ``mmspec`` command takes, declared once with its help text, and the
groups of them a command takes whole.

A group is a dataclass whose fields are options (:func:`option`: the default, the flag's
spelling, its help and the ``--help`` panel it is listed under); :func:`takes` lets a command
name a group as one parameter (``models: ModelFlags``): typer sees the group's options in its
place, and the command gets the dataclass filled from them. So ``generate`` and ``serve`` take
the same model, drafting and runtime options from one declaration, ``check head`` the block's
shape as they do, and each help text is written once. Options of one command alone stay with it.
The checks of what the flags say are :mod:`mmspec.cli.checks`' (they read
:class:`~mmspec.cli.checks.GenerateOptions`, which :meth:`Flags.fields` fills).

A flag that sets one of :class:`~mmspec.SpecDecoder`'s options takes its default from
:mod:`mmspec.config` (``DRAFT``, ``TREE``, ``RUNTIME`` below: the typed configs' defaults), never a
literal of its own; where the command line means something else on purpose it says so beside the
flag (``--views M``: the letter of the config's ``("multimodal",)``; ``--check-head``: on, where
the Python default is off).
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import typer

from mmspec.config import DraftConfig, RuntimeConfig, TreeConfig

MODELS, DRAFTING, RUNTIME = "Models", "Drafting", "Runtime"  # --help panels
DRAFT, TREE, RUNTIME_CONFIG = DraftConfig(), TreeConfig(), RuntimeConfig()  # the defaults the flags map onto


def option(default: Any, *decls: str, help: str, panel: str | None = None, **kw) -> Any:
    """A group's field: its default, and the typer option it is on the command line."""
    return field(default=default, metadata={"option": typer.Option(default, *decls, help=help,
                                                                   rich_help_panel=panel, **kw)})


# ---------------------------------------------------------------------------------- single options
THREADS_HELP = ("CPU threads for torch (default: the cores the machine leaves idle, from its load; one on a "
                "busy machine); give each of several runs side by side a share of the cores.")
THREADS = typer.Option(None, help=THREADS_HELP, rich_help_panel=RUNTIME)
DEVICE_HELP = "cpu, cuda, cuda:1, ..."
FRESH = typer.Option(False, help="Start over instead of resuming the checkpoints an interrupted run left in --out.")
CHECK_HEAD = typer.Option(True, help="With a head: a short calibration on load (4 world prompts, in the chain or tree "
                          "this command drafts) that reports tau, acceptance by depth and a diagnosis, and warns when "
                          "the head barely drafts (mmspec check head).")


def max_new_tokens(default: int, what: str = "") -> Any:
    """``--max-new-tokens`` (each command its own default)."""
    return typer.Option(default, help=f"New tokens per {what or 'answer'} at most (EOS may end it sooner).")


def device(default: str | None = "cpu", what: str = "") -> Any:
    """``--device`` (each command its own default and what runs there)."""
    return typer.Option(default, help=f"{what}{DEVICE_HELP}", rich_help_panel=RUNTIME)


def methods(default: str | None, *decls: str) -> Any:
    """The drafting methods, in the notation ``bench run -m`` and ``demo --methods`` take."""
    return typer.Option(default, *decls, help=methods_help(default or ",".join(_bench_methods())))


def _bench_methods() -> tuple[str, ...]:
    from mmspec.bench.config import DEFAULT_METHODS

    return DEFAULT_METHODS


def methods_help(default: str) -> str:
    return ("Drafting methods, comma-separated (or -m repeated): views (M, MTC, ...), a head variant (eagle, eagle3, "
            "msd), or lookup / suffix (no draft model: prompt lookup, suffix decoding; beside views or a head: "
            "M+suffix, eagle+lookup), then in any order +tree, +tree:DEPTHxTOPKxBUDGET (6x4x16), +tree:[[0],[1]] "
            f"(README, \"Token trees\"), +relaxed (lossy), +adaptive. Default: {default}.")


def heads(example: str) -> Any:
    """``--head VARIANT=DIR`` of ``bench run`` and ``demo``."""
    return typer.Option(None, "--head", help=("VARIANT=DIR: a feature-level head (mmspec's, EAGLE-1/2, EAGLE-3 or speculators) for a head method "
            f"(e.g. {example}); every head method needs one (none ships with the embedded pack). Repeat for several."))


# ---------------------------------------------------------------------------------- groups
class Flags:
    """A group of options (a dataclass of :func:`option` fields)."""

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ModelFlags(Flags):
    """The models a command decodes with (``generate``, ``serve``)."""

    target: str | None = option(None, help="Target VLM: local directory or hub id (default: the embedded target).",
                                panel=MODELS)
    draft: str | None = option(None, help="Draft model: local directory or hub id; or a draft head directory (as "
                               "--head); or 'lookup' / 'suffix': drafting with no model (prompt lookup, suffix "
                               "decoding; docs/lookup.md).", panel=MODELS)
    head: str | None = option(None, "--head", help="A feature-level draft head directory (mmspec train head's, or an "
                              "EAGLE-1/2, EAGLE-3 or speculators one): it drafts from the target's own hidden states, "
                              "so --views and --captioner do not apply. `--draft HEAD_DIR` works too.", panel=MODELS)
    model_free: str | None = option(DRAFT.model_free, "--model-free", help="lookup or suffix beside the draft model or head: "
                                    "their proposals join each block's tree as other branches (docs/lookup.md).",
                                    panel=MODELS)
    lookup_options: str | None = option(DRAFT.lookup_options, "--lookup-options", help="Settings of lookup / suffix, KEY=VALUE "
                                        "comma-separated: ngram_min, ngram_max, candidates, suffix_depth, suffix_mb, "
                                        "suffix_factor, suffix_min_prob (docs/lookup.md, \"Bounds\").", panel=MODELS)
    captioner: str | None = option(DRAFT.captioner, help="Captioner (HF image-to-text) for the caption view (C).", panel=MODELS)
    captioner_prompt: str | None = option(None, help="Task prompt for the captioner, e.g. `<CAPTION>` for Florence-2 "
                                          "(default: the one an `mmspec train` captioner records).", panel=MODELS)


@dataclass
class ViewFlags(Flags):
    """How a draft model sees the prompt (``generate``, ``serve``)."""

    # "M": the letter of DraftConfig's ("multimodal",)
    views: str = option("M", help="Drafting views: letters M,T,C,P or names, comma-separated (pooled:36); several = "
                        "the in-batch ensemble (e.g. MT, MTC). M is the fastest measured with the embedded pair "
                        "(docs/perf.md).", panel=DRAFTING)
    weights: str | None = option(DRAFT.weights, help="Ensemble weights: one number per view, comma-separated (default equal), "
                                 "or adaptive (adaptive:loglik, adaptive:tabed:0.2: per block, TABED).",
                                 panel=DRAFTING)
    tree_children: str = option(TREE.tree_children, help="Tree children from the views' mixture, or 'views': each view's own "
                                "top tokens (trees only).", panel=DRAFTING)


@dataclass
class ShapeFlags(Flags):
    """A block's shape: a chain or a token tree (``generate``, ``serve``, ``check head``)."""

    gamma: int | None = option(TREE.gamma, help="Draft tokens per block of a chain (default 5); a tree's shape is --tree's.",
                               panel=DRAFTING)
    tree: str | None = option(TREE.tree, help="Block shape (README, \"Token trees\"): chain (default), dynamic (EAGLE-2 "
                              "with the device's measured defaults), DEPTHxTOPKxBUDGET such as 6x4x16, a static "
                              "tree as JSON child-rank paths, e.g. '[[0],[1],[0,0]]', or auto (per step the chain or "
                              "the dynamic tree at one of two budgets, by measured tokens/s).", panel=DRAFTING)
    tree_depth: int | None = option(TREE.tree_depth, help="With --tree dynamic (or auto): expansion steps.", panel=DRAFTING)
    tree_topk: int | None = option(TREE.tree_topk, help="With --tree dynamic (or auto): children per node and nodes expanded "
                                   "per depth.", panel=DRAFTING)
    tree_budget: int | None = option(TREE.tree_budget, help="With --tree dynamic (or auto: the larger tree's): nodes verified per "
                                     "block (root excluded).", panel=DRAFTING)
    stop_below: float | None = option(TREE.stop_below, help="Chains only: stop drafting a block when the draft's probability of "
                                      "its proposal falls below this (lossless).", panel=DRAFTING)


@dataclass
class RuntimeFlags(Flags):
    """Where and how the models run (``generate``, ``serve``)."""

    cuda_graphs: str = option(RUNTIME_CONFIG.cuda_graphs, help="auto (on for a CUDA device), on, off.", panel=RUNTIME)
    compile: bool = option(RUNTIME_CONFIG.compile, "--compile/--no-compile", help="The step's forwards through torch.compile "
                           "(inductor kernels, captured by the step's CUDA graph; compiling takes a while per "
                           "shape; uncompiled if it fails). docs/perf.md, §7.", panel=RUNTIME)
    dtype: str = option(RUNTIME_CONFIG.dtype, help="auto, float32, bfloat16, float16, float64 (auto: float32 on the CPU, where "
                        "half precision is several times slower; the checkpoint's own on a GPU; float64: exact "
                        "checks, slow).", panel=RUNTIME)
    device: str = option("cpu", help=DEVICE_HELP, panel=RUNTIME)
    threads: int | None = option(None, help=THREADS_HELP, panel=RUNTIME)


def takes(command):
    """A command whose parameters annotated with a :class:`Flags` group are that group's options
    on the command line (in its place, in order), handed to it as the filled dataclass."""
    hints = typing.get_type_hints(command)
    groups: dict[str, type] = {}
    params = []
    for p in inspect.signature(command).parameters.values():
        kind = hints.get(p.name)
        if isinstance(kind, type) and issubclass(kind, Flags):
            groups[p.name] = kind
            group_hints = typing.get_type_hints(kind)
            params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.metadata["option"],
                                         annotation=group_hints[f.name]) for f in fields(kind)]
        else:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=kind if kind is not None
                                    else p.annotation))
    names = [p.name for p in params]
    if len(names) != len(set(names)):
        raise TypeError(f"{command.__name__}: an option is declared twice: {sorted(n for n in names if names.count(n) > 1)}")

    @functools.wraps(command)
    def run(**given):
        for name, kind in groups.items():
            given[name] = kind(**{f.name: given.pop(f.name, f.default if f.default is not MISSING else None)
                                  for f in fields(kind)})
        return command(**given)

    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run
