import sys, torch, collections
from transformers import LlavaForConditionalGeneration
from mmspec.train.pack import world_tokenizer_and_processor
from mmspec.train.data import Encoder, example_from_sample
from mmspec.train.recipe import greedy_answer
from mmspec.train.evaluate import states
from mmspec.world import generate_samples
torch.set_num_threads(2)
tok, proc = world_tokenizer_and_processor(0)
m = LlavaForConditionalGeneration.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
enc = Encoder(tok); hit = collections.Counter(); tot = collections.Counter()
for i, s in enumerate(generate_samples("chartqa", "test", int(sys.argv[2]))):
    ids = greedy_answer(m, enc, proc.image_processor, example_from_sample(s), max_new_tokens=128)
    text = tok.decode(ids, skip_special_tokens=True)
    for k, v in s.facts.items():
        tot[k] += 1; hit[k] += states(text, v)
    if i < 4: print(s.captions[0], "|", s.question, "\n  ->", text[:200])
print({k: f"{hit[k]}/{tot[k]}" for k in tot})
