"""``python -m memplan.torch.estimate``: what one rank of a training
configuration needs, before renting the GPUs (the function is
:func:`memplan.torch.estimate`; docs/estimate.md).

    python -m memplan.torch.estimate --torchtitan 8B --world 8 --seq 8192 --ac selective \\
        --device-memory 80GiB

captures one rank's step on the meta device under PyTorch's fake process
group and prints FSDP2 eager's memory (default allocator, expandable
segments), memplan's plan and fit, the lower bound and, with
``--device-memory``, the largest micro-batch each fits. ``--json`` prints
the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    from memplan.torch import _estimate, _estimate_model

    p = argparse.ArgumentParser(prog="python -m memplan.torch.estimate",
                                description="One rank's memory for a training configuration, estimated without "
                                            "the ranks or the GPUs (one process, the meta device, PyTorch's fake "
                                            "process group).")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", help="a Hugging Face config.json (or its folder): its causal LM")
    model.add_argument("--torchtitan", metavar="FLAVOR", help="a torchtitan Llama 3 flavor (debugmodel, 8B, 70B, ...)")
    p.add_argument("--layers", type=int, help="override the model's number of blocks")
    p.add_argument("--world", type=int, help="ranks in all (dp_shard is what the other sizes leave)")
    p.add_argument("--dp-shard", type=int, help="FSDP2's shard size")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas of each shard (HSDP when > 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (not captured yet: refused above 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (refused above 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (refused above 1)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch and rank (default 1)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--mixed-precision", choices=_estimate.PRECISIONS, default="bf16",
                   help="bf16: FSDP2's bf16 parameters and float32 reduction, as torchtitan (default); fp32")
    p.add_argument("--ac", choices=_estimate_model.AC_MODES, default="none",
                   help="activation checkpointing, torchtitan's modes (selective: every second block)")
    p.add_argument("--optimizer", choices=tuple(_estimate.OPTIMIZERS), default="adamw")
    p.add_argument("--clip-grad-norm", type=float, help="max norm (torchtitan's flavors: 1.0 unless given)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the device FSDP2 eager is simulated on (cpu: to compare with gloo runs)")
    p.add_argument("--device-memory", help="also the largest micro-batch each side fits in this much (80GiB)")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds for the plan and for the fit")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import memplan
    import memplan.torch
    from memplan.torch import _estimate

    try:
        r = memplan.torch.estimate(args.config, torchtitan=args.torchtitan, layers=args.layers,
                               world=args.world, dp_shard=args.dp_shard,
                               dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp, ep=args.ep, seq=args.seq,
                               micro_batch=args.micro_batch, accumulate=args.accumulate,
                               mixed_precision=args.mixed_precision, ac=args.ac, optimizer=args.optimizer,
                               clip_grad_norm=args.clip_grad_norm, device=args.device,
                               device_memory=args.device_memory, time_limit=args.time_limit,
                               progress=not args.no_progress and sys.stderr.isatty())
    except memplan.MemplanError as e:
        print(f"memplan estimate: {e}", file=sys.stderr)
        return 1
    print(json.dumps(r, indent=2) if args.json else _estimate.table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
