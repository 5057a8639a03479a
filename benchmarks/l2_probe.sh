#!/usr/bin/env bash
# The decode step's L2 prefetch (rlx.plugins.rollout.hf_prefetch) on the GPU, in one call (carry build/gpu_wheels;
# source gpu_env.sh first): its GPU tests; the 0.5b decode at 64 and 8 rows with the prefetch off and in each of
# its ways (one process, the same random model); then the fast GRPO setting of issue 31 beside TRL with the
# fastest way at 64 rows, and without the prefetch.
#   bash benchmarks/l2_probe.sh            # OUT defaults to $OUT or /tmp/l2_probe
set -u
OUT=${OUT:-/tmp/l2_probe}
mkdir -p "$OUT"
F="actor.model_dtype=bfloat16 actor.use_torch_compile=true actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=32768 actor.log_prob_chunk_size=4096"
g() { echo "== $1"; shift; timeout 200 python3 benchmarks/grpo_vs_trl.py "$@" 2>&1 | grep -E "step times|s/step|peak|rlx.*timing|Error|error" | tail -12; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/plugins/rollout/test_rollout_hf_fast.py -k "l2_prefetch or cuda_graph_replays" 2>&1 | tail -3
timeout 260 python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 8 --repeats 3 --check \
  --l2-prefetch off line bulk load line:mlp+next bulk:mlp+next --out "$OUT/decode.json" 2>&1 | grep -E "^0.5b|^shape|Error|error|warn" | tail -16
BEST=$(python3 - "$OUT/decode.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1])) if r.get("rows") == 64 and "error" not in r]
except Exception:
    rows = []
off = [r["generate_s"] for r in rows if r["variant"] == "l2-off"]
best = min(rows, key=lambda r: r["generate_s"], default=None)
if best is None or not off or best["variant"] == "l2-off":
    print("off")
else:
    print(best["variant"][3:].replace("-mlp+next", ":mlp+next"))
PY
)
echo "fastest at 64 rows: $BEST"
g "fast_l2_$BEST" "$OUT/fast_l2" --steps 4 --parts rlx,trl $F --l2-prefetch "$BEST"
left=$((585 - SECONDS))
[ "$left" -gt 60 ] && g fast_off "$OUT/fast_off" --steps 4 --parts rlx $F --l2-prefetch off
python3 benchmarks/step_summary.py "$OUT/fast_l2/results.json" "$OUT/fast_off/results.json"
echo "seconds: $SECONDS"
