"""Records a training step as a memplan graph and as a program that can run
again in another order.

:class:`Recorder` is a ``TorchDispatchMode`` entered above a
``FakeTensorMode``: every aten op the step runs (forward, the autograd
engine's backward ops, the per-parameter optimizer update) reaches
:meth:`Recorder.__torch_dispatch__` after autograd and before any kernel,
and becomes

- one memplan op (``graph``), with the tensors it reads (``inputs``), makes
  (``outputs``) and writes in place (``updates``), and
- one :class:`Call` (``calls``): the ``OpOverload`` with its arguments, each
  tensor argument replaced by a :class:`Ref` to a graph tensor. Running the
  calls in any order the graph allows, with real tensors bound to the refs,
  computes the step.

Tensors are followed by **storage** (:mod:`._tensors`): an output whose
storage is new is a new memplan tensor of the storage's size; an output
sharing the storage of an argument (``view``, ``t``, ``expand``,
``as_strided``...) is a ``view_of`` that argument; an argument the op's schema marks as written (``add_``,
``copy_``, ``out=``) is an update. On fake tensors none of this costs
memory or time, so a GPT-2 XL step records in seconds.

**Random ops** (dropout's ``bernoulli_`` on the CPU, ``native_dropout``
on CUDA, ``rand``...) draw from their device's generator, so a replay
equals eager only if it makes the same draws in the same sequence. Each
such op also updates one zero-byte tensor per device, ``rng:<device>``
(role ``input``): the generator's state. In-place updates of one tensor
run in the order they were recorded (docs/graph-format.md), so every order
memplan plans keeps the random ops in eager's sequence, and recomputation
never runs one again (``memplan fit`` recomputes no op that updates in
place). The replay calls them as recorded (:attr:`Call.random`), never
twice, so a step from the same generator state draws what eager draws.
Reading and setting a generator's state (``torch.get_rng_state``, which
``torch.utils.checkpoint`` uses to recompute dropout with the forward's
masks) are recorded as ops on the same tensor (:mod:`._generators`).

What cannot be replayed is refused with an :class:`UnsupportedStep` that
names the op: ops that read a tensor's value into Python (``.item()``,
data-dependent shapes: the recorded program would bake one step's value
in), and tensors made outside any op the recorder saw.

The rules about particular aten ops (which write undeclared arguments,
which fake kernels give other results than the real ones, which may write
over an argument) are :mod:`._aten`'s.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ._aten import (
    DATA_DEPENDENT,
    GRAD_MODE_DEPENDENT,
    SKIPPED_NAMESPACES,
    aliased_argument,
    draws,
    may_write_over,
    op_flops,
    out_variant,
    real_results,
    rerun_without_writes,
    writes_like_pointwise,
    written_arguments,
)
from ._calls import Call, Ref, replayed
from ._errors import UnsupportedStep
from ._generators import Generators
from ._outside import Outside
from ._tensors import TensorTable, storage_key


def _unique(xs: Sequence[int]) -> List[int]:
    seen = set()
    return [x for x in xs if not (x in seen or seen.add(x))]


class _Operands:
    """The tensor arguments of one call: the graph tensors it reads and
    writes, the torch tensors themselves, and the call's arguments with a
    :class:`Ref` for each tensor."""

    def __init__(self, rec: "Recorder", func, args, kwargs) -> None:
        self.written = written_arguments(func, args, kwargs)
        self.reads: List[int] = []
        self.writes: List[int] = []
        self.objects: List[torch.Tensor] = []
        schema = func._schema
        for pos, v in enumerate(args):
            pname = schema.arguments[pos].name if pos < len(schema.arguments) else None
            self._visit(rec, func, v, pos in self.written or pname in self.written)
        for k, v in kwargs.items():
            self._visit(rec, func, v, k in self.written)

        def ref(x):
            return Ref(rec._arg(x, func)) if isinstance(x, torch.Tensor) else x

        self.call_args = tree_map(ref, args)
        self.call_kwargs = tree_map(ref, kwargs)

    def _visit(self, rec: "Recorder", func, value: Any, is_written: bool) -> None:
        for x in tree_flatten(value)[0]:
            if isinstance(x, torch.Tensor):
                self.objects.append(x)
                (self.writes if is_written else self.reads).append(rec._arg(x, func))


class Recorder(TorchDispatchMode):
    """Turns every aten op run under it into a graph op and a :class:`Call`.

    ``device`` is the device type whose memory is planned; tensors on any
    other device (the optimizer's host scalars on a CUDA step) have size 0.
    Sizes are storage sizes in bytes; ``align`` is every tensor's alignment.
    The graph tensors are :attr:`table`'s (:class:`TensorTable`), the
    generators' :attr:`generators`' and the real tensors the step reads from
    outside :attr:`outside`'s.

    With ``replay=False`` the graph is recorded to be planned or compared,
    not run (``python -m memplan.torch.export --update eager`` records
    eager's own ``optimizer.step()`` this way): a value read into Python
    (AdamW's host step counter, ``.item()``) is an op like any other, and a
    tensor no recorded op made and nobody registered (a constant made
    outside the step) is an input ``unseen<k>``, counted in
    :attr:`unseen_storages`, instead of a refusal.
    """

    def __init__(self, device: str, align: int, replay: bool = True) -> None:
        super().__init__()
        self.device = device
        self.replay = replay
        self.unseen_storages = 0
        self.table = TensorTable(device, align)
        self.generators = Generators(self)
        self.ops: List[Dict[str, Any]] = []
        self.calls: List[Call] = []
        self.outside = Outside(self)

    @property
    def phase(self) -> str:
        """The phase being recorded: forward, backward or optimizer."""
        return self.table.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self.table.phase = phase

    def _arg(self, x: torch.Tensor, func) -> int:
        """The graph tensor a call's tensor argument `x` is: one seen
        before, or a constant input (``torch.tensor`` data, or with
        ``replay=False`` any unseen tensor)."""
        table = self.table
        i = table.find(x)
        if i is not None:
            return i
        value = x if not isinstance(x, FakeTensor) else x.constant
        if not self.replay:
            self.unseen_storages += 1
            return table.new_input(x, f"unseen{self.unseen_storages}")
        if value is not None:
            # A constant the step makes from Python data (`torch.tensor`):
            # its value is known, so it is a step input the runner binds.
            i = table.new_input(x, f"const{len(table.constants)}")
            with _disable_current_modes():
                table.constants[i] = value.detach().clone()
            return i
        raise UnsupportedStep(
            f"{func}: reads a tensor of shape {tuple(x.shape)} that no recorded op made and "
            "that is not a parameter, buffer, optimizer state or batch tensor (a constant made "
            "outside the step? register it as a buffer)"
        )

    # ---- the dispatch mode --------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in SKIPPED_NAMESPACES:
            return func(*args, **kwargs)
        self._refuse_unreplayable(func)
        if self.outside.fake_mode is not None:
            args, kwargs = tree_map(lambda x: self.outside.read(x, func), (args, kwargs))
        random = torch.Tag.nondeterministic_seeded in func.tags and draws(func, args, kwargs)
        operands = _Operands(self, func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            raise UnsupportedStep(
                f"{func}: the shape of its output depends on tensor values (boolean-mask indexing, "
                "nonzero); memplan replays a graph of static shapes"
            ) from None
        out = real_results(func, args, kwargs, out)
        flat_out = tree_flatten(out)[0]
        self._refuse_results(func, operands, flat_out)
        outputs, new_roots, call_outputs = self._results(func, args, kwargs, operands.objects, flat_out)
        writes = operands.writes
        if random:
            writes.append(self.generators.drawn_by(func, operands.objects, flat_out, kwargs))
        updates = _unique(writes)
        inputs = [i for i in _unique(operands.reads) if i not in updates and i not in outputs]
        if not (inputs or updates or outputs):
            return out
        flops = op_flops(func, args, kwargs, out)
        op = self._op(str(func), {"inputs": inputs, "outputs": outputs, "updates": updates}, flops)
        if updates and rerun_without_writes(func, args, kwargs):
            op["attrs"] = {"rerun_without_updates": True}  # (memplan's fit may run a copy without them)
        hint = self._reuse_hint(func, writes, outputs, new_roots, operands.objects, inputs)
        if hint is not None:
            ids = self.table.tensors
            op["reuse"] = [{"output": ids[hint[0]]["id"], "input": ids[hint[1]]["id"]}]
        self.calls.append(Call(replayed(func, args, kwargs), operands.call_args, operands.call_kwargs,
                               call_outputs, random, frozenset(operands.written)))
        self.table.used(inputs + updates + outputs)
        return out

    def _refuse_unreplayable(self, func) -> None:
        """Refuses, when the step is to be replayed, an op whose real kernel
        differs without autograd or that reads a value into Python."""
        name = func._schema.name
        if name in GRAD_MODE_DEPENDENT and self.replay:
            raise UnsupportedStep(f"{func}: {GRAD_MODE_DEPENDENT[name]}")
        if name in DATA_DEPENDENT and self.replay:
            raise UnsupportedStep(
                f"{func}: reads a tensor's value into Python (`.item()`, a data-dependent shape); "
                "memplan replays a fixed graph, so the step must not branch on values"
            )

    def _refuse_results(self, func, operands: _Operands, flat_out: List[Any]) -> None:
        """Refuses a call that grows a storage, writes a constant made
        outside the step, or makes or reads a tensor that is not dense."""
        self._refuse_grown_storages(func, operands.objects, operands.writes)
        if any(self.table.root(i) in self.outside.roots for i in operands.writes):
            raise UnsupportedStep(
                f"{func}: writes a tensor made outside the step that is not a buffer of the model (the step "
                "would update a copy of it); register it as a buffer"
            )
        for x in operands.objects + flat_out:
            if isinstance(x, torch.Tensor) and x.layout != torch.strided:
                raise UnsupportedStep(
                    f"{func}: a {x.layout} tensor (sparse gradients: nn.Embedding(sparse=True)...); memplan "
                    "plans dense tensors, whose bytes are known before the step runs"
                )

    def _refuse_grown_storages(self, func, arg_objs: List[torch.Tensor], writes: List[int]) -> None:
        """An op that writes a tensor must leave its storage the size it
        was made with (`resize_`, `set_` may grow it): memplan places each
        tensor's bytes when it is made, and the arena has no more there."""
        if not writes:
            return
        table = self.table
        for x in arg_objs:
            i = table.seen(x)
            if i is None or i not in writes or x.device.type != self.device:
                continue
            made = table.tensors[table.root(i)]["size"]
            now = x.untyped_storage().nbytes()
            if now > made:
                raise UnsupportedStep(
                    f"{func}: grows the storage of a tensor made earlier in the step from {made} to {now} "
                    "bytes; memplan places each tensor's bytes when it is made (make it at its full size)"
                )

    def _results(self, func, args, kwargs, arg_objs: List[torch.Tensor], flat_out: List[Any]):
        """The graph tensors a call's results become: a new root for new
        bytes, a view of the argument whose bytes a result shares. Returns
        them, the results that are new roots, and the call's
        (result position, graph tensor) pairs. A result that is an argument
        (in place, ``out=``) is an update, not a result."""
        table = self.table
        arg_ids = {id(x) for x in arg_objs}
        outputs: List[int] = []
        new_roots: List[torch.Tensor] = []
        call_outputs: List[Tuple[int, int]] = []
        for pos, x in enumerate(flat_out):
            if not isinstance(x, torch.Tensor) or id(x) in arg_ids:
                continue
            key = storage_key(x)
            base = table.root_of(x)
            aliased = aliased_argument(func, pos, args, kwargs) if base is None else None
            if aliased is not None:
                # Declared an alias of an argument (`lift_fresh`), though a
                # fake tensor gave it new bytes: a view, as the real op
                # returns its argument.
                i = table.alias(x, self._arg(aliased, func))
            elif base is None:
                role = "temporary" if self.phase == "optimizer" else "activation"
                i = table.new_root(x, f"t{len(table.tensors)}", role, "transient")
                new_roots.append(x)
            else:
                src = base
                for a in arg_objs:
                    if storage_key(a) == key:
                        seen = table.seen(a)
                        src = base if seen is None else seen
                        break
                i = table.add(x, f"t{len(table.tensors)}", 0, "activation", "transient", src)
            outputs.append(i)
            call_outputs.append((pos, i))
        return outputs, new_roots, call_outputs

    def _op(self, type: str, fields: Dict[str, List[int]], flops: Optional[int] = None) -> Dict[str, Any]:
        """Appends a graph op of the current phase (its kind) and returns
        it; `fields` maps inputs, outputs and updates to graph tensors, the
        empty ones left out."""
        op: Dict[str, Any] = {"id": f"o{len(self.ops)}", "kind": self.phase, "type": type}
        if flops is not None:
            op["flops"] = flops
        for field, ts in fields.items():
            if ts:
                op[field] = [self.table.tensors[i]["id"] for i in ts]
        self.ops.append(op)
        return op

    def emit(self, type: str, fields: Dict[str, List[int]], call: Call) -> Dict[str, Any]:
        """Records an op the driver makes (a generator's state read or set,
        a collective) with its call."""
        op = self._op(type, fields)
        self.calls.append(call)
        return op

    def collective(self, what: str, call: Any, tensors: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor] = ()) -> None:
        """Records a collective that updates `tensors` in place (a gradient's
        all-reduce, an all-gather's buffer), reading `inputs`: an op of kind
        ``collective``, type ``memplan.<what>``, and a :class:`Call` of
        `call` (a Python callable doing the collective on the real tensors
        at replay, given the updated tensors then the inputs). Nothing runs
        while recording: the tensors are fake, and their values do not
        matter."""
        ids = [self._arg(t, f"memplan.{what}") for t in tensors]
        reads = [self._arg(t, f"memplan.{what}") for t in inputs]
        call = Call(call, tuple(Ref(i) for i in ids + reads), {}, [], writes=frozenset(range(len(ids))))
        op = self.emit(f"memplan.{what}", {"inputs": reads, "updates": ids}, call)
        op["kind"] = "collective"
        self.table.used(ids + reads)

    def _reuse_hint(self, func, writes, outputs, new_roots, args, inputs) -> Optional[Tuple[int, int]]:
        """A reuse hint (output, input) for a pointwise or :data:`ROW_WISE`
        op with one new output: it may be written into an argument's bytes
        (:func:`may_write_over`, and of its dtype, so the runner can pass
        that tensor as ``out=``) when memplan's order makes the op that
        argument's last use; the runner then calls the op's ``out=``
        overload with that argument (:class:`memplan.torch._run.Program`)."""
        if writes or len(outputs) != 1 or len(new_roots) != 1 or not writes_like_pointwise(func):
            return None
        x = new_roots[0]
        if x.device.type != self.device:
            return None
        for a in args:
            ai = self.table.seen(a)
            if (ai is not None and ai in inputs and a.device.type == self.device and a.dtype == x.dtype
                    and may_write_over(x, a)):
                if out_variant(func) is None:
                    return None
                return outputs[0], ai
        return None

    # ---- closing ------------------------------------------------------

    def finish(self, name: str, metadata: Dict[str, Any]) -> Dict[str, Any]:
        """Assigns the roles the driver did not set and returns the graph
        document (docs/graph-format.md)."""
        self.table.assign_roles()
        self.table.release()
        self.generators.release()
        self.outside.release()
        return {
            "format": "memplan-graph",
            "version": 1,
            "name": name,
            "tensors": self.table.tensors,
            "ops": self.ops,
            "metadata": metadata,
        }
