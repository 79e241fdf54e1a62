"""A constrained row's model-free proposal: the tokens its grammar forces, then what prompt lookup
or suffix decoding proposes, cut at the first illegal token.

:class:`ConstrainedProposer` wraps a row's proposer (:mod:`mmspec.drafting.lookup`) for a request with a
constraint: its trie keeps only the paths the grammar accepts (walked with the row's matcher, with
rollback), and the tokens the grammar forces from the row's state (the only legal token, or
xgrammar's jump-forward string tokenized: ``{"``, a key, ``":``, closing brackets) are added as a path, so they ride in the
block at no draft cost and the constrained target always accepts them. The engine verifies the
proposal as it verifies any (:mod:`mmspec.drafting.proposals`), masked by the grammar again.
"""

from __future__ import annotations

import time

from mmspec.constrain.state import RowGrammar
from mmspec.drafting.lookup import Node


class ProposalRoot(Node):
    """A proposal's root with its speculation length (suffix decoding's adaptive limit)."""

    __slots__ = ("limit",)


class ConstrainedProposer:
    """A row's proposer under its grammar (module docstring). ``inner``: the lookup or suffix
    proposer (None: the forced tokens alone)."""

    def __init__(self, inner, grammar: RowGrammar):
        self.inner = inner
        self.grammar = grammar

    def begin(self, tokens) -> None:
        if self.inner is not None:
            self.inner.begin(tokens)

    def extend(self, tokens) -> None:
        if self.inner is not None:
            self.inner.extend(tokens)

    def finish(self, answer) -> None:
        if self.inner is not None:
            self.inner.finish(answer)

    def propose(self, depth: int) -> tuple[Node | None, float]:
        root, min_prob = (None, 0.0) if self.inner is None else self.inner.propose(depth)
        forced = self.grammar.forced_run([], depth)
        t0 = time.perf_counter()
        out = ProposalRoot()
        out.limit = max(getattr(root, "limit", depth), len(forced)) if root is not None else depth
        if root is not None:
            out.count = root.count
            self._legal(root, out, depth)
        node = out
        for t in forced:  # the only legal child at each level: probability 1 whatever its count
            child = node.kids.get(t)
            if child is None:
                child = node.kids[t] = Node()
            child.count = max(child.count, 1)
            node = child
        self.grammar.host_s += time.perf_counter() - t0
        return (out if out.kids else None), min_prob

    def _legal(self, src: Node, dst: Node, depth: int) -> None:
        """Copy ``src``'s children that the grammar accepts (from the matcher's state), recursively."""
        if depth <= 0:
            return
        m = self.grammar.matcher
        for t, child in src.kids.items():
            if m.is_terminated() or not m.accept_token(t):
                continue
            kept = dst.kids[t] = Node()
            kept.count = child.count
            self._legal(child, kept, depth - 1)
            m.rollback(1)
