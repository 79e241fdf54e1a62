"""Does a target take the asked bar's value from its reading, or from the image?

    python trust.py MODEL_DIR N      (MODEL_DIR "": the shipped target)

Counterfactual charts of the test split (``reading_trust_examples``: the image of one chart, a
reading with every value and colour moved to another bar). The answer is teacher-forced up to
the first "<asked label> is" after the reading, and the argmax at the next token is compared with
the value the reading gives that bar (a lookup in the text) and the value the image shows (a
lookup in the image). Value and colour questions only (they name the bar). Needs the mmspec of
the counterfactual patch on ``PYTHONPATH`` (docs/results/counterfactual-2026-11-23/).
"""
import collections
import dataclasses
import os
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import Encoder, collate, counterfactual_chart, reading_trust_examples
from mmspec.train.recipe import batch_forward
from mmspec.world.core import derive_rng

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
path = sys.argv[1] or str(default_path() / "target")
n = int(sys.argv[2])
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
tok = processor.tokenizer
encoder = Encoder(tok)
seed = 1234  # a stream no training run used (stages draw with their world seed)
said = collections.Counter()
for i, ex in enumerate(reading_trust_examples(n, seed, split="test")):
    spec, fake = counterfactual_chart(derive_rng(seed, "chartqa-counterfactual", "test", i), "test")
    if spec.kind not in ("value", "colour"):
        continue
    la = spec.labels[spec.a]
    at_text = ex.answer.index(f"{la} is", ex.given) + len(f"{la} is")
    text_v, image_v = str(fake.values[spec.a]), str(spec.values[spec.a])
    e = encoder.encode(dataclasses.replace(ex, answer=ex.answer[:at_text] + f" {text_v}.", given=0))
    want = tok(" " + text_v, add_special_tokens=False)["input_ids"]
    at = len(e.input_ids) - 2 - len(want)  # the value's first token ("." and eos follow it)
    batch = collate([e], tok.pad_token_id, processor.image_processor, 64)
    image_first = tok(" " + image_v, add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        pred = int(batch_forward(model, batch).logits[0, at - 1].argmax())  # guesses the value's first token
    said["reading's value" if pred == want[0] else "image's value" if pred == image_first else "another"] += 1
total = sum(said.values())
print(f"$ trust.py {sys.argv[1]!r} {n}: {total} value/colour questions, after '<asked label> is' the argmax is")
for k in ("reading's value", "image's value", "another"):
    print(f"  {k:16s} {said[k]}/{total} = {said[k] / max(total, 1):.0%}")
