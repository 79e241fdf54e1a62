"""The old decision point, split by what the scene holds (needs the world before commit dc8c5f3:
`git checkout f83ec2c -- src/mmspec/world` or a worktree at f83ec2c).

docs/results/hallu-2026-11-22/verdict_probe.py (teacher-force the reference answer up to its scene
sentence, read P(" The") + P(" One") against P(" There")), with the existence questions grouped by
(true answer, asked colour in the scene sentence, asked shape in it). A model that used the question
at all would at least put No-questions whose colour or shape is absent from the scene below the rest.

    python old_probe_by_scene.py MODEL_DIR [N=200] [multimodal|caption]
"""
import sys, torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from mmspec.world import generate_samples
from mmspec.train.data import Encoder, Example, example_from_sample, collate
from mmspec.train.recipe import batch_forward
path = sys.argv[1]
view = sys.argv[3] if len(sys.argv) > 3 else "multimodal"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
torch.set_num_threads(2)
m = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
proc = AutoProcessor.from_pretrained(path)
tok = proc.tokenizer
enc = Encoder(tok)
ids = {w: tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("There", "The", "One")}
stats = {"Yes": [], "No": []}; info = []
for s in generate_samples("hallusionbench", "test", n):
    if "count" in s.facts:
        continue
    ex = example_from_sample(s)
    scene_end = ex.answer.index(". ") + 1  # end of the scene sentence
    e = enc.encode(Example(ex.prompt, ex.answer[:scene_end], ex.images, ex.captions, ex.family), view)
    ids_ = e.input_ids[:-1]  # drop eos: next token after the scene sentence
    b = collate([type(e)(ids_, e.labels[:-1], e.images)], tok.pad_token_id, proc.image_processor, 64)
    with torch.no_grad():
        p = batch_forward(m, b).logits[0, -1].softmax(-1)
    yes = (p[ids["The"]] + p[ids["One"]]).item(); no = p[ids["There"]].item()
    stats[s.facts["answer"]].append(yes / (yes + no)); info.append((s.facts["answer"], ex.prompt, ex.answer, yes / (yes + no)))
for k, v in stats.items():
    v = torch.tensor(v)
    print(k, len(v), "mean P(yes-branch)=%.3f" % v.mean(), "frac>0.5=%.2f" % (v > 0.5).float().mean(), "frac>0.33=%.2f" % (v > 1/3).float().mean())
import re
groups = {}
for ans, prompt, answer, p in info:
    m = re.search(r"(?:there an?|contain an?|see an?) (\w+) (\w+)", prompt)
    if m is None: print("NOMATCH", prompt[-80:]); continue
    c, sh = m.group(1), m.group(2)
    scene = answer[:answer.index(". ")]
    key = (ans, c in scene, sh in scene)
    groups.setdefault(key, []).append(p)
for k in sorted(groups):
    print(k, len(groups[k]), "%.3f" % (sum(groups[k]) / len(groups[k])))
