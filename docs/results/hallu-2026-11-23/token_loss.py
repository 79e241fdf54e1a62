"""Per-token loss (nats) of a model on the first three existence answers among the hallusionbench
test samples, in one view: which answer tokens it has learned and which it guesses.

    python token_loss.py MODEL_DIR multimodal|caption
"""
import sys, torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from mmspec.world import generate_samples
from mmspec.train.data import Encoder, example_from_sample, collate
from mmspec.train.recipe import batch_forward
torch.set_num_threads(1)
path, view = sys.argv[1], sys.argv[2]
m = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
proc = AutoProcessor.from_pretrained(path); tok = proc.tokenizer
enc = Encoder(tok)
for s in [x for x in generate_samples('hallusionbench', 'test', 12) if 'count' not in x.facts][:3]:
    e = enc.encode(example_from_sample(s), view)
    b = collate([e], tok.pad_token_id, proc.image_processor, 64)
    with torch.no_grad():
        lp = batch_forward(m, b).logits[0].log_softmax(-1)
    ids = b["input_ids"][0] if isinstance(b, dict) else b.input_ids[0]
    start = [i for i, l in enumerate(e.labels) if l != -100][0]
    print(' '.join(f"{tok.decode([int(ids[i])])!r}:{-lp[i-1, ids[i]].item():.2f}" for i in range(start, len(ids))))
