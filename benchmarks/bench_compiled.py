"""memplan's planned step with Inductor's kernels against ``torch.compile``
(issue 57's CPU comparison): the same model, weights, batches and AdamW on
every side, each side's step timed (median of `steps` after two warm-up
steps that compile and make the optimizer state) and its peak measured
from the allocator's events over one more step.

    python -m benchmarks.bench_compiled                           # Llama 8 x 512 and GPT-2 6 x 512, seq 512, b4, f32
    python -m benchmarks.bench_compiled --bf16 --json out.json    # under bf16 autocast
    python -m benchmarks.bench_compiled --cap 1300                # each side's largest batch in 1300 MiB, tokens/s

The sides:

- ``eager``: ``loss.backward(); optimizer.step(); zero_grad()``;
- ``compile``: the model compiled with Inductor's defaults and the AdamW
  step compiled too (``torch.compile`` of a function calling
  ``optimizer.step()``), as the PyTorch tutorial on compiled optimizers
  does;
- ``compile-amb-0.5`` (``--budget``): the same with the partitioner's
  ``activation_memory_budget`` at 0.5 (Inductor recomputes to hold about
  half the activations);
- ``memplan``: the captured step in memplan's order, aten's kernels;
- ``memplan-inductor``: the same plan, its regions compiled by Inductor
  (``kernels="inductor"``, docs/compiled.md);
- ``memplan-fit-0.1%`` and ``memplan-fit-0.1%-inductor``: the smallest
  step memplan finds for at most 0.1% more FLOPs
  (``capture(..., max_added=0.001)``), with each kind of kernels.

Every side's losses are compared with the first side's (eager's, by
default). A peak is the bytes of the
tensors held across steps (parameters, buffers, the optimizer's state, the
batch) plus the highest running sum of the allocator's events during the
step (:func:`memplan.torch._run.allocator_peak`), so compiled kernels' own
buffers count. Times are ratios inside one run on a shared machine:
compare sides, not runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

from memplan.torch import capture
from memplan.torch._run import allocator_peak
from memplan.torch.export.workloads import hf_gpt2, hf_llama, lm_loss, lm_loss_bf16

from . import largest_batch

SIDES = ("eager", "compile", "memplan", "memplan-inductor", "memplan-fit-0.1%", "memplan-fit-0.1%-inductor")


def models(layers: Dict[str, int], hidden: int, vocab: int) -> Dict[str, Callable[[], torch.nn.Module]]:
    """name -> a function making the model (the same weights each call)."""
    def llama():
        torch.manual_seed(0)
        return hf_llama("4l-256", num_hidden_layers=layers["hf-llama"], hidden_size=hidden,
                        intermediate_size=hidden * 43 // 16, num_attention_heads=hidden // 64,
                        num_key_value_heads=hidden // 64, vocab_size=vocab, max_position_embeddings=2048)

    def gpt2():
        torch.manual_seed(0)
        return hf_gpt2("4l-256", n_layer=layers["hf-gpt2"], n_embd=hidden, n_head=hidden // 64, vocab_size=vocab,
                       n_positions=2048)
    return {"hf-llama": llama, "hf-gpt2": gpt2}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False)


def _side(side: str, model, loss_fn, batch, time_limit: float):
    """(step function returning the loss, optimizer, extra figures,
    memplan's step object or None)."""
    opt = _adamw(model.parameters())
    extra: Dict[str, Any] = {}
    if side == "eager" or side.startswith("compile"):
        fwd = model if side == "eager" else torch.compile(model)

        def update():
            opt.step()
        update = update if side == "eager" else torch.compile(update)

        def step(b):
            loss = loss_fn(fwd, b)
            loss.backward()
            update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step, opt, extra, None
    kernels = "inductor" if side.endswith("-inductor") else "eager"
    s = capture(model, opt, batch, loss_fn, time_limit=time_limit, kernels=kernels)
    if side.startswith("memplan-fit-0.1%"):
        f = s.fit(max_added=0.001, minimise="flops", time_limit=time_limit)
        extra["added_flops_share"] = f["added_flops"] / f["step_flops"]  # (of the cost model's FLOPs)
    st = s.plan["stats"]
    extra.update(max_live_bytes=st["max_live_bytes"], lower_bound_bytes=st["lower_bound_bytes"],
                 capture_seconds=s.stats["capture_seconds"])
    return (lambda b: s(b)), opt, extra, s


def run_side(side: str, make, loss_fn, batches, steps: int, time_limit: float) -> Dict[str, Any]:
    if side.startswith("compile-amb-"):  # the partitioner's budget, for this side's compiles only
        import torch._functorch.config

        with torch._functorch.config.patch(activation_memory_budget=float(side.rsplit("-", 1)[1])):
            return _run_side(side, make, loss_fn, batches, steps, time_limit)
    return _run_side(side, make, loss_fn, batches, steps, time_limit)


def _run_side(side: str, make, loss_fn, batches, steps: int, time_limit: float) -> Dict[str, Any]:
    model = make()
    t0 = time.perf_counter()
    step, opt, extra, s = _side(side, model, loss_fn, batches[0], time_limit)
    losses = [float(step(batches[0])), float(step(batches[1]))]
    first = time.perf_counter() - t0  # setup, capture and plan, compiles, two steps
    times: List[float] = []
    for k in range(steps):
        t = time.perf_counter()
        losses.append(float(step(batches[k % len(batches)])))
        times.append(time.perf_counter() - t)
    resident = (list(model.parameters()) + list(model.buffers()) + list(batches)
                + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    peak = allocator_peak(lambda: step(batches[0]), resident)
    if s is not None and "inductor" in s.stats:
        ind = s.stats["inductor"]
        extra.update(regions=ind["regions"], compiled_regions=ind["compiled_regions"],
                     fused_max_live_bytes=ind["fused_max_live_bytes"])
    return dict(extra, step_seconds=statistics.median(times), peak_bytes=peak, losses=losses,
                setup_and_first_steps_seconds=first)


def measure(model: str, make, loss_fn, batch: int, seq: int, vocab: int, steps: int, time_limit: float,
            sides=SIDES, log=print) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(3)]
    rows: Dict[str, Dict[str, Any]] = {}
    for side in sides:
        rows[side] = run_side(side, make, loss_fn, batches, steps, time_limit)
        torch._dynamo.reset()  # (no side reuses another's compiled graphs)
        r = rows[side]
        r["loss_difference"] = max(abs(a - b) for a, b in zip(r["losses"], rows[sides[0]]["losses"]))
        log(f"{model:9} {side:18} step {1000 * r['step_seconds']:9.1f} ms  peak {r['peak_bytes'] / 2 ** 20:8.1f} MiB"
            f"  loss diff {r['loss_difference']:.2e}  setup+2 steps {r['setup_and_first_steps_seconds']:6.1f} s")
    return rows


def largest(model: str, make, loss_fn, cap_bytes: int, seq: int, vocab: int, steps: int, time_limit: float,
            sides=SIDES, upto: int = 16, log=print) -> Dict[str, Any]:
    """Each side's largest batch (at most `upto`) whose measured peak is
    within `cap_bytes`, and its tokens per second: batches doubled from 1
    until one does not fit, then the gap bisected, each batch run afresh
    (a new model, side and compile) as in :func:`measure`."""
    rows: Dict[str, Dict[str, Any]] = {}
    for side in sides:
        tried: Dict[int, Dict[str, Any]] = {}

        def fits(b: int) -> bool:
            g = torch.Generator().manual_seed(1)
            batches = [torch.randint(0, vocab, (b, seq), generator=g) for _ in range(3)]
            tried[b] = run_side(side, make, loss_fn, batches, steps, time_limit)
            torch._dynamo.reset()
            return tried[b]["peak_bytes"] <= cap_bytes
        good = largest_batch(fits, upto)
        row: Dict[str, Any] = {"largest_batch": good, "peaks_by_batch": {k: r["peak_bytes"] for k, r in tried.items()}}
        if good:
            r = tried[good]
            row.update(peak_bytes=r["peak_bytes"], step_seconds=r["step_seconds"],
                       tokens_per_second=good * seq / r["step_seconds"])
        rows[side] = row
        log(f"{model:9} {side:26} within {cap_bytes / 2 ** 20:g} MiB: batch {good:3}" + (
            f"  peak {row['peak_bytes'] / 2 ** 20:8.1f} MiB  {row['tokens_per_second']:8.1f} tokens/s" if good else ""))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="hf-llama,hf-gpt2")
    ap.add_argument("--llama-layers", type=int, default=8)
    ap.add_argument("--gpt2-layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--bf16", action="store_true", help="the forward under bf16 autocast (f32 parameters)")
    ap.add_argument("--budget", type=float, help="also torch.compile with this activation_memory_budget")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--cap", type=float, help="instead: each side's largest batch within CAP MiB, and its tokens/s")
    ap.add_argument("--upto", type=int, default=16, help="the largest batch --cap tries")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    sides = tuple(a.sides.split(","))
    if a.budget is not None:
        sides += (f"compile-amb-{a.budget:g}",)
    makers = models({"hf-llama": a.llama_layers, "hf-gpt2": a.gpt2_layers}, a.hidden, a.vocab)
    loss_fn = lm_loss_bf16 if a.bf16 else lm_loss
    out: Dict[str, Any] = {"spec": vars(a), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for name in a.models.split(","):
        if a.cap is not None:
            out[name] = largest(name, makers[name], loss_fn, int(a.cap * 2 ** 20), a.seq, a.vocab, a.steps,
                                a.time_limit, sides, a.upto)
        else:
            out[name] = measure(name, makers[name], loss_fn, a.batch, a.seq, a.vocab, a.steps, a.time_limit, sides)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
