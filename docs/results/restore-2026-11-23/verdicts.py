"""Hallusionbench yes/no verdicts in a benchmark run's baseline rows, split into existence and count
questions: (kind, the reference's verdict, the target's verdict) -> questions.

    python docs/results/restore-2026-11-23/verdicts.py RUN_DIR   # e.g. docs/results/embedded-2026-11-23-v12
"""
import collections
import gzip
import json
import re
import sys
from pathlib import Path

from mmspec.train.evaluate import verdict

run = Path(sys.argv[1])
files = sorted(run.glob("results.rank*.jsonl*"))
if not files:
    sys.exit(f"{run} has no results.rank*.jsonl[.gz]: pass a `mmspec bench run` output directory")
tally = collections.Counter()
for path in files:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as lines:
        for row in map(json.loads, lines):
            if row["kind"] == "baseline" and row["dataset"] == "hallusionbench":
                existence = re.search(r"(Looking for|Checking for|Searching the image for) an? ", row["reference"])
                kind = "existence" if existence else "count"
                tally[(kind, verdict(row["reference"]), verdict(row["text"]))] += 1
for key in sorted(tally):
    print(*key, tally[key])
