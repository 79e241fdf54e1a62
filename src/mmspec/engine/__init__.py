"""The engine: one step over every request's row, its state on the device.

- :mod:`.step`: THE STEP (:class:`~mmspec.engine.step.Engine`): draft, one target forward, one
  verification, commit, one host read;
- :mod:`.admission`: requests joining the batch, prefilled together straight into their rows;
- :mod:`.scheduler`: continuous batching, ``generate`` as a batch of one;
- :mod:`.policy`: the speculation policy (each step's depth and shape, plain steps included).

What a step runs on (the rows' device state, forwards, graphs, masks, randomness) is
:mod:`mmspec.runtime`'s, shared with the drafters; what a step drafts is :mod:`mmspec.drafting`'s;
the maths of verification :mod:`mmspec.runtime.verify`'s. The drafters never import the engine.
"""
