"""Each constrained row's grammar state, and the one mask a step's verification applies.

:class:`RowGrammar` is one request's xgrammar ``GrammarMatcher`` at the row's committed tokens
(the root of its next tree): the host advances it by the tokens each step emitted (after the
step's one read), and counts the tokens the grammar forced (the only legal token where they were
emitted: ``GenerationStats.forced_tokens``).

:meth:`RowGrammar.fill_tree` fills every node of a drafted tree with the grammar state along that
node's path (``GrammarMatcher.traverse_draft_tree``: the matcher walks the tree with rollback and
comes back to the root); :func:`mmspec.constrain.tails.constrained_tree` packs all rows' masks into
one tensor and the engine masks the verify logits of every row with one ``masked_fill``. The
constrained target is then exactly "p with illegal tokens masked", so greedy and sampling
verification (:func:`mmspec.runtime.verify.verify_steps`) stay exact for it.
:meth:`RowGrammar.forced_run` gives the tokens the grammar forces after a path (forced tails,
model-free proposals). :class:`DraftMask` masks a step's drafts at each depth. A step without a
constrained row never calls any of it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from mmspec.constrain.compile import xgrammar

WORD = 32  # bits per bitmask word (xgrammar's int32)


def words(vocab: int) -> int:
    return (vocab + WORD - 1) // WORD


class RowGrammar:
    """One constrained request's grammar state (module docstring). ``compiled``: its
    CompiledGrammar (:class:`~mmspec.constrain.compile.GrammarCompiler`)."""

    def __init__(self, compiled, vocab: int, encode=None):
        self.xgr = xgrammar()
        self.matcher = self.xgr.GrammarMatcher(compiled)
        self.vocab = vocab
        self.encode = encode  # str -> token ids (the tokenizer's, no special tokens): jump-forward strings; None: off
        self._bm = torch.zeros(1, words(vocab), dtype=torch.int32)  # a scratch bitmask, read through numpy
        self._bm_np = self._bm.numpy().view(np.uint32)
        self.forced = 0  # emitted tokens that were the only legal one where they were emitted
        self.tail = 0  # emitted tokens accepted as forced-tail nodes (mmspec.constrain.tails: never drafted)
        self.host_s = 0.0  # seconds of grammar work on the host (masks, advancing)
        self._tree: tuple[list[int], list[int], list[bool], int] | None = None  # the last step's (tokens, parents, forced, drafted)

    def fill_tree(self, tokens: list[int], parents: list[int], out: torch.Tensor, drafted: int | None = None) -> None:
        """Each node's next-token bitmask into ``out`` [N, words] (int32, CPU): node 0 the root
        (the matcher's state), node i the state after the tokens on its path. ``out`` comes in
        all ones; nodes the walk does not reach (under an illegal token) keep it. ``drafted``:
        the nodes before the forced tails (None: all)."""
        t0 = time.perf_counter()
        N = len(tokens)
        child, sib = [-1] * N, [-1] * N
        for i in range(N - 1, 0, -1):  # first child / next sibling, children in node order
            p = parents[i]
            if p < 0:
                continue
            sib[i], child[p] = child[p], i
        nodes = torch.tensor(tokens, dtype=torch.long)
        self.matcher.traverse_draft_tree(torch.tensor(child, dtype=torch.long), torch.tensor(sib, dtype=torch.long),
                                         nodes, out)
        empty = (out == 0).all(-1)  # rejected nodes (an illegal token) and past the grammar's end
        out[empty] = -1
        forced = popcount(out) == 1  # [N]
        self._tree = (tokens, parents, forced.tolist(), N if drafted is None else drafted)
        self.host_s += time.perf_counter() - t0

    def accept(self, tokens: list[int]) -> None:
        """The tokens the row emitted this step (after the host read): the matcher advances, and
        the forced ones are counted (from the masks :meth:`fill_tree` made for this step)."""
        t0 = time.perf_counter()
        if self._tree is not None:
            forced, tail = self._count_forced(tokens)
            self.forced += forced
            self.tail += tail
            self._tree = None
        for t in tokens:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"the grammar refused token {t} that the masked verification emitted")
        self.host_s += time.perf_counter() - t0

    def _count_forced(self, emitted: list[int]) -> tuple[int, int]:
        """Emitted token j was chosen at the node its predecessors lead to along the tree: ->
        (the forced ones, the ones accepted as tail nodes)."""
        tokens, parents, forced, drafted = self._tree
        node, n, tail = 0, 0, 0
        for t in emitted:
            n += forced[node]
            nxt = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == t), None)
            if nxt is None:
                break  # the recovered or bonus token: the last one of the step
            node = nxt
            tail += node >= drafted
        return n, tail

    def forced_run(self, path: list[int], budget: int) -> list[int]:
        """The tokens the grammar forces after ``path`` (tokens from the current state), up to
        ``budget``: xgrammar's jump-forward string (the characters every legal continuation starts
        with, ``GrammarMatcher.find_jump_forward_string``) tokenized by ``encode`` and kept as far as
        the grammar accepts it, then again from there; where the string is empty, a token that is
        the only legal one (an EOS the finished grammar asks for). A path the grammar refuses
        forces nothing; the matcher comes back to where it was. A jump-forward string may have other
        tokenizations than the one proposed: verification accepts a token only where the
        constrained target would have chosen it, so the proposal costs nothing but nodes."""
        t0 = time.perf_counter()
        m, n, out = self.matcher, 0, []
        for t in path:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        while n == len(path) and len(out) < budget and not m.is_terminated():
            jump = m.find_jump_forward_string() if self.encode is not None else ""
            got = 0
            for t in (self.encode(jump) if jump else [])[:budget - len(out)]:
                if not m.accept_token(t):
                    break
                out.append(t)
                got += 1
            if got:
                continue
            tok = self._only_legal()
            if tok is None or not m.accept_token(tok):
                break
            out.append(tok)
        if n + len(out):
            m.rollback(n + len(out))
        self.host_s += time.perf_counter() - t0
        return out

    def forced_count(self, path: list[int], need: int) -> int:
        """How many tokens in a row the grammar forces (each the only legal one) after ``path``,
        counted up to ``need``; the matcher comes back to where it was."""
        t0 = time.perf_counter()
        m, n, k = self.matcher, 0, 0
        for t in path:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        while n == len(path) and k < need and not m.is_terminated():
            tok = self._only_legal()
            if tok is None or not m.accept_token(tok):
                break
            k += 1
        if n + k:
            m.rollback(n + k)
        self.host_s += time.perf_counter() - t0
        return k

    def _only_legal(self) -> int | None:
        """The one token the grammar allows from the matcher's state, or None (several, or none)."""
        self.matcher.fill_next_token_bitmask(self._bm)
        bits = self._bm_np[0]
        nz = np.flatnonzero(bits)
        if len(nz) != 1:
            return None
        word = int(bits[nz[0]])
        if word & (word - 1):
            return None
        return int(nz[0]) * WORD + word.bit_length() - 1

    def fill_path(self, path: list[int], out: torch.Tensor) -> None:
        """The next-token bitmask after ``path`` (tokens from the current state) into ``out``
        [words]; a path the grammar refuses, or past its end, leaves ``out`` as it came (all ones)."""
        t0 = time.perf_counter()
        n = 0
        for t in path:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n == len(path) and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(out[None])
        if n:
            self.matcher.rollback(n)
        self.host_s += time.perf_counter() - t0

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a path from the current state) the grammar accepts in a row."""
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n


_SHIFTS = torch.arange(WORD, dtype=torch.int32)


def popcount(bm: torch.Tensor) -> torch.Tensor:
    """Set bits per row of an int32 bitmask [..., words] -> [...] (CPU, small)."""
    return ((bm[..., None] >> _SHIFTS.to(bm.device)) & 1).sum((-1, -2))


def bit_index(row: torch.Tensor) -> int:
    """The index of the one set bit of a bitmask row [words]."""
    w = int((row != 0).nonzero()[0, 0])
    return w * WORD + int((((row[w] >> _SHIFTS) & 1) != 0).nonzero()[0, 0])


def unpack(bm: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [..., words] -> bool allowed [..., vocab] (bit i of word w: token 32 w + i)."""
    bits = (bm[..., None] >> torch.arange(WORD, dtype=torch.int32, device=bm.device)) & 1  # [..., words, 32]
    return bits.flatten(-2)[..., :vocab].bool()


