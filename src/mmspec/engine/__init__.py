"""The engine: one step over every request's row, its state on the device.

- :mod:`.step`: THE STEP (:class:`~mmspec.engine.step.Engine`): draft, one target forward, one
  verification, commit, one host read;
- :mod:`.state`: the persistent batch (every row's decoding state as device tensors);
- :mod:`.forwards`: a step's fixed-shape forwards over a cache's rows, and newcomers' prefill;
- :mod:`.admission`: requests joining the batch, prefilled together straight into their rows;
- :mod:`.scheduler`: continuous batching, ``generate`` as a batch of one, the speculation policy;
- :mod:`.graphs`: CUDA graphs per shape, one pool per engine; :mod:`.masks`: the one mask
  builder; :mod:`.rng`: every random draw, a stream per request.

What a step drafts is :mod:`mmspec.drafting`'s; the maths of verification :mod:`mmspec.verify`'s.
"""
