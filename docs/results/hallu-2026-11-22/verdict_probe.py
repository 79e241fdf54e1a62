"""Does a target tell yes from no at the point where its existence answer decides?

For the existence questions among the first N hallusionbench test samples, the reference answer
is teacher-forced up to the end of its scene sentence ("The picture contains a red diamond in the
top left."). It then reads the probability of the yes branch, P(" The") + P(" One"), against
the no branch, P(" There"), renormalised over the three. A target that compares the asked object
with the listed ones puts this high for yes questions and low for no questions.

    python verdict_probe.py MODEL_DIR [N=200] [multimodal|caption]
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
stats = {"Yes": [], "No": []}
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
    stats[s.facts["answer"]].append(yes / (yes + no))
for k, v in stats.items():
    v = torch.tensor(v)
    print(k, len(v), "mean P(yes-branch)=%.3f" % v.mean(), "frac>0.5=%.2f" % (v > 0.5).float().mean(), "frac>0.33=%.2f" % (v > 1/3).float().mean())
