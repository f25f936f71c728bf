#!/usr/bin/env bash
# The Python packages accelrun needs that the GPU machine's image lacks, as wheels for its Python
# (3.12, x86-64 Linux), fetched here (the GPU machine reaches no package registry) into .gpu-wheels/,
# which git ignores. Carry that folder with the device command; bench/gpu_smoke.sh installs from it:
#
#   bash bench/gpu_wheels.sh            # here, once per session
#   run(command="bash bench/gpu_smoke.sh ...", carry=[".gpu-wheels"])   # on the GPU machine
#
# The image holds torch, Triton, transformers, click, rich, pyyaml and pytest (KINDS.md in the device
# tool's notes); not pydantic and its own requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"
rm -rf .gpu-wheels && mkdir -p .gpu-wheels
# The versions this machine's tests ran with.
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp -d .gpu-wheels \
    "pydantic==$(python -c 'import pydantic; print(pydantic.VERSION)')" \
    "pydantic-core==$(python -c 'import pydantic_core; print(pydantic_core.__version__)')" \
    annotated-types==0.7.0 typing-inspection==0.4.2
ls -1 .gpu-wheels
du -sh .gpu-wheels
