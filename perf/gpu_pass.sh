#!/usr/bin/env bash
# One prepared GPU pass (docs/perf.md, "A GPU pass"): every figure a GPU is lent for, in one call,
# cheap and certain steps first, each with its own time limit, each writing its log and JSON into
# OUTDIR as soon as it has them; a failing or timed-out step never loses another's. After each
# step the whole of OUTDIR is packed into one tar.gz (--pack), so a call killed at any moment
# still brings back everything finished before it.
#
#   bash perf/gpu_pass.sh OUTDIR [--dry-run] [--steps a,b,...] [--pack FILE] [--budget SECONDS] [--list]
#
#   --dry-run   every step on the CPU: tiny shapes, few repeats, graphs emulated, the tests
#               collected but not run; proves every argument, path and import (about a minute
#               here; tests/perf/test_gpu_pass.py runs a part of it and checks every command line)
#   --steps     a subset, run in the order given (the pass's: env,tests,speed,bf16,batch,trees,shapes,compile)
#   --pack      the tar.gz written after each step (default: OUTDIR.tgz); not inside OUTDIR
#   --budget    seconds for the whole pass (default 400 on a GPU, 600 dry): each step's limit is
#               cut to what is left, and a step with under 20 s left is skipped
#   --list      print each step's limit and command line (tab-separated) and exit
#
# Through the device tool (the repository root is the working directory, $OUT comes back):
#   bash perf/gpu_pass.sh /tmp/gpu-pass --pack "$OUT/results.tgz" > "$OUT/pass.txt" 2>&1; tail -n 40 "$OUT/pass.txt"
# Environment: PY (default python3).
set -u
cd "$(dirname "$0")/.." || exit 2
ALL="env tests speed bf16 batch trees shapes compile"
OUT="" DRY=0 STEPS="" PACK="" BUDGET="" LIST=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) STEPS="${2:?--steps needs a list}"; shift ;;
    --pack) PACK="${2:?--pack needs a file}"; shift ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --list) LIST=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "gpu_pass.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "gpu_pass.sh: one OUTDIR only (got $OUT and $1)" >&2; exit 2; }; OUT="$1" ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "usage: bash perf/gpu_pass.sh OUTDIR [--dry-run] [--steps a,b] [--pack FILE] [--budget S] [--list]" >&2; exit 2; }
