#!/usr/bin/env bash
# Every test of the project, after setting up what the build needs: the Rust
# workspace (unit, property, integration and doc tests; among them a C
# program using the C ABI), the Python package, and the Python tools' tests. The README's test
# command; CI (.ci/run) calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where the time goes: each phase's seconds, printed at the end (and kept in
# target/test-times/phases.tsv; docs/testing.md has a clean run's table).
source scripts/phase.sh
: > target/test-times/phases.tsv
report() {
  echo "test.sh: seconds by phase (total $SECONDS s):" >&2
  awk -F'\t' '{ printf "  %6d s  %s\n", $1, $2 }' target/test-times/phases.tsv >&2
}
trap report EXIT
phase "setup (apt packages)" bash scripts/setup.sh
# HiGHS prebuilt (PyPI's highsbox wheel, pinned by hash) instead of
# compiling its C++ sources in the build below; where that cannot be had
# (another platform, no network), the build compiles them as before.
if phase "HiGHS: the prebuilt library (scripts/highs.sh)" bash scripts/highs.sh; then
  export PKG_CONFIG_PATH="$PWD/target/highs${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$PWD/target/highs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "test.sh: no prebuilt HiGHS; the build compiles its sources" >&2
fi
# `--features memplan/cuda` builds the CUDA executor too (CUDA is loaded at
# run time, so no toolkit or GPU is needed), so it cannot rot unseen. The
# Python extension is built and tested by maturin below, not by cargo test.
phase "Rust: build the tests" cargo test --workspace --exclude memplan-python --all-targets --features memplan/cuda --no-run
phase "Rust: unit, property and integration tests" \
  cargo test --workspace --exclude memplan-python --all-targets --features memplan/cuda
# The CUDA kernels' source, compiled as host C++ against a shim of CUDA's
# built-ins (no NVRTC here): typos and type errors in kernels.cu fail CI.
phase "CUDA kernels' syntax (host C++)" bash tools/check_cuda_syntax.sh
phase "Rust: doc tests" cargo test --workspace --exclude memplan-python --doc --features memplan/cuda
# The Python package (PyO3 + maturin) in the ignored .venv.
# (it times its own phases into the same table)
# (Installing its packages while the Rust tests build was tried, 2026-12-03:
# pip's unpacking and byte-compiling took the cores from the build, 925 s
# against 711 s, for 347 s of install beside it: no gain.)
bash scripts/python_tests.sh
# The CUDA kernels compiled by NVRTC itself (it needs no GPU), with the
# NVRTC that PyTorch's CUDA wheels put in .venv: machine code for sm_80,
# sm_90 and sm_100, every kernel within its launch bound, no spills.
nvrtc=$(ls "$PWD"/.venv/lib/python3*/site-packages/nvidia/*/lib/libnvrtc.so.* 2>/dev/null | head -1)
if [ -z "$nvrtc" ]; then
  echo "no libnvrtc.so in .venv's nvidia packages (PyPI's torch wheel brings one)" >&2
  exit 1
fi
phase "CUDA kernels compiled by NVRTC" env LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --workspace --exclude memplan-python --lib --features memplan/cuda cuda::compile -- --ignored
# The Python tools' tests, with the torch that python_tests.sh installed.
phase "Python tools' tests" .venv/bin/python scripts/timed_unittest.py target/test-times/tools.tsv -s tools -t .
