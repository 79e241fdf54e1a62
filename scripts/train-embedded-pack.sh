#!/usr/bin/env bash
# Reproduces the shipped embedded pack (src/mmspec/assets/embedded/) from nothing, with the exact
# stages and flags that made it (docs/embedded-models.md records times and hardware).
#
#   bash scripts/train-embedded-pack.sh OUT_DIR [THREADS]
#
# Steps 1-2 (the v5 target): about 5 h 30 min on a 2-core CPU. Steps 3-5: about 26 min on one H100
# GPU with 16 CPU cores (set DEVICE=cpu to run them on the CPU: same minutes, far fewer steps).
# Steps 6-7: about 37 + 35 min on the 2-core CPU. Step 8: about 10 min on one H100. Steps 9-12:
# about 85 + 20 + 35 + 20 min on the 2-core CPU. Then point
# load_embedded(path=OUT_DIR) at the result, or copy OUT_DIR/{target,draft,draft_pooled,captioner} over src/mmspec/assets/embedded/
# (keep the shipped pack_report.json: OUT_DIR's records step 1 only). scripts/swap-pack.py swaps
# single models in; it refuses a new vision tower, which a run from nothing has.
# Time-budgeted stages follow the clock, so a faster machine trains more steps in the same minutes.
# Steps 1-5 made the v10 pack when the world's existence answers still decided before naming the
# object (before commit dc8c5f3); run at a later commit, they train on the new answers throughout
# (and step 1's tokenizer is fitted to them), so they are close to, not bit-identical with, that run.
# Likewise, steps 1-8 made v13 before the world's chart and vqav2 lookup answers wrote each value
# right after its key (commit eebc921); run now, they train on that layout. Steps 9-10 (v14) and
# 11-12 (v15) were made on that layout.
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

# 5. v10: step 4 again from the v9 target (target 3.5 min); the shipped pack until 2026-11-23
bash scripts/gpu-pack-v9.sh "$OUT/work/v10" "$OUT/work/v9/target" 3.5

# --- Back on the 2-core CPU (2026-11-23).
# 6. v11: the world's existence answers name the object they look for before deciding ("Looking for a
#    red star: no, there is none."); the v10 target's projector + LM trained on for them (25 min), then
#    the draft (8 min) and the pooled draft (3 min). Vision towers and the captioner stay v10's.
V=$OUT/work/v10
W11=$OUT/work/v11
TGT=(--trainable projector+lm --steps 100000000 --batch-size 32 --n-train-per-family 1500
     --family-samples hallusionbench=20000 --family-samples pororosv=500 --family-samples vist=500
     --family-samples spot_the_diff=500 --family-samples iedit=500 --caption-view-prob 0.5 --fact-weight 4
     --cue-weight 4 --workers 1 --threads "$T" --half)
$M stage --init "$V/target" "${TGT[@]}" --lr 3e-4 --minutes 25 --seed 41 --out "$W11/target"
DRF=(--trainable projector+lm --lr 3e-4 --steps 100000000 --batch-size 32 --n-train-per-family 2000
     --family-samples hallusionbench=8000 --workers 1 --threads "$T" --half)
$M stage --init "$V/draft" "${DRF[@]}" --minutes 8 --text-view-prob 0.2 --caption-view-prob 0.1 --seed 43 \
    --out "$W11/draft"
$M stage --init "$V/draft_pooled" "${DRF[@]}" --minutes 3 --pooled-tokens 16 --seed 44 --out "$W11/draft_pooled"

# 7. v12: the v11 target trained on for 35 min with a family mix like v10's, to win back the signs and
#    image pairs that step 6's hallusionbench-weighted mix cost (the shipped target)
$M stage --init "$W11/target" --trainable projector+lm --steps 100000000 --batch-size 32 --n-train-per-family 1500 \
    --family-samples chartqa=5000 --family-samples textvqa=7000 --family-samples hallusionbench=6000 \
    --family-samples vqav2=3000 --family-samples spot_the_diff=3000 --family-samples iedit=3000 \
    --family-samples pororosv=1000 --family-samples vist=1000 --caption-view-prob 0.3 --fact-weight 4 \
    --cue-weight 4 --workers 1 --threads "$T" --half --lr 2e-4 --minutes 35 --seed 51 --out "$OUT/work/v12/target"

# --- On a CUDA GPU again: the lent H100 of 2026-11-23 (DEVICE=cpu runs it on the CPU, where the
# --- answers take far longer and the same minutes train far fewer steps).
# 8. v13: draft distillation. The v12 target's own greedy answers to 24,000 training samples (seed 61),
#    then the v11 draft trained on them for 1.5 + 3.5 min and the v11 pooled draft for 1.5 min; the
#    target and captioner stay v12's.
DEV=${DEVICE:-cuda}
W13=$OUT/work/v13
mkdir -p "$W13"
$M answers --target "$OUT/work/v12/target" --n-train-per-family 3000 --seed 61 --batch-size 256 --device "$DEV" \
    --out "$W13/answers-s61.jsonl"
DST=(--trainable projector+lm --lr 3e-4 --batch-size 64 --n-train-per-family 3000 --seed 61 --workers 6
     --device "$DEV" --half --answers "$W13/answers-s61.jsonl")
$M stage --init "$W11/draft" "${DST[@]}" --minutes 1.5 --text-view-prob 0.2 --caption-view-prob 0.1 \
    --out "$W13/draft_a"
$M stage --init "$W13/draft_a" "${DST[@]}" --minutes 3.5 --text-view-prob 0.2 --caption-view-prob 0.1 \
    --out "$W13/draft"
$M stage --init "$W11/draft_pooled" "${DST[@]}" --minutes 1.5 --pooled-tokens 16 --out "$W13/draft_pooled"

# --- Back on the 2-core CPU (2026-11-24).
# 9. v14's target: the v12 target on the world whose lookup answers write each value right after its
#    key, with lookup practice between world stages (scripts/train-lookup-target.sh, about 85 min)
bash scripts/train-lookup-target.sh "$OUT/work/v14" "$T" "$OUT/work/v12/target"
# 10. v14's drafts: v13's distilled again on the v14 target's own answers (about 20 min)
bash scripts/distill-drafts.sh "$OUT/work/v14/target" "$OUT/work/v14/drafts" "$T" "$W13/draft" "$W13/draft_pooled"
# 11. v15's target: v14's with practice on the place of an object, then two world stages
#     (scripts/train-place-target.sh, about 35 min)
bash scripts/train-place-target.sh "$OUT/work/v15" "$T" "$OUT/work/v14/target"
# 12. v15's drafts: v14's distilled again on the v15 target's answers to other samples (seed 72)
bash scripts/distill-drafts.sh "$OUT/work/v15/target" "$OUT/work/v15/drafts" "$T" "$OUT/work/v14/drafts/draft" \
    "$OUT/work/v14/drafts/draft_pooled" 72

rm -rf "${OUT:?}/target" && cp -r "$OUT/work/v15/target" "$OUT/target"
for role in draft draft_pooled; do
    rm -rf "${OUT:?}/$role" && cp -r "$OUT/work/v15/drafts/$role" "$OUT/$role"
done
rm -rf "${OUT:?}/captioner" && cp -r "$V/captioner" "$OUT/captioner"
echo "pack in $OUT"
