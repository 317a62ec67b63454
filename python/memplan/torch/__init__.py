"""memplan for PyTorch: capture a training step, plan it, run it in the plan.

    import memplan.torch
    step = memplan.torch.capture(model, optimizer, batch, loss_fn)
    for batch in data:
        loss = step(batch)          # forward, backward, optimizer update
    step.stats                      # planned peak, lower bound, tracked peak

:func:`capture` records one whole training step at the aten level, on fake
tensors (no memory, no arithmetic): the forward pass and the loss
(``loss_fn(model, batch)``), the backward pass (``torch.autograd.grad``), and
the optimizer's update written **one parameter at a time** (PyTorch's
single-tensor arithmetic; see :mod:`memplan.torch._optim`), so each update
can run as soon as its gradient is complete. The record is memplan's graph
(docs/graph-format.md) and a program of aten calls. memplan plans the graph
(the order of the ops and each tensor's offset), and the returned
:class:`Step` runs the program in the planned order on the model's own
parameters, buffers and optimizer state, updating them in place as
``optimizer.step()`` would, and drops every value after its last use, so
the live bytes of the run are the plan's.

``step(batch, arena=True)`` makes every planned tensor at its offset in
one buffer of the planned size (:class:`~memplan.torch._run.Arena`), and
``step(batch, graph=True)`` records that arena step once as a CUDA graph
and launches it as one (:mod:`memplan.torch._graph`).

What is outside the plan: memory that kernels allocate for themselves
(library workspaces) and the caller's tensors (parameters, buffers,
optimizer state and the batch, which the plan counts as live for the whole
step).

Random ops (dropout) are kept in eager's sequence by every plan and never
recomputed, so a step draws what eager draws from the same generator
state. What cannot be captured raises :class:`UnsupportedStep` naming the
op: reading values into Python (``.item()``, data-dependent shapes),
optimizers other than those :mod:`memplan.torch._optim` writes. A batch of
another shape than the captured one is refused at run time (capture again).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

import memplan

from . import _distributed, _graph, _optim, _scaler
from ._capture import Captured, _callers_line, _Inputs, _not_a_tensor, _step_device, _trace, local_tensor
from ._captured import AsCaptured
from ._distributed import CollectiveTimeout, RankFailure
from ._record import Call, Recorder, Ref, UnsupportedStep
from ._run import Arena, Gate, Program, StorageTracker

__all__ = ["capture", "train_step", "compile", "max_batch", "Step", "UnsupportedStep", "RankFailure", "CollectiveTimeout"]


class Step:
    """A captured, planned training step. Calling it with a batch of the
    captured shapes runs forward, loss, backward and the optimizer update in
    the planned order and returns the loss (a tensor)."""

    def __init__(self, model, optimizer: _optim.Optimizers, hyper: _optim.Hyper, captured: Captured,
                 scaling=None, dist: Optional[_distributed.DataParallel] = None) -> None:
        c = captured
        self.model = model
        # Data parallel (DDP): plans and fits are made on the group's first
        # rank and sent to the others, so every rank runs one order.
        self._dist = dist
        self._as_captured = AsCaptured(model)
        # With a gradient scaler: (scaler, its settings at capture, each
        # optimizer's overflow flag's graph tensor, the ids of the ops it
        # gates).
        self._scaling = scaling
        self.scaler = scaling[0] if scaling is not None else None
        # Whether the last run skipped the update (a gradient overflowed): a
        # bool, or one per optimizer when there are several.
        self.skipped_update: Any = False
        self._optimizers = optimizer  # _optim.Optimizers over what the caller gave
        self.optimizer = optimizer.members[0] if len(optimizer.members) == 1 else list(optimizer.members)
        self.graph = c.graph
        self.device = c.device
        self._calls = c.calls
        self._bound = c.bound  # graph tensor index -> caller's tensor
        self._batch_spec = c.batch_spec
        self._batch_layouts = c.batch_layouts
        self._loss = c.loss
        self._norm = c.norm  # the clipped gradients' total norm, if clipping
        self.accumulate = c.accumulate  # micro-batches per step
        self.grad_norm: Optional[torch.Tensor] = None
        self._updated = c.updated
        self._updated_by_member: Optional[List[List[torch.Tensor]]] = None  # made on the first scaled run
        self._hyper = hyper
        self._optimizer_calls = c.optimizer_calls
        self.capture_seconds = c.seconds
        self.plan: Optional[Dict[str, Any]] = None
        self.plan_seconds = 0.0
        self._programs: Dict[str, Program] = {}
        self.tracked_peak_bytes: Optional[int] = None
        self._layouts = c.layouts
        # The step as captured: what `fit` starts from.
        self._captured = c
        self._captured_plan: Optional[Dict[str, Any]] = None  # the plan of the captured graph, once made
        self.fitted: Optional[Dict[str, Any]] = None
        self._arena: Optional[Arena] = None
        self._graphed: Optional[_graph.Graphed] = None  # made by the first run(graph=True)
        self._placed: Dict[int, torch.Tensor] = {}
        self._batch_slots: Dict[int, torch.Tensor] = {}
        # Tensors read from outside the step: [graph tensor, the caller's
        # tensor, its version when last copied].
        self._outside = [[i, x, x._version] for i, x in c.sources.items()]
        # The optimizer state the graph reads (graph tensor, parameter,
        # key), and the state dicts it was found in.
        self._state_slots = list(c.state_slots)
        # The param groups' tensors the graph reads (graph tensor, group
        # index, key): a capturable Adam's tensor learning rate.
        self._group_slots = list(c.group_slots)
        self._state_dicts = [o.state for o in optimizer.members]

    # ---- planning -------------------------------------------------------

    def make_plan(self, time_limit: float = 10.0) -> Dict[str, Any]:
        """Plans the graph with memplan (checked by its independent checker)."""
        t0 = time.perf_counter()
        make = lambda: memplan.plan(self.graph, time_limit=time_limit)  # noqa: E731
        if self._dist is None:
            self.plan = make()
        else:
            self.plan = self._own_rank(self.graph, self._dist.from_first_rank(make, "planning the step"))
        self.plan_seconds = time.perf_counter() - t0
        self._programs.pop("planned", None)
        if self.graph is self._captured.graph:
            self._captured_plan = self.plan
        return self.plan

    def _own_rank(self, graph: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
        """The first rank's plan as this rank runs it: its order and places,
        checked against this rank's graph (FSDP2's later shards may be
        shorter, or empty: those own no bytes here), with this rank's max
        live."""
        if self._dist is None or self._dist.rank == 0:
            return plan
        empty = {t["id"] for t in graph["tensors"] if t["size"] == 0}
        plan["tensors"] = [t for t in plan["tensors"] if t["id"] not in empty]
        plan["reuse"] = [r for r in plan.get("reuse", []) if r["output"] not in empty and r["input"] not in empty]
        plan["stats"]["max_live_bytes"] = memplan.check(graph, plan)["max_live_bytes"]
        return plan

    def fit(self, budget: Optional[int] = None, time_limit: float = 60.0, minimise: str = "time",
            *, max_added: Optional[float] = None) -> Dict[str, Any]:
        """Fits the step into `budget` bytes by recomputation.

        memplan chooses the forward ops to run again in the backward pass
        (:func:`memplan.fit`), and from then on the step runs them: the
        graph, the plan and the program become the fitted step's, so its
        live bytes stay within `budget`. Returns what the fit reports
        (`recomputed_ops`, `added_flops`, `arena_bytes`, ...); raises
        :class:`memplan.MemplanError` with the bound when nothing fits.
        Fitting again starts from the captured step. Where the step's own
        plan (of the captured graph) is no larger than what the fit finds
        and within `budget`, the step keeps it (no op recomputed;
        ``kept_unfitted`` in the report).

        With `max_added` instead of a budget, the step becomes the smallest
        memplan finds whose recomputation adds at most that share of the
        step's cost: ``step.fit(max_added=0.001, minimise="flops")`` is at
        most 0.1% more FLOPs, recomputing cheap ops as ``torch.compile``
        does by default.
        """
        if self._arena is not None:
            raise ValueError("the step already runs in its arena; fit before the first arena run")
        base = self._captured
        t0 = time.perf_counter()
        make = lambda: memplan.fit(base.graph, budget, time_limit=time_limit, minimise=minimise,  # noqa: E731
                                   max_added=max_added)
        fitted = make() if self._dist is None else self._dist.from_first_rank(make, "fitting the step")
        self.plan_seconds = time.perf_counter() - t0
        kept = self._captured_plan
        if kept is not None and kept["arena_bytes"] <= fitted["plan"]["arena_bytes"] and (
                budget is None or kept["arena_bytes"] <= budget):
            # Never worse than the step's own plan: the fit plans each of
            # its probes in a share of its time, and its plan without
            # recomputation can come out larger than the one the step has.
            fitted.update(arena_bytes=kept["arena_bytes"], max_live_bytes=kept["stats"]["max_live_bytes"],
                          recomputed_ops=[], added_flops=0, added_seconds_estimate=0.0, kept_unfitted=True)
            fitted["graph"], fitted["plan"] = base.graph, kept
        self.graph = fitted.pop("graph")
        self.plan = fitted.pop("plan")
        self._calls, self._layouts = _recomputed_program(base.graph, base.calls, base.layouts, self.graph)
        self._optimizer_calls = [op["kind"] == "optimizer" for op in self.graph["ops"]]
        self._programs.clear()
        self.fitted = fitted
        return fitted

    def program(self, order: str = "planned") -> Program:
        """The program in the planned order or in the recorded (eager) one."""
        if order not in self._programs:
            if order == "eager":
                seq = list(range(len(self._calls)))
            elif order == "planned":
                if self.plan is None:
                    self.make_plan()
                index = {op["id"]: k for k, op in enumerate(self.graph["ops"])}
                seq = [index[op] for op in self.plan["order"]]
            else:
                raise ValueError(f"order must be 'planned' or 'eager', not {order!r}")
            keep = list(self._bound) + [self._loss] + ([self._norm] if self._norm is not None else [])
            takes = self._taken_reuses() if order == "planned" else None
            self._programs[order] = Program(self._calls, seq, keep, takes, self._gate())
        return self._programs[order]

    def _gate(self) -> Optional[Gate]:
        """The gradient scaler's gate over this graph's update calls."""
        if self._scaling is None:
            return None
        _, _, flags, ids = self._scaling
        return Gate(flags, [frozenset(k for k, op in enumerate(self.graph["ops"]) if op["id"] in gated)
                            for gated in ids])

    def _taken_reuses(self) -> Dict[int, tuple]:
        """The plan's taken reuses as call index -> (output, input) tensor
        indices: the call that makes the output writes it over the input.
        The plan names the input's root (the tensor owning the bytes); the
        call reads the tensor its hint names, maybe a view of that root."""
        index = {t["id"]: i for i, t in enumerate(self.graph["tensors"])}
        hinted = {}
        for k, op in enumerate(self.graph["ops"]):
            for r in op.get("reuse", []):
                hinted[r["output"]] = (k, index[r["output"]], index[r["input"]])
        takes = {}
        for r in self.plan.get("reuse", []):
            k, o, i = hinted[r["output"]]
            takes[k] = (o, i)
        return takes

    @property
    def stats(self) -> Dict[str, Any]:
        """The plan's figures and the last run's tracked peak (bytes)."""
        s: Dict[str, Any] = {"capture_seconds": self.capture_seconds, "plan_seconds": self.plan_seconds,
                             "ops": len(self._calls)}
        if self.plan is not None:
            ps = self.plan["stats"]
            s.update(
                arena_bytes=self.plan["arena_bytes"],
                max_live_bytes=ps["max_live_bytes"],
                lower_bound_bytes=ps["lower_bound_bytes"],
            )
        if self.tracked_peak_bytes is not None:
            s["tracked_peak_bytes"] = self.tracked_peak_bytes
        if self._graphed is not None:
            g = self._graphed
            s.update(graph_recordings=g.recordings, graph_launches=g.launches, graph_refused=g.refused)
        return s

    # ---- running --------------------------------------------------------

    def _bind_batch(self, batch, env: Dict[int, torch.Tensor]) -> None:
        micro = self.accumulate
        if micro == 1:
            batches = [batch]
        elif not isinstance(batch, (list, tuple)) or len(batch) != micro:
            raise UnsupportedStep(f"the step accumulates gradients over {micro} micro-batches: pass a list of "
                                  f"{micro} batches of the captured shapes")
        else:
            batches = list(batch)
        leaves = []
        for b in batches:
            flat, spec = tree_flatten(b)
            if spec != self._batch_spec:
                raise UnsupportedStep(f"the batch's structure {spec} is not the captured one {self._batch_spec}")
            leaves += flat
        for x, (i, shape, dtype, device, name) in zip(leaves, self._batch_layouts):
            if not isinstance(x, torch.Tensor):
                raise UnsupportedStep(_not_a_tensor(name, x))
            if tuple(x.shape) != shape or x.dtype != dtype or x.device != device:
                raise UnsupportedStep(
                    f"batch element {name}: shape {tuple(x.shape)} {x.dtype} on {x.device}, but the step "
                    f"was captured for {shape} {dtype} on {device} (shapes are static: capture again)"
                )
            env[i] = x

    def place(self) -> Arena:
        """Makes the arena (one buffer of the planned size) and moves the
        parameters, buffers and optimizer state into their planned places
        (``p.data`` becomes a view of the arena, so the model and the
        optimizer keep working on the same objects). Called by the first
        ``run(..., arena=True)``."""
        if self._arena is not None:
            return self._arena
        self._refuse_meta()
        if self.plan is None:
            self.make_plan()
        offsets = {t["id"]: t["offset"] for t in self.plan["tensors"] if "offset" in t}
        device = self._layouts[self._loss].device
        arena = Arena(self.plan["arena_bytes"], device)
        placed: Dict[int, torch.Tensor] = {}
        for i, t in enumerate(self.graph["tensors"]):
            if "view_of" in t or t["size"] == 0 or t["id"] not in offsets:
                continue
            # The step's own tensors (parameters, state) own their bytes.
            own = t["size"] if i in self._bound else None
            placed[i] = arena.view(offsets[t["id"]], self._layouts[i], own_storage=own)
        self._same_layouts()
        with torch.no_grad():
            for i, x in list(self._bound.items()):
                if i in placed:
                    placed[i].copy_(x)
                    x.data = placed[i]
                    del placed[i]  # bound: lives there, nothing makes it
            self._place_bound_views(device)
        self._batch_slots = {i: placed.pop(i) for i, *_ in self._batch_layouts if i in placed}
        self._placed = placed
        self._arena = arena
        return arena

    def _place_bound_views(self, device: torch.device) -> None:
        """Parameters (or state) that share their bytes with another one
        were recorded as views of its root: each moves with that root, to
        its own offset in the root's new storage, with its value."""
        tensors = self.graph["tensors"]
        index = {t["id"]: k for k, t in enumerate(tensors)}
        for i, x in self._bound.items():
            if "view_of" not in tensors[i]:
                continue
            r = i
            while "view_of" in tensors[r]:
                r = index[tensors[r]["view_of"]]
            root = self._bound.get(r)
            if root is None:
                continue
            shape, stride, offset, dtype, _ = self._layouts[i]
            moved = torch.empty(0, dtype=dtype, device=device).set_(root.untyped_storage(), offset, shape, stride)
            moved.copy_(x)
            x.data = moved

    def run(self, batch, order: str = "planned", track: bool = False, arena: bool = False,
            graph: bool = False) -> torch.Tensor:
        """One training step on `batch`; `order` is ``"planned"`` or
        ``"eager"`` (the recorded order, for comparison). With `track`, a
        :class:`StorageTracker` measures the live tensor bytes on the step's
        device and :attr:`tracked_peak_bytes` holds its peak (with `arena`,
        the arena counts as one storage). With `arena`, every tensor the
        plan places is made at its offset in one buffer (see
        :meth:`place`); the batch is copied into its place. With `graph`
        (CUDA; implies `arena`), the arena step is recorded once as a CUDA
        graph and launched as one (see :mod:`memplan.torch._graph`; the
        first run settles the arena without a graph); the loss returned is
        then overwritten by the next step."""
        self._refuse_meta()
        self._as_captured.check()
        self._refresh_outside()
        self._rebind_state()
        prog = self.program(order)
        env: Dict[int, torch.Tensor] = dict(self._bound)
        self._bind_batch(batch, env)
        if graph:
            self._graph_checks(order, track)
            arena = True
        if arena and self._dist is not None and not self._dist.supports_arena:
            raise UnsupportedStep("a step sharded with FSDP2 runs outside the arena for now (arena=True and "
                                  "graph=True move the parameters into the arena, where FSDP2 owns their storage)")
        if arena:
            if order != "planned":
                raise ValueError("the arena holds the planned order's layout: run it with order='planned'")
            self.place()
            for i, slot in self._batch_slots.items():
                slot.copy_(env[i])
                env[i] = slot
        if graph:
            self._graph_ready(env)  # the step's, once its tensors are in their places
        snapshots = self._scaler_ready(prog)
        numbers = self._hyper.values(_optim.advance_steps(self._optimizers, self._updated))

        def go():
            try:
                with AsCaptured.without_autocast():  # the recorded ops carry their casts
                    if graph:
                        return self._graphed.run(self._arena, prog, self._placed, env, numbers,
                                                 self._optimizer_calls)
                    if arena:
                        self._arena.run(prog, self._placed, env, numbers, self._optimizer_calls)
                    else:
                        prog.run(env, numbers, self._optimizer_calls)
                    return env
            except RuntimeError:
                self._same_layouts()  # a tensor converted since capture: say which
                raise

        if track:
            tracker = StorageTracker(self.device)
            if arena:
                tracker.count_as_one(self._arena.buffer)
            for x in env.values():
                tracker.track(x)
            tracker.measure()
            with tracker:
                env = go()
            self.tracked_peak_bytes = tracker.peak_bytes
        else:
            env = go()
        self._updates_done(prog, snapshots)
        if self._norm is not None:
            self.grad_norm = env[self._norm]
        return env[self._loss]

    __call__ = run

    def _refuse_meta(self) -> None:
        if self._captured.meta:
            raise UnsupportedStep(
                "the model is on the meta device, which holds no values: this step can be planned "
                "(step.plan, step.stats, step.fit) but not run; to run it, make the model on a real device "
                "(or model.to_empty(device=...) and initialise its weights) and capture it again"
            )

    def _graph_checks(self, order: str, track: bool) -> None:
        """Refuses, saying why, a call a CUDA graph cannot run (see
        :func:`_graph.refusal`): the call's arguments every time, the
        step's device, scaler and optimizer until it has a graph."""
        if self._graphed is not None:
            _graph.refuse_unless_graphable(track=track, order=order)
            return
        _graph.refuse_unless_graphable(device=self._layouts[self._loss].device, scaled=self._scaling is not None,
                                       track=track, order=order,
                                       dependent=_optim.step_dependent(self._optimizers))

    def _graph_ready(self, env: Dict[int, torch.Tensor]) -> None:
        """Refuses a step that reads host tensors, checked with its tensors
        in their places (the arena moves a host tensor learning rate to the
        device); makes the step's :class:`_graph.Graphed`."""
        if self._graphed is not None:
            return
        device = self._layouts[self._loss].device
        host = [self.graph["tensors"][i]["id"] for i, x in env.items() if x.device.type != device.type]
        _graph.refuse_unless_graphable(host_inputs=host)
        self._graphed = _graph.Graphed()

    def _same_layouts(self) -> None:
        """Refuses, by name, a parameter, buffer or state tensor whose dtype
        or shape changed since capture (``model.to(torch.bfloat16)``, an op
        that resized it in place)."""
        for i, x in self._bound.items():
            shape, _, _, dtype, _ = self._layouts[i]
            if (tuple(x.shape), x.dtype) == (shape, dtype):
                continue
            why = ("converted since (model.to(dtype), .half()...)" if x.dtype != dtype else
                   "resized in place since (quantization-aware training's observers grow on their first call: "
                   "run one eager forward pass under torch.no_grad() before capture)")
            raise UnsupportedStep(
                f"{self.graph['tensors'][i]['id']} is {x.dtype} {list(x.shape)} now and was {dtype} {list(shape)} "
                f"at capture: {why}; the recorded ops are for the captured layouts, capture the step again"
            )

    def _rebind_state(self) -> None:
        """After ``optimizer.load_state_dict`` (which gives the optimizer
        new state tensors, a checkpoint's): their values are copied into the
        tensors the step updates (in the arena, their places), and the
        optimizer is given those back, so it and the step hold one state.
        The same for the param groups' tensors the step reads (a tensor
        learning rate)."""
        self._rebind_groups()
        members = self._optimizers.members
        if all(o.state is d for o, d in zip(members, self._state_dicts)):
            return
        with torch.no_grad():
            for i, p, k in self._state_slots:
                st, mine = self._optimizers.state[p], self._bound[i]
                new = st.get(k)
                if local_tensor(new) is mine:  # the tensor itself, or a DTensor over it
                    continue
                if not isinstance(new, torch.Tensor) or new.shape != mine.shape:
                    raise UnsupportedStep(
                        f"{self.graph['tensors'][i]['id']}: the optimizer's state holds "
                        f"{'a tensor of shape ' + str(list(new.shape)) if isinstance(new, torch.Tensor) else new!r} "
                        f"where the step was captured with {list(mine.shape)} (a checkpoint of another "
                        "optimizer or model?); capture the step again"
                    )
                if type(new).__name__ == "DTensor":  # FSDP2's state: the step holds its local shard
                    mine.copy_(local_tensor(new))
                    st[k] = type(new).from_local(mine, new.device_mesh, new.placements, run_check=False,
                                                 shape=new.shape, stride=new.stride())
                    continue
                mine.copy_(new)
                st[k] = mine
        self._state_dicts = [o.state for o in members]

    def _rebind_groups(self) -> None:
        groups = self._optimizers.param_groups
        with torch.no_grad():
            for i, gi, k in self._group_slots:
                new, mine = groups[gi].get(k), self._bound[i]
                if new is mine:
                    continue
                if not isinstance(new, torch.Tensor) or new.shape != mine.shape:
                    raise UnsupportedStep(
                        f"param group {gi}: its {k} is {new!r} where the step was captured with a tensor of "
                        f"shape {list(mine.shape)}; capture the step again")
                mine.copy_(new)
                groups[gi][k] = mine

    def _refresh_outside(self) -> None:
        """A tensor the step reads from outside it (class weights in a
        loss), updated in place by the caller since it was last copied: the
        step's copy takes its new value, as eager would read it."""
        for entry in self._outside:
            i, x, seen = entry
            if x._version != seen:
                with torch.no_grad():
                    self._bound[i].copy_(x)
                entry[2] = x._version

    def _scaler_ready(self, prog: Program):
        """With a gradient scaler: checks its settings, resets the gate and
        returns each optimizer's step counters as they are before the step
        advances them (None without a scaler)."""
        if self._scaling is None:
            return None
        _scaler.check_unchanged(self._scaling[0], self._scaling[1])
        prog.gate.reset()
        if self._updated_by_member is None:
            self._updated_by_member = [[p for p in self._updated if self._optimizers.owner(p) is o]
                                       for o in self._optimizers.members]
        return [_scaler.Snapshot(self._optimizers, ps) for ps in self._updated_by_member]

    def _updates_done(self, prog: Program, snapshots) -> None:
        """After a run: an optimizer whose update the scaler skipped gets
        its step counters back, as eager's ``scaler.step(o)`` never called
        ``o.step()``; the others count as stepped for learning-rate
        schedulers, which check ``_opt_called`` to tell a late
        ``scheduler.step()``."""
        members = self._optimizers.members
        skipped = [bool(s) for s in prog.gate.skipped] if snapshots is not None else [False] * len(members)
        for j, (o, skip) in enumerate(zip(members, skipped)):
            if skip:
                snapshots[j].restore()
            else:
                o._opt_called = True
        self.skipped_update = skipped[0] if len(skipped) == 1 else skipped


