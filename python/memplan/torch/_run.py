"""Runs a recorded step in a planned order, and measures what it holds.

:class:`Program` is the recorded calls plus, for the chosen order, which
tensors die after each position (a tensor dies after the last op that reads,
writes or makes it or any view of it; the caller's tensors never die). The
runner keeps each value in one table and drops it there, so PyTorch's
allocator gets its bytes back at exactly the point memplan's liveness says.

:class:`StorageTracker` is the independent measurement: a
``TorchDispatchMode`` that sees every op the runner calls, notes each new
storage an op returns (weakly, so it does not keep it alive) and, after each
op, sums the bytes of the storages still alive on the planned device. Its
peak is what the run really held in tensors, whatever the runner believes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ._record import Call, Ref


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages on `device` (a device type) seen so far."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self._live: Dict[int, Any] = {}  # storage key -> (weak ref, bytes)
        self.live_bytes = 0
        self.peak_bytes = 0

    def track(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.device.type != self.device:
            return
        st = x.untyped_storage()
        ref = StorageWeakRef(st)
        if ref.cdata not in self._live:
            self._live[ref.cdata] = (ref, st.nbytes())

    def measure(self) -> int:
        total = 0
        for key in [k for k, (r, _) in self._live.items() if r.expired()]:
            del self._live[key]
        for _, n in self._live.values():
            total += n
        self.live_bytes = total
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            self.track(x)
        self.measure()
        return out


class Program:
    """The calls of a step in one order, with the tensors that die after
    each position."""

    def __init__(self, calls: Sequence[Call], order: Sequence[int], parent: Sequence[Optional[int]],
                 keep: Sequence[int]) -> None:
        self.calls = calls
        self.order = list(order)
        last: Dict[int, int] = {}
        for pos, k in enumerate(self.order):
            c = calls[k]
            for x in tree_flatten((c.args, c.kwargs))[0]:
                if isinstance(x, Ref):
                    last[x.index] = pos
            for _, i in c.outputs:
                last[i] = pos
        kept = set(keep)
        self.dies: List[List[int]] = [[] for _ in self.order]
        for i, pos in last.items():
            if i not in kept:
                self.dies[pos].append(i)

    def run(self, env: Dict[int, torch.Tensor], numbers: Dict[float, float],
            optimizer_calls: Sequence[bool]) -> None:
        """Runs every call in order on the values in `env` (graph tensor
        index -> tensor), substituting the optimizer's markers in the calls
        flagged in `optimizer_calls`."""

        def bind(x):
            if isinstance(x, Ref):
                return env[x.index]
            return x

        def bind_numbers(x):
            if isinstance(x, Ref):
                return env[x.index]
            if isinstance(x, float) and x in numbers:
                return numbers[x]
            return x

        with torch.no_grad():
            for pos, k in enumerate(self.order):
                c = self.calls[k]
                f = bind_numbers if optimizer_calls[k] else bind
                out = c.func(*tree_map(f, c.args), **tree_map(f, c.kwargs))
                if c.outputs:
                    flat = tree_flatten(out)[0]
                    for p, i in c.outputs:
                        env[i] = flat[p]
                    flat = None
                out = None  # no reference may outlive the table's
                for i in self.dies[pos]:
                    env.pop(i, None)
