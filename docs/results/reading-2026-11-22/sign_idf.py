"""Diagnostic: the reading objective with idf-weighted bags, on signs only, from the shipped tower.
Sign-word accuracy = the word's token scores highest among the 40 sign words (300 test signs)."""
import math, sys, torch, itertools
from transformers import LlavaForConditionalGeneration
from mmspec.train.pack import world_tokenizer_and_processor
from mmspec.train.reading import ReadingHead, caption_bags, image_caption_stream, _pixels
from mmspec.train.pooling import vision_patch_features
from mmspec.world import make_sample, single
torch.set_num_threads(2); torch.manual_seed(0)
tok, proc = world_tokenizer_and_processor(0)
m = LlavaForConditionalGeneration.from_pretrained("src/mmspec/assets/embedded/target", dtype=torch.float32)
V = len(tok); head = ReadingHead.for_model(m, V)
# idf over 2,000 train captions of the stream's mix
stream = image_caption_stream("train", {"textvqa": 100000}, 64, 0)
df = torch.zeros(V); n = 0
for imgs, caps in itertools.islice(image_caption_stream("train", {"textvqa": 100000}, 64, 1), 30):
    df += caption_bags(tok, caps, V).sum(0); n += len(caps)
idf = torch.log((n + 1) / (df + 1))  # [V]
word_ids = torch.tensor([tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in single.SIGN_WORDS])
te = [make_sample("textvqa", "test", i) for i in range(300)]
y = torch.tensor([single.SIGN_WORDS.index(s.facts["word"]) for s in te])
pv_te = proc.image_processor([s.images[0] for s in te], return_tensors="pt")["pixel_values"]
params = list(m.model.vision_tower.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
for step in range(1, int(sys.argv[1]) + 1):
    imgs, caps = next(stream)
    bags = caption_bags(tok, caps, V) * idf  # idf-weighted bag
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = torch.log_softmax(head(vision_patch_features(m, _pixels(proc.image_processor, imgs, "cpu"))), -1)
    loss = -((bags / bags.sum(-1, keepdim=True)) * logp).sum(-1).mean()
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
    if step % 150 == 0:
        with torch.no_grad():
            acc = (head(vision_patch_features(m, pv_te))[:, word_ids].argmax(1) == y).float().mean().item()
        print(f"step {step} loss {loss.item():.3f} sign word acc {acc:.3f}", flush=True)
