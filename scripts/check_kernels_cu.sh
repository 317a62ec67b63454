#!/usr/bin/env bash
# Compile-checks the CUDA kernels (runtime/src/device/kernels.cu) without a
# GPU or CUDA toolkit: clang's CUDA front end through libclang's Python
# wheel, installed into an ignored virtual environment (.venv-clang).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-clang/bin/python ]; then
    python3 -m venv .venv-clang
    .venv-clang/bin/pip install --quiet libclang
fi
.venv-clang/bin/python scripts/cuda_check/check.py runtime/src/device/kernels.cu
