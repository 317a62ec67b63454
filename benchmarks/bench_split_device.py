"""Splitting the loss chain on a GPU, against Liger-Kernel's fused linear
cross-entropy (issue 40): ``python -m benchmarks.bench_split_device``.

The same Hugging Face Llama (random weights, AdamW, bf16 autocast with
``--bf16``) trained on CUDA four ways, in this order, each from the same
weights on the same batches:

- ``eager``: Hugging Face's loss (the logits of the whole sequence, upcast
  to float32);
- ``eager-liger``: the final hidden states fed to Liger-Kernel's
  ``LigerFusedLinearCrossEntropyLoss`` with the LM head's weight (PyPI
  ``liger-kernel``), which never holds more than a chunk of logits, as
  Liger's Hugging Face integration does;
- ``eager-chunked-ce``: torchtune's ``CEWithChunkedOutputLoss`` (8 chunks,
  :func:`benchmarks.bench_split.chunked_ce_loss`);
- ``memplan-split``: the step with Hugging Face's loss captured with
  ``split="auto"`` (or ``--chunks K``) and run in its arena.

Each side runs one untimed step (the optimizer state), then ``--steps``
timed steps; its peak is ``torch.cuda.max_memory_allocated`` over them
(cache emptied and peaks reset first: parameters, gradients, optimizer
state and the batch included), with ``max_memory_reserved`` and the median
step time beside it. The losses are compared with eager's. Prints one
JSON object; a side that fails records its error and the others go on.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any, Callable, Dict, List


def liger_loss(args) -> Callable:
    """The model's final hidden states through Liger-Kernel's fused linear
    cross-entropy with the LM head's weight (shifted labels, mean over the
    counted tokens: Hugging Face's loss)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from .bench_split import _autocast

    flce = LigerFusedLinearCrossEntropyLoss()

    def loss(m, b):
        with _autocast(args):
            h = m.model(input_ids=b).last_hidden_state
            return flce(m.lm_head.weight, h[:, :-1].reshape(-1, h.shape[-1]), b[:, 1:].reshape(-1))
    return loss


def _eager_step(model, opt, loss_fn):
    def step(b):
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _measure(step, batches, steps: int, resident) -> Dict[str, Any]:
    """One untimed step, then `steps` timed ones: the peak over them
    (CUDA's ``max_memory_allocated``; elsewhere the allocator's events over
    the last, with `resident` the tensors held around it), the median time
    and every loss."""
    import torch

    from memplan.torch._run import allocator_peak

    cuda = batches[0].is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = [float(step(batches[0]))]
    if cuda:
        sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times: List[float] = []
    for i in range(steps):
        b = batches[1 + i % (len(batches) - 1)]
        measured_here = not cuda and i == steps - 1  # (the CPU's peak: the last step's events)
        t0 = time.perf_counter()
        if measured_here:
            peak = allocator_peak(lambda: losses.append(float(step(b))), resident() + [b])
        else:
            loss = step(b)
        sync()
        times.append(time.perf_counter() - t0)
        if not measured_here:
            losses.append(float(loss))
    times.sort()
    row = {"step_seconds": times[len(times) // 2], "losses": losses}
    if cuda:
        row.update(allocated_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved())
    else:
        row.update(allocated_bytes=peak, reserved_bytes=None)
    return row


def side(args, name: str, batches) -> Dict[str, Any]:
    """One side's figures (module doc)."""
    import torch

    import memplan.torch as mt

    from .bench_split import _model, chunked_ce_loss, hf_loss

    model = _model(args).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    row: Dict[str, Any] = {}
    if name == "memplan-split":
        t0 = time.perf_counter()
        s = mt.capture(model, opt, batches[0], hf_loss(args), time_limit=args.time_limit,
                       split="auto" if args.chunks is None else args.chunks)
        row.update(capture_and_plan_seconds=time.perf_counter() - t0, arena_bytes=s.plan["arena_bytes"],
                   max_live_bytes=s.plan["stats"]["max_live_bytes"],
                   lower_bound_bytes=s.plan["stats"]["lower_bound_bytes"])
        if s.split is not None:
            row["split"] = {k: s.split[k] for k in ("chunks", "tried", "added_flops")}

        def step(b):  # in its arena on CUDA (on the CPU each tensor allocated in the planned order)
            return s(b, arena=b.is_cuda).detach()
    else:
        loss_fn = {"eager": hf_loss, "eager-liger": liger_loss, "eager-chunked-ce": chunked_ce_loss}[name](args)
        step = _eager_step(model, opt, loss_fn)

    def resident():  # (CPU) what the step holds around it: weights, optimizer state, its constants
        held = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()
                                           if isinstance(v, torch.Tensor)]
        return held + (list(s._bound.values()) if name == "memplan-split" else [])
    row.update(_measure(step, batches, args.steps, resident))
    if "arena_bytes" in row:
        row["outside_arena_bytes"] = row["allocated_bytes"] - row["arena_bytes"]
        if batches[0].is_cuda:  # which ops allocate outside the arena, most first (one more step)
            from .bench import _outside_by_op

            row["outside_ops"] = _outside_by_op(lambda: step(batches[1]), batches[0].device)
    return row


SIDES = ("eager", "eager-liger", "eager-chunked-ce", "memplan-split")


def run(args) -> Dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
               for _ in range(3)]
    out: Dict[str, Any] = {"config": dict(vars(args)), "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name()
    for name in args.sides.split(","):
        try:
            out[name] = side(args, name, batches)
        except Exception as e:  # noqa: BLE001 - one side's failure is reported; the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        r = out[name]
        print(f"{name:18} " + (r["error"] if "error" in r else
                               f"allocated {r['allocated_bytes'] / 2**30:7.3f} GiB, reserved "
                               f"{(r['reserved_bytes'] or 0) / 2**30:7.3f} GiB, step {1000 * r['step_seconds']:8.1f} ms, "
                               f"losses {', '.join(f'{x:.5f}' for x in r['losses'])}"), flush=True)
    ref = out.get("eager", {}).get("losses")
    for name in args.sides.split(","):
        r = out[name]
        if ref and "losses" in r:
            r["loss_difference"] = max(abs(a - b) for a, b in zip(r["losses"], ref))
    liger, ours = out.get("eager-liger", {}), out.get("memplan-split", {})
    if "allocated_bytes" in liger and "allocated_bytes" in ours:
        out["summary"] = {"memplan_split_peak_vs_liger": ours["allocated_bytes"] / liger["allocated_bytes"],
                          "memplan_split_time_vs_liger": ours["step_seconds"] / liger["step_seconds"]}
    return out


def main(argv=None) -> None:
    from .bench_split import model_arguments

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_split_device",
                                description=__doc__.split("\n\n")[0])
    model_arguments(p, layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, seq=4096,
                    batch=1, time_limit=10.0)
    p.add_argument("--steps", type=int, default=3, help="timed steps of each side (at least 1)")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated, from: " + ", ".join(SIDES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="also write the JSON object to this file")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    args.meta = False
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
