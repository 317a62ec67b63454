"""Where a :class:`memplan.torch.Step`'s tensors live (:class:`Placement`):
the arena (every planned tensor at its offset in one buffer, the caller's
parameters, buffers and optimizer state moved into their places), and the
binding of the caller's tensors to the step's, kept between runs: the
optimizer state and param-group tensors given back to the optimizer after
``load_state_dict``, the tensors read from outside the step refreshed,
and the refusal of a tensor whose layout changed since capture.

:class:`Placement` reads the step's plan, graph and layouts from its
:class:`~memplan.torch._planning.Planning`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from . import _distributed
from ._capture import Captured, local_tensor
from ._optim import Optimizers
from ._errors import UnsupportedStep
from ._planning import Planning
from ._run import Arena


@dataclasses.dataclass
class Outside:
    """A tensor the step reads from outside it (class weights in a loss):
    its graph tensor, the caller's tensor the step's copy was made from,
    and that tensor's version when last copied."""

    tensor: int
    source: torch.Tensor
    version: int


class Placement:
    """Where a :class:`memplan.torch.Step`'s tensors live: it owns the
    arena, the planned tensors' places in it and the batch's slots, and
    what binds the caller's tensors (`bound`: graph tensor -> the caller's
    tensor, shared with the step) to the step's."""

    def __init__(self, c: Captured, planning: Planning, optimizers: Optimizers,
                 dist: Optional[_distributed.DataParallel]) -> None:
        self.arena: Optional[Arena] = None
        self.placed: Dict[int, torch.Tensor] = {}  # graph tensor -> its place (the step makes it there)
        self.batch_slots: Dict[int, torch.Tensor] = {}  # batch tensor -> its place (each run copies it in)
        self.bound = c.bound
        self._outside: List[Outside] = [Outside(i, x, x._version) for i, x in c.sources.items()]
        # The optimizer state the graph reads, and the state dicts it was
        # found in.
        self.state_slots = list(c.state_slots)
        # The param groups' tensors the graph reads: a capturable Adam's
        # tensor learning rate.
        self.group_slots = list(c.group_slots)
        self._state_dicts = [o.state for o in optimizers.members]
        self._optimizers = optimizers
        self._batch_layouts = c.batch_layouts
        self._loss = c.loss
        self._meta = c.meta
        self._planning = planning
        self._dist = dist

    def refuse_meta(self) -> None:
        """Refuses to run (or place) a step traced from a model on the meta
        device, saying how to get one that runs."""
        if self._meta:
            raise UnsupportedStep(
                "the model is on the meta device, which holds no values: this step can be planned "
                "(step.plan, step.stats, step.fit) but not run; to run it, make the model on a real device "
                "(or model.to_empty(device=...) and initialise its weights) and capture it again"
            )

    def place(self) -> Arena:
        """Makes the arena (one buffer of the planned size) and moves the
        parameters, buffers and optimizer state into their planned places
        (``p.data`` becomes a view of the arena, so the model and the
        optimizer keep working on the same objects). Called by the first
        ``run(..., arena=True)``."""
        if self.arena is not None:
            return self.arena
        self.refuse_meta()
        planning = self._planning
        if planning.plan is None:
            planning.make_plan()
        offsets = {t["id"]: t["offset"] for t in planning.plan["tensors"] if "offset" in t}
        device = planning.layouts[self._loss].device
        arena = Arena(planning.plan["arena_bytes"], device)
        placed: Dict[int, torch.Tensor] = {}
        for i, t in enumerate(planning.graph["tensors"]):
            if "view_of" in t or t["size"] == 0 or t["id"] not in offsets:
                continue
            # The step's own tensors (parameters, state) own their bytes.
            own = t["size"] if i in self.bound else None
            placed[i] = arena.view(offsets[t["id"]], planning.layouts[i], own_storage=own)
        self.same_layouts()
        with torch.no_grad():
            for i, x in list(self.bound.items()):
                if i in placed:
                    placed[i].copy_(x)
                    x.data = placed[i]
                    del placed[i]  # bound: lives there, nothing makes it
            self._place_bound_views(device)
        self.batch_slots = {b.tensor: placed.pop(b.tensor) for b in self._batch_layouts if b.tensor in placed}
        self.placed = placed
        self.arena = arena
        if self._dist is not None:
            self._dist.placed()
        return arena

    def _place_bound_views(self, device: torch.device) -> None:
        """Parameters (or state) that share their bytes with another one
        were recorded as views of its root: each moves with that root, to
        its own offset in the root's new storage, with its value."""
        tensors = self._planning.graph["tensors"]
        index = {t["id"]: k for k, t in enumerate(tensors)}
        for i, x in self.bound.items():
            if "view_of" not in tensors[i]:
                continue
            r = i
            while "view_of" in tensors[r]:
                r = index[tensors[r]["view_of"]]
            root = self.bound.get(r)
            if root is None:
                continue
            at = self._planning.layouts[i]
            moved = torch.empty(0, dtype=at.dtype, device=device).set_(root.untyped_storage(), at.offset, at.shape,
                                                                       at.stride)
            moved.copy_(x)
            x.data = moved

    def same_layouts(self) -> None:
        """Refuses, by name, a parameter, buffer or state tensor whose dtype
        or shape changed since capture (``model.to(torch.bfloat16)``, an op
        that resized it in place)."""
        layouts = self._planning.layouts
        for i, x in self.bound.items():
            shape, dtype = layouts[i].shape, layouts[i].dtype
            if (tuple(x.shape), x.dtype) == (shape, dtype):
                continue
            why = ("converted since (model.to(dtype), .half()...)" if x.dtype != dtype else
                   "resized in place since (quantization-aware training's observers grow on their first call: "
                   "run one eager forward pass under torch.no_grad() before capture)")
            raise UnsupportedStep(
                f"{self._planning.graph['tensors'][i]['id']} is {x.dtype} {list(x.shape)} now and was {dtype} {list(shape)} "
                f"at capture: {why}; the recorded ops are for the captured layouts, capture the step again"
            )

    def rebind_state(self) -> None:
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
            for i, p, k in self.state_slots:
                st, mine = self._optimizers.state[p], self.bound[i]
                new = st.get(k)
                if local_tensor(new) is mine:  # the tensor itself, or a DTensor over it
                    continue
                if not isinstance(new, torch.Tensor) or new.shape != mine.shape:
                    raise UnsupportedStep(
                        f"{self._planning.graph['tensors'][i]['id']}: the optimizer's state holds "
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
            for i, gi, k in self.group_slots:
                new, mine = groups[gi].get(k), self.bound[i]
                if new is mine:
                    continue
                if not isinstance(new, torch.Tensor) or new.shape != mine.shape:
                    raise UnsupportedStep(
                        f"param group {gi}: its {k} is {new!r} where the step was captured with a tensor of "
                        f"shape {list(mine.shape)}; capture the step again")
                mine.copy_(new)
                groups[gi][k] = mine

    def refresh_outside(self) -> None:
        """A tensor the step reads from outside it (class weights in a
        loss), updated in place by the caller since it was last copied: the
        step's copy takes its new value, as eager would read it."""
        for o in self._outside:
            if o.source._version != o.version:
                with torch.no_grad():
                    self.bound[o.tensor].copy_(o.source)
                o.version = o.source._version
