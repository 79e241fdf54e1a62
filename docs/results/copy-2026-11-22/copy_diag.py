"""Does the LM use the caption? Per-token loss of the answer's fact tokens with the true caption vs a
caption from another sample (caption view)."""
import sys, torch
from transformers import LlavaForConditionalGeneration
from mmspec.train.pack import world_tokenizer_and_processor
from mmspec.train.data import Encoder, Example, example_from_sample
from mmspec.world import generate_samples
torch.set_num_threads(2)
tok, _ = world_tokenizer_and_processor(0); enc = Encoder(tok, fact_weight=2.0)
m = LlavaForConditionalGeneration.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
for fam in ["textvqa", "chartqa", "hallusionbench"]:
    ss = list(generate_samples(fam, "test", 40))
    res = {"true": [0, 0, 0], "other": [0, 0, 0]}
    for i, s in enumerate(ss):
        ex = example_from_sample(s)
        for name, caps in (("true", ex.captions), ("other", ss[(i + 1) % len(ss)].captions)):
            e = enc.encode(Example(ex.prompt, ex.answer, ex.images, caps, fam, ex.facts), "caption")
            ids = torch.tensor([e.input_ids]); lab = torch.tensor([e.labels]); w = torch.tensor([e.weights or [1.0] * len(e.labels)])
            with torch.no_grad():
                lg = m(input_ids=ids).logits[0, :-1]
            ce = torch.nn.functional.cross_entropy(lg, lab[0, 1:], ignore_index=-100, reduction="none")
            fact = (w[0, 1:] > 1.5)
            res[name][0] += float(ce[fact].sum()); res[name][1] += int(fact.sum()); res[name][2] += float(ce[lab[0, 1:] != -100].mean())
    for k, (a, b, c) in res.items():
        print(fam, k, "fact-token CE %.3f" % (a / max(b, 1)), "mean answer CE %.3f" % (c / 40))
