#!/usr/bin/env bash
# Every test of the project: the Rust workspace (unit, property, integration
# and doc tests). Called by `make test` and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets
cargo test --workspace --doc
# The Python tools' tests (the ones that need torch skip themselves without it).
if command -v python3 >/dev/null; then
  python3 -m unittest discover -s tools -t .
fi
