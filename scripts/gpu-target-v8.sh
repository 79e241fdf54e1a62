#!/usr/bin/env bash
# The v8 target experiment on one CUDA GPU (run on the lent H100 of 2026-11-22): copy practice for the
# shipped target's LM, then two world stages side by side on the same GPU (the models are too small to
# fill it), one training everything (vision tower included) and one the projector and LM only.
#
#   bash scripts/gpu-target-v8.sh WORK_DIR [INIT]
#
# INIT defaults to the shipped target. About 9 minutes on an H100 with 16 CPU cores. Every stage is
# time-budgeted (--minutes), so a slower machine trains fewer steps in the same time.
set -euo pipefail
W=${1:?usage: gpu-target-v8.sh WORK_DIR [INIT]}
INIT=${2:-src/mmspec/assets/embedded/target}
M="python -m mmspec train"
DEV=${DEVICE:-cuda}
mkdir -p "$W"

# 1. copy practice (text only): copy alone until the copying phase change, then lookups and lists
$M copy --init "$INIT" --out "$W/copy1" --lr 5e-4 --batch-size 64 --lookup-share 0 --minutes 0.7 \
    --device "$DEV" --seed 0
$M copy --init "$W/copy1" --out "$W/copy2" --lr 3e-4 --batch-size 64 --lookup-share 0.2 --list-share 0.5 \
    --minutes 0.5 --device "$DEV" --seed 1

# 2. the world, 4.5 minutes, 98,000 samples (v5's mix scaled up 4x), captions, copy practice and the
#    caption view mixed in, fact-weighted loss; everything vs projector + LM, side by side
MIX=(--n-train-per-family 2500 --family-samples chartqa=25000 --family-samples textvqa=25000
     --family-samples hallusionbench=20000 --family-samples vqav2=15000 --family-samples spot_the_diff=4000
     --family-samples iedit=4000 --family-samples pororosv=2500 --family-samples vist=2500
     --caption-mix 0.75 --copy-mix 0.25 --caption-view-prob 0.1 --fact-weight 4)
run_world() {  # NAME TRAINABLE
    $M stage --init "$W/copy2" --trainable "$2" --lr 5e-4 --steps 100000000 --minutes 4.5 "${MIX[@]}" \
        --batch-size 64 --workers 6 --device "$DEV" --bf16 --half --eval --seed 2 --out "$W/$1"
}
run_world target_v8_all all > "$W/all.log" 2>&1 & a=$!
run_world target_v8_lm projector+lm > "$W/lm.log" 2>&1 & l=$!
wait "$a" && wait "$l" || { echo "a job failed: see $W/*.log" >&2; exit 1; }
echo "done: $W/target_v8_all $W/target_v8_lm"
