#!/usr/bin/env bash
# ReMax settings on the built-in job, seeds 1-5 each, all configurations side by side (one thread per run).
# Usage: benchmarks/remax_sweep.sh OUT JOBS_PER_CONFIG "name:override override" ...
set -euo pipefail
out=$1; jobs=$2; shift 2
for spec in "$@"; do
  name=${spec%%:*}; overrides=${spec#*:}
  # shellcheck disable=SC2086
  python benchmarks/builtin_learning.py --algorithms remax --seeds 1 2 3 4 5 --jobs "$jobs" \
    --out "$out/$name" $overrides > "$out/$name.md" 2>&1 &
done
wait
