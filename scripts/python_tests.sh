#!/usr/bin/env bash
# Builds the Python package (python/, PyO3 + maturin) into the project's
# ignored virtual environment .venv (made, with maturin, when missing) and
# runs its tests. Called by scripts/test.sh. PyTorch (PyPI's wheel, used on
# the CPU), torchvision and transformers are installed into the same .venv
# when missing, once per checkout (pip's cache makes a second checkout
# cheap): memplan.torch's tests run real models and must not skip; so do
# jax's CPU wheel and XLA's CPU PJRT plugin, for the tools' XLA test. The tests build the extension
# without the HiGHS back end (`--no-default-features`), which spares a
# second HiGHS build (the Rust tests build it in another profile); a wheel
# for users (`maturin build --release`) has it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's seconds, added to target/test-times/phases.tsv (scripts/test.sh
# prints the table).
source scripts/phase.sh
# What the tests need in .venv, installed when missing.
venv() {
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  if ! .venv/bin/python -c 'import maturin' >/dev/null 2>&1; then
    .venv/bin/pip install --quiet "maturin>=1.7,<2"
  fi
  # Pinned: a fresh clone on 2026-12-03 got transformers 5.25.0, whose
  # Mamba2 forward writes a cache counter made outside the step (refused by
  # name at capture) and which brings the `kernels` package; the tests'
  # model zoo is checked against these versions.
  if ! .venv/bin/python -c 'import torch, torchvision, transformers
assert (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0], transformers.__version__) == ("2.15.0", "0.29.2", "5.24.0")' >/dev/null 2>&1; then
    echo "installing torch, torchvision and transformers into .venv (about 3.5 GB, once)"
    .venv/bin/pip install --quiet "torch==2.15.0" "torchvision==0.29.2" "transformers==5.24.0"
  fi
  # XLA's CPU compiler through its PJRT C API plugin, for the test that XLA
  # runs memplan's order (tools/test_xla_run_scheduled.py; docs/hlo.md).
  if ! .venv/bin/python -c 'import jax, pypjrt, lammps_jax_pjrt_cpu' >/dev/null 2>&1; then
    echo "installing jax[cpu], pypjrt and lammps-jax-pjrt-cpu into .venv (XLA's CPU plugin, once)"
    .venv/bin/pip install --quiet "jax[cpu]>=0.10,<0.11" pypjrt lammps-jax-pjrt-cpu
  fi
  # torchtitan, pinned: its own Llama, FSDP2 wrapping and checkpointing are
  # trained through memplan in test_torch_distributed (0.2.2: its debug
  # model runs SDPA; 0.3.0's needs flex attention, whose backward PyTorch
  # does not run on the CPU).
  if ! .venv/bin/python -c 'import torchtitan; assert torchtitan.__version__ == "0.2.2"' >/dev/null 2>&1; then
    .venv/bin/pip install --quiet "torchtitan==0.2.2"
  fi
  # The documentation site's builder (mkdocs-material, API pages from the
  # docstrings by mkdocstrings), pinned: the site is built below with
  # warnings as errors.
  if ! .venv/bin/python -c 'import mkdocs, material, mkdocstrings_handlers.python' >/dev/null 2>&1; then
    .venv/bin/pip install --quiet "mkdocs==1.6.1" "mkdocs-material==9.8.2" "mkdocstrings==1.0.8" \
      "mkdocstrings-python==2.0.11"
  fi
}
phase "Python: the .venv's packages (torch, transformers, jax, torchtitan, mkdocs)" venv
export VIRTUAL_ENV="$PWD/.venv"
phase "Python: the extension (maturin develop)" \
  bash -c 'cd python && ../.venv/bin/maturin develop --quiet --no-default-features'
phase "Python: the package's tests" .venv/bin/python scripts/timed_unittest.py target/test-times/python.tsv -s python/tests
# The docs site (mkdocs.yml): broken links between pages, missing anchors
# and API pages whose objects are gone fail the build.
phase "the docs site (mkdocs build --strict)" env NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