_RECOMPUTE = "recompute."


def _recomputed_program(graph: Dict[str, Any], calls: List, layouts: List, fitted: Dict[str, Any]):
    """The calls and tensor layouts of `fitted`, the step `graph` with
    recomputed ops added by memplan (docs/fit.md): one call per op of
    `fitted`, in its order. Tensors keep their indices (memplan appends the
    copies after the captured tensors); a recomputed op is its original's
    call on the copies of its inputs, writing the copies of its outputs,
    and an op that now reads a copy has its arguments redirected."""
    index = {t["id"]: i for i, t in enumerate(fitted["tensors"])}
    original = {op["id"]: k for k, op in enumerate(graph["ops"])}
    new_layouts = list(layouts) + [None] * (len(fitted["tensors"]) - len(layouts))
    new_calls = []
    for op in fitted["ops"]:
        oid = op["id"]
        if oid in original:
            k = original[oid]
        else:
            at = oid.find(_RECOMPUTE)
            k = original.get(oid[at + len(_RECOMPUTE):]) if at >= 0 else None
            if k is None:
                raise memplan.MemplanError(f"fitted step: op {oid!r} is neither captured nor a recomputation")
        was = graph["ops"][k]
        remap: Dict[int, int] = {}
        for field in ("inputs", "outputs", "updates"):
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

        new_calls.append(Call(c.func, tree_map(ref, c.args), tree_map(ref, c.kwargs),
                              [(p, remap.get(i, i)) for p, i in c.outputs], c.random, c.writes))
    return new_calls, new_layouts


