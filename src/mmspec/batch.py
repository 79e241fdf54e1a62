"""Many requests at once: :class:`BatchScheduler` (continuous batching), :class:`SpeculationPolicy`
and :func:`generate_batch`, on the one engine (:mod:`mmspec.engine`)."""

from mmspec.engine.scheduler import SPECULATE, BatchScheduler, SpeculationPolicy, StepEvent, generate_batch

__all__ = ["SPECULATE", "BatchScheduler", "SpeculationPolicy", "StepEvent", "generate_batch"]
