#!/usr/bin/env bash
# Builds the Python package (python/, PyO3 + maturin) into the project's
# ignored virtual environment .venv (made, with maturin, when missing) and
# runs its tests. Called by scripts/test.sh. The tests build the extension
# without the HiGHS back end (`--no-default-features`), which spares a
# second HiGHS build (the Rust tests build it in another profile); a wheel
# for users (`maturin build --release`) has it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import maturin' >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "maturin>=1.7,<2"
fi
export VIRTUAL_ENV="$PWD/.venv"
(cd python && ../.venv/bin/maturin develop --quiet --no-default-features)
.venv/bin/python -m unittest discover -s python/tests -v
