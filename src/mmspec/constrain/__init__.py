"""Constrained decoding: what a request may constrain its answer to (a JSON schema, any JSON
object, a regex, a choice among strings, an EBNF grammar), compiled per tokenizer and applied
to every drafted and verified token."""

from mmspec.constrain.spec import Constraint

__all__ = ["Constraint"]
