#!/usr/bin/env bash
# Installs what memplan's build needs on a fresh Debian/Ubuntu machine:
# cmake and libclang-dev (HiGHS is built from source by highs-sys, through
# cmake and bindgen, unless pkg-config finds a prebuilt one), a C compiler, and python3 with venv (the Python
# package's tests). Rust itself must already be installed (rustup).
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
if ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q 'libclang\.so'; then
  need+=(libclang-dev)
fi
command -v c++ >/dev/null 2>&1 || need+=(g++)
# scripts/highs.sh's prebuilt HiGHS is found by highs-sys through pkg-config.
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
# The C ABI's test compiles a C program with `cc`.
command -v cc >/dev/null 2>&1 || need+=(gcc)
# tools/limits_bench.py (and its test) measures commands with GNU time.
[ -x /usr/bin/time ] || need+=(time)
# The Python package's tests build it into a virtual environment.
command -v python3 >/dev/null 2>&1 || need+=(python3)
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  need+=(python3-venv)
fi

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "setup: need root (or sudo) to apt-get install ${need[*]}" >&2; exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs), then run this again" >&2
  exit 1
fi
