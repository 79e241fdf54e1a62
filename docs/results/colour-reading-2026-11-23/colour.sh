#!/usr/bin/env bash
# The v12 target trained on the colour-reading world (branch colour-reading, worktree /work/wt-colour;
# the branch is gone, commit 1 of ../induction-2026-11-23/world.patch names colours the same way).
# $1: out name, $2: minutes, $3: threads, rest: extra flags. The stage's flags are shared with the
# induction experiments: ../induction-2026-11-23/ind.sh, run here with this session's worktree and
# output folder. Run from the main checkout's root.
set -euo pipefail
WT=/work/wt-colour OUT=runs/v15 exec bash "$(dirname "$0")/../induction-2026-11-23/ind.sh" "$@"
