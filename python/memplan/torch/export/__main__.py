"""Command line: ``python -m memplan.torch.export --model resnet50 --batch 32 -o FILE``.

Run ``python -m memplan.torch.export --help`` for the options and
``docs/torch-export.md`` for what is recorded.
"""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memplan.torch.export",
        description="Record one PyTorch training step (forward, loss, backward, optimizer step) "
        "at the aten level and write it as a memplan JSON graph.",
    )
    p.add_argument("--model", help="a named workload (--list) or package.module:function")
    p.add_argument("--batch", type=int, help="batch size (default: the workload's)")
    p.add_argument("--seq", type=int, help="sequence length for language models")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--optimizer", default="adamw",
                   choices=["adamw", "adamw-forloop", "adamw-fused", "sgd"])
    p.add_argument("--update", default="memplan", choices=["memplan", "eager"],
                   help="memplan: the step memplan.torch.capture records and runs (each parameter's update "
                   "on its own); eager: the optimizer's own step() as eager PyTorch runs it, recorded as "
                   "a baseline (docs/torch-export.md)")
    p.add_argument("--trace-device", default="auto", choices=["auto", "meta", "cuda"],
                   help="auto: fake CUDA tensors when a GPU is present, else meta tensors "
                   "with CUDA's kernel choices emulated")
    p.add_argument("--align", type=int, default=256, help="alignment of every tensor in bytes")
    p.add_argument("--no-reuse-hints", action="store_true",
                   help="do not let outputs of pointwise ops take a dying input's bytes")
    p.add_argument("--measure", default="auto", choices=["auto", "yes", "no"],
                   help="also run the step for real on CUDA and record PyTorch's peaks "
                   "(auto: when a GPU is present)")
    p.add_argument("-o", "--output", help="graph file to write (.json or .json.gz)")
    p.add_argument("--list", action="store_true", help="list the named workloads")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: torch is not installed (pip install torch torchvision transformers)",
              file=sys.stderr)
        return 2
    from . import workloads
    from . import graph, step

    if args.list:
        for name, f in workloads.WORKLOADS.items():
            doc = (f.__doc__ or "").strip().splitlines()
            print(f"{name:12} {doc[0] if doc else ''}")
        return 0
    if not args.model or not args.output:
        print("error: give --model and -o/--output (or --list)", file=sys.stderr)
        return 2
    if args.align < 1 or (args.batch is not None and args.batch < 1):
        print("error: --align and --batch must be positive", file=sys.stderr)
        return 2
    try:
        d = step.export(args.model, args.batch, args.seq, args.dtype, args.optimizer,
                        args.trace_device, args.align, not args.no_reuse_hints, args.update)
        # memplan's core checks the graph and gives its eager order's max live.
        live = graph.program_order_max_live(d)
    except ValueError as e:  # MemplanError and UnsupportedStep are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    measure = args.measure == "yes" or (args.measure == "auto" and torch.cuda.is_available())
    if measure:
        if not torch.cuda.is_available():
            print("error: --measure yes needs a CUDA GPU", file=sys.stderr)
            return 2
        d["reference_peaks"] = step.measure(args.model, args.batch, args.seq, args.dtype, args.optimizer)
        d["metadata"]["measured_on"] = torch.cuda.get_device_name()
    d["metadata"]["program_order_max_live_bytes"] = live
    graph.write(d, args.output)
    print(f"wrote {args.output}: {len(d['ops'])} ops, {len(d['tensors'])} tensors, "
          f"program-order max live {live:,} bytes")
    for k, v in sorted(d.get("reference_peaks", {}).items()):
        print(f"  {k}: {v:,} bytes")
    if d["metadata"].get("unseen_storages"):
        print(f"  note: {d['metadata']['unseen_storages']} storages were first met as op arguments "
              "(recorded as inputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
