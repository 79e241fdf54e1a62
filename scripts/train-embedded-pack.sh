#!/usr/bin/env bash
# Reproduces the shipped embedded pack (src/mmspec/assets/embedded/) from nothing, with the exact
# stages and flags that made it (docs/embedded-models.md records times and hardware).
#
#   bash scripts/train-embedded-pack.sh OUT_DIR [THREADS]
#
# Steps 1-2 (the v5 target): about 5 h 30 min on a 2-core CPU. Steps 3-5: about 26 min on one H100
# GPU with 16 CPU cores (set DEVICE=cpu to run them on the CPU: same minutes, far fewer steps). Then
# copy OUT_DIR/{target,draft,draft_pooled,captioner}
# and OUT_DIR/pack_report.json over src/mmspec/assets/embedded/ (or point load_embedded(path=...)).
# Time-budgeted stages follow the clock, so a faster machine trains more steps in the same minutes.
set -euo pipefail
OUT=${1:?usage: train-embedded-pack.sh OUT_DIR [THREADS]}
T=${2:-2}
M="python -m mmspec train"
mkdir -p "$OUT"

# 1. the whole recipe once (tokenizer; target stage 0/1/2; first draft, pooled draft, captioner)
$M embedded --out "$OUT" --minutes-budget 36 --n-train-per-family 400 --threads "$T"

# 2. target: stage 2 continued, then everything (vision tower included) with caption examples mixed in
$M stage --init "$OUT/target" --trainable projector+lm --lr 5e-4 --steps 1000000 --minutes 12 \
    --n-train-per-family 1500 --batch-size 8 --threads "$T" --half --eval --out "$OUT/work/target_s2b"
$M stage --init "$OUT/work/target_s2b" --trainable all --lr 5e-4 --steps 1000000 --minutes 65 \
    --n-train-per-family 2500 --caption-mix 0.5 --batch-size 8 --threads "$T" --bf16 --half --eval \
    --out "$OUT/work/target_v2"

# 2b. target grown from 6 to 10 LM layers (exact at init) and trained on with the vision tower frozen
$M grow --init "$OUT/work/target_v2" --layers 10 --out "$OUT/work/target_grown" --half
$M stage --init "$OUT/work/target_grown" --trainable projector+lm --lr 5e-4 --steps 1000000 --minutes 75 \
    --n-train-per-family 4000 --caption-mix 0.5 --batch-size 8 --threads "$T" --bf16 --half --eval \
    --out "$OUT/work/target_v3"

# 2c. everything again (vision tower included), the task mix weighted toward the families whose facts
#     the target missed (chart labels, sign words, yes/no probes), with more caption examples
$M stage --init "$OUT/work/target_v3" --trainable all --lr 5e-4 --steps 1000000 --minutes 55 \
    --n-train-per-family 1500 --family-samples chartqa=6000 --family-samples textvqa=6000 \
    --family-samples hallusionbench=4000 --family-samples vqav2=3000 --family-samples pororosv=1000 \
    --family-samples vist=1000 --caption-mix 0.75 --batch-size 8 --threads "$T" --bf16 --half --eval \
    --out "$OUT/work/target_v4"

# 2d. projector + LM only (the vision tower stays target_v4's until step 4), the loss on
#     the answer tokens that state the image's facts weighted 4x; mix weighted toward charts and yes/no
#     probes (6,000 each), then signs (4,000) and object scenes (3,000)
$M stage --init "$OUT/work/target_v4" --trainable projector+lm --lr 3e-4 --steps 1000000 --minutes 70 \
    --n-train-per-family 1500 --family-samples chartqa=6000 --family-samples hallusionbench=6000 \
    --family-samples textvqa=4000 --family-samples vqav2=3000 --family-samples pororosv=1000 \
    --family-samples vist=1000 --caption-mix 0.5 --fact-weight 4 --batch-size 8 --threads "$T" --bf16 --half \
    --eval --out "$OUT/work/target_v5"

# --- From here on a CUDA GPU: the lent H100 of 2026-11-22 (DEVICE=cpu runs it on the CPU, where the
# --- same minutes train far fewer steps). Each stage is time-budgeted, as above.
# 3. v8: copy practice for the LM, then 4.5 min of world training; of the two branches it trains side
#    by side, the projector + LM one is kept (the vision tower is the v4 one still)
bash scripts/gpu-target-v8.sh "$OUT/work/v8" "$OUT/work/target_v5"

# 4. v9: the vision tower learns to read with CLIP's objective (contrastive, 2.5 min); then, side by
#    side on the new tower: the target's projector + LM (4 min), a new draft + pooled draft, a new captioner
bash scripts/gpu-pack-v9.sh "$OUT/work/v9" "$OUT/work/v8/target_v8_lm" 4

# 5. v10: step 4 again from the v9 target (target 3.5 min); this is the shipped pack
bash scripts/gpu-pack-v9.sh "$OUT/work/v10" "$OUT/work/v9/target" 3.5

for role in target draft draft_pooled captioner; do
    rm -rf "${OUT:?}/$role" && cp -r "$OUT/work/v10/$role" "$OUT/$role"
done
echo "pack in $OUT"
