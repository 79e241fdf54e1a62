"""What a :class:`~mmspec.SpecDecoder` is built with, grouped: :class:`DecoderConfig`.

The decoder takes its options either as one typed object or as flat keywords (the names the
docs, the CLI and earlier releases use); each keyword belongs to exactly one group:

* :class:`DraftConfig`: what a draft model reads and how its views mix (``views``, ``weights``,
  ``captioner``, ``draft_tokenizer``, ``draft_processor``, ``substitute``), model-free drafting
  beside it (``model_free``, ``lookup_options``) and a head's check on load (``check_head``);
* :class:`TreeConfig`: a block's shape (``gamma``, ``tree``, ``tree_depth``, ``tree_topk``,
  ``tree_budget``, ``tree_children``, ``stop_below``);
* :class:`RuntimeConfig`: how the models run (``dtype``, ``cuda_graphs``, ``static_cache``,
  ``compile``, ``prefix_cache_mb``);
* :class:`AcceptanceOptions`: exact (lossless) or relaxed (LOSSY) acceptance (``acceptance``,
  ``relaxed_thresholds``, ``relaxed_window``).

This module owns the defaults (the fields' values here, and the constants below that other
modules and the CLI's flags read: ``mmspec.cli.options`` maps flags onto these fields); it only
groups and names (and refuses a group that is not of its class, like
``DecoderConfig(tree="dynamic")``); the values are checked where they are used (the decoder's
constructor, :mod:`mmspec.checks`; the engine's settings made from them, :mod:`mmspec.options`),
so an error names the keyword the user wrote. It imports nothing heavy (no torch): the command
line reads it before any model loads.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any

from mmspec.errors import MMSpecError

PREFIX_CACHE_MB = 1024.0  # SpecDecoder's default budget (docs/perf.md, "Prefix caching"): ~2,000 tokens of a
# 7B LLaVA's fp16 KV (512 KiB a token); the embedded pack's conversations take well under 1 MiB each
MAX_LOGPROBS = 20  # the most log-probability alternatives per token an engine serves by default (OpenAI's bound)
DEFAULT_THRESHOLDS = (0.6, 0.4)  # MSD's relaxed acceptance (vision, text)
DEFAULT_WINDOW = 64  # positions after the prompt's last image token that count as vision context
SPECULATE = ("always", "never", "auto")  # a batch's speculation policies (mmspec.batch.SpeculationPolicy)


@dataclass(frozen=True)
class DraftConfig:
    """A draft model's views and their mixture; model-free drafting beside it; a head's check."""

    views: Any = ("multimodal",)  # names ("multimodal", "text", ...) or letters ("MTC")
    weights: Any = None  # one per view, "adaptive", "adaptive:loglik" or an AdaptiveWeights
    captioner: Any = None  # caption(images) -> list[str], or a path to an image-to-text model
    draft_tokenizer: Any = None
    draft_processor: Any = None
    substitute: Any = None  # the substitute view's encoder, or its directory
    model_free: str | None = None  # "lookup" / "suffix" beside a draft model or head
    lookup_options: dict | None = None  # mmspec.drafting.lookup.LookupConfig's fields
    check_head: bool = False  # a feature-level head: a short calibration on load


@dataclass(frozen=True)
class TreeConfig:
    """A block's shape: a chain of ``gamma`` drafts, a static tree, or a dynamic one (EAGLE-2)."""

    gamma: int | None = None  # a chain's length; None: 5 (mmspec.drafting.tree.DEFAULT_GAMMA); refused with a tree
    tree: Any = None  # None / "chain", "dynamic", child-rank paths, or a TreeSpec
    tree_depth: int | None = None
    tree_topk: int | None = None
    tree_budget: int | None = None
    tree_children: str = "mixture"  # or "views": each view's own top tokens as siblings
    stop_below: float | None = None  # a chain stops drafting below this draft probability


