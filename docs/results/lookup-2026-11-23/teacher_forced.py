"""Teacher-forced lookups: given the reference answer so far, does a target predict each fact of
the answer's lookup part (the sentences after the first, which read the image out) right?

    python teacher_forced.py MODEL_DIR FAMILY N [VIEW]     (MODEL_DIR "": the shipped target)

For each of the first N test samples of FAMILY, every occurrence of a fact value after the first
sentence counts as predicted when the argmax at each of its tokens is that token. Occurrences are
split by kind of fact, by sentence (``final`` = the answer's last sentence, ``body`` = between
the reading and it) and by whether it is the asked fact (the sample's first) or another one.
Because every earlier token is the reference's, a miss here is that step's own error.
"""
import collections
import re
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import Encoder, collate, example_from_sample
from mmspec.train.recipe import batch_forward
from mmspec.world import generate_samples

path = sys.argv[1] or str(default_path() / "target")
family, n = sys.argv[2], int(sys.argv[3])
view = sys.argv[4] if len(sys.argv) > 4 else "multimodal"
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
tok = processor.tokenizer
encoder = Encoder(tok, answer_weight=2.0)  # weight 2 marks the lookup part's tokens
stats = collections.defaultdict(lambda: [0, 0])
for sample in generate_samples(family, "test", n):
    e = encoder.encode(example_from_sample(sample), view=view)
    batch = collate([e], tok.pad_token_id, processor.image_processor, 64)
    with torch.no_grad():
        pred = batch_forward(model, batch).logits[0].argmax(-1)  # [T]: pred[t] is the guess for token t+1
    marked = [i for i, w in enumerate(e.weights) if w == 2.0]
    first, last = marked[0], marked[-1]
    pieces = [tok.decode([t]) for t in e.input_ids]
    asked = next(iter(sample.facts))
    for key, value in sample.facts.items():
        want = tok(" " + str(value), add_special_tokens=False)["input_ids"]
        for i in range(first, last + 1):
            if e.input_ids[i:i + len(want)] != want:
                continue
            ok = all(int(pred[i - 1 + k]) == want[k] for k in range(len(want)))
            where = "body" if "." in "".join(pieces[i:last + 1]).rstrip(". ") else "final"
            cell = stats[(re.sub(r"_\d+$", "", key), where, "asked" if key == asked else "other")]
            cell[0] += ok
            cell[1] += 1
for (kind, where, which), (right, total) in sorted(stats.items()):
    print(f"{family} {view} {kind:10s} {where:5s} {which:5s} {right}/{total} = {right / total:.0%}")
