"""Held-out reading practice scored by lookup kind (`mmspec.train.recipe.final_value_accuracy`).

    python docs/results/lookup-target-2026-11-24/by_kind.py MODEL_DIR

400 examples from `mmspec.train.data.reading_example` (seed 12345, not the practice's seeds):
200 chart value lookups and 200 scene lookups, split by the question's kind. One thread.
"""
import random
import sys
from collections import defaultdict

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder, reading_example
from mmspec.train.recipe import final_value_accuracy


def kind(ex, scene: bool) -> str:
    if not scene:
        return "chart value"
    q = ex.prompt
    if "colour" in q.lower():
        return "scene: colour of a shape"
    return "scene: place of an object" if ("Where" in q or "which part" in q) else "scene: shape at a place"


def main() -> None:
    torch.set_num_threads(1)
    init = sys.argv[1]
    proc = AutoProcessor.from_pretrained(init)
    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    rng = random.Random(12345)
    groups = defaultdict(list)
    for i in range(400):
        ex = reading_example(rng, scene=i % 2 == 0)
        groups[kind(ex, i % 2 == 0)].append(ex)
    for k, exs in sorted(groups.items()):
        acc = final_value_accuracy(model, Encoder(proc.tokenizer), proc.image_processor, exs)
        print(f"{k}: {acc:.1%} of {len(exs)}", flush=True)


if __name__ == "__main__":
    main()
