#!/usr/bin/env bash
# $1: out name, rest: weighting flags
set -euo pipefail
NAME=$1; shift
python -m mmspec train stage --init src/mmspec/assets/embedded/target --trainable projector+lm \
  --steps 100000000 --batch-size 32 --n-train-per-family 1500 \
  --family-samples chartqa=6000 --family-samples vqav2=4000 --family-samples hallusionbench=4000 \
  --family-samples textvqa=3000 --family-samples spot_the_diff=1500 --family-samples iedit=1500 \
  --family-samples pororosv=500 --family-samples vist=500 --caption-view-prob 0.3 \
  --workers 0 --threads 1 --no-bf16 --half --lr 2e-4 --minutes 50 --seed 71 --world-seed 71 \
  "$@" --out runs/v14/$NAME
