# Source this on the GPU machine: installs the wheels carried in build/gpu_wheels (rlx's own wheel, pydantic,
# TRL and datasets, megatron-core and mbridge: packages the machine's image lacks) into a folder of their
# own and puts it on PYTHONPATH. Build the wheels on a machine with internet first:
#   pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
#       -d build/gpu_wheels pydantic pydantic-core annotated-types typing-inspection trl==1.16.0 \
#       datasets==5.2.0 dill multiprocess xxhash mbridge
#   pip download --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
#       -d build/gpu_wheels megatron-core==0.16.1
#   pip download --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
#       -d build/gpu_wheels pluggy typer rich pyyaml     # the rlx CLI's own (with their dependencies)
#   pip wheel --no-deps . -w build/gpu_wheels
# Run the CLI as `python3 -m rlx`: the `rlx` script's shebang may name another Python than the image's.
# then carry build/gpu_wheels with the call (device tool: carry=["build/gpu_wheels"]).
GPU_SITE=${GPU_SITE:-/tmp/rlx_site}
pip install -q --no-index --no-deps --target "$GPU_SITE" build/gpu_wheels/*.whl 2>&1 | grep -v -i "warning" | tail -3
export PYTHONPATH="$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$GPU_SITE/bin:$PATH"
python3 -c "import torch, transformers, rlx; print('torch', torch.__version__, 'transformers', transformers.__version__, 'rlx from', rlx.__file__)"
