"""Does a target's LM copy a sequence it has seen? The classic induction test, two ways.

    python repeat.py MODEL_DIR      (MODEL_DIR "": the shipped target)

* raw: bos + 16 rows of L random token ids (ids >= 100) + the same L ids again; the share of the
  second copy's tokens the argmax predicts (after its first token). Chance is about 0.1%.
* templated: ``USER: Repeat: w1 ... wL ASSISTANT: w1 ... wL`` with whole-word tokens
  (`mmspec.train.data.word_pool`), the form of `mmspec train copy`'s practice: the share of the
  answer's words predicted.
"""
import sys

import torch
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import word_pool

torch.set_num_threads(1)
path = sys.argv[1] or str(default_path() / "target")
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
vocab = model.config.text_config.vocab_size
g = torch.Generator().manual_seed(0)
print(f"$ repeat.py {sys.argv[1]!r}")
for n in (10, 30):
    seq = torch.randint(100, vocab, (16, n), generator=g)  # [16, n]
    ids = torch.cat([torch.full((16, 1), tok.bos_token_id), seq, seq], 1)  # [16, 1 + 2n]
    with torch.no_grad():
        pred = model(input_ids=ids).logits[:, :-1].argmax(-1)  # [16, 2n]: guesses for ids[:, 1:]
    second = (pred[:, n + 1:] == ids[:, n + 2:]).float().mean().item()
    pool = word_pool(tok)
    right = total = 0
    for row in range(16):
        words = [pool[int(i) % len(pool)] for i in torch.randint(0, 10**6, (n,), generator=g)]
        text = " ".join(words)
        prompt = tok(f"USER: Repeat: {text} ASSISTANT:")["input_ids"]
        answer = tok(" " + text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([prompt + answer])
        with torch.no_grad():
            p = model(input_ids=x).logits[0, len(prompt) - 1:-1].argmax(-1)  # guesses for the answer
        right += int((p == torch.tensor(answer)).sum())
        total += len(answer)
    print(f"L={n}: raw second copy {second:.0%}, templated 'Repeat:' answer {right / total:.0%}")
