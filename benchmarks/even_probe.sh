#!/usr/bin/env bash
# Even token-budget micro-batches (rlx.step.EVEN_MICRO_BATCHES, 2026-12-07) on the GPU: the memory-lean GRPO setting
# of issue 31 at a budget of 16,384 (two micro-batches: 7 groups and 1 under first-fit, 4 and 4 now) with each,
# TRL beside the first, then at 20,480; one call (carry build/gpu_wheels; source gpu_env.sh first).
#   bash benchmarks/even_probe.sh            # OUT defaults to $OUT or /tmp/even_probe
set -u
OUT=${OUT:-/tmp/even_probe}
mkdir -p "$OUT"
L="rollout.free_on_sleep=discard actor.use_torch_compile=true actor.use_dynamic_bsz=true actor.log_prob_chunk_size=512"
g() { echo "== $1"; shift; timeout 200 python3 benchmarks/grpo_vs_trl.py "$@" 2>&1 | grep -E "step times|s/step|peak|rlx.*timing|Error|error" | tail -12; }
g lean16k_even "$OUT/lean16k_even" --steps 4 --parts rlx_bf16,trl $L actor.ppo_max_token_len_per_gpu=16384
g lean16k_first_fit "$OUT/lean16k_first_fit" --steps 4 --parts rlx_bf16 --first-fit-micro-batches $L \
  actor.ppo_max_token_len_per_gpu=16384
left=$((570 - SECONDS))
[ "$left" -gt 90 ] && g lean20k_even "$OUT/lean20k_even" --steps 4 --parts rlx_bf16 $L actor.ppo_max_token_len_per_gpu=20480
python3 benchmarks/step_summary.py "$OUT/lean16k_even/results.json" "$OUT/lean16k_first_fit/results.json" \
  "$OUT/lean20k_even/results.json"
echo "seconds: $SECONDS"
