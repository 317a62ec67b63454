"""The planned step with Inductor's kernels (``kernels="inductor"``).

memplan's core chooses the regions (:func:`memplan.fuse`): runs of
consecutive ops of the planned order that write nothing in place, grown
while the fused program's live bytes stay within the plan's max live, so
fusing never raises the step's peak. This module only turns each region
into an FX graph of the aten calls it stands for (:func:`_region_graph`),
compiles it with Inductor on its first run, and runs it in the region's
place (:class:`Region`, a callable in a :class:`~memplan.torch._calls.Call`
of the program). Intermediates inside a region are Inductor's: it fuses
them into its kernels or holds them in its own buffers (the fused plan
gives each region a workspace of their most bytes live at once in the
planned order).

What is never compiled, and runs as recorded: ops writing in place (the
optimizer's updates, a gradient's accumulation), random draws, collectives,
the driver's own calls (generator states, clipping), calls that are not
aten or prims ops, ops whose results are not a tensor, a tuple or a list
of them, and ops the gradient scaler gates.

A region Inductor fails to compile, or whose compiled results do not alias
what the recorded step's views alias, runs with eager kernels (its FX
graph calls the recorded aten ops), with a warning naming it: never a
crash, never a different step. Compiled regions are kept for the step's
later runs and shared by regions of the same ops on the same layouts (a
model's repeated blocks compile once); Inductor's own cache keeps them
across processes.
"""

from __future__ import annotations

import operator
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

import memplan

from ._calls import Call, Ref

# (FX code, input layouts, options) -> compiled callable, shared by steps.
_COMPILED: Dict[tuple, Any] = {}


def _flat_results(func) -> Optional[str]:
    """How `func`'s result is flattened: ``"one"`` (a tensor), ``"tuple"``
    (positions of a tuple) or ``"list"`` (a list of tensors); None when
    it is anything else (nested lists, no result)."""
    returns = func._schema.returns
    if not returns:
        return None
    kinds = [str(r.type) for r in returns]
    if any("[]" in k and len(kinds) > 1 for k in kinds):
        return None
    if len(kinds) == 1:
        return "list" if kinds[0].startswith("Tensor[]") or kinds[0].startswith("List[Tensor]") else "one"
    return "tuple"


def compilable(c: Call) -> bool:
    """Whether a recorded call may go into a region (module docs)."""
    f = c.func
    return (isinstance(f, torch._ops.OpOverload) and f.namespace in ("aten", "prims") and not c.random
            and not c.writes and _flat_results(f) is not None)


