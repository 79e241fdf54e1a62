"""A target's greedy answers to the first chartqa (or other family) test questions of one kind.

    PYTHONPATH=/path/to/world/src python show.py MODEL_DIR FAMILY N [ASKED]

Prints, per question: answered right (``answers_question``) | question | answer || reference.
ASKED picks questions whose asked fact has that key (value, colour, label, difference, ...).
"""
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder, example_from_sample
from mmspec.train.evaluate import answers_question
from mmspec.train.recipe import greedy_answer
from mmspec.world import generate_samples

torch.set_num_threads(1)
path, fam, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
kind = sys.argv[4] if len(sys.argv) > 4 else None
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
enc = Encoder(processor.tokenizer)
shown = 0
for s in generate_samples(fam, "test", 200):
    if kind and next(iter(s.facts)) != kind:
        continue
    ex = example_from_sample(s)
    ids = greedy_answer(model, enc, processor.image_processor, ex, max_new_tokens=96)
    text = processor.tokenizer.decode(ids, skip_special_tokens=True)
    print(answers_question(s, text), "|", ex.prompt.split("answer. ")[-1][:-11], "|", text, "|| REF:", ex.answer)
    shown += 1
    if shown >= n:
        break
