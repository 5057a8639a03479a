#!/usr/bin/env bash
# The real-model recipe search (issue 32) on one GPU: SmolLM2-135M-Instruct, GRPO on arithmetic word
# problems. Several runs share the GPU at once (a 135M model leaves it mostly idle), each bounded in time.
#   bash benchmarks/real_model_sweep.sh OUT MINUTES "name:task:lr:temperature ..."
# Needs: the rlx wheels (build/gpu_wheels, benchmarks/gpu_env.sh) installed, and the converted model in
# $MODEL (examples/real_model/convert_smollm2.py). Writes base and final evals (JSON) and metrics to OUT.
set -uo pipefail
OUT=$1; MINUTES=$2; RUNS=$3
MODEL=${MODEL:-/root/persist/smollm2}
WORK=${WORK:-/root/persist/sweep}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

tasks=$(for r in $RUNS; do echo "$r" | cut -d: -f2; done | sort -u)
for t in $tasks; do
  [ -f "$WORK/data/$t/test.parquet" ] || python3 examples/real_model/make_data.py --task "$t" --out "$WORK/data/$t" --test-size 200
done

evaluate() {  # MODEL_DIR TASK TAG: greedy accuracy and pass@8 / maj@8 at the training temperature
  rlx eval --model "$1" --data "$WORK/data/$2/test.parquet" --reward gsm8k --max-tokens 128 -o "$OUT/$3-greedy.json" > /dev/null 2>&1
  rlx eval --model "$1" --data "$WORK/data/$2/test.parquet" --reward gsm8k --max-tokens 128 --n 8 --temperature 0.8 \
      --k 1 --k 8 -o "$OUT/$3-n8.json" > /dev/null 2>&1
}

if [ "${SKIP_BASE:-0}" != 1 ]; then
  for t in $tasks; do [ -f "$OUT/base-$t-greedy.json" ] || evaluate "$MODEL" "$t" "base-$t" & done
  wait
fi

start=$(date +%s)
for r in $RUNS; do
  IFS=: read -r name task lr temp <<< "$r"
  run="$WORK/runs/$name"
  timeout $((MINUTES * 60)) rlx train --config examples/real_model/config.yaml model.path="$MODEL" \
      data.train_files="$WORK/data/$task/train.parquet" data.val_files="$WORK/data/$task/test.parquet" \
      actor.optim.lr="$lr" rollout.temperature="$temp" trainer.output_dir="$run" ${EXTRA:-} \
      > "$OUT/$name-train.log" 2>&1 &
done
wait
echo "training took $(( $(date +%s) - start )) s"

for r in $RUNS; do
  IFS=: read -r name task lr temp <<< "$r"
  run="$WORK/runs/$name"
  cp "$run/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null || { echo "== $name failed:"; tail -8 "$OUT/$name-train.log"; }
  final="$run/hf_model"
  [ -f "$final/config.json" ] || { rlx export "$run" --out "$WORK/export-$name" --force > /dev/null 2>&1; final="$WORK/export-$name"; }
  evaluate "$final" "$task" "final-$name" &
done
wait

python3 - "$OUT" $RUNS <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def evals(tag):
    try:
        g = json.loads((out / f"{tag}-greedy.json").read_text())["metrics"]["all"]
        s = json.loads((out / f"{tag}-n8.json").read_text())["metrics"]["all"]
    except (OSError, ValueError, KeyError):
        return "missing"
    return f"greedy {g['acc']:.3f} pass@8 {s['pass@8']:.3f} maj@8 {s['maj@8']:.3f}"
for r in sys.argv[2:]:
    name, task, lr, temp = r.split(":")
    path = out / f"{name}-metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    val = [(x.get("step"), round(v, 3)) for x in rows for k, v in x.items() if k == "val/acc"]
    print(f"{name} {task} lr={lr} T={temp} steps={len(rows)} | base {evals('base-' + task)} | final {evals('final-' + name)} | val {val}")
PY
