#!/bin/bash
# Head training on the embedded pack (LLaVA-1.5): sequences/s with the target's features on the fly
# vs from --cache-features, then tau of an EAGLE-3 head trained a few CPU-minutes vs the chain M.
# Run from the repository root: bash docs/results/trainfam-2026-11-27/run.sh
set -e
export PYTHONPATH=src
R=runs/trainfam
T=src/mmspec/assets/embedded/target
D="--target $T --variant eagle3 --data world --families chartqa,spot_the_diff --samples 8 --threads 1 --fresh"
N="nice -n 10 python -m mmspec"
echo "start $(date -u +%FT%TZ) | $(uptime)"
$N train head $D --batch-size 4 --steps 8 --out $R/fly                           # 8 steps on the fly
echo "fly done $(date -u +%FT%TZ) | $(uptime)"
$N train head $D --batch-size 4 --steps 4 --cache-features $R/cache --out $R/fill  # one epoch: all 16 dumped
echo "fill done $(date -u +%FT%TZ) | $(uptime)"
$N train head $D --batch-size 4 --steps 8 --cache-features $R/cache --out $R/cached  # 8 steps read from it
echo "cached done $(date -u +%FT%TZ) | $(uptime)"
$N train head $D --batch-size 4 --steps 100000 --minutes 5 --cache-features $R/cache --out $R/head5
echo "head done $(date -u +%FT%TZ) | $(uptime)"
$N bench run -m M,eagle3 --head eagle3=$R/head5 -d chartqa,spot_the_diff -n 2 --max-new-tokens 32 --no-latency \
    --threads 1 --no-progress --out $R/bench
echo "bench done $(date -u +%FT%TZ) | $(uptime)"
$N report $R/bench || true