def capture(model: torch.nn.Module, optimizer, example_batch: Any,
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, plan: bool = True,
            time_limit: float = 10.0, align: int = 256, name: Optional[str] = None,
            meta_device: str = "cpu", budget: Optional[int] = None,
            max_added: Optional[float] = None, clip_grad_norm: Optional[float] = None,
            norm_type: float = 2.0, accumulate: int = 1, scaler=None,
            clip_grad_value: Optional[float] = None, collective_timeout: float = 300.0) -> Step:
    """Captures one training step of `model` and plans it.

    `loss_fn(model, batch)` returns the scalar loss; `example_batch` is a
    tensor or a tuple, list or dict of tensors (the shapes every later batch
    must have). `optimizer` is one of ``torch.optim``'s ``AdamW``, ``Adam``,
    ``SGD``, ``RMSprop``, ``Adagrad``, ``Adamax``, ``Adadelta``, ``NAdam``,
    ``RAdam``, ``Adafactor`` and ``Muon`` over the model's parameters, or a
    list of them over disjoint parameters (Muon for the matrices, AdamW for
    the rest); a parameter's state is made as its first ``step()`` would
    make it. With ``plan=False`` the step is not planned until :meth:`Step.make_plan` or the first planned run. With
    `budget` (bytes), the step is fitted into it by recomputation instead
    (:meth:`Step.fit`, within `time_limit` seconds); with `max_added` (a
    share of the step's FLOPs, e.g. 0.001), it becomes the smallest step
    memplan finds for at most that many more FLOPs
    (``Step.fit(max_added=..., minimise="flops")``).

    A model wrapped with ``DistributedDataParallel`` is captured, in each
    process of its group, as the step that rank runs: its forward and
    backward pass, DDP's reduction of each gradient (times ``1/W``, then an
    all-reduce) and broadcast of the buffers as collective ops the planner
    orders, and the update (:mod:`memplan.torch._distributed`). Every rank
    must call capture (and later the step) with batches of the same shapes;
    the ranks' graphs are compared and the plan is made on the group's
    first rank. A collective that fails raises :class:`RankFailure`, one
    that does not complete within `collective_timeout` seconds (gloo)
    :class:`CollectiveTimeout`.

    With `clip_grad_norm` (``max_norm``), the gradients are clipped between
    the backward pass and the update as ``loss.backward();
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type);
    optimizer.step()`` does (PyTorch's own function is what is recorded);
    after each run :attr:`Step.grad_norm` holds the total norm before
    clipping, what ``clip_grad_norm_`` returns. Every update then waits for
    every gradient, as in eager PyTorch.

    With `clip_grad_value` (``clip_value``), each gradient is clamped to
    ``[-clip_value, clip_value]`` as ``torch.nn.utils.clip_grad_value_``
    does (its kernels, ``_foreach_clamp_min_``/``_foreach_clamp_max_``,
    one gradient at a time): a gradient's update then waits for that
    gradient only, so the updates still run inside the backward pass.
    Give at most one of `clip_grad_norm` and `clip_grad_value`.

    With `accumulate` = N > 1 the step accumulates gradients over N
    micro-batches of `example_batch`'s shapes before clipping and updating,
    as eager PyTorch does with ``(loss_fn(model, mb) / N).backward()`` for
    each micro-batch and one ``optimizer.step()``: the step is called with
    a list of N batches and returns the sum of the divided losses (their
    mean). The graph holds every micro-batch's forward and backward, so
    memplan orders across them (each update can run in the last backward
    pass), and each micro-batch is an input the caller holds for the whole
    step.

    With `scaler` (a ``torch.amp.GradScaler``: float16 autocast in
    `loss_fn`), the step scales the loss, unscales and checks the
    gradients (before clipping), skips the update when one overflowed and
    updates the scale, as ``scaler.scale(loss).backward();
    scaler.unscale_(optimizer); clip...; scaler.step(optimizer);
    scaler.update()`` does (each optimizer of a list skips on its own
    gradients' overflow, as ``scaler.step(o)`` for each);
    :attr:`Step.skipped_update` says whether the last run skipped it (one
    per optimizer for a list). The scaler's tensors are the step's,
    updated in place (``scaler.get_scale()`` reads them).

    The graph's metadata records the batch size (``"batch"``: the leading
    dimension every batch tensor shares), which :func:`max_batch` uses.

    A model built on the ``meta`` device (no memory: how a GPT-2 XL step is
    planned on a laptop) is traced as if it were on `meta_device`, so the
    kernels that device's dispatcher picks (e.g. CPU flash attention) are
    the ones recorded; such a step can be planned but not run.
    """
    if budget is not None and max_added is not None:
        raise TypeError("give either budget (bytes) or max_added (a share of the step's FLOPs)")
    if clip_grad_norm is not None and clip_grad_value is not None:
        raise TypeError("give either clip_grad_norm or clip_grad_value")
    t0 = time.perf_counter()
    dist = _distributed.DataParallel.of(model, collective_timeout)
    optimizer = _optim.Optimizers(optimizer)  # one, or several over disjoint parameters
    hyper = _optim.Hyper(optimizer)
    params = dict(model.named_parameters())
    device, traced = _step_device(model, optimizer, params, meta_device)
    rec = Recorder(device, align)
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive number of micro-batches, not {accumulate!r}")
    if dist is not None:
        dist.check_options(hyper.kinds, clip_grad_norm if clip_grad_norm is not None else clip_grad_value,
                           _scaler.active(scaler))
    held = dist.inputs(params) if dist is not None else params  # FSDP2: each rank's local shards
    inputs = _Inputs(rec, traced, held, dict(model.named_buffers()), optimizer, example_batch, accumulate)
    rec.fake_mode = inputs.fake
    if _scaler.active(scaler):
        inputs.scaler(scaler, _scaler.prepare(scaler, next(iter(params.values())).device))
    clip = ("norm", clip_grad_norm, norm_type) if clip_grad_norm is not None else (
        ("value", clip_grad_value) if clip_grad_value is not None else None)
    try:
        loss_index, updated, norm_index, gate = _trace(rec, model, optimizer, hyper, loss_fn, inputs, clip, dist)
    except UnsupportedStep as e:
        where = _callers_line(e.__traceback__)
        if where is None:
            raise
        raise UnsupportedStep(f"{e} [at {where}]").with_traceback(e.__traceback__) from None
    for i, value in rec.constants.items():
        where = rec.layouts[i].device
        inputs.bound[i] = value.to(where) if value.device != where else value
    label = name or f"{type(model).__name__}-step"
    meta = {"source": "memplan.torch.capture", "torch": torch.__version__, "device": device,
            "optimizer": optimizer.name}
    leading = {shape[0] if shape else None for _, shape, *_ in inputs.batch_layouts}
    if len(leading) == 1 and None not in leading:
        meta["batch"] = leading.pop()
    if accumulate > 1:
        meta["accumulate"] = accumulate
    if dist is not None:
        meta["world_size"] = dist.world
    graph = rec.finish(label, meta)
    if dist is not None:
        dist.agree(graph)
    optimizer_calls = [op["kind"] == "optimizer" for op in rec.ops]
    scaling = (scaler, _scaler.settings(scaler)) + gate if gate is not None else None
    captured = Captured(graph=graph, calls=rec.calls, layouts=rec.layouts, device=rec.device, bound=inputs.bound,
                        sources=dict(rec.sources), batch_spec=inputs.spec, batch_layouts=inputs.batch_layouts,
                        loss=loss_index, norm=norm_index, updated=updated, optimizer_calls=optimizer_calls,
                        accumulate=accumulate, state_slots=tuple(inputs.state_slots),
                        group_slots=tuple(inputs.group_slots), seconds=time.perf_counter() - t0,
                        meta=traced is not None)
    step = Step(model, optimizer, hyper, captured, scaling=scaling, dist=dist)
    if budget is not None:
        step.fit(budget, time_limit=time_limit)
    elif max_added is not None:
        step.fit(max_added=max_added, minimise="flops", time_limit=time_limit)
    elif plan:
        step.make_plan(time_limit)
    return step


