#!/usr/bin/env bash
# Issue 31, round 3, first GPU call: where the megatron backend's update time goes (profiles, micro-batch
# sizes, megatron-core's optimizer fallbacks against torch's kernels, compiled layers), and whether cuBLASLt
# helps the decode step's skinny matrix products. One H200; carry build/gpu_wheels.
#   bash benchmarks/perf_probe.sh
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 250 python3 benchmarks/megatron_step.py step --shape 0.5b --steps 3 \
    --variants default+stock default budget12288 budget12288+compile --profile default+stock budget12288
timeout 130 python3 benchmarks/megatron_step.py step --shape 1.5b --steps 3 --variants budget12288 budget12288+compile
timeout 150 python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 --prefill --blas cublaslt --out "$OUT/decode_lt.json"
