"""Offloaded steps (``step.fit(budget, offload=True)``, docs/offload.md):
the Rust core chooses which tensors leave the device and when they come
back (``memplan.fit(..., offload=...)``), and writes the step with its
copies: an offloaded step input (a parameter, optimizer state, the batch)
moves to host memory (``"space": "host"``) and keeps its index, another
tensor ``T`` gets a host tensor ``offload.T``, each later residency is a
new device tensor ``reload<j>.T``, and the copies are ops of types
``copy_to_host`` and ``copy_to_device``. This module maps those copies to
calls; the compute ops are the captured ones with their arguments
redirected (:func:`memplan.torch._fitting.recomputed_program`).

On the CPU the host pool is a second set of storages beside the step's
own: a copy to the host is made outside the step's dispatch modes, so the
storage tracker counts device bytes only (``track=True`` gives the
device's peak, which the plan's max live bounds), and a copy to the device
is an ordinary clone. The values are the same bits either way: a copy is
a copy. On CUDA the host pool would be pinned memory on side streams; that
is not run yet, and is refused by name.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._calls import Call, Ref
from ._errors import UnsupportedStep

COPIES = ("copy_to_host", "copy_to_device")


def to_device(host: torch.Tensor) -> torch.Tensor:
    """A residency's device tensor: a copy of the host one, seen by the
    step's dispatch modes (the tracker counts it)."""
    return host.clone()


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A tensor's host copy, made outside the step's dispatch modes: the
    host pool is not device memory."""
    with _disable_current_modes():
        return x.clone()


def write_back(host: torch.Tensor, x: torch.Tensor) -> None:
    """The last write of an offloaded step input, copied into the input
    the caller holds (a parameter, a moment) in the host pool."""
    with _disable_current_modes():
        host.copy_(x)


def host_tensors(graph: Dict[str, Any]) -> Set[int]:
    """The indices of `graph`'s tensors in host memory."""
    return {i for i, t in enumerate(graph["tensors"]) if t.get("space") == "host"}


def copy_call(op: Dict[str, Any], index: Dict[str, int]) -> Call:
    """The call of one copy op of the offloaded graph."""
    ins = [index[t] for t in op.get("inputs", [])]
    outs = [index[t] for t in op.get("outputs", [])]
    ups = [index[t] for t in op.get("updates", [])]
    if op["type"] == "copy_to_device" and len(ins) == 1 and len(outs) == 1 and not ups:
        return Call(to_device, (Ref(ins[0]),), {}, [(0, outs[0])])
    if op["type"] == "copy_to_host" and len(ins) == 1 and len(outs) == 1 and not ups:
        return Call(to_host, (Ref(ins[0]),), {}, [(0, outs[0])])
    if op["type"] == "copy_to_host" and len(ins) == 1 and not outs and len(ups) == 1:
        return Call(write_back, (Ref(ups[0]), Ref(ins[0])), {}, [], writes=frozenset({0}))
    raise UnsupportedStep(f"offloaded step: copy op {op['id']!r} ({op['type']}) has "
                          f"{len(ins)} inputs, {len(outs)} outputs and {len(ups)} updates; "
                          "memplan.torch runs a copy of one tensor into one place")


def copy_layouts(fitted: Dict[str, Any], layouts: List[Optional[Any]]) -> None:
    """Gives each tensor a copy makes the layout of the tensor it copies
    (a reload of an offload copy takes it from that copy, in whatever
    order the graph lists the two)."""
    index = {t["id"]: i for i, t in enumerate(fitted["tensors"])}
    pairs = [(index[src], index[dst]) for op in fitted["ops"] if op.get("type") in COPIES
             for src, dst in zip(op.get("inputs", []), op.get("outputs", []))]
    changed = True
    while changed:
        changed = False
        for src, dst in pairs:
            if layouts[dst] is None and layouts[src] is not None:
                layouts[dst] = layouts[src]
                changed = True


def refuse(device: str, dist: Any, split: Optional[Dict[str, Any]]) -> None:
    """What an offloaded step does not run yet, by name."""
    if device != "cpu":
        raise UnsupportedStep(f"offload: memplan.torch runs offloaded steps on the CPU only so far (this step is "
                              f"on {device!r}; pinned host copies on side streams are not written yet). "
                              "memplan.fit(step.graph, ..., offload=True) plans it")
    if dist is not None:
        raise UnsupportedStep("offload: a data-parallel or sharded step is not offloaded yet; fit it by "
                              "recomputation (step.fit(budget)) or offload a single-process step")
    if split is not None and split.get("chunks", 1) > 1:
        raise UnsupportedStep("offload: a split step is not offloaded (memplan fit refuses --split with "
                              "--offload too); capture without split")


def refuse_arena(host: Set[int]) -> None:
    """The arena holds device tensors; an offloaded step (one with `host`
    tensors) runs outside it."""
    if host:
        raise UnsupportedStep("an offloaded step runs outside the arena so far (its host pool has no places "
                              "yet): run it with arena=False and graph=False")
