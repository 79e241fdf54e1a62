"""Chart value/colour questions: does the target name the asked bar's colour, and when it names a
wrong one, is the value it then gives the value of the bar that has that colour?"""
import re, sys, torch
from collections import Counter
from transformers import AutoProcessor, LlavaForConditionalGeneration
from mmspec.embedded import default_path
from mmspec.train.data import Encoder
from mmspec.train.evaluate import model_answers, answers_question
from mmspec.world import generate_samples
from mmspec.world.core import sentences
from mmspec.world.render import COLOURS
torch.set_num_threads(1)
path = (sys.argv[1] if len(sys.argv) > 1 else "") or default_path() / "target"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
m = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
p = AutoProcessor.from_pretrained(path)
s = [x for x in generate_samples("chartqa", "test", n) if "value" in x.facts and "colour" in x.facts
     and "label" not in x.facts]
c = Counter()
names = sorted(COLOURS, key=len, reverse=True)
for sample, text in model_answers(m, Encoder(p.tokenizer), p.image_processor, s, "multimodal"):
    bars = {col: int(v) for col, _lab, v in (item.split() for item in sample.captions[0].split(": ", 1)[1].split(", "))}
    kind = "colour" if next(iter(sample.facts)) == "colour" else "value"
    parts = sentences(text)
    body = parts[1] if len(parts) > 2 else ""
    col = next((w for w in re.findall(r"[a-z]+", body) if w in bars or w in names), None)
    val = re.findall(r"\b\d+\b", body)
    c[kind, "n"] += 1
    c[kind, "right"] += answers_question(sample, text)
    if col is None or not val:
        c[kind, "unparsed"] += 1
        continue
    if col == sample.facts["colour"]:
        c[kind, "colour right"] += 1
        c[kind, "colour right, value right"] += int(val[-1]) == int(sample.facts["value"])
    else:
        c[kind, "colour wrong"] += 1
        c[kind, "colour wrong, value of that colour's bar"] += col in bars and int(val[-1]) == bars[col]
        c[kind, "colour wrong, value of the asked bar"] += int(val[-1]) == int(sample.facts["value"])
for k in sorted(c):
    print(*k, c[k], sep=" | ")
