#!/usr/bin/env bash
# Builds, on this machine, what a lent GPU machine needs to run
# scripts/gpu_check.sh: that machine has CUDA, PyTorch and transformers but
# no Rust toolchain and no network, so the memplan binary (with the CUDA
# executor) and the Python extension travel prebuilt in the ignored folder
# .gpu/ (the device tool's `carry`, 64 MiB in all; both are stripped).
#
#   scripts/gpu_bundle.sh            # then, with the device tool:
#   run(carry=[".gpu"], command="bash scripts/gpu_check.sh .gpu/memplan /tmp/gc > $OUT/log 2>&1;
#       tar czf $OUT/gc.tgz -C /tmp gc")
#
# split_liger also needs Liger-Kernel (not in the machine's image): this
# script saves its wheel in the ignored .whl/; carry both and install it
# first: run(carry=[".gpu", ".whl"], command="python3 -m pip install -q
# --no-index --no-deps --target /tmp/site .whl/*.whl && export
# PYTHONPATH=/tmp/site; SECTIONS=split_liger bash scripts/gpu_check.sh ...").
#
# SECTIONS=... before `bash` picks gpu_check.sh's sections (each call is at
# most 10 minutes, a machine idle for 30 s is given back, and a session
# has 15 minutes of device time, starts included, so put what belongs
# together in one call): "torch_step torch_step_loops" (issue 12's arena
# step: about 3 + 2 minutes on an H200), then "torch_step_precision
# torch_step_graph" (float16, Adafactor, the step as one CUDA graph), then
# "llama torch_side" and "explicit fused torch_side" (issue 15's, measured
# on an H200 on 2026-11-25 and an H100 on 2026-11-23: docs/runtime.md).
# cudarc loads CUDA at run time; with no nvcc here its
# bindings are those of CUDA_VERSION below (13.0 by default: the lent
# machines' driver 580 and their nvidia-*-cu13 wheels), and libraries are
# found by their major version (libcublas.so.13, libnvrtc.so.13).
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDARC_CUDA_VERSION=${CUDA_VERSION:-13000}
cargo build --release --features cuda --bin memplan
# The extension without HiGHS (no cmake there, and memplan.torch does not
# need the ILP); abi3, so the machine's Python 3.12 loads it.
cargo build --release -p memplan-python --no-default-features
mkdir -p .gpu
strip -o .gpu/memplan target/release/memplan
strip -o .gpu/_memplan.abi3.so target/release/lib_memplan.so
ls -l .gpu
du -sh .gpu
# Liger-Kernel for split_liger (pure Python; the machine has torch and triton).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "liger-kernel==${LIGER_VERSION:-0.8.5}" \
  || echo "liger-kernel's wheel could not be fetched: split_liger will report its side as an error"
ls -l .whl 2>/dev/null || true
