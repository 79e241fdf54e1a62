"""Many requests at once: :class:`BatchScheduler` (continuous batching), :class:`SpeculationPolicy`
and :func:`generate_batch`, on the one engine (:mod:`mmspec.engine`)."""

from mmspec.engine.policy import SpeculationPolicy
from mmspec.engine.scheduler import BatchScheduler, StepEvent, generate_batch
from mmspec.options import SPECULATE

__all__ = ["SPECULATE", "BatchScheduler", "SpeculationPolicy", "StepEvent", "generate_batch"]
