"""Does a target tell yes from no where its existence answer decides (the world since 2026-11-23)?

An existence answer now names the object it looks for and decides with the next word:
"... in the top left. Looking for a red diamond: yes, it is in the top left. ...". For the existence
questions among the first N hallusionbench test samples, the reference answer is teacher-forced up
to that colon; the probe reads P(" yes") against P(" no"), renormalised over the two, and how often
the larger one is the true answer. " yes" is two tokens in the world's tokenizer (" y" "es"), so its
first piece stands for it (" yellow" and " you" are tokens of their own). The same script on the answer's scene sentence alone (the old
decision point) is docs/results/hallu-2026-11-22/verdict_probe.py.

    python verdict_probe.py MODEL_DIR [N=200] [multimodal|caption]
"""
import sys

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder, Example, collate, example_from_sample
from mmspec.train.recipe import batch_forward
from mmspec.world import generate_samples

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
view = sys.argv[3] if len(sys.argv) > 3 else "multimodal"
torch.set_num_threads(2)
m = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
proc = AutoProcessor.from_pretrained(path)
tok = proc.tokenizer
enc = Encoder(tok)
yes_id, no_id = (tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
assert yes_id != no_id and tok.decode([no_id]) == " no"
stats = {"Yes": [], "No": []}
for s in generate_samples("hallusionbench", "test", n):
    if "count" in s.facts:
        continue
    ex = example_from_sample(s)
    (cue,) = s.cues
    cut = ex.answer.index(cue) + cue.index(":") + 1  # "... Looking for a red diamond:"
    e = enc.encode(Example(ex.prompt, ex.answer[:cut], ex.images, ex.captions, ex.family), view)
    b = collate([type(e)(e.input_ids[:-1], e.labels[:-1], e.images)], tok.pad_token_id, proc.image_processor, 64)
    with torch.no_grad():
        p = batch_forward(m, b).logits[0, -1].softmax(-1)
    yes, no = p[yes_id].item(), p[no_id].item()
    stats[s.facts["answer"]].append(yes / (yes + no))
right = 0
for k, v in stats.items():
    v = torch.tensor(v)
    right += int(((v > 0.5) if k == "Yes" else (v <= 0.5)).sum())
    print(k, len(v), "mean P(yes)=%.3f" % v.mean(), "frac>0.5=%.2f" % (v > 0.5).float().mean())
print("verdict right: %d/%d" % (right, sum(len(v) for v in stats.values())))
