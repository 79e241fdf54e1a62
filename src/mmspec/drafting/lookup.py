"""Drafting with no model: prompt lookup and suffix decoding, alone or beside a draft.

Owns the two model-free proposers, their settings (:class:`LookupConfig`, checked before
anything loads) and the cut of a proposal to a block's shape (:func:`pick`); the engine turns
every row's proposal into its tree, or adds it to a draft model's or head's tree as other
branches, so the target verifies both in one forward (:mod:`mmspec.drafting.proposals`).

* **lookup** (prompt lookup; transformers' ``prompt_lookup_num_tokens``, vLLM / SGLang ``ngram``):
  the longest n-gram (``ngram_max`` .. ``ngram_min`` tokens) ending the request's text so far
  (captions, prompt, answer) that occurred earlier in it; what followed its ``candidates`` most
  recent earlier occurrences, merged into a trie whose counts are the proposal's distribution.
* **suffix** (SuffixDecoding, arXiv 2411.04975; vLLM's ``suffix``): a suffix trie of depth
  ``suffix_depth`` over the prompts and answers this decoder produced (:class:`SuffixStore`, one
  per decoder: across requests and turns, within ``suffix_mb``, the oldest request dropped first),
  plus one over the request itself. The longest suffix of the request's text found in a trie is the
  pattern; the speculation length is at most ``suffix_factor`` x the pattern's length (the paper's
  adaptive rule), nodes whose path probability falls below ``suffix_min_prob`` are left out, and of
  the two tries the proposal with the larger expected accepted length (sum of path probabilities)
  is drafted.

Image and video placeholders never take part in a match (they are separators here).

The proposal's distribution is the q verification uses: a chain under sampling DRAWS each token
from the continuation counts (``sampled``, q = counts / total); otherwise (greedy, and every tree)
tokens are chosen deterministically, and a deterministic choice is a point mass (q one-hot), as the
top-k children of a model's tree. Beside a draft, whenever a proposal is added the whole
block is verified as point masses, the draft's drawn tokens too (exact: recursive rejection of
point masses yields exactly p for any candidate set chosen independently of the target's draws;
keeping a drawn token "drawn" only when no proposal coincides with it would make its test depend
on its value, which biases the output: a test checks it). Under sampling this costs the drawn
tokens' min(1, p/q) acceptance (they accept with p(x)) in blocks where a proposal was added.

This module knows nothing about models, caches or acceptance; proposals are host ints.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from mmspec.drafting.tree import TreeSpec
from mmspec.errors import MMSpecError

MODEL_FREE = ("lookup", "suffix")
SEP = -1  # an image / video placeholder, or a boundary between texts: never matched, never proposed
# Estimated bytes of one suffix-trie node (a slotted object and its dict entry in its parent's
# children), measured with tracemalloc on CPython 3.12 (tests/core/test_lookup.py checks it holds).
NODE_BYTES = 320


@dataclass(frozen=True)
class LookupConfig:
    """The model-free drafters' settings (SpecDecoder's ``lookup_options``; the CLI's ``--ngram``,
    ``--lookup-candidates``, ``--suffix-*``). Bounds are checked by :meth:`parse`."""

    ngram_min: int = 1  # lookup: shortest n-gram matched (1..ngram_max)
    ngram_max: int = 4  # lookup: longest n-gram matched, tried first (ngram_min..32)
    candidates: int = 8  # lookup: earlier occurrences read, most recent first (1..256)
    suffix_depth: int = 32  # suffix: the tries' depth = longest pattern + continuation (2..256)
    suffix_mb: float = 64.0  # suffix: memory of the decoder's store (MiB, > 0)
    suffix_factor: float = 2.0  # suffix: speculation length <= factor x pattern length (0 < f <= 64)
    suffix_min_prob: float = 0.1  # suffix: keep nodes with path probability >= this ([0, 1))

    BOUNDS = {"ngram_min": (1, 32), "ngram_max": (1, 32), "candidates": (1, 256), "suffix_depth": (2, 256)}

    @classmethod
    def parse(cls, options, flag: str = "lookup_options") -> LookupConfig:
        """``None`` / a dict of the fields / a LookupConfig -> a checked LookupConfig."""
        if options is None:
            return cls()
        if isinstance(options, LookupConfig):
            options = {f.name: getattr(options, f.name) for f in fields(cls)}
        if not isinstance(options, dict):
            raise MMSpecError(f"{flag} must be a dict of settings such as {{'ngram_max': 3}} (keys: "
                              f"{', '.join(f.name for f in fields(cls))}), got {options!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise MMSpecError(f"{flag}: unknown setting(s) {unknown}; use some of {', '.join(known)}")
        for key, (lo, hi) in cls.BOUNDS.items():
            v = options.get(key, getattr(cls, key))
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise MMSpecError(f"{key} must be a whole number from {lo} to {hi}, got {v!r}")
        lo_n, hi_n = options.get("ngram_min", cls.ngram_min), options.get("ngram_max", cls.ngram_max)
        if lo_n > hi_n:
            raise MMSpecError(f"ngram_min ({lo_n}) is above ngram_max ({hi_n}); the n-grams tried run from "
                              "ngram_max down to ngram_min: raise ngram_max or lower ngram_min")
        mb = options.get("suffix_mb", cls.suffix_mb)
        if not _number(mb) or mb <= 0:
            what = "a suffix budget of 0 keeps no history, so suffix decoding would never propose anything" \
                if _number(mb) and mb == 0 else f"suffix_mb must be a number of MiB > 0, got {mb!r}"
            raise MMSpecError(f"{what}; give suffix_mb > 0 (default {cls.suffix_mb:g}), or use the lookup draft, "
                              "which keeps no history across requests")
        f = options.get("suffix_factor", cls.suffix_factor)
        if not _number(f) or not 0 < f <= 64:
            raise MMSpecError(f"suffix_factor must be a number in (0, 64] (speculation length <= factor x the "
                              f"matched pattern's length), got {f!r}")
        p = options.get("suffix_min_prob", cls.suffix_min_prob)
        if not _number(p) or not 0 <= p < 1:
            raise MMSpecError(f"suffix_min_prob must be a probability in [0, 1), got {p!r}")
        return cls(**options)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- tries
class Node:
    """A trie node: how often its path occurred (``count``) and its children by token."""

    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, Node] = {}


class SuffixTrie:
    """Every suffix of the stored texts, cut at ``depth`` tokens (and at separators), with counts.
    ``add`` / ``remove`` a whole text; ``extend`` grows the newest one token by token (O(depth))."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.nodes = 0
        self._frontier: list[tuple[Node, int]] = []  # extend(): nodes of the suffixes ending the text

    def add(self, seq: Sequence[int]) -> None:
        for i in range(len(seq)):
            node = self.root
            for t in seq[i:i + self.depth]:
                if t == SEP:
                    break
                child = node.kids.get(t)
                if child is None:
                    child = node.kids[t] = Node()
                    self.nodes += 1
                child.count += 1
                node = child

    def remove(self, seq: Sequence[int]) -> None:
        for i in range(len(seq)):
            node = self.root
            for t in seq[i:i + self.depth]:
                if t == SEP:
                    break
                child = node.kids[t]
                child.count -= 1
                if child.count == 0:  # no other stored suffix passes here: drop the subtree
                    del node.kids[t]
                    self.nodes -= _size(child)
                    break
                node = child

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            if t == SEP:
                self._frontier = []
                continue
            new = []
            for node, d in self._frontier + [(self.root, 0)]:
                child = node.kids.get(t)
                if child is None:
                    child = node.kids[t] = Node()
                    self.nodes += 1
                child.count += 1
                if d + 1 < self.depth:
                    new.append((child, d + 1))
            self._frontier = new

    def match(self, context: Sequence[int]) -> tuple[Node | None, int]:
        """The longest suffix of ``context`` (at most depth - 1 tokens) found here with a
        continuation: (its node, its length), or (None, 0)."""
        n = len(context)
        for k in range(min(n, self.depth - 1), 0, -1):
            node = self.root
            for t in context[n - k:]:
                node = node.kids.get(t)
                if node is None:
                    break
            if node is not None and node.kids:
                return node, k
        return None, 0


