#!/usr/bin/env bash
# $1: out name, $2: caption view prob, rest: extra flags
set -euo pipefail
NAME=$1; P=$2; shift 2
python -m mmspec train stage --init src/mmspec/assets/embedded/target --trainable projector+lm \
  --steps 100000000 --batch-size 32 --n-train-per-family 1000 \
  --family-samples chartqa=12000 --family-samples vqav2=2000 --family-samples hallusionbench=2000 \
  --family-samples textvqa=2000 --family-samples spot_the_diff=500 --family-samples iedit=500 \
  --family-samples pororosv=300 --family-samples vist=300 --caption-view-prob "$P" \
  --fact-weight 4 --answer-weight 4 \
  --workers 0 --threads 1 --no-bf16 --half --lr 2e-4 --minutes 35 --seed 81 --world-seed 81 \
  "$@" --out runs/v15/$NAME
