"""Running a :class:`memplan.torch.Step` (:class:`Running`): one call
with a batch checks that the caller's objects are still as captured, binds
the batch and the caller's tensors, runs the program in the planned or the
recorded order (outside the arena, in it, or as one CUDA graph, refusing
what a graph cannot run), and settles the gradient scaler's skipped
updates and the optimizers' step counters after it.

:class:`Running` reads the program from the step's
:class:`~memplan.torch._planning.Planning` and the places from its
:class:`~memplan.torch._placement.Placement`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from . import _distributed, _graph, _offload, _optim, _scaler
from ._capture import Captured, _not_a_tensor
from ._captured import AsCaptured
from ._errors import UnsupportedStep
from ._placement import Placement
from ._planning import Planning
from ._run import Program, StorageTracker


class Running:
    """How a :class:`memplan.torch.Step` runs: it owns what a run leaves
    behind (the loss's norm, the tracked peak, whether the scaler skipped
    the update) and the step's CUDA graph. Made from the captured step,
    the caller's model and optimizers, the step's other two roles, the
    gradient scaler (None without one) and the data-parallel group (None
    on one process)."""

    def __init__(self, c: Captured, model, optimizers: _optim.Optimizers, hyper: _optim.Hyper,
                 planning: Planning, placement: Placement, scaling: Optional[_scaler.Scaling],
                 dist: Optional[_distributed.DataParallel]) -> None:
        self._as_captured = AsCaptured(model)
        self._optimizers = optimizers
        self._hyper = hyper
        self._planning = planning
        self._placement = placement
        self._dist = dist
        self._device = c.device
        self._loss = c.loss
        self._norm = c.norm
        self._batch_spec = c.batch_spec
        self._batch_layouts = c.batch_layouts
        self.accumulate = c.accumulate  # micro-batches per step
        self._updated = c.updated
        # With a gradient scaler: the scaler, its settings at capture, its
        # flags and the ops they gate.
        self.scaling = scaling
        # Whether the last run skipped the update (a gradient overflowed): a
        # bool, or one per optimizer when there are several.
        self.skipped_update: Any = False
        self._updated_by_member: Optional[List[List[torch.Tensor]]] = None  # made on the first scaled run
        self.grad_norm: Optional[torch.Tensor] = None
        self.tracked_peak_bytes: Optional[int] = None
        # What the tracked peak held: (bytes, the op that made it, or None
        # for a tensor held before the step) per storage, largest first.
        self.tracked_peak_contents: Optional[List[Tuple[int, Optional[str]]]] = None
        self.graphed: Optional[_graph.Graphed] = None  # made by the first run(graph=True)

    def run(self, batch, order: str = "planned", track: bool = False, arena: bool = False,
            graph: bool = False) -> torch.Tensor:
        """One training step on `batch`; `order` is ``"planned"`` or
        ``"eager"`` (the recorded order, for comparison). With `track`, a
        :class:`StorageTracker` measures the live tensor bytes on the step's
        device and :attr:`tracked_peak_bytes` holds its peak (with `arena`,
        the arena counts as one storage), :attr:`tracked_peak_contents`
        what it held. With `arena`, every tensor the
        plan places is made at its offset in one buffer (see
        :meth:`~memplan.torch._placement.Placement.place`); the batch is copied into its place. With `graph`
        (CUDA; implies `arena`), the arena step is recorded once as a CUDA
        graph and launched as one (see :mod:`memplan.torch._graph`; the
        first run settles the arena without a graph); the loss returned is
        then overwritten by the next step."""
        placement, planning = self._placement, self._planning
        placement.refuse_meta()
        self._as_captured.check()
        placement.refresh_outside()
        placement.rebind_state()
        prog = planning.program(order)
        env: Dict[int, torch.Tensor] = dict(placement.bound)
        self._bind_batch(batch, env)
        if graph and self._dist is not None and not self._dist.supports_graph:
            raise UnsupportedStep("a step sharded with FSDP2 is not launched as one CUDA graph yet (its "
                                  "collectives run outside graphs): run it with arena=True and graph=False")
        if graph:
            self._graph_checks(order, track)
            arena = True
        if arena and planning.kernels == "inductor" and order == "planned":
            raise UnsupportedStep("kernels='inductor' runs its compiled regions on the caching allocator, not in "
                                  "the arena yet: run it with arena=False and graph=False, or set "
                                  "step.kernels = 'eager'")
        if arena and self._dist is not None and not self._dist.supports_arena:
            raise UnsupportedStep("this sharded step runs outside the arena")
        if arena:
            _offload.refuse_arena(planning.host)
            if order != "planned":
                raise ValueError("the arena holds the planned order's layout: run it with order='planned'")
            placement.place()
            for i, slot in placement.batch_slots.items():
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
                        return self.graphed.run(placement.arena, prog, placement.placed, env, numbers,
                                                planning.optimizer_calls)
                    if arena:
                        placement.arena.run(prog, placement.placed, env, numbers, planning.optimizer_calls)
                    else:
                        prog.run(env, numbers, planning.optimizer_calls)
                    return env
            except RuntimeError:
                placement.same_layouts()  # a tensor converted since capture: say which
                raise

        if track:
            tracker = StorageTracker(self._device)
            if arena:
                tracker.count_as_one(placement.arena.buffer)
            for i, x in env.items():
                if i not in planning.host:  # an offloaded step's host pool is not device memory
                    tracker.track(x)
            tracker.measure()
            with tracker:
                env = go()
            self.tracked_peak_bytes = tracker.peak_bytes
            self.tracked_peak_contents = tracker.peak_contents()
        else:
            env = go()
        self._updates_done(prog, snapshots)
        if self._norm is not None:
            self.grad_norm = env[self._norm]
        return env[self._loss]

    def _graph_checks(self, order: str, track: bool) -> None:
        """Refuses, saying why, a call a CUDA graph cannot run (see
        :func:`_graph.refusal`): the call's arguments every time, the
        step's device, scaler and optimizer until it has a graph."""
        if self.graphed is not None:
            _graph.refuse_unless_graphable(track=track, order=order)
            return
        _graph.refuse_unless_graphable(device=self._planning.layouts[self._loss].device,
                                       scaled=self.scaling is not None,
                                       track=track, order=order,
                                       dependent=_optim.step_dependent(self._optimizers))

    def _graph_ready(self, env: Dict[int, torch.Tensor]) -> None:
        """Refuses a step that reads host tensors, checked with its tensors
        in their places (the arena moves a host tensor learning rate to the
        device); makes the step's :class:`_graph.Graphed`."""
        if self.graphed is not None:
            return
        device = self._planning.layouts[self._loss].device
        host = [self._planning.graph["tensors"][i]["id"] for i, x in env.items() if x.device.type != device.type]
        _graph.refuse_unless_graphable(host_inputs=host)
        self.graphed = _graph.Graphed()

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

    def _scaler_ready(self, prog: Program):
        """With a gradient scaler: checks its settings, resets the gate and
        returns each optimizer's step counters as they are before the step
        advances them (None without a scaler)."""
        if self.scaling is None:
            return None
        _scaler.check_unchanged(self.scaling.scaler, self.scaling.settings)
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
