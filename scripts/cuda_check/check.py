"""Parses runtime/src/device/kernels.cu with clang's CUDA front end (libclang)
and prints every error: a compile check of the NVRTC source on a machine
without CUDA. prelude.h declares the CUDA built-ins the kernels use."""
import pathlib
import sys

import clang.cindex as ci

here = pathlib.Path(__file__).parent
prelude = (here / "prelude.h").read_text()
source = pathlib.Path(sys.argv[1]).read_text()
offset = prelude.count("\n") + 1
tu = ci.Index.create().parse(
    "kernels.cu",
    args=["-x", "cuda", "--cuda-device-only", "-nocudainc", "-nocudalib",
          "--cuda-gpu-arch=sm_90", "-std=c++17"],
    unsaved_files=[("kernels.cu", prelude + "\n" + source)],
)
errors = [d for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
for d in errors:
    print(f"{sys.argv[1]}:{d.location.line - offset}: {d.spelling}")
print(f"{len(errors)} errors")
sys.exit(1 if errors else 0)
