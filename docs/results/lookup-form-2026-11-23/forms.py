"""Which part of the world's chart reading keeps a small LM from learning a lookup?

    THREADS=1 [OUT=DIR] python forms.py FORM MINUTES [INIT] [SEED]   (INIT "" or absent: the shipped target;
                                                                     OUT: save the trained model there)

Text-only lookup practice in one of eight forms, learning curve printed as it goes (held-out
share of the asked value's tokens predicted right, teacher-forced, 256 examples; every 50 steps).
Every form has 3-4 pairs with the asked one anywhere (position cannot stand in for the match)
and distinct values. The first four share the question and answer frame ("What goes with k?
... k goes with v."); the last four use the chart answer's frames:

  pw       Pairs: k1 v1, k2 v2 and k3 v3.       random one-token vocabulary words (the form
                                                 `train copy` taught to 100% in 14 minutes)
  pw_is    Pairs: k1 is v1, k2 is v2 and k3 is v3.   the same words, "is" between key and value
  lab      Pairs: egg 4, cup 7 and box 8.        the 12 chart labels and the values 1-10
  lab_is   Pairs: egg is 4, cup is 7 and box is 8.   labels, values and "is": a chart reading
  world    the chart reading in the world's own words, in the answer, then the world's frame:
           "USER: Reading: egg is 4, cup is 7 and box is 8. What is the value of cup?
            ASSISTANT: The chart has 3 bars: egg is 4, cup is 7 and box is 8. So the value of
            cup is 7."  (the reading is copied from the prompt, positional copying the target
            already does; the lookup is the last number)
  world_adj  the same with the value right after its label, in the reading and in the frame:
           "... The chart has 3 bars: egg 4, cup 7 and box 8. So the asked bar is cup 7."
  answer_adj world_adj without the reading in the prompt ("USER: What is the value of cup?
           ASSISTANT: ..."): the reading stands only in the answer, unpredictable, as in the
           world's answers with the image taken away
  adj_frame  world_adj's adjacent reading with world's frame: "... egg 4, cup 7 and box 8. So
           the value of cup is 7." (the token before the value, "is", is not in the reading)

Plain AdamW at a constant learning rate after 20 warm-up steps, batch 64, one seed.
"""
import os
import random
import sys
import time

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import default_path
from mmspec.train.data import Encoder, Example, batch_stream, collate, word_pool
from mmspec.train.recipe import batch_forward, batch_loss
from mmspec.world.single import CHART_LABELS

FORMS = ("pw", "pw_is", "lab", "lab_is", "world", "world_adj", "answer_adj", "adj_frame")
# the chart-answer forms: (the reading in the prompt as well as the answer, the frame before the value)
CHART_FORMS = {"world": (True, "So the value of {k} is"), "world_adj": (True, "So the asked bar is {k}"),
               "answer_adj": (False, "So the asked bar is {k}"), "adj_frame": (True, "So the value of {k} is")}


def example(form: str, rng: random.Random, pool: list[str]) -> Example:
    m = rng.choice((3, 4))
    if form.startswith("pw"):
        words = rng.sample(pool, 2 * m)
        keys, values = words[:m], words[m:]
    else:
        keys, values = rng.sample(CHART_LABELS, m), [str(v) for v in rng.sample(range(1, 11), m)]
    q = rng.randrange(m)
    sep = " is " if form.endswith("_is") or form == "world" else " "  # *_adj, adj_frame, pw, lab: adjacent
    items = [f"{k}{sep}{v}" for k, v in zip(keys, values)]
    listing = ", ".join(items[:-1]) + " and " + items[-1]
    if form in CHART_FORMS:
        in_prompt, frame = CHART_FORMS[form]
        reading = f"Reading: {listing}. " if in_prompt else ""
        return Example(f"USER: {reading}What is the value of {keys[q]}? ASSISTANT:",
                       f"The chart has {m} bars: {listing}. {frame.format(k=keys[q])} {values[q]}.",
                       (), (), form, (values[q],))
    return Example(f"USER: Pairs: {listing}. What goes with {keys[q]}? ASSISTANT:",
                   f"{keys[q]} goes with {values[q]}.", (), (), form, (values[q],))


@torch.no_grad()
def value_accuracy(model, tok, image_processor, held: list[Example]) -> float:
    """Share of held-out examples whose last value (the looked-up one, before "." and eos) is
    predicted right in all its tokens, teacher-forced."""
    model.eval()
    enc = Encoder(tok)
    right = 0
    for i in range(0, len(held), 64):
        chunk = [enc.encode(ex) for ex in held[i:i + 64]]
        batch = collate(chunk, tok.pad_token_id, image_processor, 64)
        pred = batch_forward(model, batch).logits.argmax(-1)  # [B, T]: pred[t] guesses token t+1
        for b, (e, ex) in enumerate(zip(chunk, held[i:i + 64])):
            want = tok(" " + ex.facts[0], add_special_tokens=False)["input_ids"]
            at = len(e.input_ids) - 2 - len(want)  # the value's first token ("." and eos follow)
            assert list(e.input_ids[at:at + len(want)]) == want, (ex.answer, e.input_ids[-6:], want)
            right += all(int(pred[b, at - 1 + j]) == want[j] for j in range(len(want)))
    return right / len(held)


def main() -> None:
    form, minutes = sys.argv[1], float(sys.argv[2])
    init = (sys.argv[3] if len(sys.argv) > 3 else "") or str(default_path() / "target")
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    assert form in FORMS, form
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(init)
    tok = processor.tokenizer
    pool = [w for w in word_pool(tok) if w.lower() not in {"is", "and", "goes", "with", "what", "pairs"}]
    rng, held_rng = random.Random(seed), random.Random(seed + 1000)
    train = [example(form, rng, pool) for _ in range(50000)]
    held = [example(form, held_rng, pool) for _ in range(256)]
    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    stream = batch_stream(train, Encoder(tok), processor.image_processor, 64, torch.Generator().manual_seed(seed))
    params = [p for n, p in model.named_parameters() if "vision_tower" not in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    print(f"$ forms.py {form} {minutes} {init} {seed}   e.g. {held[0].prompt!r} -> {held[0].answer!r}", flush=True)
    print(f"{form} step 0 held-out {value_accuracy(model, tok, processor.image_processor, held):.1%}", flush=True)
    start, step, losses = time.time(), 0, []
    while time.time() - start < 60 * minutes:
        model.train()
        loss = batch_loss(model, next(stream), train_vision=False)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        losses.append(loss.item())
        if step % 50 == 0:
            acc = value_accuracy(model, tok, processor.image_processor, held)
            print(f"{form} step {step} ({step * 64} examples, {time.time() - start:.0f}s) loss "
                  f"{sum(losses) / len(losses):.3f} held-out {acc:.1%}", flush=True)
            losses = []
    if os.environ.get("OUT"):  # keep the trained model for probes (../induction-2026-11-23/induct.py adjacent)
        model.save_pretrained(os.environ["OUT"])
        processor.save_pretrained(os.environ["OUT"])


if __name__ == "__main__":
    main()
