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

Tensors are followed by **storage**: an output whose storage is new is a new
memplan tensor of the storage's size; an output sharing the storage of an
argument (``view``, ``t``, ``expand``, ``as_strided``...) is a ``view_of``
that argument; an argument the op's schema marks as written (``add_``,
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
masks) are recorded as ops on the same tensor (:class:`GeneratorStates`).

What cannot be replayed is refused with an :class:`UnsupportedStep` that
names the op: ops that read a tensor's value into Python (``.item()``,
data-dependent shapes: the recorded program would bake one step's value
in), and tensors made outside any op the recorder saw.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from memplan import MemplanError

# Namespaces whose ops are bookkeeping, not computation on tensors.
SKIPPED_NAMESPACES = ("prim", "profiler")

# Ops whose result is a Python value read from a tensor: a program recorded
# past them would replay one step's value forever.
DATA_DEPENDENT = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::unique",
    "aten::_unique2",
    "aten::masked_select",
    "aten::item",
}

# The package's one element-type table: each torch dtype's name in memplan's
# graphs (docs/graph-format.md; the Rust core's `memplan::dtype` reads the
# same names). Widths come from torch itself (`dtype.itemsize`).
DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_itemsize(name: str, default: torch.dtype) -> int:
    """Bytes of one element of the dtype named `name` in a graph, or of
    `default` for a name the table lacks."""
    return TORCH_DTYPES.get(name, default).itemsize



def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> Optional[int]:
    """FLOPs of one aten call by PyTorch's own formulas
    (``torch.utils.flop_counter``: matrix products, convolutions, attention);
    None for ops it has no formula for, which memplan's cost model then
    prices by the bytes they write."""
    count = flop_registry.get(getattr(func, "_overloadpacket", None))
    if count is None:
        return None
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments
        return None


@functools.lru_cache(maxsize=None)
def out_variant(func, without: Tuple[str, ...] = ()):
    """The ``out=`` overload of `func` and the names of its out arguments,
    or None. Its other arguments must be `func`'s but those named in
    `without`, by name and type (``pow.Tensor_Scalar``'s is
    ``pow.Tensor_Scalar_out``, not ``pow.Tensor_Tensor_out``)."""
    if func.namespace != "aten":
        return None
    packet = func.overloadpacket
    names = [(a.name, str(a.type)) for a in func._schema.arguments if a.name not in without]
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        outs = [a.name for a in cand._schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in cand._schema.arguments if not a.is_out]
        if outs and rest == names and len(outs) == len(func._schema.returns):
            return cand, outs
    return None


# Ops that are not pointwise but may still write their result over an
# argument of the same layout: softmax and log-softmax and their backward
# passes reduce each row first (max, sum) and then write every element of
# the row from the same element of their arguments, once the reductions are
# done (aten's CPU kernels and CUDA's `cunn_SoftMax*`/persistent kernels
# alike). `out=` over either argument gives the functional result bit for
# bit (python/tests/test_torch.py, RowWiseOpsWriteOverDyingInputs). At the
# loss of a language model these are the vocabulary-sized tensors.
ROW_WISE = frozenset({
    "aten::_softmax", "aten::_log_softmax",
    "aten::_softmax_backward_data", "aten::_log_softmax_backward_data",
})


def writes_like_pointwise(func) -> bool:
    """Whether `func` reads each element of its arguments before it writes
    the same element of its result, so that result may take an argument's
    bytes (:func:`may_write_over`): aten's pointwise ops and
    :data:`ROW_WISE`."""
    return torch.Tag.pointwise in func.tags or func._schema.name in ROW_WISE


