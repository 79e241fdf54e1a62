"""Quick test-split fact recall of a target dir on the single-image families (not the official figure)."""
import json, sys, torch
from transformers import LlavaForConditionalGeneration
from mmspec.train.pack import world_tokenizer_and_processor
from mmspec.train.data import Encoder
from mmspec.train.recipe import fact_recall
from mmspec.world import generate_samples
torch.set_num_threads(2)
path, n = sys.argv[1], int(sys.argv[2])
tok, proc = world_tokenizer_and_processor(0)
m = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
out = {}
for fam in ["chartqa", "textvqa", "vqav2", "hallusionbench"]:
    r = fact_recall(m, Encoder(tok), proc.image_processor, list(generate_samples(fam, "test", n)), max_new_tokens=128)
    out[fam] = r["recall"]; print(fam, round(r["recall"], 3), flush=True)
print(json.dumps(out))