def _size(node: Node) -> int:
    return 1 + sum(_size(c) for c in node.kids.values())


class SuffixStore:
    """A decoder's history for suffix decoding: one trie over the prompts and answers of the
    requests it finished, within ``budget_mb`` (estimated at :data:`NODE_BYTES` a node); the
    oldest request is dropped first when a new one does not fit. A request larger than the whole
    budget is not kept."""

    def __init__(self, cfg: LookupConfig) -> None:
        self.trie = SuffixTrie(cfg.suffix_depth)
        self.budget = int(cfg.suffix_mb * 2**20)
        self.requests: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._ids = itertools.count()

    @property
    def nbytes(self) -> int:
        return self.trie.nodes * NODE_BYTES

    def add(self, seq: Sequence[int]) -> None:
        seq = tuple(seq)
        if not seq:
            return
        self.trie.add(seq)
        self.requests[next(self._ids)] = seq
        while self.nbytes > self.budget and self.requests:
            _, old = self.requests.popitem(last=False)  # the newest goes last: alone too large, it goes too
            self.trie.remove(old)


# --------------------------------------------------------------------------- proposers
class PromptLookup:
    """Prompt lookup over one request's text (module docstring)."""

    def __init__(self, cfg: LookupConfig) -> None:
        self.cfg = cfg
        self.hist: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where a token after it would start

    def extend(self, tokens: Iterable[int]) -> None:
        lo, hi = self.cfg.ngram_min, self.cfg.ngram_max
        for t in tokens:
            self.hist.append(t)
            e = len(self.hist)
            for n in range(lo, min(hi, e) + 1):
                gram = tuple(self.hist[e - n:e])
                if SEP not in gram:
                    self.index.setdefault(gram, []).append(e)

    def propose(self, depth: int) -> tuple[Node | None, float]:
        """A trie of what followed the longest matching n-gram (root = the match), and the
        smallest path probability to keep (0: all)."""
        h, e = self.hist, len(self.hist)
        for n in range(min(self.cfg.ngram_max, e), self.cfg.ngram_min - 1, -1):
            starts = self.index.get(tuple(h[e - n:e]))
            if not starts:
                continue
            root = Node()
            for c in itertools.islice((c for c in reversed(starts) if c < e), self.cfg.candidates):
                node = root
                for t in h[c:c + depth]:
                    if t == SEP:
                        break
                    node = node.kids.setdefault(t, Node())
                    node.count += 1
            if root.kids:
                return root, 0.0
        return None, 0.0

    def begin(self, tokens: Sequence[int]) -> None:
        """The request's text before its pending last prompt token (:func:`history`)."""
        self.extend(tokens)

    def finish(self, answer: Sequence[int]) -> None:
        """Nothing outlives a request."""


