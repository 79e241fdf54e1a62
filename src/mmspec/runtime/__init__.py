"""The pieces a step runs on, below both the engine and the drafters: the rows' device state and
its staging (``state``), counter-based randomness (``rng``), the one 4-D mask builder (``masks``),
the forwards over row caches and their prefill (``forwards``), and graph capture with its shape
buckets (``graphs``). ``mmspec.engine`` (the step, admission, the scheduler, the policy) and
``mmspec.drafting`` (trees, ensembles, heads, model-free proposals) both import from here; the
drafters never import the engine.
"""
