"""Shared helpers of the test suite, one package imported as ``helpers`` (``pythonpath = ["tests"]``
in pyproject.toml): test modules import from here or use conftest.py's fixtures, never from one
another.

- ``helpers.tiny``: tiny random models, tokenizer, processor and prompts built from configs.
- ``helpers.bench_data``: parquet fixtures in the lmms-lab schemas and a fake bench backend.
- ``helpers.reference``: what the outputs are checked against (``target.generate``, chi-square).
- ``helpers.qwen``: tiny Qwen2-VL / Qwen2.5-VL models and their inputs.
- ``helpers.scripts``: the top-level speed scripts, imported by path.
- ``helpers.verify_ref``: the chain verifiers and the node-by-node sampling rule, references for
  ``mmspec.runtime.verify``'s tree functions; ``helpers.caches``: ``kv_rows``, a batch row read out of a cache.
- ``helpers/vllm_eagle3_load.py``: a script (not imported) run by a Python with vLLM: vLLM's own
  EAGLE-3 drafter loads an exported head (``tests/core/test_head_formats.py``).
"""