class SuffixDecoding:
    """Suffix decoding for one request: its own trie (prompt, captions, answer so far) and the
    decoder's :class:`SuffixStore` of earlier requests (module docstring)."""

    def __init__(self, cfg: LookupConfig, store: SuffixStore, shared: bool = True) -> None:
        self.cfg = cfg
        self.store = store
        self.shared = shared  # search the decoder's store of earlier requests too (False: this request's text only)
        self.local = SuffixTrie(cfg.suffix_depth)
        self.hist: list[int] = []
        self.answer_start = 0

    def begin(self, tokens: Sequence[int]) -> None:
        """The request's text before its pending last prompt token (:func:`history`)."""
        self.extend(tokens)
        self.answer_start = len(self.hist) + 1  # the pending prompt token comes first

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.hist.extend(tokens)
        self.local.extend(tokens)

    def propose(self, depth: int) -> tuple[Node | None, float]:
        ctx = self.hist[-(self.cfg.suffix_depth - 1):]
        best, best_score = None, 0.0
        for trie in (self.local, self.store.trie) if self.shared else (self.local,):
            node, k = trie.match(ctx)
            if node is None:
                continue
            limit = min(depth, int(self.cfg.suffix_factor * k))  # the adaptive rule: length follows the match
            if limit < 1:
                continue
            score = _expected_length(node, limit, self.cfg.suffix_min_prob)
            if score > best_score:
                best, best_score = (node, limit), score
        if best is None:
            return None, 0.0
        node, limit = best
        return _cut(node, limit), self.cfg.suffix_min_prob

    def finish(self, answer: Sequence[int]) -> None:
        """The finished request (prompt and the answer the decoder produced: its last tokens were
        never pending) joins the store."""
        self.store.add(self.hist[:self.answer_start] + list(answer))


def _expected_length(node: Node, depth: int, min_prob: float) -> float:
    """Sum of path probabilities of the nodes a greedy-by-count walk keeps: the proposal's
    expected accepted length if the target followed the counts (SuffixDecoding's score)."""
    total, prob = 0.0, 1.0
    for _ in range(depth):
        if not node.kids:
            break
        s = sum(c.count for c in node.kids.values())
        node = max(node.kids.values(), key=lambda c: c.count)
        prob *= node.count / s
        if prob < min_prob:
            break
        total += prob
    return total


class _Limited(Node):
    """A matched node seen as a proposal's root, with the adaptive speculation length."""

    __slots__ = ("limit",)


def _cut(node: Node, depth: int) -> Node:
    root = _Limited()
    root.kids, root.count, root.limit = node.kids, node.count, depth
    return root


