"""Where does a target trained on the stopping reading stop? For the first value and colour
questions of chartqa's test split: the answer's reading, whether its last entry names the asked
label, whether that entry is true of the chart (label, value and colour of one bar), and whether
the reading named the asked bar earlier without stopping.

    python stops.py MODEL_DIR N      (run with the world of world.patch on PYTHONPATH)
"""
import re
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder
from mmspec.train.evaluate import model_answers
from mmspec.world import generate_samples
from mmspec.world.single import CHART_LABELS

torch.set_num_threads(1)
path, n = sys.argv[1], int(sys.argv[2])
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
samples = [s for s in generate_samples("chartqa", "test", 200) if set(s.facts) == {"value", "colour"}][:n]
answers = model_answers(model, Encoder(processor.tokenizer), processor.image_processor, samples, max_new_tokens=96)
counts = dict(last_is_asked=0, last_true=0, last_is_asked_and_true=0, passed_asked=0)
for s, (_, text, *_rest) in zip(samples, answers):
    asked = next(w for w in re.findall(r"\w+", s.question) if w in CHART_LABELS)
    bars = {lab: (v, c) for c, lab, v in (b.split(" ") for b in s.captions[0].removeprefix("a bar chart: ").split(", "))}
    read = re.findall(r"(\w+) is (\d+) in (\w+)", text.split(". ")[0])
    last = read[-1] if read else ("", "", "")
    true = bars.get(last[0]) == (last[1], last[2])
    counts["last_is_asked"] += last[0] == asked
    counts["last_true"] += true
    counts["last_is_asked_and_true"] += last[0] == asked and true
    counts["passed_asked"] += any(lab == asked and bars.get(lab) == (v, c) for lab, v, c in read[:-1])
print(f"$ stops.py {path} {n}")
print(", ".join(f"{k} {v} of {len(samples)}" for k, v in counts.items()))
