#!/usr/bin/env bash
# CPU smoke runs of the benchmark scripts (issue 31): each script's own code on a tiny model or input, in
# seconds, so that none rots between GPU sessions. Their numbers mean nothing; a script that fails, hangs
# (over 5 minutes) or finds its result wrong fails this one. Every output goes to a temporary folder, removed
# at the end. Run from the repository root in the dev virtualenv:
#   bash benchmarks/smoke.sh
# Not here: gpu_env.sh, gpu_vision_check.sh, the *_probe.sh calls and real_model_*.sh set up or run GPU-machine
# sessions (wheels, profiles, a real model), and remax_sweep.sh is builtin_learning.py over 5 seeds per
# setting (its smoke below).
set -euo pipefail
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export TMPDIR=$TMP  # the scripts' own temporary folders (tempfile) go there too
export HF_HUB_OFFLINE=1  # every model is built locally: nothing may be downloaded
PY=${PYTHON:-python}
failed=()
total_start=$SECONDS

smoke() {  # smoke NAME COMMAND...: run one, its output kept in a log and shown only if it fails
  local name=$1 start=$SECONDS status=0
  shift
  printf '== %-22s %s\n' "$name" "$*"
  timeout --kill-after=10 300 "$@" > "$TMP/$name.log" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    printf '   ok in %d s\n' $((SECONDS - start))
  else
    tail -n 60 "$TMP/$name.log"
    printf '   FAILED (exit %d) in %d s: %s\n' "$status" $((SECONDS - start)) "$name"
    failed+=("$name")
  fi
}

smoke decode_speed "$PY" benchmarks/decode_speed.py --smoke --out "$TMP/decode_speed.json"
smoke grpo_vs_trl "$PY" benchmarks/grpo_vs_trl.py "$TMP/grpo_vs_trl" --smoke
smoke actor_update "$PY" benchmarks/actor_update.py --tiny --json "$TMP/actor_update.jsonl"
smoke actor_update_equiv "$PY" benchmarks/actor_update.py --equivalence
smoke fsdp_scaling "$PY" benchmarks/fsdp_scaling.py --tiny --rows 4 --micro 2 --prompt 16 --response 16 --steps 1 \
  --warmup 1
smoke weight_sync "$PY" benchmarks/weight_sync.py --tiny --syncs 2
smoke gpu_step "$PY" benchmarks/gpu_step.py "$TMP/gpu_step" --smoke
# overlap_probe.py measures CUDA side streams and green contexts, which only a GPU has: its smoke runs the rest
# (arguments, the tiny model, generation in the main thread, in a thread alone and beside matrix products).
smoke overlap_probe "$PY" benchmarks/overlap_probe.py "$TMP/overlap_probe" --smoke
smoke builtin_learning "$PY" benchmarks/builtin_learning.py --smoke --out "$TMP/builtin_learning"
smoke from_verl_scripts "$PY" benchmarks/from_verl_scripts.py --smoke
smoke dispatch_balance "$PY" benchmarks/dispatch_balance.py --smoke
# megatron_step.py: a 2-layer model through megatron-core's local layers on one gloo rank (its DDP and optimizer
# need CUDA), eager and with compiled layers, and the row's arithmetic (needs the megatron extra).
smoke megatron_step "$PY" benchmarks/megatron_step.py step --smoke --variants default budget64+compile \
    --json "$TMP/megatron_step.jsonl"
# perf_report.py reads the JSON of decode_speed.py, grpo_vs_trl.py (its two GRPO settings) and megatron_step.py.
smoke perf_report "$PY" benchmarks/perf_report.py "$TMP/perf_report" --smoke

printf '== %d s in all\n' $((SECONDS - total_start))
if [ ${#failed[@]} -gt 0 ]; then
  echo "benchmark smoke runs failed: ${failed[*]}" >&2
  exit 1
fi
