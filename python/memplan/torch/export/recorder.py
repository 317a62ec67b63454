"""Records a training step's aten ops as a memplan graph.

:class:`Recorder` is a ``TorchDispatchMode``: every aten op the step runs
(forward, the autograd engine's backward ops, the optimizer's ``_foreach_*``
ops) passes through :meth:`Recorder.__torch_dispatch__` after autograd and
before the kernel, and becomes one memplan op, in the order it ran.

Tensors are followed by **storage**, not by Python object: an op's output
whose storage is new is a new memplan tensor of the storage's size; an output
that shares an existing storage (``view``, ``t``, ``expand``, ``detach``,
``as_strided``...) is a view (``view_of``) of the tensor it was made from; an
argument the op's schema marks as written (``add_``, ``copy_``, ``out=``,
each list element of ``_foreach_*_``) is an in-place update of that
tensor's bytes. Storage identity is the address of the storage object
(``StorageWeakRef.cdata``); the recorder keeps every storage it saw alive until
it is closed so an address is never reused by a later storage. On fake or
meta tensors that costs no memory.

Pointwise ops (aten's ``pointwise`` tag: ``add``, ``mul``, ``gelu``,
``threshold_backward``...) and softmax, log-softmax and their backward passes
(``ROW_WISE``) get **reuse hints**: an output may take the bytes
of an argument with exactly its layout if the op is that argument's last use
(memplan decides; PyTorch eager never does this on its own, a planned
executor would call the op with ``out=`` that argument).

Tensors on the host (``cpu`` while the step runs on an accelerator or on
``meta``), such as AdamW's ``step`` counters, are recorded with size 0: they
still order the ops that use them but occupy no device memory.

The recorder does not decide roles on its own: the driver
(:mod:`memplan.torch.export.step`) registers parameters, buffers, optimizer
state and inputs before the step, sets :attr:`Recorder.phase`, and marks the
loss and the gradients; :meth:`Recorder.finish` then assigns the remaining
roles (``activation`` for forward tensors the backward pass reads,
``temporary`` otherwise; backward tensors other than ``.grad`` are
``activation``, like memplan's built-in GPT-2 model).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# Shared with memplan.torch's recorder: which namespaces are bookkeeping,
# element type names, storage identity, and PyTorch's FLOP formulas.
from memplan.torch._record import (DTYPE_NAMES, SKIPPED_NAMESPACES, may_write_over, op_flops, real_results,
                                   storage_key, writes_like_pointwise, written_arguments)

from .graph import GraphBuilder


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class Recorder(TorchDispatchMode):
    """Turns every aten op run under it into a memplan op.

    ``device`` is the device type that stands for accelerator memory
    (``"cuda"``, or ``"meta"`` when tracing without one); tensors on any other
    device are host tensors of size 0. ``align`` is every tensor's alignment
    in the written graph.
    """

    def __init__(self, name: str, device: str, align: int = 256, reuse_hints: bool = True) -> None:
        super().__init__()
        self.graph = GraphBuilder(name)
        self.reuse_hints = reuse_hints
        self.device = device
        self.align = align
        self.phase = "forward"
        self._by_object = WeakIdKeyDictionary()  # tensor object -> tensor index
        self._root_of_storage: Dict[int, int] = {}  # storage key -> root index
        self._kept: Dict[int, Any] = {}  # root index -> its storage, kept alive
        self.resized_storages = 0
        self._phase_of: Dict[int, str] = {}  # root index -> phase that made it
        self._used_in: Dict[int, set] = {}  # root index -> phases that used it
        self._fixed_role: Dict[int, str] = {}  # roots whose role the driver set
        self.unseen_storages = 0  # storages first met as an op argument
        self.skipped_ops = 0
        self._generators: Dict[str, int] = {}  # "rng:<device>" -> its tensor

    # ---- registration by the driver -------------------------------------

    def _is_host(self, t: torch.Tensor) -> bool:
        return t.device.type != self.device

    def _new_root(self, t: torch.Tensor, id: str, role: str, lifetime: str) -> int:
        key = storage_key(t)
        host = self._is_host(t)
        size = 0 if host else t.untyped_storage().nbytes()
        i = self.graph.add_tensor(
            ("host:" + id) if host else id,
            size,
            role=role,
            lifetime=lifetime,
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            align=self.align,
        )
        self._root_of_storage[key] = i
        self._kept[i] = t.untyped_storage()
        self._by_object[t] = i
        self._phase_of[i] = self.phase
        return i

    def register(self, t: torch.Tensor, id: str, role: str, persistent: bool) -> int:
        """Registers a tensor that exists before the step (parameter,
        buffer, optimizer state, input). A tensor sharing the storage of one
        registered before becomes a view of it."""
        key = storage_key(t)
        if key in self._root_of_storage:
            root = self._root_of_storage[key]
            i = self.graph.add_tensor(
                id + "@view", 0, role=role, view_of=root, dtype=dtype_name(t.dtype),
                shape=list(t.shape), align=self.align,
            )
            self._by_object[t] = i
            return i
        i = self._new_root(t, id, role, "persistent" if persistent else "transient")
        self._fixed_role[i] = role
        self._phase_of[i] = "before"
        return i

    def root_of(self, t: torch.Tensor) -> Optional[int]:
        """The root tensor index holding `t`'s bytes, if recorded."""
        return self._root_of_storage.get(storage_key(t))

    def mark(self, t: torch.Tensor, role: str, persistent: Optional[bool] = None) -> None:
        """Sets the role (and optionally the lifetime) of `t`'s root."""
        r = self.root_of(t)
        if r is None:
            raise KeyError("mark(): the tensor was not recorded")
        self.graph.tensors[r]["role"] = role
        self._fixed_role[r] = role
        if persistent is not None:
            self.graph.tensors[r]["lifetime"] = "persistent" if persistent else "transient"

    # ---- the dispatch mode ----------------------------------------------

    def _index(self, t: torch.Tensor) -> int:
        """The memplan tensor an argument stands for."""
        i = self._by_object.get(t)
        if i is not None:
            return i
        key = storage_key(t)
        r = self._root_of_storage.get(key)
        if r is not None:
            # A new Python object over known bytes (e.g. `.data`, made
            # without dispatch): reading it reads the root.
            self._by_object[t] = r
            return r
        # Bytes made outside any op we saw (a constant from torch.tensor,
        # a tensor from before the step that nobody registered).
        self.unseen_storages += 1
        i = self._new_root(t, f"unseen{self.unseen_storages}", "input", "transient")
        self._fixed_role[i] = "input"
        return i

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in SKIPPED_NAMESPACES:
            return func(*args, **kwargs)
        schema = func._schema
        # Which arguments the op writes, by position and by name (batch
        # norm's running statistics too, which its schema does not say).
        written = written_arguments(func, args, kwargs)
        reads: List[int] = []
        writes: List[int] = []
        arg_objs: List[torch.Tensor] = []

        def visit(value: Any, is_written: bool) -> None:
            flat, _ = tree_flatten(value)
            for x in flat:
                if isinstance(x, torch.Tensor):
                    i = self._index(x)
                    arg_objs.append(x)
                    (writes if is_written else reads).append(i)

        for pos, v in enumerate(args):
            name = schema.arguments[pos].name if pos < len(schema.arguments) else None
            visit(v, pos in written or name in written)
        for k, v in kwargs.items():
            visit(v, k in written)

        # The results the real kernels make where fake kernels say otherwise.
        out = real_results(func, args, kwargs, func(*args, **kwargs))

        flat_out, _ = tree_flatten(out)
        arg_ids = {id(x) for x in arg_objs}
        outputs: List[int] = []
        new_roots: List[torch.Tensor] = []
        for x in flat_out:
            if not isinstance(x, torch.Tensor) or id(x) in arg_ids:
                continue  # in-place result or `out=` argument: already an update
            key = storage_key(x)
            base = self._root_of_storage.get(key)
            if base is None:
                role = "activation" if self.phase != "optimizer" else "temporary"
                i = self._new_root(x, f"t{len(self.graph.tensors)}", role, "transient")
                new_roots.append(x)
            else:
                # A view: of the argument it shares bytes with, else the root.
                src = base
                for a in arg_objs:
                    if storage_key(a) == key:
                        src = self._by_object.get(a, base)
                        break
                i = self.graph.add_tensor(
                    f"t{len(self.graph.tensors)}",
                    0,
                    role=self.graph.tensors[base]["role"],
                    view_of=src,
                    dtype=dtype_name(x.dtype),
                    shape=list(x.shape),
                    align=self.align,
                )
                self._by_object[x] = i
            outputs.append(i)

        writes_tensors = bool(writes)
        if torch.Tag.nondeterministic_seeded in func.tags:
            writes.append(self._generator(arg_objs + [x for x in flat_out if isinstance(x, torch.Tensor)]))
        updates = _unique(writes)
        inputs = [i for i in _unique(reads) if i not in updates and i not in outputs]
        reuse = []
        if self.reuse_hints and not writes_tensors and writes_like_pointwise(func):
            reuse = self._pointwise_reuse(new_roots, arg_objs, inputs)
        if not (inputs or updates or outputs):
            self.skipped_ops += 1
            return out
        kind = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}.get(
            self.phase, "other"
        )
        self.graph.add_op(
            f"o{len(self.graph.ops)}",
            kind,
            str(func),
            inputs=inputs,
            outputs=outputs,
            updates=updates,
            reuse=reuse,
            flops=op_flops(func, args, kwargs, out),
        )
        for i in inputs + updates + outputs:
            r = self._root(i)
            self._used_in.setdefault(r, set()).add(self.phase)
        return out

    def _generator(self, tensors: List[torch.Tensor]) -> int:
        """The zero-byte tensor ``rng:<device>`` standing for the state of
        the generator a random op (``nondeterministic_seeded``: dropout,
        ``bernoulli_``, ``rand``...) draws from, on its first tensor's
        device; made on first use. Every random op updates it, so every
        order memplan plans keeps eager's sequence of draws (as
        :mod:`memplan.torch` does for the steps it runs)."""
        device = tensors[0].device.type if tensors else self.device
        name = f"rng:{'host' if device != self.device else device}"
        i = self._generators.get(name)
        if i is None:
            i = self.graph.add_tensor(name, 0, role="input", lifetime="persistent")
            self._generators[name] = i
            self._fixed_role[i] = "input"
            self._phase_of[i] = "before"
        return i

    def _pointwise_reuse(self, outs, args, inputs) -> List[tuple]:
        """Reuse hints for a pointwise (or row-wise) op: an output may take the bytes of an
        argument with the same layout (shape, strides, offset 0, element
        size) that fills its whole storage, exactly as the output will; each
        element is then read before it is written, as in ``out=`` calls."""
        pairs = []
        taken = set()
        for x in outs:
            if self._is_host(x):
                continue
            xi = self._by_object[x]
            for a in args:
                ai = self._by_object.get(a)
                if (
                    ai is None
                    or ai in taken
                    or ai not in inputs
                    or self._is_host(a)
                    or not may_write_over(x, a)
                ):
                    continue
                pairs.append((xi, ai))
                taken.add(ai)
                break
        return pairs

    def _root(self, i: int) -> int:
        t = self.graph.tensors[i]
        while "view_of" in t:
            i = t["view_of"]
            t = self.graph.tensors[i]
        return i

    # ---- closing ----------------------------------------------------------

    def finish(self) -> GraphBuilder:
        """Assigns roles not set by the driver and lets go of the storages."""
        for i, t in enumerate(self.graph.tensors):
            if "view_of" in t or i in self._fixed_role:
                continue
            made = self._phase_of.get(i)
            if made == "forward":
                t["role"] = "activation" if "backward" in self._used_in.get(i, ()) else "temporary"
            elif made == "backward":
                t["role"] = "activation"
            elif made == "optimizer":
                t["role"] = "temporary"
        # Views carry their root's role (informational only).
        for i, t in enumerate(self.graph.tensors):
            if "view_of" in t:
                t["role"] = self.graph.tensors[self._root(i)]["role"]
        # A storage may have grown after it was made (`resize_`, `out=`
        # kernels): the graph holds its largest size.
        for i, st in self._kept.items():
            t = self.graph.tensors[i]
            if not t["id"].startswith("host:") and st.nbytes() > t["size"]:
                t["size"] = st.nbytes()
                self.resized_storages += 1
        self._kept.clear()
        self._root_of_storage.clear()
        return self.graph


def _unique(xs: Sequence[int]) -> List[int]:
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
