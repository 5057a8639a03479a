#!/usr/bin/env bash
# Issue 31, round 3: the first GPU call of a session, an A/B of each change not yet measured on a GPU (written
# on 2026-12-04, when no GPU was lent): the decode step's fused sampling kernel and split attention, cuBLASLt,
# the skinny-matrix Triton kernels against cuBLAS, and the megatron backend's torch optimizer kernels and
# compiled layers (with a profile of where its step's time goes). One H200; carry build/gpu_wheels (rebuild the
# rlx wheel first: rm build/gpu_wheels/rlx-*.whl; pip wheel -q --no-deps . -w build/gpu_wheels).
#   bash benchmarks/perf_probe.sh decode      # each part about 6-8 minutes: one device call each
#   bash benchmarks/perf_probe.sh decode-ab   # decode's A/Bs and GPU tests only (beside perf_report's decode)
#   bash benchmarks/perf_probe.sh linear      # outputs under $OUT (or ./perf_probe)
#   bash benchmarks/perf_probe.sh megatron    # alone in its call: the head's A/B at 0.5b and 1.5b, a profile
# Then benchmarks/perf_report.py for the figures beside their goals.
set -uo pipefail
OUT=${OUT:-perf_probe}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
PART=${1:-decode}
# Each run gets its own limit, cut to what is left of the call's (PROBE_SECONDS, default 570 s), so one slow
# run cannot cost the rest their output; what finished is under $OUT either way.
DEADLINE=$(( $(date +%s) + ${PROBE_SECONDS:-570} ))
t() {
    local limit=$1 left; shift
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 30 ]; then echo "skipped (no time left): $*"; return 0; fi
    # the whole output kept in $OUT/probe.log (a call's reply holds only its tail)
    timeout $(( limit < left ? limit : left )) "$@" 2>&1 | tee -a "$OUT/probe.log" | grep -v -i "warn" \
        | tail -"${TAIL:-4}"
}
if [ "$PART" = decode ] || [ "$PART" = decode-ab ]; then
# decode-ab: the A/B runs only, for a call that also runs perf_report.py's decode group (which measures the new
# step at 0.5b and 135m); the kernels' GPU tests come before the optional A/Bs, which the deadline may cut.
D="python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 --check --prefill"
if [ "$PART" = decode ]; then
t 100 $D --out "$OUT/decode_new.json"
fi
t 100 $D --without fused-sampling split-attention rope-attention --out "$OUT/decode_before.json"
if [ "$PART" = decode ]; then
t 90 python3 benchmarks/decode_speed.py --shape 135m --batch 512 --check --out "$OUT/decode_135m.json"
fi
t 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/plugins/rollout/test_rollout_hf_fast.py \
    tests/plugins/rollout/test_hf_linear.py
t 90 $D --without own-prefill --out "$OUT/decode_model_prefill.json"
t 90 $D --without split-attention --out "$OUT/decode_no_split.json"
t 90 $D --without rope-attention --out "$OUT/decode_no_rope.json"
t 90 $D --blas cublaslt --out "$OUT/decode_lt.json"
elif [ "$PART" = linear ]; then
t 200 python3 benchmarks/linear_probe.py --batch 8 64 512 --head --json "$OUT/linear_probe.json"
t 250 python3 benchmarks/decode_speed.py --shape 0.5b --batch 64 --check --prefill --with skinny-linear \
    --out "$OUT/decode_linear.json"
else
# 2026-12-07 (H100): 0.5b budget12288+compile 24.1%, 1.5b 42.6% update MFU, the head's vocabulary-parallel function
# a fifth of the 0.5b kernel time. +tphead is the before of the chunked head at one TP rank built after that call;
# the profile is of the best setting. A call of its own (the 150 s limit of the call beside perf_report cut rows).
TAIL=60 t 270 python3 benchmarks/megatron_step.py step --shape 0.5b --steps 3 --json "$OUT/megatron.jsonl" \
    --variants budget12288+compile budget12288+compile+tphead default+stock default --profile budget12288+compile
TAIL=30 t 250 python3 benchmarks/megatron_step.py step --shape 1.5b --steps 3 --json "$OUT/megatron.jsonl" \
    --variants budget12288+compile budget12288+compile+tphead
fi
