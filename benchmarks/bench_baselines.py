"""Eager PyTorch as experts configure it, against memplan, on the CPU or
(``--device cuda``) a GPU: the command line of :mod:`benchmarks.baselines`
(the sides, measured in this process) and
:mod:`benchmarks.bench_baselines_device` (each side in its own process).

    .venv/bin/python -m benchmarks.bench_baselines --models hf-gpt2,hf-llama --size small
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import torch

from . import bench_baselines_device as dev
from .baselines import largest_batches, loss_fn, measure, model_configs, report

# What tests and tools read beside the command: the sides' names.
from .baselines import CHECKPOINTING, EAGER_SIDES

__all__ = ["main", "CHECKPOINTING", "EAGER_SIDES"]


def _on_device(args) -> int:
    out = {}
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    for name in [n for n in args.models.split(",") if n]:
        r = dev.measure(name, args.size, args.batch, args.seq, args.steps, args.time_limit, args.device,
                        compile=args.compile, log=log, bf16=args.bf16)
        if args.cap is not None:
            r["largest_batch"] = dev.largest(name, args.size, args.seq, args.steps, args.time_limit, args.device,
                                             args.cap / 1024, log=log, bf16=args.bf16)
        out[name] = r
        if not args.json:
            print(dev.report(name, r))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_baselines", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="hf-gpt2,hf-llama", help="comma-separated: hf-gpt2, hf-llama")
    ap.add_argument("--size", choices=("tiny", "small", "medium", "1b"), default="small",
                    help="1b: GPT-2 XL and Llama 3.2 1B's shape (for a GPU)")
    ap.add_argument("--bf16", action="store_true", help="the loss under bf16 autocast on every side")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--cap", type=float, metavar="MIB", help="also the largest batch whose step fits MIB MiB")
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds for each plan and fit")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile with Inductor's defaults (minutes of compiling on a CPU)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--device", default="cpu",
                    help="cuda: every side in its own process, expandable segments off and on, "
                         "torch.cuda.max_memory_*, timed (benchmarks.bench_baselines_device)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each side (with --device)")
    args = ap.parse_args(argv)
    if args.device != "cpu":
        return _on_device(args)
    torch.set_num_threads(1)
    configs = model_configs(args.size)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: choose from {', '.join(configs)}")
    out = {}
    for name in names:
        make = configs[name]
        vocab = make.vocab_size
        r = measure(make, args.batch, args.seq, vocab, args.time_limit, args.compile, loss_fn(args.bf16))
        if args.cap is not None:
            r["largest_batch"] = largest_batches(make, args.seq, vocab, int(args.cap * 2 ** 20),
                                                 time_limit=args.time_limit, lm=loss_fn(args.bf16))
        out[name] = r
        if not args.json:
            print(report(name, r))
            if "largest_batch" in r:
                lb = r["largest_batch"]
                print(f"largest batch in {args.cap:g} MiB: " + ", ".join(
                    f"{k} {v}" for k, v in lb.items() if k != "cap_bytes"))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
