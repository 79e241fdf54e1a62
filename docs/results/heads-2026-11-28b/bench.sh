#!/bin/bash
set -e
# A: the shipped draft (M) beside the head; B: the draft re-trained at the head's budget beside the same head.
taskset -c 0,1 mmspec bench run --out runs/s54/bench-shipped -d chartqa,spot_the_diff -n 30 --max-new-tokens 64 \
  -m M,M+tree,eagle3,eagle3+tree --head eagle3=runs/s54/head --threads 2 --no-latency --no-progress
taskset -c 0,1 mmspec bench run --out runs/s54/bench-equal -d chartqa,spot_the_diff -n 30 --max-new-tokens 64 \
  --target src/mmspec/assets/embedded/target --draft runs/s54/draft -m M,M+tree,eagle3,eagle3+tree --head eagle3=runs/s54/head --threads 2 --no-latency --no-progress
mmspec report runs/s54/bench-shipped
mmspec report runs/s54/bench-equal