STEPS=${STEPS:-${ALL// /,}}
for s in ${STEPS//,/ }; do
  case " $ALL " in *" $s "*) ;; *) echo "gpu_pass.sh: unknown step '$s'; steps: ${ALL// /,}" >&2; exit 2 ;; esac
done
OUT=$(realpath -m "$OUT")
PACK=$(realpath -m "${PACK:-$OUT.tgz}")
case "$PACK/" in "$OUT"/*) echo "gpu_pass.sh: --pack $PACK lies inside OUTDIR $OUT; put it beside" >&2; exit 2 ;; esac
BUDGET=${BUDGET:-$([ $DRY = 1 ] && echo 600 || echo 400)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
PY=${PY:-python3}
# the test files with tests that need CUDA: every file with a skipif on torch.cuda.is_available()
CUDA_TESTS=$(grep -rlE "skipif\(not torch\.cuda\.is_available\(\)" tests | sort | tr '\n' ' ')

declare -A LIMIT CMD
if [ $DRY = 0 ]; then
  LIMIT[env]=60;      CMD[env]="$PY perf/ceilings.py --device cuda --out $OUT/env/env.json"
  LIMIT[tests]=150;   CMD[tests]="$PY -m pytest -q -rs -p no:cacheprovider -n 8 --junitxml=$OUT/tests/junit.xml $CUDA_TESTS"
  LIMIT[speed]=150;   CMD[speed]="$PY perf/speed.py --device cuda --repeats 3 --step-rounds 10 --out $OUT/speed"
  LIMIT[bf16]=100;    CMD[bf16]="$PY perf/speed.py --device cuda --dtype bfloat16 --repeats 1 --latency-repeats 3 --step-rounds 5 --no-profile --out $OUT/speed-bf16"
  LIMIT[batch]=120;   CMD[batch]="$PY perf/batch_speed.py --device cuda --batch 1 8 32 --engine graphs --speculate always never auto --overlap on off --engine-time --out $OUT/batch/batch_speed.jsonl"
  LIMIT[trees]=90;    CMD[trees]="$PY perf/tree_sweep.py --device cuda --repeats 1 --auto --out $OUT/trees"
  LIMIT[shapes]=150;  CMD[shapes]="$PY perf/gpu_shapes.py --device cuda --modes eager,graph --engine-modes graph --gammas 1,2,3,5,8 --trees 16,32,64 --batches 1,2,4,8 --repeats 15 --engine-repeats 2 --kernels --capacities 0,2048,8192,32768 --compile --compile-modes engine --out $OUT/shapes"
  LIMIT[compile]=150; CMD[compile]="$PY perf/gpu_shapes.py --device cuda --modes graph --gammas 5 --trees 64 --batches 1 --repeats 15 --no-engine --compile --compile-modes layers+mmspec-graph,reduce-overhead --out $OUT/compile"
else
  TINY="--families chartqa --n-per-family 1 --max-new-tokens 4 --threads 2"
  LIMIT[env]=60;      CMD[env]="$PY perf/ceilings.py --device cpu --copy-mib 8 --matmul 128 --repeats 2 --out $OUT/env/env.json"
  LIMIT[tests]=120;   CMD[tests]="$PY -m pytest -q -p no:cacheprovider --collect-only $CUDA_TESTS"
  LIMIT[speed]=120;   CMD[speed]="$PY perf/speed.py --device cpu --graphs emulate $TINY --repeats 1 --latency-repeats 1 --step-rounds 1 --out $OUT/speed"
  LIMIT[bf16]=120;    CMD[bf16]="$PY perf/speed.py --device cpu --graphs emulate --dtype bfloat16 $TINY --repeats 1 --latency-repeats 1 --step-rounds 1 --no-profile --out $OUT/speed-bf16"
  LIMIT[batch]=120;   CMD[batch]="$PY perf/batch_speed.py --device cpu --threads 2 --batch 1 2 --new 4 --engine eager graphs --speculate always never auto --overlap on off --engine-time --out $OUT/batch/batch_speed.jsonl"
  LIMIT[trees]=120;   CMD[trees]="$PY perf/tree_sweep.py --device cpu --graphs emulate $TINY --shapes 3x2x4 --repeats 1 --auto --out $OUT/trees"
  LIMIT[shapes]=120;  CMD[shapes]="$PY perf/gpu_shapes.py --small --device cpu --context 32 --modes eager,graph --engine-modes graph --gammas 1,5 --trees 8 --batches 1,2 --repeats 2 --warmup 1 --copy-mib 4 --engine-new-tokens 8 --engine-repeats 1 --engine-noise 0 --kernels --capacities 0,128 --compile --compile-modes engine --out $OUT/shapes"
  LIMIT[compile]=120; CMD[compile]="$PY perf/gpu_shapes.py --small --device cpu --context 32 --modes graph --gammas 5 --trees 8 --batches 1 --repeats 2 --warmup 1 --copy-mib 4 --no-engine --compile --compile-modes layers+mmspec-graph,reduce-overhead --out $OUT/compile"
fi

if [ $LIST = 1 ]; then
  for s in ${STEPS//,/ }; do printf '%s\t%s\t%s\n' "$s" "${LIMIT[$s]}" "${CMD[$s]}"; done
  exit 0
fi

mkdir -p "$OUT" "$(dirname "$PACK")" || exit 2
say() { echo "$*" | tee -a "$OUT/pass.txt"; }
pack() {  # atomically: a call killed mid-tar leaves the previous pack whole
  tar czf "$PACK.tmp" -C "$OUT" . 2>/dev/null && mv -f "$PACK.tmp" "$PACK"
}
json_str() { local s=${1//\\/\\\\}; printf '"%s"' "${s//\"/\\\"}"; }
record() {  # one JSON line per step into pass.jsonl: $1 step, $2 rc, $3 seconds, $4 limit, $5 note
  printf '{"step": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "note": %s, "log": "%s.log", "command": %s}\n' \
    "$1" "$2" "$3" "$4" "$(json_str "$5")" "$1" "$(json_str "${CMD[$1]}")" >>"$OUT/pass.jsonl"
}

START=$SECONDS
: >"$OUT/pass.jsonl"
say "=== gpu_pass $(date -u +%FT%TZ) $([ $DRY = 1 ] && echo 'DRY RUN (CPU)' || echo GPU): steps ${STEPS//,/ }; budget ${BUDGET}s; out $OUT; pack $PACK"
pack
SUMMARY=""
for s in ${STEPS//,/ }; do
  left=$((BUDGET - (SECONDS - START) - 10))  # 10 s kept for the last pack
  limit=${LIMIT[$s]}; [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    say "--- $s skipped: ${left}s of the budget left"; record "$s" -1 0 0 "skipped: no time left"
    SUMMARY+="$(printf '%-8s skipped (no time left)' "$s")"$'\n'; continue
  fi
  say "=== $s $(date -u +%T) (limit ${limit}s): ${CMD[$s]}"
  t0=$SECONDS
  timeout -k 10 "$limit" bash -c "${CMD[$s]}" >"$OUT/$s.log" 2>&1
  rc=$?; dt=$((SECONDS - t0))
  note=$([ $rc = 124 ] || [ $rc = 137 ] && echo "timed out at ${limit}s" || echo "")
  say "--- $s rc=$rc ${dt}s${note:+ ($note)}"
  tail -n "${TAILN:-12}" "$OUT/$s.log" | cut -c1-300
  record "$s" "$rc" "$dt" "$limit" "$note"
  SUMMARY+="$(printf '%-8s rc=%-4s %4ss  %s' "$s" "$rc" "$dt" "$note")"$'\n'
  pack
done
say "=== done in $((SECONDS - START))s; rc 3 = a probe failed, its error in the step's JSON; 1 = outputs differ"
say "$SUMMARY"
pack
ls -la "$PACK"
