#!/usr/bin/env bash
# Run HERE (a CPU machine with PyPI) before a GPU check: builds ferryman's abi3 wheel and fetches
# the wheels the GPU machine lacks into .whl/ (git-ignored), for the device tool to carry.
# FlashInfer: flashinfer-python 0.6.13 (14 MB; 0.7.x is 62 MB) with the dependencies that image
# lacks. nvidia-cutlass-dsl's libraries (large) are left out: the paged-attention wrappers this
# project uses are JIT-compiled with nvcc, which that machine has.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh >/dev/null
rm -rf .whl && mkdir -p .whl
maturin build --release -q -o .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 \
  gguf==0.19.0
du -sh .whl