def may_write_over(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether a pointwise (or :data:`ROW_WISE`) op's new output `x` may be
    written into the bytes of its argument `a`: the two have the same shape,
    strides and element size, each fills its whole storage from offset 0,
    and neither is a lazily conjugated or negated view. Then ``out=a``
    writes every element exactly where it was read from, after reading it
    (what aten's kernels do for a fully overlapping output)."""
    return (
        not (a.is_conj() or a.is_neg() or x.is_conj() or x.is_neg())  # lazily conjugated or negated views
        and a.shape == x.shape
        and a.stride() == x.stride()
        and a.storage_offset() == 0
        and x.storage_offset() == 0
        and a.element_size() == x.element_size()
        and a.untyped_storage().nbytes() == x.untyped_storage().nbytes()
    )


# Ops whose real kernels return other results without autograd than with
# it; the step replays under `torch.no_grad()`.
GRAD_MODE_DEPENDENT = {
    "aten::mkldnn_rnn_layer": (
        "oneDNN's LSTM keeps the workspace its backward needs only while autograd records, and the step "
        "replays without it; capture (and train) with torch.backends.mkldnn.flags(enabled=False), which "
        "records the LSTM as plain ops"
    ),
}


class UnsupportedStep(MemplanError):
    """A step memplan cannot run in another order; the message names the
    op and says why. A :class:`memplan.MemplanError` (a ``ValueError``),
    as every refusal of the package is, of kind ``"unsupported"``."""

    kind = "unsupported"


class Layout(NamedTuple):
    """How a graph tensor sits in its storage, as recorded."""

    shape: tuple
    stride: tuple
    offset: int  # storage offset, in elements
    dtype: torch.dtype
    device: torch.device


class Ref:
    """A tensor argument of a recorded call: graph tensor `index`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Ref({self.index})"


class Call:
    """One recorded aten call: ``func(*args, **kwargs)`` with :class:`Ref`
    in place of tensors; ``outputs`` pairs a position in the flattened
    result with the graph tensor it becomes. ``random``: the call draws
    random numbers, so it must run exactly once per step, as recorded.
    ``writes``: the arguments (positions and names) it updates in place."""

    __slots__ = ("func", "args", "kwargs", "outputs", "random", "writes")

    def __init__(self, func, args, kwargs, outputs: List[Tuple[int, int]], random: bool = False,
                 writes: frozenset = frozenset()) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.random = random
        self.writes = writes


def storage_key(t: torch.Tensor) -> int:
    """Identity of `t`'s storage (shared by all views of it)."""
    return StorageWeakRef(t.untyped_storage()).cdata


# Ops whose result autograd never links to their argument.
_DETACHING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}

# Ops whose `storage_offset` counts from the start of `self`'s storage.
STORAGE_OFFSET_OPS = {"aten::as_strided", "aten::as_strided_", "aten::as_strided_copy"}


class FromStorageStart:
    """A recorded ``as_strided(self, size, stride, storage_offset)`` (or
    ``as_strided_``, ``as_strided_copy``) with an explicit offset, which
    counts elements from the start of `self`'s storage. When the step runs,
    `self` may sit elsewhere in a larger storage (a view into the arena):
    the offset moves by as much as `self`'s own storage offset moved from
    the recorded `self_offset`, so the result covers the same bytes of
    `self`'s tensor as it did when recorded."""

    __slots__ = ("func", "_raw", "self_offset")

    def __init__(self, func, self_offset: int) -> None:
        self.func = func
        self._raw = getattr(func, "_op", func)
        self.self_offset = self_offset

    def __call__(self, x, size, stride, storage_offset=None, **kwargs):
        if storage_offset is not None:
            storage_offset = storage_offset + x.storage_offset() - self.self_offset
        return self._raw(x, size, stride, storage_offset, **kwargs)

    def __repr__(self) -> str:
        return f"{self.func} (offset from self's storage)"


def _replayed(func, args, kwargs):
    """What a :class:`Call` runs for `func` called with `args`: `func`, or
    for an explicit storage offset a :class:`FromStorageStart`."""
    if func._schema.name not in STORAGE_OFFSET_OPS:
        return func
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if offset is None:
        return func
    return FromStorageStart(func, int(args[0].storage_offset()))


# Ops that update arguments their schema does not declare written: batch
# norm in training updates the running statistics it is given (PyTorch's
# `_native_batch_norm_legit` declares it; these older ops, which eager
# calls, do not).
UNDECLARED_WRITES = {"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"}


def undeclared_writes(func, args, kwargs) -> set:
    """The positions and names of the arguments `func` updates though its
    schema does not say so (the running statistics of a batch norm in
    training: without them, the update is not ordered, the arena's first
    run applies it twice, and `fit` may recompute it)."""
    if func._schema.name not in UNDECLARED_WRITES:
        return set()
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    if not bound.get("training"):
        return set()
    return {x for pos, name in ((3, "running_mean"), (4, "running_var")) if bound.get(name) is not None
            for x in (pos, name)}


# Normalisations whose saved statistics (results 1 and 2) PyTorch keeps in
# float32 when a low-precision input meets float32 weights ("mixed type",
# as under CPU autocast), where the fake kernels give the input's dtype:
# op -> (argument positions of weight and bias, only on the CPU).
MIXED_TYPE_STATISTICS = {
    "aten::native_layer_norm": ((2, 3), True),
    "aten::native_batch_norm": ((1, 2), True),
    "aten::native_group_norm": ((1, 2), False),
}


def real_dtypes(func, args, out):
    """`out` with the dtypes the real kernel gives where PyTorch's fake
    kernel says otherwise; a recorded tensor of the wrong dtype would be
    planned at the wrong size, and in the arena the real kernel refuses
    its place. Seen with mixed types (low-precision input, float32
    weights): the statistics of the normalisations in
    MIXED_TYPE_STATISTICS, which really are float32, and the input
    gradient of `native_group_norm_backward`, which really has the
    input's dtype."""
    name = func._schema.name
    if not isinstance(out, tuple) or not isinstance(args[0], torch.Tensor):
        return out
    if name == "aten::native_group_norm_backward" and isinstance(out[0], torch.Tensor):
        return (_as_dtype(out[0], args[1].dtype),) + out[1:]
    rule = MIXED_TYPE_STATISTICS.get(name)
    if rule is None or len(out) < 3:
        return out
    (w, b), cpu_only = rule
    x = args[0]
    params = [args[k] for k in (w, b) if k < len(args) and isinstance(args[k], torch.Tensor)]
    if (x.dtype not in (torch.float16, torch.bfloat16) or not any(p.dtype == torch.float32 for p in params)
            or (cpu_only and x.device.type != "cpu")):
        return out
    return (out[0], _as_dtype(out[1], torch.float32), _as_dtype(out[2], torch.float32)) + out[3:]


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t`, or a fake tensor of its layout in `dtype` (made below the
    recorder: not an op of the step)."""
    if t.dtype == dtype:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def written_arguments(func, args, kwargs) -> set:
    """The positions and names of the arguments `func` writes: those its
    schema marks written (``add_``, ``copy_``, ``out=``...) and those it
    writes without saying so (:func:`undeclared_writes`)."""
    written = undeclared_writes(func, args, kwargs)
    for pos, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            written.update((a.name, pos))
    return written


def real_results(func, args, kwargs, out):
    """`out` as the real kernel makes it where PyTorch's fake kernel says
    otherwise (:func:`masked_off`, :func:`real_dtypes`)."""
    return real_dtypes(func, args, masked_off(func, args, kwargs, out))


def masked_off(func, args, kwargs, out):
    """`out` with the results its `output_mask` argument switches off as
    None, as the real kernel leaves them undefined: the fake kernel of
    `native_batch_norm_backward` makes them anyway (a batch norm over the
    batch itself, whose input needs no gradient), and a recorded tensor
    the real op never makes would be planned and placed."""
    for pos, a in enumerate(func._schema.arguments):
        if a.name == "output_mask":
            mask = args[pos] if pos < len(args) else kwargs.get("output_mask")
            if isinstance(out, tuple) and mask is not None and len(mask) == len(out):
                return tuple(o if on else None for on, o in zip(mask, out))
            break
    return out


def _aliased_argument(func, pos: int, args, kwargs) -> Optional[torch.Tensor]:
    """The tensor argument that result `pos` of `func` is declared to alias
    without writing it (``lift_fresh(Tensor(a) self) -> Tensor(a)``), or
    None."""
    returns = func._schema.returns
    if pos >= len(returns) or returns[pos].alias_info is None or returns[pos].alias_info.is_write:
        return None
    sets = returns[pos].alias_info.before_set
    for k, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set == sets:
            v = args[k] if k < len(args) else kwargs.get(a.name)
            return v if isinstance(v, torch.Tensor) else None
    return None


def _draws(func, args, kwargs) -> bool:
    """Whether a seeded op really draws: attention kernels carry the tag
    for their dropout and draw nothing when its probability is 0."""
    for pos, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p"):
            v = args[pos] if pos < len(args) else kwargs.get(a.name, a.default_value)
            return not (isinstance(v, (int, float)) and v == 0)
    return True


_ORIGINAL_STATE_CALLS = {
    "get": (torch.random.get_rng_state, torch.cuda.random.get_rng_state),
    "set": (torch.random.set_rng_state, torch.cuda.random.set_rng_state),
}


def _cuda_device(device) -> torch.device:
    """`torch.cuda`'s device argument (an index, a name, a device) as a
    device with an index."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def read_generator(device: str) -> torch.Tensor:
    """The state of `device`'s default generator (a recorded
    ``get_rng_state``, run)."""
    cpu_get, cuda_get = _ORIGINAL_STATE_CALLS["get"]
    return cpu_get() if device == "cpu" else cuda_get(device)


def write_generator(state: torch.Tensor, device: str) -> None:
    """Sets `device`'s default generator to `state` (a recorded
    ``set_rng_state``, run)."""
    cpu_set, cuda_set = _ORIGINAL_STATE_CALLS["set"]
    if device == "cpu":
        cpu_set(state)
    else:
        cuda_set(state, device)


class GeneratorStates:
    """While a step is captured, ``torch.get_rng_state``/``set_rng_state``
    and ``torch.cuda``'s become ops of the recorder (:meth:`Recorder.get_state`,
    :meth:`Recorder.set_state`): how ``torch.utils.checkpoint`` replays
    dropout in its recomputation with the forward's masks. Reseeding
    inside the step (``torch.manual_seed``) is refused."""

    def __init__(self, rec: "Recorder") -> None:
        self.rec = rec
        self._saved: List[Tuple[Any, str, Any]] = []

    def _patch(self, module, name: str, value) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def __enter__(self) -> "GeneratorStates":
        rec = self.rec

        def get_cpu():
            return rec.get_state(torch.device("cpu"))

        def set_cpu(new_state):
            rec.set_state(new_state, torch.device("cpu"))

        def get_cuda(device="cuda"):
            return rec.get_state(_cuda_device(device))

        def set_cuda(new_state, device="cuda"):
            rec.set_state(new_state, _cuda_device(device))

        def reseed(*_args, **_kwargs):
            raise UnsupportedStep("torch.manual_seed inside the step: seed before capturing and running it")

        for module in (torch, torch.random):
            self._patch(module, "get_rng_state", get_cpu)
            self._patch(module, "set_rng_state", set_cpu)
            self._patch(module, "manual_seed", reseed)
        for module in (torch.cuda, torch.cuda.random):
            self._patch(module, "get_rng_state", get_cuda)
            self._patch(module, "set_rng_state", set_cuda)
            self._patch(module, "manual_seed", reseed)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()


def _unique(xs: Sequence[int]) -> List[int]:
    seen = set()
    return [x for x in xs if not (x in seen or seen.add(x))]


class Recorder(TorchDispatchMode):
    """Turns every aten op run under it into a graph op and a :class:`Call`.

    ``device`` is the device type whose memory is planned; tensors on any
    other device (the optimizer's host scalars on a CUDA step) have size 0.
    Sizes are storage sizes in bytes; ``align`` is every tensor's alignment.

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
        self.align = align
        self.replay = replay
        self.unseen_storages = 0
        self.phase = "forward"
        self.tensors: List[Dict[str, Any]] = []
        self.ops: List[Dict[str, Any]] = []
        self.calls: List[Call] = []
        self.constants: Dict[int, torch.Tensor] = {}  # graph tensor -> its value
        self.sources: Dict[int, torch.Tensor] = {}  # a constant -> the caller's tensor it was copied from
        # The capture's FakeTensorMode (set by the driver), and the fake
        # stand-in of each real tensor the step reads from outside.
        self.fake_mode = None
        self._outside: Dict[int, torch.Tensor] = {}
        self._outside_roots: set = set()
        # Real storage of each parameter and buffer -> its fake and graph id.
        self._inputs_by_storage: Dict[int, Tuple[torch.Tensor, str]] = {}
        self.parent: List[Optional[int]] = []  # per tensor: what it is a view of
        self.layouts: List[Layout] = []  # per graph tensor
        self._by_object = WeakIdKeyDictionary()
        self._root_of_storage: Dict[int, int] = {}
        self._kept: List[Any] = []  # storages kept alive while recording
        self._phase_of: Dict[int, str] = {}
        self._used_in: Dict[int, set] = {}
        self._fixed_role: Dict[int, str] = {}
        self._generators: Dict[str, int] = {}  # device -> its rng:<device> tensor
        self._states: Dict[int, int] = {}  # id of a recorded generator state -> its tensor

    # ---- tensors ------------------------------------------------------

    def _add(self, x: torch.Tensor, id: str, size: int, role: str, lifetime: str,
             view_of: Optional[int]) -> int:
        t: Dict[str, Any] = {"id": id, "size": int(size), "role": role, "lifetime": lifetime}
        if self.align != 1:
            t["align"] = self.align
        if view_of is not None:
            t["view_of"] = self.tensors[view_of]["id"]
        t["dtype"] = DTYPE_NAMES.get(x.dtype, str(x.dtype).replace("torch.", ""))
        t["shape"] = [int(d) for d in x.shape]
        self.tensors.append(t)
        self.parent.append(view_of)
        self.layouts.append(Layout(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype, x.device))
        i = len(self.tensors) - 1
        self._by_object[x] = i
        self._phase_of[i] = self.phase
        return i

    def _new_root(self, x: torch.Tensor, id: str, role: str, lifetime: str) -> int:
        size = 0 if x.device.type != self.device else x.untyped_storage().nbytes()
        i = self._add(x, id, size, role, lifetime, None)
        self._root_of_storage[storage_key(x)] = i
        self._kept.append(x.untyped_storage())
        return i

    def register(self, x: torch.Tensor, id: str, role: str) -> int:
        """Registers a step input (parameter, buffer, optimizer state, batch,
        host scalar): persistent, owned by the caller. A tensor sharing the
        storage of one registered before becomes a view of it."""
        root = self._root_of_storage.get(storage_key(x))
        if root is not None:
            i = self._add(x, id, 0, role, "transient", root)
        else:
            i = self._new_root(x, id, role, "persistent")
        self._fixed_role[i] = role
        self._phase_of[i] = "before"
        return i

    def index_of(self, x: torch.Tensor) -> int:
        i = self._by_object.get(x)
        if i is None:
            raise KeyError("the tensor was not recorded")
        return i

    def root_of(self, x: torch.Tensor) -> Optional[int]:
        """The root tensor holding `x`'s bytes, if any op or registration
        made them (a gradient the autograd engine hands over as a new
        object over an op's output)."""
        return self._root_of_storage.get(storage_key(x))

    def root(self, i: int) -> int:
        """The root tensor whose bytes tensor `i` uses."""
        while self.parent[i] is not None:
            i = self.parent[i]
        return i

    def mark(self, x: torch.Tensor, role: str, persistent: bool = False) -> int:
        """Sets the role (and the lifetime) of the tensor `x` stands for."""
        i = self.index_of(x)
        t = self.tensors[i]
        if "view_of" in t:
            raise UnsupportedStep(f"the {role} is a view of another tensor; return a fresh tensor")
        t["role"] = role
        if persistent:
            t["lifetime"] = "persistent"
        self._fixed_role[i] = role
        return i

    def stands_for(self, real: torch.Tensor, fake: torch.Tensor, id: str) -> None:
        """Makes `fake`, registered as `id`, what the step reads wherever it
        reads the real parameter or buffer `real` (or a tensor over its
        bytes, ``p.data``, ``p.detach()``) from outside the model it was
        given: a list made before capture, a gradient hook's closure."""
        self._inputs_by_storage.setdefault(storage_key(real), (fake, id))

    def _from_outside(self, x, func):
        """A real tensor the step reads from outside it (class weights in a
        loss, a mask made before the step) becomes a constant input: its
        value, copied at capture, is bound at every run, and a fake
        stand-in takes its place while recording. A tensor over a
        parameter's or buffer's bytes is read as that step input instead
        (:meth:`_as_step_input`)."""
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        known = self._inputs_by_storage.get(storage_key(x))
        if known is not None:
            return self._as_step_input(x, func, *known)
        fake = self._outside.get(id(x))
        if fake is None:
            if x.requires_grad:
                raise UnsupportedStep(
                    f"{func}: reads a tensor of shape {tuple(x.shape)} that requires grad but is not a "
                    "parameter of the model (make it one, or detach it)"
                )
            with _disable_current_modes():
                value = x.detach().clone()
                fake = self.fake_mode.from_tensor(value)
            i = self._new_root(fake, f"const{len(self.constants)}", "input", "persistent")
            self._fixed_role[i] = "input"
            self._phase_of[i] = "before"
            self.constants[i] = value
            self.sources[i] = x
            self._outside[id(x)] = fake
            self._outside_roots.add(i)
            self._kept.append(x)  # its id stays its own while recording
        return fake

    def _as_step_input(self, x: torch.Tensor, func, fake: torch.Tensor, id: str) -> torch.Tensor:
        """The fake step input `fake` (or the view of it that `x` is) for
        a real tensor `x` over the bytes of the parameter or buffer `id`:
        its value is the step's at every run, as eager reads it. Refused
        where autograd would record the read: the gradient would go to the
        real tensor, not to the step's parameter."""
        if x.requires_grad and torch.is_grad_enabled() and func not in _DETACHING:
            raise UnsupportedStep(
                f"{func}: reads {id} through a reference held from outside the model given to loss_fn "
                "(a list of parameters made before capture, a closure), so its gradient would be lost; "
                "reach it through the model loss_fn is given (model.parameters(), model.<name>), or detach it"
            )
        if x.dtype != fake.dtype:
            raise UnsupportedStep(f"{func}: reads {id}'s bytes as {x.dtype}, not as its {fake.dtype}")
        if (x.shape, x.stride(), x.storage_offset()) == (fake.shape, fake.stride(), fake.storage_offset()):
            return fake
        view = torch.ops.aten.as_strided.default
        return self.__torch_dispatch__(view, (), (fake, tuple(x.shape), tuple(x.stride()), x.storage_offset()), {})

    def _refuse_grown_storages(self, func, arg_objs: List[torch.Tensor], writes: List[int]) -> None:
        """An op that writes a tensor must leave its storage the size it
        was made with (`resize_`, `set_` may grow it): memplan places each
        tensor's bytes when it is made, and the arena has no more there."""
        if not writes:
            return
        for x in arg_objs:
            i = self._by_object.get(x)
            if i is None or i not in writes or x.device.type != self.device:
                continue
            made = self.tensors[self.root(i)]["size"]
            now = x.untyped_storage().nbytes()
            if now > made:
                raise UnsupportedStep(
                    f"{func}: grows the storage of a tensor made earlier in the step from {made} to {now} "
                    "bytes; memplan places each tensor's bytes when it is made (make it at its full size)"
                )

    def _arg(self, x: torch.Tensor, func) -> int:
        i = self._by_object.get(x)
        if i is not None:
            return i
        r = self._root_of_storage.get(storage_key(x))
        if r is not None:
            self._by_object[x] = r  # a new object over known bytes (`.data`)
            return r
        value = x if not isinstance(x, FakeTensor) else x.constant
        if not self.replay:
            self.unseen_storages += 1
            i = self._new_root(x, f"unseen{self.unseen_storages}", "input", "persistent")
            self._fixed_role[i] = "input"
            self._phase_of[i] = "before"
            return i
        if value is not None:
            # A constant the step makes from Python data (`torch.tensor`):
            # its value is known, so it is a step input the runner binds.
            i = self._new_root(x, f"const{len(self.constants)}", "input", "persistent")
            self._fixed_role[i] = "input"
            self._phase_of[i] = "before"
            with _disable_current_modes():
                self.constants[i] = value.detach().clone()
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
        name = func._schema.name
        if name in GRAD_MODE_DEPENDENT and self.replay:
            raise UnsupportedStep(f"{func}: {GRAD_MODE_DEPENDENT[name]}")
        if name in DATA_DEPENDENT and self.replay:
            raise UnsupportedStep(
                f"{func}: reads a tensor's value into Python (`.item()`, a data-dependent shape); "
                "memplan replays a fixed graph, so the step must not branch on values"
            )
        if self.fake_mode is not None:
            args, kwargs = tree_map(lambda x: self._from_outside(x, func), (args, kwargs))
        random = torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs)
        schema = func._schema
        written = written_arguments(func, args, kwargs)
        reads: List[int] = []
        writes: List[int] = []
        arg_objs: List[torch.Tensor] = []

        def ref(x):
            if isinstance(x, torch.Tensor):
                return Ref(self._arg(x, func))
            return x

        def visit(value: Any, is_written: bool) -> None:
            for x in tree_flatten(value)[0]:
                if isinstance(x, torch.Tensor):
                    arg_objs.append(x)
                    (writes if is_written else reads).append(self._arg(x, func))

        for pos, v in enumerate(args):
            pname = schema.arguments[pos].name if pos < len(schema.arguments) else None
            visit(v, pos in written or pname in written)
        for k, v in kwargs.items():
            visit(v, k in written)
        call_args = tree_map(ref, args)
        call_kwargs = tree_map(ref, kwargs)

        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            raise UnsupportedStep(
                f"{func}: the shape of its output depends on tensor values (boolean-mask indexing, "
                "nonzero); memplan replays a graph of static shapes"
            ) from None
        out = real_results(func, args, kwargs, out)

        self._refuse_grown_storages(func, arg_objs, writes)
        if any(self.root(i) in self._outside_roots for i in writes):
            raise UnsupportedStep(
                f"{func}: writes a tensor made outside the step that is not a buffer of the model (the step "
                "would update a copy of it); register it as a buffer"
            )
        flat_out = tree_flatten(out)[0]
        for x in arg_objs + flat_out:
            if isinstance(x, torch.Tensor) and x.layout != torch.strided:
                raise UnsupportedStep(
                    f"{func}: a {x.layout} tensor (sparse gradients: nn.Embedding(sparse=True)...); memplan "
                    "plans dense tensors, whose bytes are known before the step runs"
                )
        arg_ids = {id(x) for x in arg_objs}
        outputs: List[int] = []
        new_roots: List[torch.Tensor] = []
        call_outputs: List[Tuple[int, int]] = []
        for pos, x in enumerate(flat_out):
            if not isinstance(x, torch.Tensor) or id(x) in arg_ids:
                continue  # an in-place result or `out=` argument: an update
            key = storage_key(x)
            base = self._root_of_storage.get(key)
            aliased = _aliased_argument(func, pos, args, kwargs) if base is None else None
            if aliased is not None:
                # Declared an alias of an argument (`lift_fresh`), though a
                # fake tensor gave it new bytes: a view, as the real op
                # returns its argument.
                src = self._arg(aliased, func)
                self._root_of_storage[key] = self.root(src)
                self._kept.append(x.untyped_storage())
                i = self._add(x, f"t{len(self.tensors)}", 0, "activation", "transient", src)
            elif base is None:
                role = "temporary" if self.phase == "optimizer" else "activation"
                i = self._new_root(x, f"t{len(self.tensors)}", role, "transient")
                new_roots.append(x)
            else:
                src = base
                for a in arg_objs:
                    if storage_key(a) == key:
                        src = self._by_object.get(a, base)
                        break
                i = self._add(x, f"t{len(self.tensors)}", 0, "activation", "transient", src)
            outputs.append(i)
            call_outputs.append((pos, i))

        if random:
            writes.append(self._generator(func, arg_objs, flat_out, kwargs))
        updates = _unique(writes)
        inputs = [i for i in _unique(reads) if i not in updates and i not in outputs]
        if not (inputs or updates or outputs):
            return out
        op: Dict[str, Any] = {"id": f"o{len(self.ops)}", "kind": self.phase, "type": str(func)}
        flops = op_flops(func, args, kwargs, out)
        if flops is not None:
            op["flops"] = flops
        for field, ts in (("inputs", inputs), ("outputs", outputs), ("updates", updates)):
            if ts:
                op[field] = [self.tensors[i]["id"] for i in ts]
        hint = self._reuse_hint(func, writes, outputs, new_roots, arg_objs, inputs)
        if hint is not None:
            op["reuse"] = [{"output": self.tensors[hint[0]]["id"], "input": self.tensors[hint[1]]["id"]}]
        self.ops.append(op)
        self.calls.append(Call(_replayed(func, args, kwargs), call_args, call_kwargs, call_outputs, random,
                               frozenset(written)))
        for i in inputs + updates + outputs:
            self._used_in.setdefault(self.root(i), set()).add(self.phase)
        return out

    def _generator(self, func, args: Sequence[torch.Tensor], outs: Sequence[Any], kwargs) -> int:
        """The graph tensor standing for the state of the generator a random
        op draws from: ``rng:<device>``, zero bytes, made on first use. An
        explicit ``generator=`` is its own device's; ops that make a tensor
        from nothing (``rand``) draw on their output's device."""
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator):
            device = gen.device
        else:
            tensors = [x for x in list(args) + list(outs) if isinstance(x, torch.Tensor)]
            if not tensors:
                raise UnsupportedStep(f"{func}: draws random numbers on no tensor's device")
            device = tensors[0].device
        return self._generator_of(torch.device(device))

    def _generator_of(self, device: torch.device) -> int:
        """The ``rng:<device>`` tensor, made on first use."""
        key = str(device)
        i = self._generators.get(key)
        if i is None:
            self.tensors.append({"id": f"rng:{key}", "size": 0, "role": "input", "lifetime": "persistent"})
            self.parent.append(None)
            self.layouts.append(Layout((), (), 0, torch.uint8, device))
            i = self._generators[key] = len(self.tensors) - 1
            self._fixed_role[i] = "input"
            self._phase_of[i] = "before"
        return i

    # ---- generator states (activation checkpointing) --------------------

    def get_state(self, device: torch.device) -> torch.Tensor:
        """Records reading `device`'s generator state (what
        ``torch.get_rng_state()`` does for ``torch.utils.checkpoint``): an
        op that reads ``rng:<device>`` and makes a state tensor, whose call
        reads the real state when the step runs. Returns a stand-in the
        caller hands back to :meth:`set_state`."""
        rng = self._generator_of(device)
        with _disable_current_modes():
            stand_in = torch.empty(0, dtype=torch.uint8)
        i = len(self.tensors)
        self.tensors.append({"id": f"t{i}", "size": 0, "role": "activation", "lifetime": "transient",
                             "dtype": "u8", "shape": [0]})
        self.parent.append(None)
        self.layouts.append(Layout((0,), (1,), 0, torch.uint8, torch.device("cpu")))
        self._phase_of[i] = self.phase
        self._states[id(stand_in)] = i
        self._kept.append(stand_in)
        self._generator_op("get_rng_state", {"inputs": [rng], "outputs": [i]},
                           Call(read_generator, (str(device),), {}, [(0, i)]))
        self._used_in.setdefault(i, set()).add(self.phase)
        return stand_in

    def set_state(self, state: Any, device: torch.device) -> None:
        """Records setting `device`'s generator to a state :meth:`get_state`
        recorded: an op that reads the state and updates ``rng:<device>``."""
        i = self._states.get(id(state))
        if i is None:
            raise UnsupportedStep(
                f"set_rng_state on {device}: the state was not read inside the step, so the step "
                "cannot restore it when it runs again (seed outside the step)"
            )
        rng = self._generator_of(device)
        self._generator_op("set_rng_state", {"inputs": [i], "updates": [rng]},
                           Call(write_generator, (Ref(i), str(device)), {}, []))
        self._used_in.setdefault(i, set()).add(self.phase)

    def _generator_op(self, what: str, fields: Dict[str, List[int]], call: Call) -> None:
        op: Dict[str, Any] = {"id": f"o{len(self.ops)}", "kind": self.phase, "type": f"memplan.{what}"}
        for field, ts in fields.items():
            op[field] = [self.tensors[t]["id"] for t in ts]
        self.ops.append(op)
        self.calls.append(call)

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
        op: Dict[str, Any] = {"id": f"o{len(self.ops)}", "kind": "collective", "type": f"memplan.{what}"}
        if reads:
            op["inputs"] = [self.tensors[i]["id"] for i in reads]
        op["updates"] = [self.tensors[i]["id"] for i in ids]
        self.ops.append(op)
        self.calls.append(Call(call, tuple(Ref(i) for i in ids + reads), {}, [],
                               writes=frozenset(range(len(ids)))))
        for i in ids + reads:
            self._used_in.setdefault(self.root(i), set()).add(self.phase)

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
            ai = self._by_object.get(a)
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
        for i, t in enumerate(self.tensors):
            if "view_of" in t or i in self._fixed_role:
                continue
            made = self._phase_of.get(i)
            if made == "forward":
                used_later = "backward" in self._used_in.get(i, ())
                t["role"] = "activation" if used_later else "temporary"
            elif made == "optimizer":
                t["role"] = "temporary"
        for i, t in enumerate(self.tensors):
            if "view_of" in t:
                t["role"] = self.tensors[self.root(i)]["role"]
        self._kept.clear()
        self._outside.clear()
        self._outside_roots.clear()
        self._states.clear()
        self._root_of_storage.clear()
        return {
            "format": "memplan-graph",
            "version": 1,
            "name": name,
            "tensors": self.tensors,
            "ops": self.ops,
            "metadata": metadata,
        }
