"""Which hallusionbench verdicts go wrong, from a benchmark run's baseline rows (the target's answers).

    python docs/results/facts-2026-11-23/binding.py docs/results/embedded-2026-11-23-v13

Existence questions ("Can you see a red diamond?") whose answer is No are split by what the
scene shares with the asked object: its colour only, its shape only, both on different objects,
or neither; count questions ("Are there exactly 2 diamonds?") are one group. Reads
results.rank*.jsonl[.gz]; the truth comes from regenerating each world sample.
"""
import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

from mmspec.train.evaluate import _sample_index, verdict
from mmspec.world import make_sample

run = Path(sys.argv[1])
rows = []
for f in sorted(run.glob("results.rank*.jsonl*")):
    with (gzip.open if f.suffix == ".gz" else open)(f, "rt") as fh:
        rows += [r for r in map(json.loads, fh) if r.get("kind") == "baseline" and r["dataset"] == "hallusionbench"]
groups: Counter = Counter()
for row in rows:
    s = make_sample(*_sample_index(row["uid"]))
    truth, said = s.facts["answer"], verdict(row["text"])
    if re.search(r"(?:exactly|show) \d", s.question):
        group = "count question"
    else:
        colour, shape = re.search(r"an? (\w+) (\w+)(?: in (?:the image|this picture))?\?$", s.question).groups()
        scene = s.captions[0]
        if truth == "Yes":
            group = "exists: Yes"
        else:
            shares = [w for w, hit in (("colour", f" {colour} " in f" {scene} "), ("shape", f" {shape}" in scene)) if hit]
            group = "exists: No, scene shares " + (" and ".join(shares) or "neither")
    groups[(group, truth, said == truth)] += 1
print(f"{len(rows)} hallusionbench answers in {run}")
print("| questions | truth | right | wrong |\n|---|---|---|---|")
for g, t in sorted({(g, t) for g, t, _ in groups}):
    print(f"| {g} | {t} | {groups[(g, t, True)]} | {groups[(g, t, False)]} |")