def max_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              make_batch: Callable[[int], Any], loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
              budget: int, *, batches=(2, 3), probe_time: float = 5.0, meta_device: str = "cpu"
              ) -> Dict[str, Any]:
    """The largest batch whose training step fits `budget` bytes: PyTorch
    eager's (caching allocator simulated over the recorded order),
    memplan's plan's, and memplan's with recomputation.

    The step is captured at the two batch sizes `batches` (``make_batch(b)``
    returns a batch of `b` samples; nothing runs, so a model on the
    ``meta`` device works) and every other batch is extrapolated along the
    line through them (:func:`memplan.max_batch`). Sizes above 1: PyTorch
    can trace batch 1 differently (squeezed dimensions). Returns
    ``{"eager", "planned", "fitted", "budget_bytes", "cap", "graphs"}``,
    `graphs` being the two captured graph documents.
    """
    b1, b2 = batches
    graphs = [capture(model, optimizer, make_batch(b), loss_fn, plan=False, meta_device=meta_device).graph
              for b in (b1, b2)]
    r = memplan.max_batch(graphs[0], graphs[1], budget, batches=(b1, b2), probe_time=probe_time)
    r["graphs"] = graphs
    return r


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, arena: bool = False,
               graph: bool = False, **options) -> Callable[[Any], torch.Tensor]:
    """A training-step function that captures and plans on its first batch
    (options as for :func:`capture`; with ``accumulate=N`` each call takes
    a list of N micro-batches) and runs the planned step on every batch;
    ``fn.step`` is the :class:`Step` once captured. `arena` and `graph`
    are :meth:`Step.run`'s: every tensor at its planned offset, and the
    step launched as one CUDA graph."""

    def step_fn(batch):
        if step_fn.step is None:
            # With accumulation the batch is the list of micro-batches.
            example = batch[0] if options.get("accumulate", 1) > 1 else batch
            step_fn.step = capture(model, optimizer, example, loss_fn, **options)
        return step_fn.step(batch, arena=arena, graph=graph)

    step_fn.step = None
    return step_fn


def compile(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], **options) -> Callable[[Any], torch.Tensor]:
    """Deprecated name of :func:`train_step` (it is not ``torch.compile``);
    it goes in the next release."""
    import warnings

    warnings.warn("memplan.torch.compile is renamed memplan.torch.train_step (it is not torch.compile); "
                  "the old name goes in the next release", DeprecationWarning, stacklevel=2)
    return train_step(model, optimizer, loss_fn, **options)
