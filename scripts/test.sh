#!/usr/bin/env bash
# Every test of the project: the Rust workspace (unit, property, integration
# and doc tests). Called by `make test` and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets
cargo test --workspace --doc
