"""memplan as an ordering method of Inductor's peak-memory pass.

    import memplan.torch.inductor
    with memplan.torch.inductor.ordering(time_limit=2.0):
        compiled = torch.compile(model)      # graphs compiled inside use it
        loss_fn(compiled, batch).backward()

``torch.compile`` (Inductor) fuses a graph's ops into kernels, then its
``reorder_for_peak_memory`` pass tries a few topological orders of the
fused nodes (LPMF, BFS, DFS) and keeps the one its estimate says peaks
lowest. :func:`ordering` adds memplan to those methods while it is active:
each fused graph becomes a memplan graph (one op per fused node, one tensor
per buffer Inductor allocates, sized as Inductor's own estimate counts it,
the graph inputs Inductor may free as inputs, the graph's outputs alive to
the end), memplan orders it, and Inductor's pass compares memplan's order
with its own by its own estimate and keeps the lowest. So a compiled
graph's estimated peak is never above Inductor's, and is below it where
memplan finds a better order. Fusion, kernels and Inductor's buffer reuse
stay Inductor's.

What this cannot change: the order across graphs (forward, backward and
the optimizer are separate graphs to Inductor), and what AOTAutograd's
partitioner saves for the backward. :func:`memplan.torch.capture` plans
the whole step as one graph instead (updates inside the backward), but
without Inductor's fusion.

Inductor's memory planning API is internal (``torch._inductor.memory``);
:func:`ordering` raises :class:`RuntimeError` when this PyTorch lacks it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List

import memplan

__all__ = ["ordering", "graph_of", "Stats"]


class Stats:
    """What the memplan method did on the graphs compiled while
    :func:`ordering` was active: one dict per graph with ``nodes``,
    ``memplan_bytes`` (memplan's max live on its model of the graph),
    ``lower_bound_bytes`` and ``seconds``."""

    def __init__(self) -> None:
        self.graphs: List[Dict[str, Any]] = []


def _memory_module():
    try:
        from torch._inductor import memory
    except ImportError as e:  # pragma: no cover - depends on the PyTorch build
        raise RuntimeError(f"this PyTorch has no Inductor memory pass: {e}") from None
    if not hasattr(memory, "reorder_for_peak_memory"):
        raise RuntimeError("this PyTorch's Inductor has no reorder_for_peak_memory pass")
    return memory


def graph_of(nodes, graph_outputs, name: str = "inductor-graph") -> Dict[str, Any]:
    """The memplan graph of Inductor's fused `nodes` (after the pass's
    planning info is assigned): every node an op in the given order, every
    buffer a tensor of Inductor's freed size (its allocated size when
    larger), freeable graph inputs as inputs that die at their last use,
    `graph_outputs` persistent, and the pass's ordering edges as `after`."""
    tensors: Dict[str, Dict[str, Any]] = {}
    ops = []
    ids = {id(n): n.get_name() for n in nodes}

    def tensor(buf, role: str) -> str:
        key = buf.get_name()
        if key not in tensors:
            info = buf.mpi_buffer
            size = max(int(info.size_alloc), int(info.size_free))
            lifetime = "persistent" if key in graph_outputs else "transient"
            tensors[key] = {"id": key, "size": size, "role": role, "lifetime": lifetime}
        return key

    for n in nodes:
        outputs = [tensor(b, "activation") for b in n.get_outputs()]
        inputs = []
        for b in n.mpi_node.pred_buffers:
            producer = getattr(b, "defining_op", None)
            key = tensor(b, "activation" if producer is not None else "input")
            if key not in inputs and key not in outputs:
                inputs.append(key)
        after = sorted({ids[id(p)] for p in n.mpi_node.pred_nodes if id(p) in ids})
        op = {"id": n.get_name(), "kind": "other", "type": type(n).__name__,
              "inputs": inputs, "outputs": outputs}
        if after:
            op["after"] = after
        ops.append(op)
    return {"format": "memplan-graph", "version": 1, "name": name,
            "tensors": list(tensors.values()), "ops": ops}


def _method(stats: Stats, graph_outputs, time_limit: float):
    def memplan_order(nodes):
        t0 = time.perf_counter()
        g = graph_of(nodes, graph_outputs, f"inductor-graph-{len(stats.graphs)}")
        plan = memplan.plan(g, time_limit=time_limit)
        by_name = {n.get_name(): n for n in nodes}
        order = [by_name[o] for o in plan["order"]]
        stats.graphs.append({"nodes": len(nodes), "memplan_bytes": plan["stats"]["max_live_bytes"],
                             "lower_bound_bytes": plan["stats"]["lower_bound_bytes"],
                             "seconds": time.perf_counter() - t0})
        return order

    memplan_order.__name__ = "memplan"
    return memplan_order


@contextlib.contextmanager
def ordering(time_limit: float = 2.0):
    """While active, Inductor's ``reorder_for_peak_memory`` also tries
    memplan's order of each graph it compiles (within `time_limit` seconds
    per graph) and keeps whichever its estimate says peaks lowest. Yields
    a :class:`Stats`. Turns the pass on (Inductor's default), disables
    Inductor's caches and resets Dynamo's (``torch._dynamo.reset()``:
    graphs compiled before would otherwise be reused for new modules of the
    same code), so the graphs compile and the pass runs."""
    memory = _memory_module()
    import torch

    original = memory.reorder_for_peak_memory
    defaults = list(original.__defaults__[0]) if original.__defaults__ else []
    stats = Stats()

    def reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, methods=None):
        methods = list(defaults if methods is None else methods)
        methods.append(_method(stats, graph_outputs, time_limit))
        return original(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs,
                        methods=methods)

    memory.reorder_for_peak_memory = reorder
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(reorder_for_peak_memory=True), \
                torch.compiler.config.patch(force_disable_caches=True):
            yield stats
    finally:
        memory.reorder_for_peak_memory = original
