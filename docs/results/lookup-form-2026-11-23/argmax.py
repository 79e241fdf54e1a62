"""The argmax after "So the asked bar is <label>" for every bar of the first 4 chartqa test charts.

    PYTHONPATH=/path/to/adjacent-world/src python argmax.py MODEL_DIR [MODEL_DIR ...]

Prints (predicted token, its logit) per bar, in reading order. A target that looks the label up
gives each bar its own value. One that does not gives the same value whatever the label.
"""
import dataclasses
import re
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder, collate, example_from_sample
from mmspec.train.recipe import batch_forward
from mmspec.world import generate_samples

torch.set_num_threads(1)
for path in sys.argv[1:]:
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    enc = Encoder(tok)
    out = []
    for s in generate_samples("chartqa", "test", 4):
        ex = example_from_sample(s)
        reading = ex.answer.split(". ")[0] + "."
        for label, value in re.findall(r"(\w+) (\d+)", reading.split(": ", 1)[1]):
            e = enc.encode(dataclasses.replace(ex, answer=reading + f" So the asked bar is {label} {value}."))
            at = len(e.input_ids) - 3  # the value's token ("." and eos follow it)
            assert [e.input_ids[at]] == tok(" " + value, add_special_tokens=False)["input_ids"], value  # one token
            with torch.no_grad():
                logits = batch_forward(model, collate([e], tok.pad_token_id, processor.image_processor, 64)).logits[0]
            out.append((tok.decode([int(logits[at - 1].argmax())]), round(float(logits[at - 1].max()), 2)))
    print(path, out)
