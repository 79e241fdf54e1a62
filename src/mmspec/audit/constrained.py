"""The target's own constrained decoding, as a reference: a transformers logits processor that
masks every token the constraint does not allow at that point, so ``target.generate(do_sample=False,
logits_processor=...)`` is the greedy decoding of the constrained target (its logits with the
illegal tokens at -inf), which a speculative answer under the same constraint must equal token
for token.

Owns :class:`GrammarLogits` (one request's matcher: it accepts each token generate() appends and
masks the next step's scores with the grammar's bitmask, unpacked in torch so any dtype, float64
included, is masked the same way) and :func:`constrained_kwargs` (a
:class:`~mmspec.constrain.Constraint` -> generate()'s ``logits_processor``, the constraint
compiled by :class:`mmspec.constrain.compile.GrammarCompiler` for the model's logits width, the
EOS ids as its stop tokens: the grammar the engine uses). Used by ``mmspec audit``'s local
reference and ``mmspec generate``'s comparison. Needs xgrammar (``mmspec[structured]``).
"""

from __future__ import annotations

import torch


class GrammarLogits:
    """One greedy generate()'s constraint (a batch of one): call it as a transformers LogitsProcessor."""

    def __init__(self, compiled, width: int):
        from mmspec.constrain.compile import xgrammar

        self.xgr = xgrammar()
        self.matcher = self.xgr.GrammarMatcher(compiled)
        self.bitmask = self.xgr.allocate_token_bitmask(1, width)  # [1, ceil(width / 32)] int32
        self.width = width
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # input_ids: [1, L]; scores: [1, V]
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        elif not self.matcher.accept_token(int(input_ids[0, -1])):
            raise RuntimeError(f"the grammar refused token {int(input_ids[0, -1])}, which it had allowed")
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return scores.masked_fill(~allowed(self.bitmask, scores.shape[-1]).to(scores.device), float("-inf"))


def allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """xgrammar's packed bitmask [1, W/32] int32 -> a bool mask [1, width] (bit k of word j: token 32j + k)."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :width]


def constrained_kwargs(model, tokenizer, eos_ids, constraint) -> dict:
    """generate()'s ``logits_processor`` for ``constraint`` (None: no keywords)."""
    if constraint is None:
        return {}
    from transformers import LogitsProcessorList

    from mmspec.constrain.compile import GrammarCompiler

    width = int(model.get_output_embeddings().weight.shape[0])
    compiled = GrammarCompiler(tokenizer, width, sorted(eos_ids)).compile(constraint)
    return {"logits_processor": LogitsProcessorList([GrammarLogits(compiled, width)])}
