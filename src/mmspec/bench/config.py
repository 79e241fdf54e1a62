"""Typed configuration of a benchmark run. The CLI only maps flags onto :class:`BenchConfig`.

Also owns the parsing of method specs (``"MTC"`` -> views ``("M", "T", "C")``) and of dataset
specs (``"chartqa"`` = embedded synthetic world, ``"chartqa=/data/chartqa.parquet"`` = the real
benchmark from local files, ``"textvqa=/data/textvqa:train"`` = its ``train`` split), and the
fingerprint that guards a results directory against being resumed with settings that would
change its numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmspec.errors import MMSpecError

DEFAULT_METHODS: tuple[str, ...] = ("M", "T", "C", "P", "MT", "MC", "MTC", "MTCP")
DEFAULT_DATASETS: tuple[str, ...] = (
    "chartqa",
    "textvqa",
    "vqav2",
    "hallusionbench",
    "spot_the_diff",
    "iedit",
    "pororosv",
    "vist",
)
_LETTERS = set("MTCP")
_SPLIT_SUFFIX = re.compile(r"^(?P<path>.+):(?P<split>[A-Za-z0-9_-]+)$")  # PATH:SPLIT; a split is a plain name
# settings that change a row's numbers: a results dir is only resumed with the same values
RESULT_KEYS = ("gamma", "max_new_tokens", "temperature", "seed", "target", "draft", "captioner",
               "captioner_prompt", "split", "dtype", "pool_tokens")


HEAD_VARIANTS = ("eagle", "eagle3", "msd")
IBED_NEW_TOKENS = 128  # the IbED paper's new tokens per sample (Section 4.1), every data set's unless below
# data sets whose protocol sets another limit when --max-new-tokens is not given (a turn's answer): MMSpec's
# evaluation follows Spec-Bench / EAGLE's 1024 (docs/bench.md)
PROTOCOL_NEW_TOKENS: dict[str, int] = {"mmspec": 1024}


def parse_method(method: str) -> tuple[tuple[str, ...], dict]:
    """One method name -> (views, SpecDecoder keywords).

    ``"MTC"`` -> (("M", "T", "C"), {}); ``"M+pooled:36"`` -> views as split. Suffixes, in any
    order (README, "Token trees"): ``tree`` asks for the dynamic token tree with the device's
    measured defaults, ``tree:DxKxB`` (``tree:6x4x16``) one of depth D, top-k K and budget B,
    ``tree:[[0],[1],[0,0]]`` a static tree, ``tree:auto`` the chain or a tree per step by measured
    tokens/s (:class:`mmspec.engine.policy.SpeculationPolicy`); ``relaxed``: MSD's relaxed acceptance (LOSSY); ``auto``:
    the batched pass decodes with ``generate_batch(speculate="auto")`` (drafts only where measured to
    pay; :class:`mmspec.batch.SpeculationPolicy`), the one-prompt rows as the method without it;
    ``adaptive`` (``adaptive:loglik``): ensemble weights that adapt per block (TABED;
    :mod:`mmspec.drafting.adaptive`), {"weights": "adaptive"}, for two views or more. A head
    variant in place of the views (``eagle``, ``eagle3+tree``, ``msd+relaxed+tree``) drafts with
    that trained head: {"head": variant}. ``lookup`` / ``suffix`` (:mod:`mmspec.drafting.lookup`) alone draft
    with no model, {"draft": name}; after views or a head (``M+suffix``, ``eagle+lookup+tree``) their
    proposals join the draft's tree, {"model_free": name}. Each tree is checked here (a zero depth
    is refused).
    """
    method = method.strip()
    if not method:
        raise MMSpecError("empty method name; use letters such as M, T, C, P, MT, MTC (add +tree for a token tree)")
    parts = [p.strip() for p in split_outside_brackets(method, "+") if p.strip()]
    kw: dict = {}
    views = []
    for part in parts:
        low = part.lower()
        if low == "auto":
            if "speculate" in kw:
                raise MMSpecError(f"method {method!r} says +auto twice; say it once")
            kw["speculate"] = "auto"
        elif low == "relaxed":
            if "acceptance" in kw:
                raise MMSpecError(f"method {method!r} says +relaxed twice; say it once")
            kw["acceptance"] = "relaxed"
        elif low == "adaptive" or low.startswith("adaptive:"):
            if "weights" in kw:
                raise MMSpecError(f"method {method!r} says +adaptive twice; say it once")
            from mmspec.drafting.adaptive import AdaptiveWeights

            kw["weights"] = AdaptiveWeights.parse(low).label  # an unknown rule is refused here
        elif low in ("lookup", "suffix"):
            if "model_free" in kw:
                raise MMSpecError(f"method {method!r} names two model-free drafts; give one (lookup or suffix)")
            kw["model_free"] = low
        elif low == "tree" or low.startswith(("tree:", "tree@")):
            if "tree" in kw:
                raise MMSpecError(f"method {method!r} has two tree parts; give one (+tree or +tree:6x4x16)")
            kw["tree"] = _tree_part(part, method)
        else:
            views.append(part)
    if not views and "model_free" in kw:  # lookup / suffix alone: no draft model
        if "weights" in kw:
            raise MMSpecError(f"method {method!r}: {kw['model_free']} drafts with no model, there are no views to "
                              "weigh; drop +adaptive")
        return (), {**{k: v for k, v in kw.items() if k != "model_free"}, "draft": kw["model_free"]}
    if not views:
        raise MMSpecError(f"method {method!r} has no views; write the views first, e.g. M+tree or MTC+tree")
    if len(views) == 1 and views[0].lower() in HEAD_VARIANTS:
        if "weights" in kw:
            raise MMSpecError(f"method {method!r}: a head drafts alone, there is no ensemble to weigh; drop +adaptive")
        return (), {**kw, "head": views[0].lower()}
    if "weights" in kw and len(views) == 1 and set(views[0]) <= _LETTERS and len(views[0]) < 2:
        raise MMSpecError(f"method {method!r}: +adaptive weighs two views or more; use e.g. MT+adaptive")
    body = "+".join(views)
    if len(views) > 1 or ":" in body or body.lower() in ("multimodal", "text", "caption", "pooled"):
        return tuple(views), kw
    if set(body) <= _LETTERS:
        return tuple(body), kw
    raise MMSpecError(
        f"unknown method {method!r}; use letters from M (multimodal), T (text), C (caption), "
        "P (pooled) such as 'MTC', or view names joined by '+' such as 'multimodal+pooled:36'; "
        "add '+tree' for a token tree (e.g. 'M+tree', 'M+tree:6x4x16', 'M+tree:[[0],[1],[0,0]]'); a trained "
        "head: 'eagle', 'eagle3+tree', 'msd+tree'; no model: 'lookup', 'suffix', beside a draft 'M+suffix'"
    )


TREE_FIX = ("write +tree (the device's measured defaults), +tree:DEPTHxTOPKxBUDGET such as M+tree:6x4x16, "
            "+tree:[[0],[1],[0,0]] (a static tree) or +tree:auto (chosen per step); README, \"Token trees\"")


def split_outside_brackets(text: str, sep: str) -> list[str]:
    """Split ``text`` at ``sep`` outside square brackets (a static tree's JSON paths hold commas)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def split_methods(values) -> tuple[str, ...]:
    """``["M,MT+tree", "M+tree:[[0],[1]]"]`` -> each method; commas inside a static tree's
    brackets do not split."""
    return tuple(x.strip() for v in values for x in split_outside_brackets(v, ",") if x.strip())


def _tree_part(text: str, method: str) -> str:
    """``tree`` -> "dynamic"; ``tree:6x4x16`` -> "6x4x16"; ``tree:[[0],[1]]`` -> its JSON; ``tree:auto``. The
    shape is checked with :func:`mmspec.drafting.tree.parse_tree` (device-independent parts)."""
    from mmspec.drafting.tree import parse_tree

    low = text.lower()
    if low.startswith("tree@"):
        raise MMSpecError(f"{text!r} in method {method!r} is the old tree@BUDGET form; give the whole "
                          "shape as +tree:DEPTHxTOPKxBUDGET, e.g. M+tree:9x3x16 (README, \"Token trees\")")
    if low == "tree":
        return "dynamic"
    shape = text[5:].strip()
    if shape.lower() == "auto":
        return "auto"
    if shape.lower() in ("dynamic", "chain") or not shape:
        raise MMSpecError(f"bad tree part {text!r} in method {method!r}; {TREE_FIX}")
    try:
        parse_tree(shape, gamma=1)
    except MMSpecError as e:
        raise MMSpecError(f"bad tree part {text!r} in method {method!r}: {e}") from None
    return shape


def method_views(method: str) -> tuple[str, ...]:
    """Views of one method: ``"MTC"`` -> ``("M", "T", "C")``; ``"M+pooled:36+tree"`` -> ("M", "pooled:36")."""
    return parse_method(method)[0]


def method_tree(method: str) -> dict:
    """SpecDecoder keywords of a method beyond its views: tree (in :func:`mmspec.drafting.tree.parse_tree`'s
    notation), acceptance ({} for a plain chain), and "head" (a head variant) for head methods."""
    return parse_method(method)[1]


BATCH_FIX = "give whole numbers >= 1, one or comma-separated, e.g. --batch-size 8 or --batch-size 1,2,4,8,16"


def parse_batch_sizes(text: str | int) -> tuple[int, ...]:
    """``"8"`` -> (8,); ``"1,2,4"`` -> (1, 2, 4); anything else (``0``, ``2.5``, ``x``, ``""``) is refused."""
    parts = [p.strip() for p in str(text).split(",")]
    out = []
    for p in parts:
        if not p.isdigit():
            raise MMSpecError(f"--batch-size {text!r}: {p!r} is not a whole number; {BATCH_FIX}")
        out.append(int(p))
    return tuple(out)


def check_batch_sizes(sizes: tuple[int, ...], n_samples: int, temperature: float) -> None:
    """Each B >= 1, listed once, no larger than ``n_samples``; batches > 1 are greedy only (the
    target's batched greedy generate is what they are compared with, token for token)."""
    if not sizes:
        raise MMSpecError(f"--batch-size is empty; {BATCH_FIX}")
    for b in sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise MMSpecError(f"--batch-size {b!r} is not a whole number >= 1; {BATCH_FIX}")
    if len(set(sizes)) != len(sizes):
        raise MMSpecError(f"--batch-size lists a size twice ({','.join(map(str, sizes))}); list each once")
    if max(sizes) > n_samples:
        raise MMSpecError(f"--batch-size {max(sizes)} is larger than --n-samples {n_samples}: no batch would be "
                          f"full; raise --n-samples to at least {max(sizes)} or use smaller batches")
    if max(sizes) > 1 and temperature > 0:
        raise MMSpecError(f"--batch-size {max(sizes)} with --temperature {temperature}: batched runs are compared "
                          "with the target's batched greedy generate, so they are greedy only; use --temperature 0")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset to run: its family name and, for a real benchmark, the local path and split."""

    name: str
    path: Path | None = None  # None: the embedded synthetic world's family of the same name
    split: str | None = None  # None: --split, else the data set's default (datasets.DEFAULT_SPLITS)

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        """``NAME``, ``NAME=PATH`` or ``NAME=PATH:SPLIT`` (the text after the last ``:`` is the
        split when it is a plain name: letters, digits, ``_``, ``-``)."""
        name, sep, path = text.partition("=")
        name = name.strip().lower()
        if not name or (sep and not path.strip()):
            raise MMSpecError(f"bad dataset spec {text!r}; use NAME, NAME=PATH or NAME=PATH:SPLIT")
        if not sep:
            return cls(name)
        m = _SPLIT_SUFFIX.match(path.strip())
        if m:
            return cls(name, Path(m["path"]).expanduser(), m["split"])
        return cls(name, Path(path.strip()).expanduser())

    def label(self) -> str:
        if self.path is None:
            return self.name
        return f"{self.name}={self.path}" + (f":{self.split}" if self.split else "")


@dataclass
class BenchConfig:
    """Everything a ``mmspec bench run`` needs. Defaults follow IbED Section 4.1."""

    out_dir: Path = Path("bench_results")
    methods: tuple[str, ...] = DEFAULT_METHODS
    datasets: tuple[DatasetSpec, ...] = tuple(DatasetSpec(d) for d in DEFAULT_DATASETS)
    n_samples: int = 100  # per dataset
    gamma: int = 5
    max_new_tokens: int | None = None  # per answer (a turn); None: each data set's protocol (new_tokens_for)
    temperature: float = 0.0  # 0 = greedy (the paper's setting)
    seed: int = 0
    target: str | None = None  # local dir / hub id; None = embedded models
    draft: str | None = None
    captioner: str | None = None
    captioner_prompt: str | None = None
    pool_tokens: int | None = None  # N of the P view; None: SpecDecoder's default (a quarter of the patch grid)
    heads: tuple[tuple[str, str], ...] = ()  # (variant, directory) of trained heads for head methods (eagle, ...)
    split: str | None = None  # split of every dataset naming none; None: embedded world test, real: its default
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else cpu
    dtype: str = "float32"
    latency: bool = True  # measure T_p, T_q(batch 1..8), T_V(gamma) once per dataset
    latency_repeats: int = 5
    latency_batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    batch_sizes: tuple[int, ...] = (1,)  # --batch-size: 1 = one prompt at a time only; B > 1 adds a batched pass
    progress: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes recorded in run metadata

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.gamma < 1:
            raise MMSpecError(f"gamma (--gamma) must be >= 1 draft token per block, got {self.gamma}")
        if self.n_samples < 1:
            raise MMSpecError(f"n_samples (-n / --n-samples) must be >= 1 sample per dataset, got {self.n_samples}")
        if self.pool_tokens is not None and self.pool_tokens < 1:
            raise MMSpecError(f"pool_tokens (--pool-tokens) must be >= 1 (or unset for the default), got {self.pool_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise MMSpecError(f"max_new_tokens (--max-new-tokens) must be >= 1, got {self.max_new_tokens}")
        if self.latency_repeats < 1:
            raise MMSpecError(f"latency_repeats (--latency-repeats) must be >= 1, got {self.latency_repeats}")
        check_batch_sizes(self.batch_sizes, self.n_samples, self.temperature)
        if not self.methods:
            raise MMSpecError("no methods given; pass -m with drafting methods such as M,MT or eagle+tree")
        trees = [method_tree(m) for m in self.methods]
        if self.temperature > 0 and any(t.get("acceptance") == "relaxed" for t in trees):
            raise MMSpecError("+relaxed (MSD's relaxed acceptance) is defined for greedy decoding only; drop the "
                              "+relaxed methods or use --temperature 0")
        if self.pool_tokens is not None and not any(v == "P" or v.split(":")[0] == "pooled"
                                                    for m in self.methods for v in method_views(m)):
            raise MMSpecError(f"--pool-tokens {self.pool_tokens} sets the pooled view (P), which no method uses; add "
                              "a P method (e.g. -m P,MTCP) or drop --pool-tokens")
        if len(set(self.methods)) != len(self.methods):
            raise MMSpecError(f"a method is listed twice in {', '.join(self.methods)}; list each once")
        from mmspec.runtime.verify import SamplingParams

        SamplingParams(temperature=float(self.temperature))  # refuses a negative or non-finite one
        from mmspec.models.loading import check_model_flags

        check_model_flags(self.target, self.draft, self.captioner, self.captioner_prompt)
        from mmspec.models.loading import resolve_dtype

        if resolve_dtype(self.dtype) == "auto":  # unknown names are refused inside, with the list
            raise MMSpecError("bench needs an explicit dtype (float32, bfloat16, float16, float64), not auto")

    def result_values(self) -> dict:
        """The settings that change a row's numbers (``RESULT_KEYS``). An unset split counts as
        ``"test"``, the embedded world's split it reads (and the old default, so that results
        directories made before the split became optional still resume)."""
        values = {k: getattr(self, k) for k in RESULT_KEYS}
        values["split"] = values["split"] or "test"
        values["max_new_tokens"] = self.new_tokens_for("")  # unset = the IbED default, as before it was optional
        protocol = {s.name: PROTOCOL_NEW_TOKENS[s.name] for s in self.datasets if s.name in PROTOCOL_NEW_TOKENS}
        if self.max_new_tokens is None and protocol:  # only then: older results directories still resume
            values["protocol_new_tokens"] = protocol
        if self.heads:  # only when given: results made before heads existed still resume
            values["heads"] = [list(h) for h in self.heads]
        return values

    def new_tokens_for(self, dataset: str) -> int:
        """New tokens per answer for ``dataset`` (a sample's dataset, ``mmspec/general_vqa`` included):
        ``max_new_tokens`` when given, else the data set's protocol (:data:`PROTOCOL_NEW_TOKENS`: MMSpec's
        1024 a turn), else the IbED paper's 128."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return PROTOCOL_NEW_TOKENS.get(dataset.split("/")[0], IBED_NEW_TOKENS)

    def fingerprint(self) -> str:
        """Hash of the settings that change a row's numbers (not which rows are run)."""
        blob = json.dumps(self.result_values(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["datasets"] = [s.label() for s in self.datasets]
        return d


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a ``torchrun`` / ``accelerate launch`` job (env vars only)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RankInfo:
        env = dict(os.environ) if env is None else env
        rank = int(env.get("RANK", env.get("LOCAL_RANK", "0")))
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_RANK", str(rank)))
        if not 0 <= rank < world:
            raise MMSpecError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher env")
        return cls(rank, world, local)

    def shard(self, items: list) -> list:
        """Round-robin shard: rank r takes items r, r+W, r+2W, ..."""
        return items[self.rank :: self.world_size]
