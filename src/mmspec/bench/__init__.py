"""Benchmarks of speculative decoding: datasets, a resumable runner, latency, metrics, report.

``mmspec.bench`` owns everything needed to reproduce the IbED evaluation (Table 3, Fig. 5, 9, 11):
loading benchmark samples (:mod:`.datasets`), running drafting methods against the target-alone
baseline into per-rank JSONL files (:mod:`.runner`, :mod:`.store`), timing T_p / T_q / T_V
(:mod:`.latency`), aggregating rows into numbers (:mod:`.metrics`) and rendering ``report.md``
with plots (:mod:`.report`, :mod:`.plots`). It knows nothing about how decoding works inside:
it drives ``SpecDecoder.generate`` and reads ``GenerationStats``. The wall-clock speed scripts
and their profiling helpers live outside the package, in the repository's ``perf/``.
"""