# --------------------------------------------------------------------------- shapes
@dataclass
class Picked:
    """A proposal cut to a block's shape: per node (root excluded, parents first) its token,
    parent (0 = root, i = the i-th picked node) and depth; ``q`` per node when drawn."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: list[dict[int, float]] | None = None


def pick(root: Node, spec: TreeSpec, min_prob: float, u: torch.Tensor | None = None) -> Picked:
    """The proposal trie ``root`` cut to ``spec``'s shape. Chains follow the likeliest child
    (``u``: draw each child from the counts instead); dynamic trees keep the ``budget`` likeliest
    paths best-first (at most ``topk`` children a node, ``depth`` deep); static trees take each
    path's ranked children. Children's probabilities are their counts over their siblings'."""
    depth_limit = min(spec.max_depth, getattr(root, "limit", spec.max_depth))
    out = Picked([], [], [], [] if u is not None else None)
    if spec.kind == "chain" or (spec.kind == "dynamic" and spec.topk == 1):
        node, parent, prob = root, 0, 1.0
        for d in range(1, depth_limit + 1):
            if not node.kids:
                break
            kids = list(node.kids.items())
            total = sum(c.count for _, c in kids)
            if u is not None:
                x, acc = float(u[d - 1]) * total, 0
                tok, child = kids[-1]
                for t, c in kids:
                    acc += c.count
                    if x < acc:
                        tok, child = t, c
                        break
                out.q.append({t: c.count / total for t, c in kids})
            else:
                tok, child = max(kids, key=lambda kv: kv[1].count)
            p = child.count / total
            prob *= p
            if prob < min_prob and u is None:
                break
            out.tokens.append(tok), out.parents.append(parent), out.depths.append(d)
            parent, node = d, child
            if spec.stop_below is not None and p < spec.stop_below:
                break
        return out
    if spec.kind == "static":
        index = {(): (0, root, 1.0)}
        for path in spec.paths:
            if len(path) > depth_limit or path[:-1] not in index:
                continue
            pi, pnode, pprob = index[path[:-1]]
            ranked = sorted(pnode.kids.items(), key=lambda kv: -kv[1].count)
            if path[-1] >= len(ranked):
                continue
            tok, child = ranked[path[-1]]
            prob = pprob * child.count / sum(c.count for _, c in ranked)
            if prob < min_prob:
                continue
            out.tokens.append(tok), out.parents.append(pi), out.depths.append(len(path))
            index[path] = (len(out.tokens), child, prob)
        return out
    budget = min(spec.n_nodes - 1, 4096)
    heap: list = []
    seq = itertools.count()

    def push(node: Node, parent: int, prob: float, d: int) -> None:
        if d > depth_limit or not node.kids:
            return
        total = sum(c.count for c in node.kids.values())
        for tok, child in sorted(node.kids.items(), key=lambda kv: -kv[1].count)[:spec.topk]:
            heapq.heappush(heap, (-prob * child.count / total, next(seq), tok, child, parent, d))

    push(root, 0, 1.0, 1)
    while heap and len(out.tokens) < budget:
        neg, _, tok, child, parent, d = heapq.heappop(heap)
        if -neg < min_prob:
            break
        out.tokens.append(tok), out.parents.append(parent), out.depths.append(d)
        push(child, len(out.tokens), -neg, d + 1)
    return out


# --------------------------------------------------------------------------- drafters
def history(prompt_ids: torch.Tensor, placeholders: Iterable[int], captions: Sequence[torch.Tensor] | None = None
            ) -> list[int]:
    """What a model-free drafter matches against before the answer: each caption (then a
    separator), then the prompt less its last token (pending: it opens the first block), image
    and video placeholders turned into separators."""
    ph = set(int(t) for t in placeholders)
    out: list[int] = []
    for cap in captions or ():
        out += [int(t) for t in cap] + [SEP]
    out += [SEP if t in ph else t for t in prompt_ids[:-1].tolist()]
    return out


def proposer_for(kind: str, cfg: LookupConfig, store: SuffixStore | None, sampled: bool = False):
    """A request's proposer. ``sampled``: the request samples, so its suffix proposals come from
    its own text alone: a sampled answer then depends on its request and seed only (the trees
    verified, and so the draws they consume, never on what earlier requests left in the store);
    a greedy answer is the target's whatever the proposals, and searches the store too."""
    if kind == "lookup":
        return PromptLookup(cfg)
    if store is None:
        raise RuntimeError("suffix decoding needs the decoder's SuffixStore")
    return SuffixDecoding(cfg, store, shared=not sampled)
