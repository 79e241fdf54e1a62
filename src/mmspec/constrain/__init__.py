"""Structured outputs: an answer constrained to a JSON schema, any JSON object, a regex, a choice
among strings or an EBNF grammar, decoded losslessly under speculation (docs/structured.md).

:mod:`~mmspec.constrain.spec` is the constraint as the user states it (plain data, checked);
:mod:`~mmspec.constrain.compile` compiles it for a tokenizer with xgrammar (cached, time-bounded);
:mod:`~mmspec.constrain.state` holds each constrained row's grammar state and masks a step's trees.
"""

from mmspec.constrain.spec import KINDS, Constraint

__all__ = ["Constraint", "KINDS"]
