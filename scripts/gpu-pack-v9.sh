#!/usr/bin/env bash
# One round of the v9 / v10 pack on one CUDA GPU (run twice on the lent H100 of 2026-11-22). First
# the vision tower learns to
# read with CLIP's objective (`mmspec train read --objective contrastive`, 2.5 min); then three jobs
# run side by side on that tower, frozen in all three: the target's projector + LM trained on; the
# draft (stage 1, 2, then pooled); the captioner (stage 1, 2). The target's flags are the v5 stage's
# (fact weight, family mix) plus copy practice; the draft's and captioner's are the CPU recipe's, with
# GPU batch sizes and minutes.
#
#   bash scripts/gpu-pack-v9.sh WORK_DIR INIT [TARGET_MINUTES]
#
# INIT: the target to start from (its projector and LM are kept and trained on). About 9 minutes on
# an H100 with 16 CPU cores; every stage is time-budgeted (--minutes).
set -euo pipefail
W=${1:?usage: gpu-pack-v9.sh WORK_DIR INIT [TARGET_MINUTES]}
INIT=${2:?usage: gpu-pack-v9.sh WORK_DIR INIT [TARGET_MINUTES]}
TM=${3:-4}
DEV=${DEVICE:-cuda}
M="python -m mmspec train"
mkdir -p "$W"

$M read --init "$INIT" --out "$W/read" --objective contrastive --lr 5e-4 --batch-size 256 --minutes 2.5 \
    --n-train-per-family 1500 --family-samples textvqa=30000 --family-samples chartqa=10000 --workers 14 \
    --device "$DEV" --eval-images 512 --seed 5 > "$W/read.log" 2>&1
T="$W/read"
COMMON=(--steps 100000000 --device "$DEV" --bf16 --seed 4)

target() {
    $M stage --init "$T" --trainable projector+lm --lr 5e-4 --minutes "$TM" --n-train-per-family 2500 \
        --family-samples chartqa=25000 --family-samples textvqa=25000 --family-samples hallusionbench=20000 \
        --family-samples vqav2=15000 --family-samples spot_the_diff=4000 --family-samples iedit=4000 \
        --family-samples pororosv=2500 --family-samples vist=2500 --caption-mix 0.5 --copy-mix 0.25 \
        --caption-view-prob 0.1 --fact-weight 4 --batch-size 128 --workers 7 --half --eval "${COMMON[@]}" \
        --out "$W/target"
}
draft() {
    $M stage --size draft --vision-from "$T" --trainable projector --lr 1e-3 --minutes 0.3 \
        --n-train-per-family 6000 --batch-size 64 --workers 3 "${COMMON[@]}" --out "$W/draft_s1"
    $M stage --init "$W/draft_s1" --trainable projector+lm --lr 1e-3 --minutes 3 --n-train-per-family 6000 \
        --batch-size 64 --text-view-prob 0.2 --caption-view-prob 0.1 --workers 3 --half --eval "${COMMON[@]}" \
        --out "$W/draft"
    $M stage --init "$W/draft" --trainable projector+lm --lr 3e-4 --minutes 0.7 --pooled-tokens 16 \
        --n-train-per-family 6000 --batch-size 64 --workers 3 --half --eval "${COMMON[@]}" --out "$W/draft_pooled"
}
captioner() {
    $M stage --size captioner --vision-from "$T" --captioner --trainable projector --lr 1e-3 --minutes 0.3 \
        --n-train-per-family 6000 --batch-size 64 --workers 2 "${COMMON[@]}" --out "$W/captioner_s1"
    $M stage --init "$W/captioner_s1" --captioner --trainable projector+lm --lr 1e-3 --minutes 3.5 \
        --n-train-per-family 6000 --batch-size 64 --workers 2 --half --eval "${COMMON[@]}" --out "$W/captioner"
}
target > "$W/target.log" 2>&1 & t=$!
draft > "$W/draft.log" 2>&1 & d=$!
captioner > "$W/captioner.log" 2>&1 & c=$!
wait "$t" && wait "$d" && wait "$c" || { echo "a job failed: see $W/*.log" >&2; exit 1; }
echo "done: $W/{target,draft,draft_pooled,captioner}"
