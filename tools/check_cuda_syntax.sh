#!/usr/bin/env bash
# Syntax-checks runtime/src/device/kernels.cu with the host C++ compiler on
# machines without CUDA: a small shim declares the CUDA built-ins the
# kernels use. This catches typos and type errors, not device semantics
# (the host emulator in runtime/src/device/emulate.rs mirrors those, and a
# GPU run compiles the file with NVRTC for real).
set -euo pipefail
cd "$(dirname "$0")/.."
shim=$(mktemp --suffix=.h)
trap 'rm -f "$shim"' EXIT
cat > "$shim" <<'SHIM'
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)
struct dim3_ { unsigned x, y, z; };
extern dim3_ threadIdx, blockIdx, blockDim, gridDim;
float __shfl_xor_sync(unsigned, float, int);
float __shfl_sync(unsigned, float, int);
float atomicAdd(float*, float);
int atomicAdd(int*, int);
int atomicCAS(int*, int, int);
void __syncthreads();
float rsqrtf(float);
float __int_as_float(int);
float __uint_as_float(unsigned);
unsigned __float_as_uint(float);
void sincos(double, double*, double*);
void host_mma16816(float*, const unsigned*, const unsigned*);
SHIM
"${CXX:-c++}" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Wno-unknown-pragmas -include "$shim" -x c++ runtime/src/device/kernels.cu
echo "kernels.cu: syntax OK"
