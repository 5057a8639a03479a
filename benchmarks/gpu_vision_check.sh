#!/bin/bash
# On the GPU machine: the vision-language path on CUDA (bf16 autocast, the hf engine's dynamic decoder with images),
# the built-in colours task on the torch and fsdp2 backends. Carry build/gpu_wheels (benchmarks/gpu_env.sh).
set -e
source benchmarks/gpu_env.sh
export RLX_CACHE=${RLX_CACHE:-/tmp/rlx_cache} OUT=${OUT:-/tmp/out}
python3 -c "import PIL; print('Pillow', PIL.__version__)"
common="--preset tiny --model builtin:tiny-qwen2-vl data.train_files=builtin:colors-train data.val_files=builtin:colors-test trainer.device=cuda trainer.val_before_train=true trainer.save_freq=0"
time python3 -m rlx train $common trainer.total_steps=${STEPS:-40} trainer.test_freq=20 trainer.output_dir=$OUT/vl_torch 2>&1 | grep -v Loading | tail -6
time python3 -m rlx train $common --backend fsdp2 actor.freeze_vision_tower=true trainer.total_steps=4 trainer.test_freq=4 trainer.output_dir=$OUT/vl_fsdp2 2>&1 | grep -v Loading | tail -4
