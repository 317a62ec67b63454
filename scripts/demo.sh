#!/usr/bin/env bash
# The newcomer's first command: set up, build, and compare memplan with the
# baselines (PyTorch caching allocator simulation, program order) and the
# min-cut floor on a built-in GPT-2 small training step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin memplan
./target/release/memplan compare --example gpt2-small "$@"
