#!/usr/bin/env bash
# The v12 target trained on the colour-reading world (branch colour-reading, worktree /work/wt-colour).
# $1: out name, $2: minutes, $3: threads, rest: extra flags
set -euo pipefail
NAME=$1; MIN=$2; T=$3; shift 3
cd /work/wt-colour  # a worktree of branch colour-reading: git worktree add /work/wt-colour colour-reading
PYTHONPATH=/work/wt-colour/src python -m mmspec train stage --init src/mmspec/assets/embedded/target --trainable projector+lm \
  --steps 100000000 --batch-size 32 --n-train-per-family 1000 \
  --family-samples chartqa=10000 --family-samples vqav2=3000 --family-samples hallusionbench=3000 \
  --family-samples textvqa=3000 --family-samples spot_the_diff=1500 --family-samples iedit=1500 \
  --family-samples pororosv=500 --family-samples vist=500 --caption-view-prob 0.3 \
  --fact-weight 4 --cue-weight 4 \
  --workers 0 --threads "$T" --no-bf16 --half --lr 2e-4 --minutes "$MIN" --seed 91 --world-seed 91 \
  "$@" --out /work/main/runs/v15/$NAME
