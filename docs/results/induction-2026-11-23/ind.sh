#!/usr/bin/env bash
# A target trained on a world with world.patch applied (this session: a worktree of branch
# induction-reading at /work/wt-ind, made from main at f181029 with `git am world.patch`).
# $1: out name, $2: minutes, $3: threads, rest: extra flags. INIT: the model to start from
# (default the shipped target), WT: the worktree whose world trains it (default /work/wt-ind),
# OUT: where under the main checkout the model goes (default runs/v16). Run from the main
# checkout's root. ../colour-reading-2026-11-23/colour.sh is this recipe on that session's world.
#   git worktree add -b induction-reading /work/wt-ind f181029 && git -C /work/wt-ind am "$PWD/docs/results/induction-2026-11-23/world.patch"
set -euo pipefail
NAME=$1; MIN=$2; T=$3; shift 3
MAIN=$(pwd)
WT=${WT:-/work/wt-ind}
cd "$WT"
PYTHONPATH="$WT/src" python -m mmspec train stage --init "${INIT:-src/mmspec/assets/embedded/target}" --trainable projector+lm \
  --steps 100000000 --batch-size 32 --n-train-per-family 1000 \
  --family-samples chartqa=10000 --family-samples vqav2=3000 --family-samples hallusionbench=3000 \
  --family-samples textvqa=3000 --family-samples spot_the_diff=1500 --family-samples iedit=1500 \
  --family-samples pororosv=500 --family-samples vist=500 --caption-view-prob 0.3 \
  --fact-weight 4 --cue-weight 4 \
  --workers 0 --threads "$T" --no-bf16 --half --lr 2e-4 --minutes "$MIN" --seed 91 --world-seed 91 \
  "$@" --out "$MAIN/${OUT:-runs/v16}/$NAME"
