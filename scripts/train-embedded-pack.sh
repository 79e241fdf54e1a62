#!/usr/bin/env bash
# Reproduces the shipped embedded pack (src/mmspec/assets/embedded/) from nothing, with the exact
# stages and flags that made it (docs/embedded-models.md records times and hardware).
#
#   bash scripts/train-embedded-pack.sh OUT_DIR [THREADS]
#
# About 5 h 50 min on a 2-core CPU. Then copy OUT_DIR/{target,draft,draft_pooled,captioner}
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

# 2d. projector + LM only (the vision tower stays target_v4's, which steps 3-5 train on), the loss on
#     the answer tokens that state the image's facts weighted 4x; mix weighted toward charts and yes/no
#     probes (6,000 each), then signs (4,000) and object scenes (3,000)
$M stage --init "$OUT/work/target_v4" --trainable projector+lm --lr 3e-4 --steps 1000000 --minutes 70 \
    --n-train-per-family 1500 --family-samples chartqa=6000 --family-samples hallusionbench=6000 \
    --family-samples textvqa=4000 --family-samples vqav2=3000 --family-samples pororosv=1000 \
    --family-samples vist=1000 --caption-mix 0.5 --fact-weight 4 --batch-size 8 --threads "$T" --bf16 --half \
    --eval --out "$OUT/work/target_v5"

# 3. draft (1 layer x 192) on the final target's frozen vision tower; 20% text view, 10% caption view
$M stage --size draft --vision-from "$OUT/work/target_v4" --trainable projector --lr 1e-3 --steps 1000000 \
    --minutes 1 --n-train-per-family 1500 --batch-size 8 --threads "$T" --out "$OUT/work/draft_s1"
$M stage --init "$OUT/work/draft_s1" --trainable projector+lm --lr 1e-3 --steps 1000000 --minutes 9 \
    --n-train-per-family 1500 --batch-size 8 --text-view-prob 0.2 --caption-view-prob 0.1 \
    --threads "$T" --half --eval --out "$OUT/work/draft"

# 4. pooled draft (16 tokens per image) fine-tuned from the draft
$M stage --init "$OUT/work/draft" --trainable projector+lm --lr 3e-4 --steps 1000000 --minutes 2 \
    --pooled-tokens 16 --n-train-per-family 1500 --batch-size 8 --threads "$T" --half --eval \
    --out "$OUT/work/draft_pooled"

# 5. captioner (LM 3 x 128) on the same tower
$M stage --size captioner --vision-from "$OUT/work/target_v4" --captioner --trainable projector --lr 1e-3 \
    --steps 1000000 --minutes 0.5 --n-train-per-family 1500 --batch-size 16 --threads "$T" \
    --out "$OUT/work/captioner_s1"
$M stage --init "$OUT/work/captioner_s1" --captioner --trainable projector+lm --lr 1e-3 --steps 1000000 \
    --minutes 4 --n-train-per-family 1500 --batch-size 16 --threads "$T" --half --eval --out "$OUT/work/captioner"

for role in target draft draft_pooled captioner; do
    src="$OUT/work/$role"; [ "$role" = target ] && src="$OUT/work/target_v5"
    rm -rf "${OUT:?}/$role" && cp -r "$src" "$OUT/$role"
done
echo "pack in $OUT"
