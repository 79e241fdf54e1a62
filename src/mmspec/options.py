"""The decoding loop's typed settings: what :class:`mmspec.SpecDecoder` checks once from its
keywords and hands to the engine (:mod:`mmspec.engine`), so the engine never sees a loose parameter.

* :class:`AcceptanceConfig`: exact (lossless, the default) or relaxed acceptance; the relaxed
  thresholds live in :class:`RelaxedAcceptance` (LOSSY, opt-in).
* :class:`EngineOptions`: the block's tree, the EOS ids and the acceptance of a decoder.
* :class:`EngineMode`: eager, static (fixed shapes) or CUDA-graph decoding, compiled or not.
* :data:`SPECULATE`: the speculation policies a batch of requests runs (``generate_batch``,
  ``BatchScheduler``, ``mmspec serve --speculate``), named once (in :mod:`mmspec.config`).

This module checks values and says what they mean; it runs no model. The defaults are
:mod:`mmspec.config`'s (the user's options); this module turns them into the engine's settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mmspec.config import DEFAULT_THRESHOLDS, DEFAULT_WINDOW, SPECULATE
from mmspec.drafting.tree import TreeSpec
from mmspec.errors import MMSpecError

__all__ = ["ACCEPTANCES", "DEFAULT_THRESHOLDS", "DEFAULT_WINDOW", "SPECULATE", "AcceptanceConfig", "EngineMode",
           "EngineOptions", "RelaxedAcceptance"]
ACCEPTANCES = ("exact", "relaxed")


@dataclass(frozen=True)
class RelaxedAcceptance:
    """MSD's modality-aware relaxed acceptance (LOSSY, opt-in): a drafted token is also accepted
    when the target's probability of it clears a threshold, ``vision`` for blocks that follow
    vision context (their root within ``window`` positions of the prompt's last image token),
    ``text`` otherwise (the engine applies it per row: ``Engine._thresholds``). Greedy decoding only."""

    vision: float = DEFAULT_THRESHOLDS[0]
    text: float = DEFAULT_THRESHOLDS[1]
    window: int = DEFAULT_WINDOW


@dataclass(frozen=True)
class AcceptanceConfig:
    """How verification accepts a drafted token: exactly (``relaxed`` None: the output is the
    target's) or also above a relaxed threshold (LOSSY)."""

    relaxed: RelaxedAcceptance | None = None

    @classmethod
    def parse(cls, acceptance: str, thresholds=DEFAULT_THRESHOLDS, window: int = DEFAULT_WINDOW) -> AcceptanceConfig:
        """SpecDecoder's ``acceptance``, ``relaxed_thresholds``, ``relaxed_window``, checked."""
        if acceptance not in ACCEPTANCES:
            raise MMSpecError(f"acceptance must be 'exact' (lossless) or 'relaxed' (lossy: MSD's relaxed "
                              f"acceptance), got {acceptance!r}")
        vision, text = _two_probabilities(thresholds)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise MMSpecError(f"relaxed_window must be a whole number >= 0, got {window!r}")
        if acceptance == "exact":
            if (vision, text) != DEFAULT_THRESHOLDS or window != DEFAULT_WINDOW:  # would be silently ignored
                raise MMSpecError("relaxed_thresholds and relaxed_window set the lossy relaxed acceptance; pass "
                                  "acceptance='relaxed' with them, or leave them out for the exact (lossless) one")
            return cls()
        return cls(RelaxedAcceptance(vision=vision, text=text, window=window))

    @property
    def name(self) -> str:
        return "exact" if self.relaxed is None else "relaxed"


def _two_probabilities(thresholds) -> tuple[float, float]:
    """(vision, text) from ``relaxed_thresholds``, or a clear error naming the expected form."""
    form = "relaxed_thresholds must be two probabilities in (0, 1], (vision, text), e.g. (0.6, 0.4)"
    if isinstance(thresholds, (str, bytes)) or not hasattr(thresholds, "__len__") or len(thresholds) != 2:
        raise MMSpecError(f"{form}; got {thresholds!r}")
    try:
        vision, text = (float(t) for t in thresholds)
    except (TypeError, ValueError):
        raise MMSpecError(f"{form}; got {thresholds!r}") from None
    if not all(math.isfinite(t) and 0 < t <= 1 for t in (vision, text)):
        raise MMSpecError(f"{form}; got {thresholds!r}")
    return vision, text


@dataclass(frozen=True)
class EngineOptions:
    """How the engine decodes, fixed per decoder: the block's tree, the EOS ids, the acceptance
    (a request's limit and sampling parameters are its own: :class:`~mmspec.request.Request`)."""

    tree: TreeSpec  # the block's shape: a chain of gamma drafts is a tree with one branch
    eos_ids: frozenset[int] = frozenset()
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)


@dataclass(frozen=True)
class EngineMode:
    """Eager decoding, fixed shapes on static caches, or those shapes captured as CUDA graphs;
    with or without the step's forwards compiled (``torch.compile``, default mode: inductor's
    kernels, captured by the step's own graph; falls back to the uncompiled forwards)."""

    graphs: str = "eager"  # a mmspec.runtime.graphs.MODES entry: "eager", "cuda" or "emulate" (CPU tests)
    static: bool = False  # static caches, whole-buffer 4-D masks (always when graphs != "eager" or compile)
    compile: bool = False  # the target's and the draft's step forwards through torch.compile

    @property
    def name(self) -> str:
        """As GenerationStats.engine reports it: "eager", "static" or "cuda-graphs", "+compile" when compiled."""
        base = "cuda-graphs" if self.graphs == "cuda" else ("static" if self.static else "eager")
        return base + ("+compile" if self.compile else "")
