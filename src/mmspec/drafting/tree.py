"""Token trees: the shape of a block's draft (a chain, a static tree or a dynamic tree) and the
drafted tree the target verifies.

A block drafts a tree of candidate continuations of the newest committed token. Node 0 is the
*root*: that committed token itself (not yet in the target cache). Every other node has a
parent, a depth (root 0) and a token. The target scores all nodes in ONE forward: node ``i``
sits at position ``past + depth[i]`` and attends to the committed tokens and to its own
ancestors (``anc[i]``), so each node sees exactly the sequence of its path. The chain of today's
speculative decoding is the tree in which every node has one child (SpecInfer, Miao et al. 2024;
Medusa's static trees; EAGLE-2's dynamic trees, Li et al. 2024).

Three shapes (:class:`TreeSpec`):

* ``chain``: ``depth`` = gamma drafts, one per depth. With sampling, each draft is drawn from
  the draft distribution q (classic speculative sampling); greedy takes q's argmax.
* ``static``: Medusa / EAGLE-1 convention, a list of paths of child ranks. ``[0, 1]`` is the
  second-likeliest child (by q) of the likeliest child of the root.
* ``dynamic``: EAGLE-2. At each of ``depth`` steps the ``topk`` best frontier nodes (by
  cumulative draft log-probability) are expanded into their ``topk`` likeliest children; at the
  end the ``budget`` best nodes are kept. Scores only fall along a path, so the kept set is a
  tree (ties broken towards the parent, :func:`best_prefix_closed`).

``tree="auto"`` (:func:`auto_shapes`) names no one shape but a few (the chain and the device's tree
at two budgets), among which each step's is chosen by its measured tokens per second on the
device at hand (:class:`mmspec.engine.policy.SpeculationPolicy`).

Tree nodes are always listed parents-first (sorted by depth), siblings in proposal order.
This module owns those shapes and the pure tensor helpers on them; the drafter builds trees,
``verify`` decides what is accepted, the engine moves caches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mmspec.errors import MMSpecError

KINDS = ("chain", "static", "dynamic")
CHILDREN = ("mixture", "views")

DEFAULT_GAMMA = 5  # a chain's length when none is given (SpecDecoder, the CLI's --gamma, bench)

# Dynamic-tree defaults per device type (depth, topk, budget): the best tokens/s of the budget sweep
# on each (perf/tree_sweep.py on the embedded pack). CPU (2026-11-25, docs/perf.md §8): tau 8.17
# against the chain's 4.45, a CPU verify over many nodes is not free, so gains stay small. CUDA
# (one H200, 2026-11-28, docs/results/gpu-2026-11-28/): 6x4x24, tau 5.94 at 0.98x the chain's
# tokens/s, the best of nine shapes (6x8x48, the old guess, 0.66x): on a model this small the verify
# forward is not memory-bound, so a tree does not pay there; the chain stays the default. Whether a
# tree pays depends on the pair and the device: tree="auto" measures it (auto_shapes).
DYNAMIC_DEFAULTS: dict[str, tuple[int, int, int]] = {
    "cpu": (9, 3, 24),
    "cuda": (6, 4, 24),
}


@dataclass(frozen=True)
class TreeSpec:
    """How a block's draft tree is shaped (see the module docstring).

    Dynamic draft length (``stop_below``, chains only; SpecVLM / transformers' assistant
    confidence threshold): stop drafting a block as soon as the draft's probability of the token
    it just proposed falls below the threshold. Lossless by construction (fewer drafts only).
    On a GPU it costs one host read per draft step.
    """

    kind: str = "chain"
    depth: int = 5  # chain: gamma; dynamic: expansion steps; static: from the paths
    topk: int = 1  # dynamic: children per expanded node and nodes expanded per depth
    budget: int | None = None  # dynamic: tree nodes kept (root excluded); None: all drafted
    paths: tuple[tuple[int, ...], ...] = ()  # static: child-rank paths
    children: str = "mixture"  # "mixture": children from the views' mixed q; "views": each view's own top tokens
    stop_below: float | None = None  # chain: dynamic draft length threshold on q(draft)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MMSpecError(f"unknown tree kind {self.kind!r}; use one of {KINDS}")
        if self.children not in CHILDREN:
            raise MMSpecError(f"tree children must be one of {CHILDREN}, got {self.children!r}")
        for name in ("depth", "topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MMSpecError(f"tree {name} must be a whole number >= 1, got {v!r}")
        if self.kind == "static":
            _check_paths(self.paths)
        if self.kind == "dynamic":
            b = self.budget
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
                raise MMSpecError(f"tree budget must be a whole number >= 1 (nodes kept, root excluded), got {b!r}")
        if self.stop_below is not None:
            if self.kind != "chain":
                raise MMSpecError("stop_below (dynamic draft length) applies to chains; a tree already "
                                  "spends its nodes where the draft is confident")
            if not 0.0 < float(self.stop_below) < 1.0:
                raise MMSpecError(f"stop_below must be a probability in (0, 1), got {self.stop_below!r}")

    # ---------------------------------------------------------------- derived shape
    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths) if self.kind == "static" else self.depth

    @property
    def n_generated(self) -> int:
        """Nodes the drafter creates (root excluded) before any budget cut."""
        if self.kind == "chain":
            return self.depth
        if self.kind == "static":
            return len(self.paths)
        k = self.topk
        return k + (self.depth - 1) * k * k

    @property
    def n_nodes(self) -> int:
        """Nodes verified per full block, root included."""
        if self.kind == "dynamic":
            return 1 + min(self.budget or self.n_generated, self.n_generated)
        return 1 + self.n_generated

    @property
    def is_chain(self) -> bool:
        """Every node has at most one child (a dynamic or static tree can be one too)."""
        if self.kind == "chain":
            return True
        if self.kind == "dynamic":
            return self.topk == 1
        return all(p[-1] == 0 for p in self.paths)

    @property
    def width(self) -> int:
        """The most children a node takes from one distribution (ranks 0..width-1)."""
        if self.kind == "chain":
            return 1
        if self.kind == "dynamic":
            return self.topk
        return 1 + max(p[-1] for p in self.paths)

    @property
    def label(self) -> str:
        if self.kind == "chain":
            return f"chain(γ={self.depth}{f', stop<{self.stop_below:g}' if self.stop_below else ''})"
        if self.kind == "static":
            return f"static({len(self.paths)} nodes, depth {self.max_depth})"
        views = ", views" if self.children == "views" else ""
        return f"dynamic(depth {self.depth}, top-{self.topk}, {self.n_nodes - 1} nodes{views})"

    def for_remaining(self, remaining: int) -> TreeSpec | None:
        """The spec for a block that may emit at most ``remaining`` tokens: no node deeper than
        ``remaining - 1`` (the target's own token always follows the accepted path). None when
        ``remaining`` is 1: that block drafts nothing and the target adds its next token."""
        d = remaining - 1
        if d < 1:
            return None
        if d >= self.max_depth:
            return self
        if self.kind == "static":
            return replace(self, paths=tuple(p for p in self.paths if len(p) <= d))
        return replace(self, depth=d)


def _check_paths(paths) -> None:
    if not paths:
        raise MMSpecError("a static tree needs at least one path, e.g. [[0], [1], [0, 0]]")
    seen = set()
    for p in paths:
        if not p or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in p):
            raise MMSpecError(f"bad static tree path {list(p)!r}: each path is a non-empty list of child ranks >= 0")
        if p in seen:
            raise MMSpecError(f"static tree path {list(p)} is listed twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise MMSpecError(f"static tree path {list(p)} has no parent path {list(p[:-1])}; list every prefix")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise MMSpecError(f"static tree path {list(p)} skips rank {p[-1] - 1}; a node's children must be "
                              "ranks 0, 1, ... without gaps (the likeliest first)")


# How the tree options are spelled in messages: SpecDecoder's keywords, or the CLI's flags.
SPELLINGS: dict[str, dict[str, str]] = {
    "python": {"tree": "tree=", "dynamic": "tree='dynamic'", "depth": "tree_depth", "topk": "tree_topk", "budget": "tree_budget",
               "children": "tree_children", "stop_below": "stop_below", "gamma": "gamma"},
    "cli": {"tree": "--tree", "dynamic": "--tree dynamic", "depth": "--tree-depth", "topk": "--tree-topk", "budget": "--tree-budget",
            "children": "--tree-children", "stop_below": "--stop-below", "gamma": "--gamma"},
}
NOTATION = ("'chain', 'dynamic' (the device's measured defaults), DEPTHxTOPKxBUDGET such as '6x4x16' "
            "(a dynamic tree of that shape), a static tree as JSON child-rank paths such as '[[0], [1], [0, 0]]', "
            "or 'auto' (the chain or a tree, per step, by measured tokens/s)")
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_tree(tree, *, gamma: int, device_type: str = "cpu", depth: int | None = None, topk: int | None = None,
               budget: int | None = None, children: str = "mixture", stop_below: float | None = None,
               spelling: str = "python") -> TreeSpec:
    """``SpecDecoder(tree=...)`` (or ``mmspec generate --tree``) -> TreeSpec. One notation
    (README, "Token trees"):

    * ``None`` / ``"chain"``: gamma drafts in a chain (``stop_below`` applies to chains only);
    * ``"dynamic"``: EAGLE-2 with the measured per-device defaults of :data:`DYNAMIC_DEFAULTS`,
      each replaced by ``depth`` / ``topk`` / ``budget`` when given;
    * ``"DxKxB"`` such as ``"6x4x16"``: a dynamic tree of depth D, top-k K and budget B;
    * a list of child-rank paths, or its JSON text ``"[[0], [1], [0, 0]]"``: a static tree;
    * a TreeSpec: as it is.

    Options that would be ignored or silently replaced are refused (a depth without a dynamic
    tree, a zero budget, ``stop_below`` with a tree). ``spelling`` names the options in messages:
    ``"python"`` (SpecDecoder's keywords) or ``"cli"`` (``--tree-depth``, ...).
    """
    n = SPELLINGS[spelling]
    given = {k: v for k, v in (("depth", depth), ("topk", topk), ("budget", budget)) if v is not None}
    for key, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MMSpecError(f"{n[key]} must be a whole number >= 1, got {v!r}; leave it out for the "
                              "device's measured default")
    shape_flags = "/".join(n[k] for k in ("depth", "topk", "budget"))
    if isinstance(tree, TreeSpec):
        if given or stop_below is not None or children != "mixture":
            raise MMSpecError(f"a TreeSpec carries its own shape; drop {shape_flags}, {n['children']} and "
                              f"{n['stop_below']} (or set them in the TreeSpec)")
        return tree
    if isinstance(tree, str) and tree.strip().startswith("["):
        try:
            tree = json.loads(tree)
        except json.JSONDecodeError as e:
            raise MMSpecError(f"cannot read the static tree {tree!r} as JSON ({e.msg}); write it like "
                              "[[0], [1], [0, 0]]") from None
        if not isinstance(tree, list):
            raise MMSpecError(f"a static tree is a list of child-rank paths such as [[0], [1], [0, 0]], got {tree!r}")
    if stop_below is not None and not (isinstance(stop_below, (int, float)) and 0.0 < float(stop_below) < 1.0):
        raise MMSpecError(f"{n['stop_below']} must be a probability in (0, 1), got {stop_below!r}")
    chain = tree is None or (isinstance(tree, str) and tree.strip().lower() == "chain")
    if not chain and stop_below is not None:
        raise MMSpecError(f"{n['stop_below']} (dynamic draft length) applies to chains only; a tree already "
                          f"spends its nodes where the draft is confident: drop {n['stop_below']} or the tree")
    if chain:
        if given:
            flag = n[next(iter(given))]
            raise MMSpecError(f"{flag} needs {n['dynamic']} (a chain's length is {n['gamma']}); "
                              f"add {n['dynamic']}, or drop {flag}")
        if children != "mixture":
            raise MMSpecError(f"{n['children']} {children!r} shapes a tree's children; a chain has one per "
                              f"node: add {n['dynamic']} (or DEPTHxTOPKxBUDGET, or a static tree), or drop it")
        return TreeSpec("chain", depth=gamma, stop_below=stop_below)
    if isinstance(tree, str) and tree.strip().lower() == "dynamic":
        d0, k0, b0 = DYNAMIC_DEFAULTS.get(device_type, DYNAMIC_DEFAULTS["cpu"])
        return TreeSpec("dynamic", depth=given.get("depth", d0), topk=given.get("topk", k0),
                        budget=given.get("budget", b0), children=children)
    if isinstance(tree, str) and _SHAPE.match(tree):
        d, k, b = (int(x) for x in _SHAPE.match(tree).groups())
        if given:
            shape = f"{n['tree']} {tree.strip()}" if spelling == "cli" else f"tree={tree.strip()!r}"
            raise MMSpecError(f"{shape} already sets depth, top-k and budget; drop "
                              f"{'/'.join(n[k] for k in given)}, or write {n['dynamic']} with them")
        for what, v in (("depth", d), ("top-k", k), ("budget", b)):
            if v < 1:
                raise MMSpecError(f"the {what} in tree {tree.strip()!r} must be >= 1 (DEPTHxTOPKxBUDGET, "
                                  "e.g. 6x4x16)")
        return TreeSpec("dynamic", depth=d, topk=k, budget=b, children=children)
    if isinstance(tree, (list, tuple)):
        if given:
            raise MMSpecError(f"{shape_flags} shape a dynamic tree; a static tree's paths fix its shape: "
                              f"drop {'/'.join(n[k] for k in given)}")
        paths = tuple(tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in tree)
        _check_paths(paths)  # before sorting: a rank that is not a number cannot be ordered
        return TreeSpec("static", paths=tuple(sorted(paths, key=lambda p: (len(p), p))), children=children)
    if is_auto(tree):
        raise MMSpecError("tree 'auto' is several shapes, chosen per step: parse it with parse_shapes")
    raise MMSpecError(f"unknown tree {tree!r}; use {NOTATION}")


def reads_gamma(tree) -> bool:
    """Whether a ``tree=`` value reads ``gamma``: a chain (None, "chain", a chain TreeSpec) or
    "auto" (its chain candidate); a dynamic or static tree has a shape of its own."""
    if isinstance(tree, TreeSpec):
        return tree.kind == "chain"
    return tree is None or is_auto(tree) or (isinstance(tree, str) and tree.strip().lower() == "chain")


def is_auto(tree) -> bool:
    """``tree="auto"``: the shape chosen per step by measurement (:func:`auto_shapes`)."""
    return isinstance(tree, str) and tree.strip().lower() == "auto"


def auto_shapes(*, gamma: int, device_type: str = "cpu", depth: int | None = None, topk: int | None = None,
                budget: int | None = None, children: str = "mixture", stop_below: float | None = None,
                spelling: str = "python") -> tuple[TreeSpec, ...]:
    """``tree="auto"``'s candidates, smallest first: the chain of ``gamma``, the device's dynamic
    tree (:data:`DYNAMIC_DEFAULTS`, each of ``depth`` / ``topk`` / ``budget`` replacing its default)
    at half its budget, and at its budget. The last bounds every block (depth and nodes: the
    caches, the context check and the engine's buffers are sized for it), so ``gamma`` may not
    exceed the tree's depth or its half budget."""
    n = SPELLINGS[spelling]
    if stop_below is not None:
        raise MMSpecError(f"{n['stop_below']} shortens a chain's blocks; with {n['tree']} auto the chain is measured "
                          f"against trees as it is: drop {n['stop_below']}")
    full = parse_tree("dynamic", gamma=gamma, device_type=device_type, depth=depth, topk=topk, budget=budget,
                      children=children, spelling=spelling)
    half = replace(full, budget=max(1, (full.n_nodes - 1) // 2))
    if gamma > min(full.depth, half.n_nodes - 1):
        raise MMSpecError(f"{n['tree']} auto measures the chain of {n['gamma']}={gamma} against trees "
                          f"{full.depth} deep of {half.n_nodes - 1} and {full.n_nodes - 1} nodes, and sizes every "
                          f"block for the largest: lower {n['gamma']}, or raise {n['depth']} / {n['budget']}")
    return TreeSpec("chain", depth=gamma), half, full


def parse_shapes(tree, *, gamma: int, device_type: str = "cpu", depth: int | None = None, topk: int | None = None,
                 budget: int | None = None, children: str = "mixture", stop_below: float | None = None,
                 spelling: str = "python") -> tuple[TreeSpec, ...]:
    """:func:`parse_tree`, and ``"auto"``: the block shapes a decoder may draft, smallest first
    (one, or :func:`auto_shapes`' candidates)."""
    kw = dict(gamma=gamma, device_type=device_type, depth=depth, topk=topk, budget=budget, children=children,
              stop_below=stop_below, spelling=spelling)
    return auto_shapes(**kw) if is_auto(tree) else (parse_tree(tree, **kw),)


# --------------------------------------------------------------------------- the drafted tree
@dataclass
class TreeBatch:
    """B drafted trees of N nodes each (one step's rows), for one batched verification
    (:func:`mmspec.runtime.verify.verify_steps`). ``q`` and ``sampled`` matter only for sampling
    verification: ``sampled[b, i]`` says node i's token was DRAWN from ``q[b, i]`` (a chain under
    sampling); otherwise it was chosen deterministically (top-k) and its proposal is a point mass on
    its token. ``fed``: the drafter's in-block slot of each node (-1: never fed). ``valid`` False
    marks a node the row does not use (past its token limit, after an unsure draft, a proposal's
    padding): never accepted; None when every node is used."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long
    depth: torch.Tensor  # [B, N] long
    anc: torch.Tensor  # [B, N, N] bool
    fed: torch.Tensor  # [B, N] long
    valid: torch.Tensor | None  # [B, N] bool
    max_depth: int  # the deepest node of any row
    q: torch.Tensor | None = None  # [B, N, V] where any row has q
    sampled: torch.Tensor | None = None  # [B, N] bool, with q

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def ancestors_rows(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] (root -1) -> anc [B, N, N] bool, anc[b, i, j] = j is i or an ancestor of i.
    Exactly ``max_depth`` passes, no data-dependent exit (no host sync on a GPU)."""
    B, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(B, n, n).clone()
    par, has = parents.clamp_min(0), (parents >= 0)[:, :, None]
    for _ in range(max_depth):
        anc = anc | (anc.gather(1, par[:, :, None].expand(B, n, n)) & has)
    return anc


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """:func:`ancestors_rows` of one tree: parents [N] -> anc [N, N]."""
    return ancestors_rows(parents[None], max_depth)[0]


def static_structure(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """Static paths (sorted by depth) -> per node (root excluded, in path order):
    parent node index (0 = root), depth, child rank."""
    index = {(): 0}
    parents, depths, ranks = [], [], []
    for i, p in enumerate(paths, start=1):
        p = tuple(p)
        index[p] = i
        parents.append(index[p[:-1]])
        depths.append(len(p))
        ranks.append(p[-1])
    return parents, depths, ranks
