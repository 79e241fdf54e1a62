"""A :class:`~mmspec.constrain.spec.Constraint` compiled for one tokenizer, with xgrammar.

:class:`GrammarCompiler` is one decoder's compiler: xgrammar's ``TokenizerInfo`` made once from the
HF tokenizer (its vocabulary padded to the target's logits width, the decoder's EOS ids as the
grammar's stop tokens: a grammar that is complete allows exactly them), and a bounded LRU of
compiled grammars keyed by the constraint's content. Knows nothing of the engine or of rows
(:mod:`mmspec.constrain.state` holds the matchers).

Bounds: a constraint is checked (:meth:`Constraint.check`: sizes) before it is compiled, and each
compilation runs in a worker thread that the caller waits on for at most ``timeout_s`` seconds
(xgrammar's compiler releases the GIL): past it the request is refused with an MMSpecError (the
thread finishes on its own; its grammar is dropped). xgrammar's own errors (an unsupported schema
feature, a regex or grammar that does not parse) come back as an MMSpecError naming the problem
as xgrammar does (the schema's field, the grammar's line and column).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from mmspec.constrain.spec import Constraint
from mmspec.errors import MMSpecError

COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is refused
CACHE_ENTRIES = 128  # compiled grammars kept per decoder (least recently used dropped)


def xgrammar():
    """xgrammar, imported on first use (the ``[structured]`` extra)."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise MMSpecError("constrained decoding needs xgrammar: pip install 'mmspec[structured]' "
                          f"(xgrammar==0.2.8 and apache-tvm-ffi); import failed: {e}") from None
    return xgr


def constraint_key(c: Constraint) -> tuple:
    """What a compiled grammar depends on (hashable; the schema as canonical JSON)."""
    schema = None if c.schema is None else json.dumps(c.schema, sort_keys=True, separators=(",", ":"))
    return (c.kind, schema, c.pattern, c.choices, c.grammar, c.any_whitespace)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings" (xgrammar's GBNF, each choice a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_XGR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")  # "[18:15:33] /project/cpp/x.cc:83: "


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    return _XGR_PREFIX.sub("", str(e)).strip() or type(e).__name__


class GrammarCompiler:
    """One decoder's constraints compiled for its tokenizer (module docstring). ``vocab_size``: the
    target's logits width (the bitmask's); ``stop_ids``: the tokens that end an answer."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, *, max_entries: int = CACHE_ENTRIES,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.xgr = xgrammar()
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=self.stop_ids)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, c: Constraint):
        """-> xgrammar's CompiledGrammar for ``c`` (cached); MMSpecError when it cannot be made."""
        if not isinstance(c, Constraint):
            raise MMSpecError(f"constraint must be a mmspec.constrain.Constraint, got {type(c).__name__}")
        c.check()
        key = constraint_key(c)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        compiled = self._compile_bounded(c)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile_bounded(self, c: Constraint):
        out: dict = {}

        def work() -> None:
            try:
                out["grammar"] = self._compile(c)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out["error"] = e

        t = threading.Thread(target=work, name="mmspec-grammar-compile", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            raise MMSpecError(f"compiling the {c.kind} constraint took longer than {self.timeout_s:g} s; "
                              "send a simpler schema, pattern or grammar")
        if "error" in out:
            e = out["error"]
            if isinstance(e, MMSpecError):
                raise e
            raise MMSpecError(f"the {c.kind} constraint{' ' + repr(c.name) if c.name else ''} cannot be compiled: "
                              f"{xgrammar_message(e)}; fix it (xgrammar's JSON-schema, regex and EBNF support "
                              "is what mmspec accepts)") from None
        return out["grammar"]

    def _compile(self, c: Constraint):
        comp = self.compiler
        if c.kind == "json_schema":
            seps = None if c.any_whitespace else (",", ":")
            return comp.compile_json_schema(json.dumps(c.schema), any_whitespace=c.any_whitespace, separators=seps,
                                            strict_mode=True)
        if c.kind == "json_object":
            if c.any_whitespace:
                return comp.compile_builtin_json_grammar()
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"),
                                            strict_mode=False)
        if c.kind == "regex":
            return comp.compile_regex(c.pattern)
        if c.kind == "choice":
            return comp.compile_grammar(choice_grammar(c.choices))
        return comp.compile_grammar(c.grammar)
