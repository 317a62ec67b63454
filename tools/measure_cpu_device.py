"""Measures the rates of memplan's `cpu-dev` device preset on this machine.

The "device" is the CPU (PyTorch's kernels on all its threads), the host
pool a second region of the same memory, and the link a copy between the
two. Prints the median of several runs of each:

- f32 and bf16 matrix products (4096 x 4096 x 4096): FLOP/s;
- memory bandwidth: `y.copy_(x)` of 256 MiB, bytes read plus written per
  second;
- the link: the same copy into a pinned-like separate buffer, bytes
  copied per second (the copy engine of a GPU moves each byte once).

Run from the repository root: `.venv/bin/python tools/measure_cpu_device.py`.
The preset in src/offload/device.rs records what it printed.
"""

import statistics
import sys
import time


def median_seconds(fn, runs=5):
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    import torch

    n = 2048
    out = {}
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        s = median_seconds(lambda: torch.mm(a, b))
        out[f"{name}_flops_per_s"] = 2 * n**3 / s
    x = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    y = torch.empty_like(x)
    s = median_seconds(lambda: y.copy_(x))
    nbytes = x.numel() * 4
    out["bytes_per_s"] = 2 * nbytes / s
    out["link_bytes_per_s"] = nbytes / s
    for k, v in out.items():
        print(f"{k}: {v:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