@dataclass(frozen=True)
class RuntimeConfig:
    """How the models run: their dtype, CUDA graphs or static shapes, the prefix cache's memory."""

    dtype: Any = "auto"
    cuda_graphs: Any = "auto"  # "auto", True or False
    static_cache: bool | None = None
    compile: bool = False  # the step's forwards through torch.compile (inside the step's graph)
    prefix_cache_mb: float = PREFIX_CACHE_MB
    max_logprobs: int = MAX_LOGPROBS  # the most log-probability alternatives a request may ask (graphs compute this many)


@dataclass(frozen=True)
class AcceptanceOptions:
    """Exact acceptance (the default: the output is the target's) or MSD's relaxed one (LOSSY)."""

    acceptance: str = "exact"
    relaxed_thresholds: tuple[float, float] = DEFAULT_THRESHOLDS  # (vision, text)
    relaxed_window: int = DEFAULT_WINDOW


@dataclass(frozen=True)
class DecoderConfig:
    """Every option of a :class:`~mmspec.SpecDecoder`, grouped (module docstring)."""

    draft: DraftConfig = field(default_factory=DraftConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    acceptance: AcceptanceOptions = field(default_factory=AcceptanceOptions)

    def __post_init__(self):
        for group, kind in zip(GROUPS, GROUP_TYPES):
            value = getattr(self, group)
            if not isinstance(value, kind):
                raise MMSpecError(_group_error(group, kind, value))

    @classmethod
    def of(cls, config: DecoderConfig | None = None, **keywords) -> DecoderConfig:
        """``config`` (default: every default) with the flat ``keywords`` set in their groups;
        an unknown keyword is refused, naming the closest known ones."""
        if config is not None and not isinstance(config, DecoderConfig):
            raise MMSpecError(f"config must be a mmspec.DecoderConfig, got {type(config).__name__}")
        cfg = config or cls()
        groups: dict[str, dict] = {}
        for name, value in keywords.items():
            group = KEYWORDS.get(name)
            if group is None:
                near = difflib.get_close_matches(name, KEYWORDS, n=2)
                hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else \
                    f"; the options are {', '.join(sorted(KEYWORDS))}"
                raise MMSpecError(f"SpecDecoder got an unknown option {name!r}{hint}")
            groups.setdefault(group, {})[name] = value
        return replace(cfg, **{g: replace(getattr(cfg, g), **kw) for g, kw in groups.items()})

    def keywords(self) -> dict[str, Any]:
        """The flat keywords this configuration sets (every option, defaults included)."""
        return {f.name: getattr(getattr(self, g), f.name) for g in GROUPS for f in fields(getattr(self, g))}


def _group_error(group: str, kind: type, value: Any) -> str:
    """The refusal of ``DecoderConfig(group=value)`` where value is no ``kind``: the group's class,
    the value written as that class where it can be (a dict of its fields, a keyword's value), and
    the flat keyword beside it."""
    names = {f.name for f in fields(kind)}
    if isinstance(value, dict) and value and set(value) <= names:
        inner = ", ".join(f"{k}={v!r}" for k, v in value.items())
        flat = ", ".join(f"{k}={v!r}" for k, v in value.items())
    elif group in names:  # DecoderConfig(tree="dynamic"): the group named like one of its keywords
        inner = flat = f"{group}={value!r}"
    else:
        inner, flat = "...", "its keywords"
    article = "an" if kind.__name__[0] in "AEIOU" else "a"
    return (f"DecoderConfig({group}={value!r}): {group}= takes {article} {kind.__name__}, not a "
            f"{type(value).__name__}: write {group}=mmspec.config.{kind.__name__}({inner}), "
            f"or pass {flat} to SpecDecoder directly")


GROUPS = ("draft", "tree", "runtime", "acceptance")
GROUP_TYPES = (DraftConfig, TreeConfig, RuntimeConfig, AcceptanceOptions)
KEYWORDS: dict[str, str] = {f.name: g for g, t in zip(GROUPS, GROUP_TYPES) for f in fields(t)}
