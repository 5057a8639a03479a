#!/usr/bin/env bash
# Shared prompts (actor.share_prompts, and the engine's hf_static.SHARE_PREFILL) on the GPU: the GPU tests, then
# the fast GRPO setting of issue 31 with both off and on (TRL beside the first), and the memory-lean one with
# both on at two token budgets; one call (carry build/gpu_wheels; source gpu_env.sh first).
#   bash benchmarks/share_probe.sh            # OUT defaults to $OUT or /tmp/share_probe
set -u
OUT=${OUT:-/tmp/share_probe}
mkdir -p "$OUT"
F="actor.model_dtype=bfloat16 actor.use_torch_compile=true actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=32768 actor.log_prob_chunk_size=4096"
L="rollout.free_on_sleep=discard actor.use_torch_compile=true actor.use_dynamic_bsz=true actor.log_prob_chunk_size=512"
g() { echo "== $1"; shift; timeout 200 python3 benchmarks/grpo_vs_trl.py "$@" 2>&1 | grep -E "step times|s/step|peak|rlx.*timing|Error|error" | tail -12; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/plugins/backends/test_shared_prompts.py -m "gpu or not gpu" 2>&1 | tail -2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/plugins/rollout/test_rollout_hf_fast.py -k "repeated_prompt or smaller_bucket" 2>&1 | tail -2
g fast_off "$OUT/fast_off" --steps 4 --parts rlx,trl $F actor.share_prompts=false --hf-static SHARE_PREFILL=0
g fast_on "$OUT/fast_on" --steps 4 --parts rlx $F
g lean_on "$OUT/lean_on" --steps 4 --parts rlx_bf16 $L actor.ppo_max_token_len_per_gpu=16384
g lean_on20k "$OUT/lean_on20k" --steps 4 --parts rlx_bf16 $L actor.ppo_max_token_len_per_gpu=20480
# the decode attention's new split rule (one wave) at 8 and 64 rows, and 8 rows without splits, in what is left
left=$((570 - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 8 --prefill --out "$OUT/decode.json" 2>&1 | grep -E "rows|ms" | tail -6
  left=$((570 - SECONDS))
  [ "$left" -gt 40 ] && timeout "$left" python3 benchmarks/decode_speed.py --shape 0.5b --batch 8 --without split-attention --out "$OUT/decode_nosplit.json" 2>&1 | grep -E "rows|ms" | tail -3
fi
python3 benchmarks/step_summary.py "$OUT/fast_off/results.json" "$OUT/fast_on/results.json" "$OUT/lean_on/results.json" "$OUT/lean_on20k/results.json"
