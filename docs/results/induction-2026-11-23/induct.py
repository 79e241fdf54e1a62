"""Does a target continue "<label> is" with that bar's value from the reading it just wrote?

    python induct.py MODEL_DIR N [VIEW] [FORM]      (MODEL_DIR "": the shipped target)

For each of the first N chartqa test samples, the answer is cut to its first sentence (the
reading: "egg is 4, cup is 7 and box is 8." or, in the induction-reading world, "egg is 4 in
red, ..."), and for every bar a frame that ends in "<label> is" is appended. The target's argmax
at the next token should be that bar's value, which stands in the reading right after the same
two words. Counts are per bar, so each chart gives 3-4 trials per frame. The world's answers are
the ones of the mmspec on ``PYTHONPATH``, so run it with the world the target was trained on.

FORM ``adjacent`` (default ``is``) probes the adjacent reading of
``../lookup-form-2026-11-23/adjacent-world.patch`` ("egg 4, cup 7 and box 8."): the frames end on
the label itself, and the value follows the same label in the reading.
"""
import collections
import dataclasses
import re
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import Encoder, collate, example_from_sample
from mmspec.train.recipe import batch_forward
from mmspec.world import generate_samples

FRAMES = {"is": (" So the value of {la} is", " The bar for {la} is", " For the asked bar, {la} is", " {la} is"),
          "adjacent": (" So the asked bar is {la}", " The answer is {la}", " {la}")}
ENTRY = {"is": r"(\w+) is (\d+)", "adjacent": r"(\w+) (\d+)"}  # one reading entry: (label, value)

torch.set_num_threads(int(__import__("os").environ.get("THREADS", "1")))
path = sys.argv[1] or str(default_path() / "target")
n = int(sys.argv[2])
view = sys.argv[3] if len(sys.argv) > 3 else "multimodal"
form = sys.argv[4] if len(sys.argv) > 4 else "is"
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
tok = processor.tokenizer
encoder = Encoder(tok)
right, total = collections.Counter(), collections.Counter()
for sample in generate_samples("chartqa", "test", n):
    ex = example_from_sample(sample)
    reading = ex.answer.split(". ")[0] + "."
    bars = re.findall(ENTRY[form], reading.split(": ", 1)[1])  # [(label, value)] in order
    assert len(bars) in (3, 4) and "is" not in dict(bars), f"{reading!r} is not a reading in the {form!r} form: run with that world"
    for label, value in bars:
        for frame in FRAMES[form]:
            e = encoder.encode(dataclasses.replace(ex, answer=reading + frame.format(la=label) + f" {value}."),
                               view=view)
            want = tok(" " + value, add_special_tokens=False)["input_ids"]
            at = len(e.input_ids) - 2 - len(want)  # the value's first token (eos and "." follow it)
            assert e.input_ids[at:at + len(want)] == want
            batch = collate([e], tok.pad_token_id, processor.image_processor, 64)
            with torch.no_grad():
                pred = batch_forward(model, batch).logits[0].argmax(-1)  # [T]: pred[t] guesses token t+1
            ok = all(int(pred[at - 1 + j]) == want[j] for j in range(len(want)))
            right[frame] += ok
            total[frame] += 1
print(f"$ induct.py {sys.argv[1]!r} {n} {view}" + (f" {form}" if form != "is" else ""))
for frame in FRAMES[form]:
    print(f"{view} {frame!r:32s} {right[frame]}/{total[frame]} = {right[frame] / total[frame]:.0%}")
