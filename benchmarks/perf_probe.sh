#!/usr/bin/env bash
# Issue 31, round 3: the first GPU call of a session, an A/B of each change not yet measured on a GPU (written
# on 2026-12-04, when no GPU was lent): the decode step's fused sampling kernel and split attention, cuBLASLt,
# the skinny-matrix Triton kernels against cuBLAS, and the megatron backend's torch optimizer kernels and
# compiled layers (with a profile of where its step's time goes). One H200; carry build/gpu_wheels (rebuild the
# rlx wheel first: rm build/gpu_wheels/rlx-*.whl; pip wheel -q --no-deps . -w build/gpu_wheels).
#   bash benchmarks/perf_probe.sh decode      # each part about 6-8 minutes: one device call each
#   bash benchmarks/perf_probe.sh linear      # outputs under $OUT (or ./perf_probe)
#   bash benchmarks/perf_probe.sh megatron
# Then benchmarks/perf_report.py for the figures beside their goals.
set -uo pipefail
OUT=${OUT:-perf_probe}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
PART=${1:-decode}
if [ "$PART" = decode ]; then
D="python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 --check --prefill"
timeout 100 $D --out "$OUT/decode_new.json" 2>&1 | tail -3
timeout 100 $D --without fused-sampling split-attention rope-attention --out "$OUT/decode_before.json" 2>&1 | tail -3
timeout 90 $D --without split-attention --out "$OUT/decode_no_split.json" 2>&1 | tail -3
timeout 90 $D --without rope-attention --out "$OUT/decode_no_rope.json" 2>&1 | tail -3
timeout 90 $D --blas cublaslt --out "$OUT/decode_lt.json" 2>&1 | tail -3
timeout 90 $D --with own-prefill --out "$OUT/decode_own_prefill.json" 2>&1 | tail -3
timeout 90 python3 benchmarks/decode_speed.py --shape 135m --batch 512 --check --out "$OUT/decode_135m.json" 2>&1 | tail -3
elif [ "$PART" = linear ]; then
timeout 200 python3 benchmarks/linear_probe.py --batch 8 64 512 --head --json "$OUT/linear_probe.json" 2>&1 | tail -40
timeout 250 python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 --check --prefill --with skinny-linear \
    --out "$OUT/decode_linear.json" 2>&1 | tail -3
else
timeout 150 python3 benchmarks/megatron_step.py step --shape 0.5b --steps 3 --json "$OUT/megatron.jsonl" \
    --variants default+stock default budget12288 budget12288+compile --profile budget12288 2>&1 \
    | grep -v -i "warn"
timeout 80 python3 benchmarks/megatron_step.py step --shape 1.5b --steps 3 --json "$OUT/megatron.jsonl" \
    --variants budget12288 budget12288+compile 2>&1 | grep -v -i "warn"
fi