def _region_graph(calls: Sequence[Call], members: Sequence[int], inputs: Sequence[int],
                  outputs: Sequence[int]) -> fx.GraphModule:
    """The FX graph of calls `members`: graph tensors `inputs` in, `outputs` out."""
    g = fx.Graph()
    node: Dict[int, fx.Node] = {i: g.placeholder(f"t{n}") for n, i in enumerate(inputs)}

    def arg(x):
        return node[x.index] if isinstance(x, Ref) else x

    for k in members:
        c = calls[k]
        n = g.call_function(c.func, tree_map(arg, c.args), tree_map(arg, c.kwargs))
        how = _flat_results(c.func)
        for pos, i in c.outputs:
            node[i] = n if how == "one" else g.call_function(operator.getitem, (n, pos))
    g.output(tuple(node[i] for i in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def _layout(x) -> tuple:
    if not isinstance(x, torch.Tensor):
        return (type(x).__name__, x)
    return (tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, str(x.device))


class Region:
    """One region's callable: compiled on its first call, then run as
    compiled (or with eager kernels when Inductor failed, module docs).
    `aliases` pairs an output position with the input or output position
    whose storage it must share (``("in", p)`` or ``("out", p)``)."""

    def __init__(self, name: str, gm: fx.GraphModule, options: Dict[str, Any],
                 aliases: List[Tuple[int, str, int]], first_op: str) -> None:
        self.name = name
        self.gm = gm
        self.options = options
        self.aliases = aliases
        self.first_op = first_op
        self.fn = None
        self.eager = False  # fell back to eager kernels
        self.seconds = 0.0  # compiling

    def __call__(self, *args):
        if self.fn is None:
            return self._first(args)
        return self.fn(*args)

    def _first(self, args):
        t0 = time.perf_counter()
        key = (self.gm.code, tuple(_layout(a) for a in args), tuple(sorted(self.options.items(), key=str)))
        fn = _COMPILED.get(key)
        if fn is None:
            try:
                fn = torch._inductor.compile(self.gm, list(args), options=dict(self.options))
            except Exception as e:  # noqa: BLE001 - any failure of the compiler falls back
                self._fall_back(f"Inductor failed to compile it ({type(e).__name__}: {str(e)[:200]})")
                fn = self.gm
        out = fn(*args)
        if fn is not self.gm and not self._aliased(args, out):
            self._fall_back("its compiled results do not share storage as the recorded views do")
            fn, out = self.gm, self.gm(*args)
        elif fn is not self.gm:
            _COMPILED[key] = fn
        self.fn = fn
        self.seconds = time.perf_counter() - t0
        return out

    def _aliased(self, args, out) -> bool:
        def storage(x):
            return x.untyped_storage().data_ptr()
        return all(storage(out[p]) == storage((args if side == "in" else out)[q]) for p, side, q in self.aliases)

    def _fall_back(self, why: str) -> None:
        self.eager = True
        warnings.warn(f"memplan region {self.name} (from op {self.first_op}): {why}; it runs with eager kernels",
                      stacklevel=4)


class Fused:
    """What ``kernels="inductor"`` made of a planned step: the program's
    extra calls (one per region), the core's answer (`report`) and the
    regions."""

    def __init__(self, report: Dict[str, Any], regions: List[Region]) -> None:
        self.report = report
        self.regions = regions

    def stats(self) -> Dict[str, Any]:
        r = self.report
        return {"regions": len(self.regions), "fused_ops": r["fused_ops"],
                "fused_max_live_bytes": r["max_live_bytes"], "unfused_max_live_bytes": r["unfused_max_live_bytes"],
                "compiled_regions": sum(1 for x in self.regions if x.fn is not None and not x.eager),
                "eager_regions": sum(1 for x in self.regions if x.eager),
                "compile_seconds": sum(x.seconds for x in self.regions)}


def _view_roots(graph: Dict[str, Any]) -> Dict[str, str]:
    """Each view tensor's root, by id."""
    view_of = {t["id"]: t.get("view_of") for t in graph["tensors"]}

    def root(t: str) -> str:
        while view_of.get(t):
            t = view_of[t]
        return t
    return {t: root(t) for t, base in view_of.items() if base}


def fused_program(graph: Dict[str, Any], calls: List[Call], seq: List[int], limit: Optional[int],
                  options: Dict[str, Any], never: Set[int]) -> Tuple[List[Call], List[int], Fused]:
    """The calls and order of the planned step `seq` (call indices) with
    its regions: `calls` plus one call per region, and the order with each
    region's ops replaced by its call. `never`: calls that stay out."""
    ops = graph["ops"]
    order = [ops[k]["id"] for k in seq]
    exclude = [ops[k]["id"] for k, c in enumerate(calls) if k in never or not compilable(c)]
    report = memplan.fuse(graph, order, limit=limit, exclude=exclude)
    op_index = {op["id"]: k for k, op in enumerate(ops)}
    tensor_index = {t["id"]: i for i, t in enumerate(graph["tensors"])}
    roots = _view_roots(graph)
    out_calls = list(calls)
    starts: Dict[int, Tuple[int, Set[int]]] = {}
    regions = []
    for r in report["regions"]:
        members = [op_index[o] for o in r["ops"]]
        inputs = [tensor_index[t] for t in r["inputs"]]
        outputs = [tensor_index[t] for t in r["outputs"]]
        at_in = {t: p for p, t in enumerate(r["inputs"])}
        at_out = {t: p for p, t in enumerate(r["outputs"])}
        aliases = []
        for p, t in enumerate(r["outputs"]):
            root = roots.get(t)
            if root in at_in:
                aliases.append((p, "in", at_in[root]))
            elif root in at_out:
                aliases.append((p, "out", at_out[root]))
        region = Region(r["name"], _region_graph(calls, members, inputs, outputs), options, aliases, r["ops"][0])
        regions.append(region)
        starts[members[0]] = (len(out_calls), set(members))
        out_calls.append(Call(region, tuple(Ref(i) for i in inputs), {}, list(enumerate(outputs))))
    out_seq: List[int] = []
    skip: Set[int] = set()
    for k in seq:
        if k in starts:
            call, members = starts[k]
            out_seq.append(call)
            skip |= members
        elif k not in skip:
            out_seq.append(k)
    return out_calls, out_seq, Fused(report, regions)


def planned(planning, seq: List[int]) -> Tuple[List[Call], List[int], Fused]:
    """:func:`fused_program` of a :class:`~memplan.torch._planning.Planning`'s
    planned order `seq`, within its plan's max live: no region holds a
    call that reads the optimizer's numbers or that the gradient scaler
    gates."""
    never = {k for k, flag in enumerate(planning.optimizer_calls) if flag}
    gate = planning._gate()
    if gate is not None:
        never |= set(gate.of_call())
    limit = planning.plan["stats"]["max_live_bytes"] if planning.plan is not None else None
    return fused_program(planning.graph, planning.calls, seq, limit, planning.inductor_options, never)
