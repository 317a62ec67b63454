"""What the recorder knows about aten ops beyond their schemas: which
draw random numbers, write arguments their schema does not declare, give
other results than their fake kernels, may write their result over an
argument, or cannot be replayed at all; and their FLOPs by PyTorch's own
formulas. Pure functions of an op and its arguments, shared by the
recorder (:mod:`._record`) and the runner (:mod:`._run`)."""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import torch
from torch.utils.flop_counter import flop_registry

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

# Ops whose result autograd never links to their argument.
DETACHING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}

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


def rerun_without_writes(func, args, kwargs) -> bool:
    """Whether `func` writes only arguments its results do not depend on,
    and given ``None`` for them computes the same results without writing:
    batch norm in training, whose outputs use the batch's statistics and
    whose running statistics are optional (:func:`without_writes` makes
    that call). A recomputed copy of it runs so, and the running statistics
    are updated once, as in eager."""
    return bool(undeclared_writes(func, args, kwargs))


def without_writes(args, kwargs, writes):
    """The arguments of a call of an op :func:`rerun_without_writes`
    accepts, with ``None`` for those it writes (positions and names in
    `writes`)."""
    return (tuple(None if k in writes else a for k, a in enumerate(args)),
            {k: (None if k in writes else v) for k, v in kwargs.items()})


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


def aliased_argument(func, pos: int, args, kwargs) -> Optional[torch.Tensor]:
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


def draws(func, args, kwargs) -> bool:
    """Whether a seeded op really draws: attention kernels carry the tag
    for their dropout and draw nothing when its probability is 0."""
    for pos, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p"):
            v = args[pos] if pos < len(args) else kwargs.get(a.name, a.default_value)
            return not (isinstance(v, (int, float)) and v == 0)
    return True
