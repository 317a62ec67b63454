#!/usr/bin/env bash
# Every test of the project, after setting up what the build needs: the Rust
# workspace (unit, property, integration and doc tests) and the Python tools'
# tests. The README's test command; CI (.ci/run) calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# `--features memplan/cuda` builds the CUDA executor too (CUDA is loaded at
# run time, so no toolkit or GPU is needed), so it cannot rot unseen.
cargo test --workspace --all-targets --features memplan/cuda
cargo test --workspace --doc --features memplan/cuda
# The Python tools' tests (the ones that need torch skip themselves without it).
if command -v python3 >/dev/null; then
  python3 -m unittest discover -s tools -t .
fi
