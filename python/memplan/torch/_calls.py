"""A recorded step as a program: one :class:`Call` per graph op, with
:class:`Ref` in place of each tensor argument, run again (in memplan's
order, in the arena) by :mod:`._run` and :mod:`._planning`."""

from __future__ import annotations

from typing import List, Tuple


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


def replayed(func, args, kwargs):
    """What a :class:`Call` runs for `func` called with `args`: `func`, or
    for an explicit storage offset a :class:`FromStorageStart`."""
    if func._schema.name not in STORAGE_OFFSET_OPS:
        return func
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if offset is None:
        return func
    return FromStorageStart(func, int(args[0].storage_offset()))

