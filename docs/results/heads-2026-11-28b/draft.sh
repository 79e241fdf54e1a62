#!/bin/bash
set -e
FS="--n-train-per-family 0 --family-samples chartqa=1500 --family-samples spot_the_diff=1500"
taskset -c 0,1 mmspec train stage --size draft --vision-from src/mmspec/assets/embedded/target --trainable projector \
  --lr 1e-3 --minutes 1 --batch-size 8 $FS --threads 2 --out runs/s54/draft-s1
taskset -c 0,1 mmspec train stage --init runs/s54/draft-s1 --trainable projector+lm --lr 1e-3 --minutes 19 \
  --batch-size 8 $FS --answers runs/s54/answers.jsonl --text-view-prob 0.2 --caption-view-prob 0.1 --half \
  --threads 2 --out runs/s54/draft
