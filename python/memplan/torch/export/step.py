"""Drives one training step: warm-up, then the traced step; optionally a real
step on a GPU to measure PyTorch's own peaks.

The step is the usual eager loop body::

    loss = workload.loss(model, batch)      # forward   (ops kind "forward")
    loss.backward()                         # backward  (ops kind "backward")
    optimizer.step()                        # optimizer (ops kind "optimizer")
    optimizer.zero_grad(set_to_none=True)   # no op: the gradients die

One untraced warm-up step runs first, so the optimizer state (AdamW's
``exp_avg``, ``exp_avg_sq`` and ``step``) exists before the traced step and is
a persistent step input, as in every step of a long run but the first. The
warm-up ends with ``zero_grad(set_to_none=True)``, so the traced step starts
with no gradients: each ``.grad`` is made by the backward pass and dies after
its last use in ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any, Callable, Dict, Optional

import torch

from . import emulate, workloads
from .graph import GraphBuilder
from .recorder import Recorder
from .._record import TORCH_DTYPES

# name -> (constructor, description). foreach is PyTorch's default on CUDA.
OPTIMIZERS: Dict[str, Any] = {
    "adamw": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
        "AdamW(lr=1e-4, weight_decay=0.01, foreach=True): PyTorch's default implementation on CUDA",
    ),
    "adamw-forloop": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=False),
        "AdamW(lr=1e-4, weight_decay=0.01, foreach=False): one parameter at a time",
    ),
    "adamw-fused": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
        "AdamW(lr=1e-4, weight_decay=0.01, fused=True)",
    ),
    "sgd": (
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "SGD(lr=1e-2, momentum=0.9, foreach=True)",
    ),
}

# The step types --dtype takes, by their names in the graph.
DTYPES = {name: TORCH_DTYPES[name] for name in ("f32", "bf16", "f16")}


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name][0](list(model.parameters()))


def run_step(w: workloads.Workload, opt: torch.optim.Optimizer, rec: Optional[Recorder] = None):
    """One training step; with a recorder, sets its phase and marks the loss
    and the gradients. Returns the loss tensor."""
    if rec is not None:
        rec.phase = "forward"
    loss = w.loss(w.model, w.batch)
    if loss.dim() != 0:
        raise ValueError(f"{w.name}: the loss must be a scalar, got shape {tuple(loss.shape)}")
    if rec is not None:
        rec.mark(loss, "output", persistent=True)
        rec.phase = "backward"
    loss.backward()
    if rec is not None:
        for name, p in w.model.named_parameters():
            if p.grad is not None and rec.root_of(p.grad) is not None:
                rec.mark(p.grad, "gradient")
        rec.phase = "optimizer"
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def resolve_trace_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "meta"
    if device not in ("meta", "cuda"):
        raise ValueError(f"--trace-device must be auto, meta or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--trace-device cuda needs a CUDA GPU (the autograd engine needs one)")
    return device


def build(factory: Callable[..., workloads.Workload], device: str, batch, seq, dtype, ctx):
    kwargs = {"dtype": dtype}
    if batch is not None:
        kwargs["batch"] = batch
    if seq is not None:
        kwargs["seq"] = seq
    with ctx, torch.device(device):
        return factory(**kwargs)


def export(
    model: str,
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    dtype: str = "f32",
    optimizer: str = "adamw",
    trace_device: str = "auto",
    align: int = 256,
    reuse_hints: bool = True,
) -> GraphBuilder:
    """Records one training step of a workload and returns its graph."""
    factory = workloads.resolve(model)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    device = resolve_trace_device(trace_device)
    if device == "cuda":
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode_ctx: Any = FakeTensorMode()
        emul: Any = contextlib.nullcontext()
    else:
        mode_ctx = contextlib.nullcontext()
        emul = emulate.CudaEmulation()
    w = build(factory, device, batch, seq, DTYPES[dtype], mode_ctx)
    w.model.train()
    opt = make_optimizer(optimizer, w.model)
    label = f"{w.name}_b{w.config.get('batch', batch)}"
    rec = Recorder(label, device, align=align, reuse_hints=reuse_hints)
    with mode_ctx, emul, emulate.EagerDataChecks():
        run_step(w, opt, None)  # warm-up: makes the optimizer state
        pnames = {}
        for name, p in w.model.named_parameters():
            rec.register(p, f"param:{name}", "parameter", persistent=True)
            pnames[p] = name
        for name, b in w.model.named_buffers():
            rec.register(b, f"buffer:{name}", "parameter", persistent=True)
        for p, state in opt.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    rec.register(v, f"state:{pnames.get(p, id(p))}.{k}", "optimizer_state", True)
        for name, x in w.batch.items():
            rec.register(x, f"input:{name}", "input", persistent=False)
        with rec:
            run_step(w, opt, rec)
    g = rec.finish()
    kinds: Dict[str, int] = {}
    for o in g.ops:
        kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
    g.metadata.update(
        {
            "source": "memplan.torch.export",
            "model": w.name,
            "config": w.config,
            "batch": w.config.get("batch", batch),
            "dtype": dtype,
            "optimizer": OPTIMIZERS[optimizer][1],
            "trace_device": device,
            "cuda_emulation": device == "meta",
            "align": align,
            "reuse_hints": reuse_hints,
            "ops_by_kind": kinds,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in w.model.parameters()),
            "unseen_storages": rec.unseen_storages,
            "resized_storages": rec.resized_storages,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
    )
    return g


class CudaStats:
    """PyTorch's own peak counters on the current CUDA device."""

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peaks(self) -> Dict[str, int]:
        return {
            "torch-allocated": int(torch.cuda.max_memory_allocated()),
            "torch-reserved": int(torch.cuda.max_memory_reserved()),
        }


def measure(
    model: str,
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    dtype: str = "f32",
    optimizer: str = "adamw",
    device: str = "cuda",
    stats: Any = None,
    observe: Optional[Callable[[str, workloads.Workload, Any], None]] = None,
) -> Dict[str, int]:
    """Runs the same step for real (warm-up, then the measured step) and
    returns the peaks PyTorch reports for the measured step.

    The counters are reset after the warm-up, when parameters, buffers,
    optimizer state and the batch are allocated and no gradient is: the state
    the traced graph starts from. The reserved peak includes the segments the
    warm-up left cached, as in any step of a long run. ``stats`` stands for
    CUDA's counters (:class:`CudaStats` by default); ``observe(stage, workload,
    optimizer)`` is called at the reset (``"reset"``) and after the measured
    step (``"end"``), for tests.
    """
    stats = stats if stats is not None else CudaStats()
    factory = workloads.resolve(model)
    w = build(factory, device, batch, seq, DTYPES[dtype], contextlib.nullcontext())
    w.model.train()
    opt = make_optimizer(optimizer, w.model)
    run_step(w, opt, None)
    stats.synchronize()
    if observe is not None:
        observe("reset", w, opt)
    stats.reset()
    loss = run_step(w, opt, None)
    stats.synchronize()
    peaks = stats.peaks()
    if observe is not None:
        observe("end", w, opt)
    if not torch.isfinite(loss).item():
        raise RuntimeError(f"{w.name}: the measured step's loss is not finite ({loss.item()})")
    return peaks
