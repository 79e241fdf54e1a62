"""Prototype: can the target LM learn to copy random tokens (induction) in minutes on this CPU?
Sequences "<s>USER: x1..xk ASSISTANT: x1..xk</s>" with random vocabulary tokens; loss on the copy."""
import sys, time, torch
from transformers import LlavaForConditionalGeneration
from mmspec.train.pack import world_tokenizer_and_processor
from mmspec.train.recipe import bf16_autocast
torch.set_num_threads(2)
src, out, minutes = sys.argv[1], sys.argv[2], float(sys.argv[3])
tok, proc = world_tokenizer_and_processor(0)
m = LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
for p in m.parameters(): p.requires_grad_(False)
params = [p for n, p in m.named_parameters() if "language_model" in n or "lm_head" in n]
for p in params: p.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=float(sys.argv[4]) if len(sys.argv) > 4 else 5e-4, weight_decay=0.0)
g = torch.Generator().manual_seed(0)
user = tok("USER:", add_special_tokens=False)["input_ids"]; asst = tok(" ASSISTANT:", add_special_tokens=False)["input_ids"]
lo = 10  # skip specials / low ids
V = len(tok)
def batch(B=64):
    k = int(torch.randint(4, 25, (1,), generator=g))
    x = torch.randint(lo, V, (B, k), generator=g)
    pre = torch.tensor([[tok.bos_token_id] + user] * B)
    mid = torch.tensor([asst] * B)
    eos = torch.full((B, 1), tok.eos_token_id)
    ids = torch.cat([pre, x, mid, x, eos], 1)
    lab = ids.clone(); lab[:, : pre.shape[1] + k + mid.shape[1]] = -100
    return ids, lab
m.train(); t0 = time.time(); step = 0
while time.time() - t0 < minutes * 60:
    ids, lab = batch()
    with bf16_autocast("cpu", True):
        logits = m(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), lab[:, 1:], ignore_index=-100)
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); step += 1
    if step % 25 == 0:
        acc = ((logits[:, :-1].argmax(-1) == lab[:, 1:]) & (lab[:, 1:] != -100)).sum() / (lab[:, 1:] != -100).sum()
        print(f"step {step} t {time.time()-t0:.0f}s loss {loss.item():.3f} copy-acc {acc.item():.3f}", flush=True)
m.eval(); m.save_pretrained(out); proc.save_pretrained(out)
