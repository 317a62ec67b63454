"""Records one training step of a workload as a graph, and optionally runs
it for real on a GPU to measure PyTorch's own peaks.

The step is the usual eager loop body::

    loss = workload.loss(model, batch)      # forward   (ops kind "forward")
    loss.backward()                         # backward  (ops kind "backward")
    optimizer.step()                        # optimizer (ops kind "optimizer")
    optimizer.zero_grad(set_to_none=True)   # no op: the gradients die

It is recorded one of two ways (``update``), both by memplan.torch's one
recorder (:class:`memplan.torch._record.Recorder`):

- ``"memplan"`` (the default): :func:`memplan.torch.capture` with
  ``plan=False``, so the graph is the very step ``memplan.torch`` plans and
  runs: each parameter's update on its own (``_foreach`` kernels over one
  parameter), which memplan may place inside the backward pass, and the
  optimizer state made as the first ``step()`` makes it.
- ``"eager"``: the optimizer's own ``step()`` as eager PyTorch runs it (one
  ``_foreach`` kernel over all parameters, or the fused kernel), after one
  untraced warm-up step that makes the optimizer state. The graph is eager's
  own, for comparing against; it is recorded, not replayed.

Either way the traced step starts with no gradient: each ``.grad`` is made
by the backward pass and dies after its last use in the update.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any, Callable, Dict, Optional

import torch

from . import workloads
from . import emulate
from .._record import Recorder
from .._tensors import TORCH_DTYPES

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

# How the update is recorded: name -> description (the module docs).
UPDATES = {
    "memplan": "each parameter's update as memplan.torch.capture records and runs it",
    "eager": "the optimizer's own step() as eager PyTorch runs it (recorded, not replayed)",
}

# The step types --dtype takes, by their names in the graph.
DTYPES = {name: TORCH_DTYPES[name] for name in ("f32", "bf16", "f16")}


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name][0](list(model.parameters()))


def run_step(w: workloads.Workload, opt: torch.optim.Optimizer, rec: Optional[Recorder] = None):
    """One eager training step; with a recorder, sets its phase and marks
    the loss and the gradients. Returns the loss tensor."""
    if rec is not None:
        rec.phase = "forward"
    loss = w.loss(w.model, w.batch)
    if loss.dim() != 0:
        raise ValueError(f"{w.name}: the loss must be a scalar, got shape {tuple(loss.shape)}")
    if rec is not None:
        rec.table.mark(loss, "output", persistent=True)
        rec.phase = "backward"
    loss.backward()
    if rec is not None:
        for p in w.model.parameters():
            r = rec.table.root_of(p.grad) if p.grad is not None else None
            if r is not None:
                rec.table.tensors[r]["role"] = "gradient"
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


def _captured(w: workloads.Workload, opt, device: str, align: int, label: str) -> Dict[str, Any]:
    """The step as :func:`memplan.torch.capture` records it (``plan=False``):
    the workload is built on ``meta`` and traced as `device`."""
    import memplan.torch

    step = memplan.torch.capture(w.model, opt, w.batch, w.loss, plan=False, align=align, name=label,
                                 meta_device=device)
    return step.graph


def _eager(w: workloads.Workload, opt, device: str, align: int, label: str) -> Dict[str, Any]:
    """Eager's own step recorded after a warm-up step: the workload's
    tensors are real ``meta`` tensors, or fake ``cuda`` ones."""
    rec = Recorder(device, align, replay=False)
    run_step(w, opt, None)  # warm-up: makes the optimizer state
    pnames = {}
    for name, p in w.model.named_parameters():
        rec.table.register(p, f"param:{name}", "parameter")
        pnames[p] = name
    for name, b in w.model.named_buffers():
        rec.table.register(b, f"buffer:{name}", "parameter")
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                rec.table.register(v, f"state:{pnames.get(p, id(p))}.{k}", "optimizer_state")
    for name, x in w.batch.items():
        rec.table.register(x, f"input:{name}", "input")
    with rec:
        run_step(w, opt, rec)
    d = rec.finish(label, {})
    d["metadata"]["unseen_storages"] = rec.unseen_storages
    return d


def export(
    model: str,
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    dtype: str = "f32",
    optimizer: str = "adamw",
    trace_device: str = "auto",
    align: int = 256,
    reuse_hints: bool = True,
    update: str = "memplan",
) -> Dict[str, Any]:
    """Records one training step of a workload and returns its graph
    document (docs/graph-format.md)."""
    factory = workloads.resolve(model)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if update not in UPDATES:
        raise ValueError(f"unknown update {update!r}: choose one of {', '.join(UPDATES)}")
    device = resolve_trace_device(trace_device)
    # On meta, CUDA's kernel choices are emulated; on a GPU machine the
    # tensors are fake CUDA tensors, which take them on their own.
    emul: Any = emulate.CudaEmulation() if device == "meta" else contextlib.nullcontext()
    if update == "eager" and device == "cuda":
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode: Any = FakeTensorMode()
        w = build(factory, device, batch, seq, DTYPES[dtype], mode)
    else:
        mode = contextlib.nullcontext()
        w = build(factory, "meta", batch, seq, DTYPES[dtype], mode)
    w.model.train()
    opt = make_optimizer(optimizer, w.model)
    label = f"{w.name}_b{w.config.get('batch', batch)}"
    with mode, emul, emulate.EagerDataChecks():
        if update == "eager":
            d = _eager(w, opt, device, align, label)
        else:
            d = _captured(w, opt, device, align, label)
    if not reuse_hints:
        for o in d["ops"]:
            o.pop("reuse", None)
    kinds: Dict[str, int] = {}
    for o in d["ops"]:
        kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
    d["metadata"].update(
        {
            "source": "memplan.torch.export",
            "model": w.name,
            "config": w.config,
            "batch": w.config.get("batch", batch),
            "dtype": dtype,
            "optimizer": OPTIMIZERS[optimizer][1],
            "update": update,
            "trace_device": device,
            "cuda_emulation": device == "meta",
            "align": align,
            "reuse_hints": reuse_hints,
            "ops_by_kind": kinds,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in w.model.parameters()),
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
    )
    return d


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