class DraftMask:
    """A step's drafts masked by each constrained row's grammar at the node they extend
    (:attr:`mmspec.drafting.trees.StepInput.grammar`): the drafter's q renormalised over the legal
    tokens, so no drafted token is illegal and a sampled draft's q is the one it was drawn from.
    ``grammars[b]``: row b's state (None: free; its q is left as it is, bit for bit)."""

    def __init__(self, grammars: list[RowGrammar | None], rows: int, device: torch.device):
        self.grammars = grammars
        on = [g is not None for g in grammars[:rows]] + [False] * max(0, rows - len(grammars))
        self.rows = torch.tensor(on, dtype=torch.bool).to(device)  # [R] (made on the host: a constrained step)
        self.all_constrained = all(g is not None for g in grammars[:rows])
        self.stop = False  # the last mask found every row's next ``need`` tokens forced (a chain stops drafting)

    def mask(self, q: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor,
             need: int = 0) -> torch.Tensor:
        """q [R, F, V] (the children distributions of the frontier nodes ``frontier`` [R, F] of
        trees drafted so far: tokens, parents [R, M]) -> q masked and renormalised on constrained rows.
        ``need`` > 0 (a chain, F = 1): :attr:`stop` says whether every row is constrained and its
        grammar forces the next ``need`` tokens (the rest of the chain, which drafting would only copy)."""
        R, F, V = q.shape
        B = min(len(self.grammars), R)
        M = tokens.shape[1]
        host_rows = torch.cat([tokens[:B], parents[:B], frontier[:B]], 1).tolist()  # ONE read a depth
        tok = [r[:M] for r in host_rows]
        par = [r[M:2 * M] for r in host_rows]
        fr = [r[2 * M:] for r in host_rows]
        host = torch.full((R, F, words(V)), -1, dtype=torch.int32)
        stop = need > 0 and self.all_constrained
        for b in range(B):
            g = self.grammars[b]
            if g is None:
                continue
            for j, node in enumerate(fr[b]):
                path = []
                while node > 0:
                    path.append(tok[b][node])
                    node = par[b][node]
                g.fill_path(path[::-1], host[b, j])
                stop = stop and g.forced_count(path[::-1], need) >= need
        self.stop = stop
        allowed = unpack(host.to(q.device), V).to(q.dtype)  # [R, F, V]
        kept = q * allowed
        total = kept.sum(-1, keepdim=True)
        uniform = allowed / allowed.sum(-1, keepdim=True)  # a q with no mass on any legal token: uniform over them
        masked = torch.where(total > 0, kept / total.clamp_min(torch.finfo(q.dtype).tiny), uniform)
        return torch.where(self.rows[:, None, None], masked, q)
