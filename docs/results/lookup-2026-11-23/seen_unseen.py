"""Per-question accuracy of a target on test samples, on train samples it was trained on, on
train samples it never saw, and on test samples through the caption view (each image replaced by
its ground-truth caption, so every fact is in the prompt as text).

    python seen_unseen.py MODEL_DIR FAMILY N OUT_JSON     (MODEL_DIR "": the shipped target)

The shipped target's last stage (v12) trained on world seed 51's train samples; seed 777's train
samples come from the same distribution and were never trained on.
"""
import json
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import Encoder
from mmspec.train.evaluate import model_answers, tally_facts
from mmspec.world import generate_samples

torch.set_num_threads(1)
path = sys.argv[1] or default_path() / "target"
family, n, out_path = sys.argv[2], int(sys.argv[3]), sys.argv[4]
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
encoder = Encoder(processor.tokenizer)
out = {}
for name, split, seed, view in (("test", "test", 0, "multimodal"), ("train-seen-s51", "train", 51, "multimodal"),
                                ("train-unseen-s777", "train", 777, "multimodal"),
                                ("test-caption", "test", 0, "caption")):
    samples = generate_samples(family, split, n, seed=seed)
    r = tally_facts(model_answers(model, encoder, processor.image_processor, samples, view))[family]
    q = r["questions"]
    out[f"{family}/{name}"] = {"right": q["right"], "recall": r["recall"],
                               "by_asked": {k: v["right"] for k, v in q["by_asked"].items()}}
    print(family, name, f"right {q['right']:.1%} recall {r['recall']:.1%}",
          {k: round(v["right"], 2) for k, v in q["by_asked"].items()}, flush=True)
with open(out_path, "w") as f:
    json.dump(out, f, indent=1)
