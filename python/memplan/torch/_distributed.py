"""Data-parallel steps: a model wrapped with ``DistributedDataParallel``,
captured on every rank as the step that rank runs.

What DDP computes in a step (PyTorch's ``Reducer``): every rank runs the
forward and backward pass on its own batch; each gradient is multiplied by
``1/W`` as it is copied into its bucket and the buckets are all-reduced
(summed), so every replica is updated with the mean gradient over the
``W`` ranks. With ``broadcast_buffers`` (the default) the module's buffers
are first broadcast from rank 0 at every forward pass.

:class:`DataParallel` records the same arithmetic, one collective per
tensor instead of one per bucket: before the forward pass a ``broadcast``
of each buffer (from the group's first rank), after the backward pass, per
gradient, ``grad.mul_(1/W)`` and an ``all_reduce`` (sum) of it in place.
Each collective is an op of kind ``collective`` in the rank's graph
(``memplan.all_reduce``, ``memplan.broadcast``) that updates its tensor, so
the planner decides when it runs: a gradient is reduced once it is
complete and its update follows the reduction, with no bucket to hold
(DDP's buckets are a second copy of every gradient). The recorded step never
calls DDP's forward or its reducer; the wrapped module's forward is
called directly while recording.

Every rank must run the same collectives in the same order:

- :meth:`DataParallel.agree` compares the ranks' graphs after capture (a
  digest, then, on a mismatch, the first op that differs, named with both
  ranks) and refuses a mismatch on every rank;
- :meth:`DataParallel.from_first_rank` makes the plan (or the fit) on the
  group's first rank only and sends it to the others, so every rank runs
  one order whatever the solver's time limit reached.

A collective that fails (a rank died: gloo reports the closed connection)
raises :class:`RankFailure` naming this rank, the op and the tensor; on
gloo a collective that does not complete within ``timeout`` seconds (a
rank stopped without dying) raises :class:`CollectiveTimeout`. Neither is
a ``RuntimeError``, so no replay retries the call.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ._record import Recorder, UnsupportedStep


class RankFailure(Exception):
    """A collective of the step failed on this rank: another rank died or
    left the group. The message names this rank, the collective and the
    tensor."""


class CollectiveTimeout(RankFailure, TimeoutError):
    """A collective of the step did not complete within its timeout."""


def _dist():
    import torch.distributed as dist

    return dist


class Collective:
    """A recorded collective, run at replay on the real tensor it updates:
    ``all_reduce`` (sum) or ``broadcast`` (from global rank `src`) over
    `group`. `what` names the tensor in errors."""

    __slots__ = ("kind", "group", "src", "timeout", "what", "rank", "poll")

    def __init__(self, kind: str, group, what: str, timeout: float, src: int = 0) -> None:
        dist = _dist()
        self.kind, self.group, self.what, self.timeout, self.src = kind, group, what, float(timeout), src
        self.rank = dist.get_rank()
        # gloo's works are polled against the timeout; NCCL's wait() only
        # orders the stream (its watchdog enforces the group's timeout).
        self.poll = dist.get_backend(group) == "gloo"

    def __call__(self, t: torch.Tensor) -> None:
        dist = _dist()
        buf = t if t.is_contiguous() else t.contiguous()
        held = buf._use_count()
        try:
            if self.kind == "all_reduce":
                work = dist.all_reduce(buf, group=self.group, async_op=True)
            else:
                work = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
            if self.poll:
                deadline = time.monotonic() + self.timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(
                            f"rank {self.rank}: {self.kind} of {self.what} did not complete within "
                            f"{self.timeout:g} s: another rank of the group failed or stopped (see its output)"
                        )
                    time.sleep(1e-4)
            work.wait()
            del work
            if self.poll:
                # gloo's worker thread lets go of the tensor a moment after
                # the work completes: wait for it, so the tensor's bytes
                # are freed where the plan frees them.
                deadline = time.monotonic() + 1.0
                while buf._use_count() > held and time.monotonic() < deadline:
                    time.sleep(1e-5)
        except RankFailure:
            raise
        except RuntimeError as e:
            raise RankFailure(
                f"rank {self.rank}: {self.kind} of {self.what} failed: another rank of the group failed or "
                f"left it (PyTorch: {str(e).strip().splitlines()[0] if str(e).strip() else e})"
            ) from e
        if buf is not t:
            t.copy_(buf)

    def __repr__(self) -> str:
        return f"memplan.{self.kind}({self.what})"


def _is_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def refuse_unsupported_wrappers(model: torch.nn.Module) -> None:
    """Refuses, by name, the parallel wrappers capture does not take:
    DDP below the root, DataParallel, FSDP1 and FSDP2 (``fully_shard``)
    modules, and DTensor parameters (tensor or sequence parallel)."""
    from torch.nn.parallel import DataParallel as DP

    for name, m in model.named_modules():
        where = name or "the model"
        if isinstance(m, DP):
            raise UnsupportedStep(f"{where}: torch.nn.DataParallel (one process, several devices) is not "
                                  "supported; use DistributedDataParallel, one process per rank")
        if name and _is_ddp(m):
            raise UnsupportedStep(f"{where}: DistributedDataParallel inside the model; capture takes it as the "
                                  "model itself (wrap the root module)")
        kind = type(m).__module__
        if "torch.distributed.fsdp" in kind or any("torch.distributed.fsdp" in c.__module__
                                                   for c in type(m).__mro__[1:]):
            raise UnsupportedStep(f"{where}: {type(m).__name__} is sharded with FSDP, which memplan.torch "
                                  "cannot capture yet; memplan's own executor shards the built-in models "
                                  "(memplan run --world-size W)")
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            raise UnsupportedStep(f"parameter {name}: a DTensor (tensor, sequence or FSDP sharding), which "
                                  "memplan.torch cannot capture yet")


class DataParallel:
    """What capture needs of a ``DistributedDataParallel`` model: its
    process group, the world size, whether buffers are broadcast, and the
    timeout of each collective (seconds)."""

    def __init__(self, ddp, timeout: float) -> None:
        dist = _dist()
        self.ddp = ddp
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.backend = dist.get_backend(self.group)
        self.timeout = float(timeout)
        if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_mp_stream", None) is not None:
            raise UnsupportedStep("DistributedDataParallel with a communication hook or mixed precision: "
                                  "memplan records DDP's default all-reduce (sum of the gradients times 1/W)")
        if getattr(ddp, "_delay_all_reduce_all_params", False):
            raise UnsupportedStep("DistributedDataParallel(delay_all_reduce_named_params=...) is not supported")
        self.broadcast_buffers = bool(ddp.broadcast_buffers) and bool(getattr(ddp, "require_forward_param_sync",
                                                                            True))
        self.ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())

    @staticmethod
    def of(model, timeout: float) -> Optional["DataParallel"]:
        """The model's data parallelism (None for a model that is not
        wrapped with DDP); refuses wrappers it cannot capture."""
        if not _is_ddp(model):
            refuse_unsupported_wrappers(model)
            return None
        if not isinstance(timeout, (int, float)) or not (0 < timeout < float("inf")):
            raise ValueError(f"collective_timeout must be a positive number of seconds, not {timeout!r}")
        refuse_unsupported_wrappers(model.module)
        return DataParallel(model, timeout)

    # ---- recording -------------------------------------------------------

    class _Forwarding:
        """While recording: the DDP wrapper's forward calls the wrapped
        module's (DDP's own forward would start its reducer and collectives
        on fake tensors), after recording the buffers' broadcast."""

        def __init__(self, dp: "DataParallel", rec: Recorder) -> None:
            self.dp, self.rec = dp, rec

        def __enter__(self):
            dp, rec = self.dp, self.rec
            module = dp.ddp.module

            def forward(*args, **kwargs):
                if dp.broadcast_buffers:
                    dp._broadcast_buffers(rec, module)
                return module(*args, **kwargs)

            dp.ddp.forward = forward
            return self

        def __exit__(self, *exc) -> None:
            del self.dp.ddp.forward

    def forwarding(self, rec: Recorder) -> "DataParallel._Forwarding":
        return DataParallel._Forwarding(self, rec)

    def _broadcast_buffers(self, rec: Recorder, module: torch.nn.Module) -> None:
        for name, b in module.named_buffers():
            if f"module.{name}" in self.ignored or name in self.ignored or b is None:
                continue
            rec.collective("broadcast", Collective("broadcast", self.group, f"buffer {name}", self.timeout,
                                                   src=self.first), [b])

    def reduce_gradients(self, rec: Recorder, grad_of: Dict[str, torch.Tensor]) -> None:
        """Records DDP's reduction of each gradient: ``grad.mul_(1/W)`` (the
        reducer's copy into its bucket) and an all-reduce (sum) in place.
        Gradients of ignored parameters are left alone, as DDP does."""
        scale = 1.0 / self.world
        with torch.no_grad():
            for name, g in grad_of.items():
                if name in self.ignored or name.removeprefix("module.") in self.ignored:
                    continue
                g.mul_(scale)
                rec.collective("all_reduce", Collective("all_reduce", self.group, f"the gradient of {name}",
                                                        self.timeout), [g])

    # ---- agreeing ------------------------------------------------------

    def _barrier(self, what: str) -> None:
        """On gloo, a barrier that names the ranks that do not reach it
        within the timeout (a rank that failed before `what`)."""
        dist = _dist()
        if self.backend != "gloo":
            return
        try:
            dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=self.timeout),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            raise CollectiveTimeout(f"rank {dist.get_rank()}: before {what}, not every rank of the group arrived "
                                    f"within {self.timeout:g} s (PyTorch: {str(e).strip()})") from e

    def agree(self, graph: Dict[str, Any]) -> None:
        """Refuses, on every rank, a capture whose graph is not the same on
        every rank of the group (another model, batch shape or optimizer on
        one rank): they would run different collectives. Names the first
        rank and op that differ."""
        dist = _dist()
        self._barrier("comparing the captured steps")
        sig = _signature(graph)
        digest = hashlib.sha256("\n".join(sig).encode()).hexdigest()
        digests: List[Any] = [None] * self.world
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) == 1:
            return
        sigs: List[Any] = [None] * self.world
        dist.all_gather_object(sigs, sig, group=self.group)
        other = next(r for r in range(self.world) if digests[r] != digests[0])
        a, b = sigs[0], sigs[other]
        k = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        first = a[k] if k < len(a) else "(no more ops)"
        theirs = b[k] if k < len(b) else "(no more ops)"
        raise UnsupportedStep(
            f"the ranks captured different steps: entry {k} of the graph is {first} on rank 0 of the group "
            f"but {theirs} on rank {other} (every rank must capture the same model, optimizer and batch shapes)"
        )

    def from_first_rank(self, make: Callable[[], Any], what: str) -> Any:
        """`make()` run on the group's first rank only, its result (or its
        error, raised on every rank) sent to the others."""
        dist = _dist()
        self._barrier(what)
        box: List[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", make())
            except Exception as e:  # sent on, then raised here too
                box[0] = ("error", type(e), str(e))
        dist.broadcast_object_list(box, src=self.first, group=self.group)
        if box[0][0] == "error":
            _, kind, msg = box[0]
            if self.rank != 0:
                msg = f"on rank 0 of the group, {what} failed: {msg}"
            raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(msg)
        return box[0][1]


def _signature(graph: Dict[str, Any]) -> List[str]:
    """One line per tensor and op: what every rank's graph must share."""
    lines = [f"tensor {t['id']} {t.get('dtype')} {t.get('shape')} {t['size']} {t['role']}"
             for t in graph["tensors"]]
    for op in graph["ops"]:
        lines.append(f"op {op['id']} {op['type']} {op['kind']} in={op.get('inputs', [])} "
                     f"out={op.get('outputs', [])} upd={op.get('updates', [])}")
    return lines
