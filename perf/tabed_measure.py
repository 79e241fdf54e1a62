"""Block efficiency of adaptive vs fixed ensemble weights vs single views on the embedded pack:
the eight world families and the scenario variants (mmspec.world.scenarios). Real decoding
(SpecDecoder through the bench's HFBackend), greedy, gamma 5, max_new_tokens 128, one thread.

    PYTHONPATH=src python perf/tabed_measure.py OUT.jsonl N_FAMILY N_SCENARIO

Writes one JSON row per (family, sample, method): tau, tokens, blocks, the weights' trajectory.
The followup scenario also runs turn 1 (its vqav2 prompt) and turn 2 started from turn 1's
final weights (method "MTCP+adaptive+carry").
"""

import json
import sys
import time

import torch

from mmspec.bench.backend import HFBackend, load_models
from mmspec.bench.config import BenchConfig
from mmspec.bench.datasets import BenchSample
from mmspec.threads import apply_threads
from mmspec.world import generate_samples
from mmspec.world.scenarios import SCENARIOS, generate_scenario_samples

FAMILIES = ["chartqa", "textvqa", "vqav2", "hallusionbench", "spot_the_diff", "iedit", "pororosv", "vist"]
METHODS = ["M", "T", "C", "P", "MT", "MTCP", "MT+adaptive:tabed:0.1", "MTCP+adaptive", "MTCP+adaptive:tabed:0.1",
           "MTCP+adaptive:loglik", "M+tree", "T+tree", "MTCP+tree", "MTCP+adaptive:tabed:0.1+tree"]


def main(out: str, n: int, n_scenario: int) -> None:
    apply_threads(1)  # the CPU figures of docs/perf.md are one-thread figures
    cfg = BenchConfig(latency=False)
    be = HFBackend(load_models(cfg), cfg, torch.device("cpu"))
    sets = [(f, generate_samples(f, "test", n)) for f in FAMILIES]
    sets = [(s, generate_scenario_samples(s, "test", n_scenario)) for s in SCENARIOS] + sets  # scenarios first
    with open(out, "w") as fh:
        for fam, samples in sets:
            for s in samples:
                bs = BenchSample(uid=s.uid, dataset=fam, prompt=s.prompt, images=s.images, reference=s.answer)
                rows = [(m, be.spec(bs, m)) for m in METHODS]
                if fam == "followup":
                    rows += carry(be, s, bs)
                for m, g in rows:
                    st = g.stats
                    fh.write(json.dumps({"family": fam, "uid": s.uid, "method": m, "tau": st["tau"],
                                         "n_tokens": st["n_tokens"], "n_blocks": st["n_blocks"],
                                         "wall_s": g.wall_s, "tokens": g.token_ids,
                                         "view_weights": st["view_weights"],
                                         "final_weights": st["final_weights"]}) + "\n")
                fh.flush()
            print(fam, time.strftime("%H:%M:%S"), flush=True)


def carry(be, s, bs):
    """Turn 1 (the vqav2 prompt before the follow-up) with MTCP+adaptive, then turn 2 from its
    final weights."""
    base = s.prompt[: s.prompt.index(" " + s.answer + " USER:")]
    t1 = be.spec(BenchSample(uid=s.uid + "-t1", dataset="followup", prompt=base, images=s.images), "MTCP+adaptive")
    dec = be._decoder("MTCP+adaptive")
    inputs = be._inputs(bs)
    t0 = time.perf_counter()
    res = dec.generate(inputs["input_ids"], pixel_values=inputs.get("pixel_values"), max_new_tokens=128,
                       images=s.images, initial_weights=t1.stats["final_weights"])
    from mmspec.bench.backend import Generation

    g = Generation(list(res.token_ids), res.text, time.perf_counter() - t0, 0, res.stats.to_dict())
    return [("MTCP+adaptive@turn1", t1), ("MTCP+adaptive+carry", g)]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
