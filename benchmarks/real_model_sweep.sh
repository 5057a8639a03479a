#!/usr/bin/env bash
# The real-model recipe search (issue 32) on one GPU: SmolLM2-135M-Instruct, GRPO on arithmetic word
# problems. Several runs share the GPU at once (a 135M model leaves it mostly idle), each bounded in time.
#   bash benchmarks/real_model_sweep.sh OUT SECONDS "name:task:lr:temperature ..."
# Needs the wheels and the converted model of benchmarks/real_model_setup.sh (MODEL, default
# /root/persist/smollm2). Everything is written under RES (default /root/persist/res) and, every 15 s, packed
# into OUT/res.tgz, so a call that runs out of time still brings back what it measured. Base evals are made
# once per task (greedy, and n=8 at the training temperature: pass@8, maj@8); each run validates greedily on
# the held-out split before training and every trainer.test_freq steps, and its last checkpoint is exported
# and evaluated the same way as the base model when time is left (or later: FINAL_ONLY=1).
set -uo pipefail
OUT=$1; SECONDS_TRAIN=$2; RUNS=$3
MODEL=${MODEL:-/root/persist/smollm2}
WORK=${WORK:-/root/persist/sweep}
RES=${RES:-/root/persist/res}
mkdir -p "$OUT" "$WORK" "$RES"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

pack() { tar czf "$OUT/res.tgz.tmp" -C "$(dirname "$RES")" "$(basename "$RES")" 2>/dev/null && mv "$OUT/res.tgz.tmp" "$OUT/res.tgz"; }
(while sleep 15; do pack; done) &
packer=$!
trap 'kill $packer 2>/dev/null; pack' EXIT

tasks=$(for r in $RUNS; do echo "$r" | cut -d: -f2; done | sort -u)
for t in $tasks; do
  [ -f "$WORK/data/$t/test.parquet" ] || python3 examples/real_model/make_data.py --task "$t" --out "$WORK/data/$t" --test-size 200
done

evaluate() {  # MODEL_DIR TASK TAG TEMPERATURE: greedy accuracy, and pass@8 / maj@8 at the training temperature
  rlx eval --model "$1" --data "$WORK/data/$2/test.parquet" --reward gsm8k --max-tokens 128 -o "$RES/$3-greedy.json" \
      > "$RES/$3-eval.log" 2>&1
  rlx eval --model "$1" --data "$WORK/data/$2/test.parquet" --reward gsm8k --max-tokens 128 --n 8 --temperature "$4" \
      --k 1 --k 8 -o "$RES/$3-n8.json" >> "$RES/$3-eval.log" 2>&1
}

if [ "${FINAL_ONLY:-0}" != 1 ]; then
  pids=()
  for key in $(for r in $RUNS; do echo "$r" | cut -d: -f2,4; done | sort -u); do
    task=${key%:*}; temp=${key#*:}
    [ -f "$RES/base-$task-T$temp-n8.json" ] || { evaluate "$MODEL" "$task" "base-$task-T$temp" "$temp" & pids+=($!); }
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"   # a bare `wait` would wait for the packer too, forever
  start=$(date +%s)
  pids=()
  for r in $RUNS; do
    IFS=: read -r name task lr temp <<< "$r"
    timeout "$SECONDS_TRAIN" rlx train --config examples/real_model/config.yaml model.path="$MODEL" \
        data.train_files="$WORK/data/$task/train.parquet" data.val_files="$WORK/data/$task/test.parquet" \
        actor.optim.lr="$lr" rollout.temperature="$temp" trainer.output_dir="$WORK/runs/$name" ${EXTRA:-} \
        > "$RES/$name-train.log" 2>&1 &
    pids+=($!)
  done
  (while sleep 10; do for r in $RUNS; do n=${r%%:*}; cp "$WORK/runs/$n/metrics.jsonl" "$RES/$n-metrics.jsonl" 2>/dev/null; done; done) &
  copier=$!
  wait "${pids[@]}"
  kill $copier
  echo "training took $(( $(date +%s) - start )) s"
fi

pids=()
for r in $RUNS; do
  IFS=: read -r name task lr temp <<< "$r"
  cp "$WORK/runs/$name/metrics.jsonl" "$RES/$name-metrics.jsonl" 2>/dev/null || { echo "== $name failed:"; tail -8 "$RES/$name-train.log"; continue; }
  [ "${SKIP_FINAL:-0}" = 1 ] && continue
  (rlx export "$WORK/runs/$name" --out "$WORK/export-$name" --force > "$RES/$name-export.log" 2>&1 \
     && evaluate "$WORK/export-$name" "$task" "final-$name" "$temp") &
  pids+=($!)
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"

python3 - "$RES" $RUNS <<'PY'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
def evals(tag):
    try:
        g = json.loads((res / f"{tag}-greedy.json").read_text())["metrics"]["all"]
        s = json.loads((res / f"{tag}-n8.json").read_text())["metrics"]["all"]
    except (OSError, ValueError, KeyError):
        return "missing"
    return f"greedy {g['acc']:.3f} pass@8 {s['pass@8']:.3f} maj@8 {s['maj@8']:.3f}"
for r in sys.argv[2:]:
    name, task, lr, temp = r.split(":")
    path = res / f"{name}-metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    val = [(x.get("step"), round(x["val/acc"], 3)) for x in rows if "val/acc" in x]
    train = [round(x["reward/mean"], 3) for x in rows if "reward/mean" in x]
    sec = rows[-1].get("timing/step") if rows else None
    print(f"{name} {task} lr={lr} T={temp} steps={len(train)} s/step={sec} | base {evals(f'base-{task}-T{temp}')} "
          f"| final {evals('final-' + name)} | val {val} | reward first/last {train[:1]} {train[-1:]}")
PY
