"""Fitting a :class:`memplan.torch.Step`'s plan (:meth:`Planning.fit`):
by recomputation, within a budget or a FLOP share, and with host memory
(offload) as a lever; then the fitted step's program
(:func:`recomputed_program`): the captured calls in the fitted graph's
order, recomputed ops as copies of their originals, and offload's copies
(:mod:`memplan.torch._offload`). The functions take the step's
:class:`~memplan.torch._planning.Planning` as `p` and swap in the fitted
graph, plan and calls (:func:`adopt`).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

from torch.utils._pytree import tree_map

import memplan

from . import _offload
from ._aten import without_writes
from ._calls import Call, Ref
from ._capture import Captured


def fit(p, budget, time_limit: float, minimise: str, max_added, offload, max_slowdown) -> Dict[str, Any]:
    """:meth:`Planning.fit` of the step `p` plans (see there)."""
    if offload or max_slowdown is not None:
        return fit_offload(p, budget, time_limit, offload, max_slowdown)
    base = p.captured
    split_added = p.split["added_flops"] if p.split is not None else 0
    unsplit = p._unsplit
    t0 = time.perf_counter()

    def make():
        # Within a share, the core counts the split's FLOPs against it
        # (memplan.fit's already_added_flops) and refuses a split that
        # alone exceeds it: then the step as captured is fitted.
        fit = lambda graph, **kw: memplan.fit(graph, budget, time_limit=time_limit,  # noqa: E731
                                              minimise=minimise, max_added=max_added, **kw)
        if split_added <= 0 or max_added is None:
            return fit(base.graph)
        try:
            return fit(base.graph, already_added_flops=split_added)
        except memplan.MemplanError as e:
            if e.kind != "does_not_fit":
                raise
            return {**fit(unsplit.graph), "dropped": str(e)}

    fitted = make() if p._dist is None else p._dist.from_first_rank(make, "fitting the step")
    if "dropped" in fitted:
        base = p._drop_split(fitted.pop("dropped"))
        split_added = 0
    p.plan_seconds = time.perf_counter() - t0
    kept = p.captured_plan
    if kept is not None and kept["arena_bytes"] <= fitted["plan"]["arena_bytes"] and (
            budget is None or kept["arena_bytes"] <= budget):
        # Never worse than the step's own plan: the fit plans each of
        # its probes in a share of its time, and its plan without
        # recomputation can come out larger than the one the step has.
        fitted.update(arena_bytes=kept["arena_bytes"], max_live_bytes=kept["stats"]["max_live_bytes"],
                      recomputed_ops=[], added_flops=0, added_seconds_estimate=0.0, kept_unfitted=True)
        fitted["graph"], fitted["plan"] = base.graph, kept
    adopt(p, base, _with_sizes_of(base.graph, fitted.pop("graph")), fitted)
    if split_added > 0:
        fitted["split_added_flops"] = split_added
    return fitted


def fit_offload(p, budget, time_limit: float, offload: Any, max_slowdown) -> Dict[str, Any]:
    """:meth:`Planning.fit` with host memory as a lever (see there)."""
    base = p.captured
    _offload.refuse(base.device, p._dist, p.split)
    t0 = time.perf_counter()
    fitted = memplan.fit(base.graph, budget, time_limit=time_limit, offload=offload, max_slowdown=max_slowdown)
    p.plan_seconds = time.perf_counter() - t0
    adopt(p, base, fitted.pop("graph"), fitted)
    return fitted


def adopt(p, base: Captured, graph: Dict[str, Any], fitted: Dict[str, Any]) -> None:
    """Makes the fitted `graph` (and the plan in `fitted`) the step's:
    its calls, layouts and programs, made from `base`."""
    p.graph = graph
    p.plan = p._own_rank(graph, fitted.pop("plan"))
    fitted["max_live_bytes"] = p.plan["stats"]["max_live_bytes"]  # this rank's
    p.calls, p.layouts = recomputed_program(base.graph, base.calls, base.layouts, graph)
    p.optimizer_calls = [op["kind"] == "optimizer" for op in graph["ops"]]
    p.host = _offload.host_tensors(graph)
    p.programs.clear()
    p.fitted = fitted


def _copy_of(fitted: Dict[str, Any]) -> Dict[str, str]:
    """Each op the fit added to `fitted`, by the id of the op it copies
    (the graph's ``metadata.recompute_of``, written by the Rust core)."""
    return fitted.get("metadata", {}).get("recompute_of", {})


def _with_sizes_of(graph: Dict[str, Any], fitted: Dict[str, Any]) -> Dict[str, Any]:
    """`fitted` (made from the group's first rank's graph) with this rank's
    tensor sizes, from `graph`, this rank's captured step: FSDP2's later
    shards may be shorter or empty. A recomputed op's outputs are copies of
    its original's, so they take those sizes. Without data parallelism the
    two agree and `fitted` comes back as it is."""
    size = {t["id"]: t["size"] for t in graph["tensors"]}
    ops = {op["id"]: op for op in graph["ops"]}
    copy_of = _copy_of(fitted)
    for op in fitted["ops"]:
        was = ops.get(copy_of.get(op["id"]))
        if was is not None:
            for a, b in zip(was.get("outputs", []), op.get("outputs", [])):
                size.setdefault(b, size.get(a))
    if all(size.get(t["id"]) in (None, t["size"]) for t in fitted["tensors"]):
        return fitted
    tensors = [dict(t, size=size[t["id"]]) if size.get(t["id"]) is not None else t for t in fitted["tensors"]]
    return dict(fitted, tensors=tensors)


def recomputed_program(graph: Dict[str, Any], calls: List, layouts: List, fitted: Dict[str, Any]):
    """The calls and tensor layouts of `fitted`, the step `graph` with
    recomputed ops added by memplan (docs/fit.md): one call per op of
    `fitted`, in its order. Tensors keep their indices (memplan appends the
    copies after the captured tensors); a recomputed op is its original's
    call on the copies of its inputs, writing the copies of its outputs,
    and an op that now reads a copy has its arguments redirected."""
    index = {t["id"]: i for i, t in enumerate(fitted["tensors"])}
    original = {op["id"]: k for k, op in enumerate(graph["ops"])}
    new_layouts = list(layouts) + [None] * (len(fitted["tensors"]) - len(layouts))
    copy_of = _copy_of(fitted)
    new_calls = []
    for op in fitted["ops"]:
        oid = op["id"]
        if op.get("type") in _offload.COPIES and oid not in original:
            new_calls.append(_offload.copy_call(op, index))
            continue
        if oid in original:
            k = original[oid]
        else:
            k = original.get(copy_of.get(oid))
            if k is None:
                raise memplan.MemplanError(f"fitted step: op {oid!r} is neither captured nor a recomputation")
        was = graph["ops"][k]
        # A copy of an op whose updates it may skip (batch norm's running
        # statistics) lists none, and runs without them.
        skip = (oid not in original and bool(was.get("updates")) and not op.get("updates")
                and was.get("attrs", {}).get("rerun_without_updates") is True)
        remap: Dict[int, int] = {}
        for field in ("inputs", "outputs") + (() if skip else ("updates",)):
            old, new = was.get(field, []), op.get(field, [])
            if len(old) != len(new):
                raise memplan.MemplanError(f"fitted step: op {oid!r} has other {field} than {was['id']!r}")
            for a, b in zip(old, new):
                remap[index[a]] = index[b]
                if new_layouts[index[b]] is None:
                    new_layouts[index[b]] = layouts[index[a]]
        c = calls[k]

        def ref(x):
            return Ref(remap.get(x.index, x.index)) if isinstance(x, Ref) else x

        args, kwargs, writes = c.args, c.kwargs, c.writes
        if skip:
            args, kwargs = without_writes(args, kwargs, writes)
            writes = frozenset()
        new_calls.append(Call(c.func, tree_map(ref, args), tree_map(ref, kwargs),
                              [(p, remap.get(i, i)) for p, i in c.outputs], c.random, writes))
    _offload.copy_layouts(fitted, new_layouts)
    return new_calls, new_layouts
