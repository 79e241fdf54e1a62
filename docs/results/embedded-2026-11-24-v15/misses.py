"""Why a target misses vqav2 questions: reading or lookup.

    python docs/results/embedded-2026-11-24-v15/misses.py MODEL_DIR [N]

Greedy answers (128 new tokens, multimodal) to the place-of-an-object questions among the first
N vqav2 test questions (default 400) and to the first 150 count questions among them. A missed
place question counts as a *lookup* miss when the answer's listing (all but its final sentence)
names the asked object at its true place ("blue cross top left") and the final sentence then
names another place; otherwise as a *reading* miss. A missed count question counts as a reading
miss when its listing differs from the reference answer's, else as a counting miss. Two threads.
"""
import re
import sys
from collections import Counter

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.data import Encoder
from mmspec.train.evaluate import answers_question, final_sentence, model_answers
from mmspec.world import generate_samples


def listing(text: str) -> str:
    """The answer without its final sentence and its head ("I can see 3 shapes ...: ")."""
    body = text[: len(text) - len(final_sentence(text))].strip().rstrip(".")
    return re.split(r": | I find ", body, maxsplit=1)[-1].strip().lower()


def main() -> None:
    torch.set_num_threads(2)
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    samples = list(generate_samples("vqav2", "test", n))
    places = [s for s in samples if next(iter(s.facts)) == "position"]
    counts = [s for s in samples if next(iter(s.facts)) == "count"][:150]
    tally = Counter()
    for s, text in model_answers(model, Encoder(proc.tokenizer), proc.image_processor, places + counts):
        kind = next(iter(s.facts))
        if answers_question(s, text):
            tally[kind, "right"] += 1
        elif kind == "position":
            name = re.search(r"the (\w+ \w+)\?", s.question).group(1)
            listed = f"{name} {s.facts['position']}" in text[: len(text) - len(final_sentence(text))]
            tally[kind, "lookup miss (listed right)" if listed else "reading miss"] += 1
        else:
            same = listing(text) == listing(s.answer)
            tally[kind, "counting miss (same listing)" if same else "reading miss (listing differs)"] += 1
    print(f"{path}: first {n} vqav2 test questions")
    for (kind, what), k in sorted(tally.items()):
        print(f"  {kind:8s} {what}: {k}")


if __name__ == "__main__":
    main()
