"""Does a target continue "<label>" with that bar's value from the adjacent reading it just wrote?

    PYTHONPATH=/path/to/adjacent-world/src python induct_adj.py MODEL_DIR N [VIEW]

``../induction-2026-11-23/induct.py`` for the adjacent reading ("egg 4, cup 7 and box 8."): for
each of the first N chartqa test samples the reference answer is cut to its first sentence and,
for every bar, a frame ending in the bar's label is appended. The target's argmax at the next
token should be the value that follows the same label in the reading. Chance (one of the 3-4
listed values) is about 29%. Run it with the adjacent world on ``PYTHONPATH`` (the reading's form
comes from the world's reference answers).
"""
import collections
import dataclasses
import os
import re
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder, collate, example_from_sample
from mmspec.train.recipe import batch_forward
from mmspec.world import generate_samples

FRAMES = (" So the asked bar is {la}", " The answer is {la}", " {la}")

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
path, n = sys.argv[1], int(sys.argv[2])
view = sys.argv[3] if len(sys.argv) > 3 else "multimodal"
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
tok = processor.tokenizer
encoder = Encoder(tok)
right, total = collections.Counter(), collections.Counter()
for sample in generate_samples("chartqa", "test", n):
    ex = example_from_sample(sample)
    reading = ex.answer.split(". ")[0] + "."
    bars = re.findall(r"(\w+) (\d+)", reading.split(": ", 1)[1])  # [(label, value)] in order
    assert len(bars) in (3, 4) and " is " not in reading.split(": ", 1)[1], reading  # the adjacent world
    for label, value in bars:
        for frame in FRAMES:
            e = encoder.encode(dataclasses.replace(ex, answer=reading + frame.format(la=label) + f" {value}."),
                               view=view)
            want = tok(" " + value, add_special_tokens=False)["input_ids"]
            at = len(e.input_ids) - 2 - len(want)  # the value's first token ("." and eos follow it)
            assert e.input_ids[at:at + len(want)] == want
            batch = collate([e], tok.pad_token_id, processor.image_processor, 64)
            with torch.no_grad():
                pred = batch_forward(model, batch).logits[0].argmax(-1)  # [T]: pred[t] guesses token t+1
            right[frame] += all(int(pred[at - 1 + j]) == want[j] for j in range(len(want)))
            total[frame] += 1
print(f"$ induct_adj.py {sys.argv[1]!r} {n} {view}")
for frame in FRAMES:
    print(f"{view} {frame!r:30s} {right[frame]}/{total[frame]} = {right[frame] / total[frame]:.0%}")
