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

- :meth:`RankGroup.agree` compares the ranks' graphs after capture (a
  digest, then, on a mismatch, the first op that differs, named with both
  ranks) and refuses a mismatch on every rank;
- :meth:`RankGroup.from_first_rank` makes the plan (or the fit) on the
  group's first rank only and sends it to the others, so every rank runs
  one order whatever the solver's time limit reached.

A collective that fails (a rank died: gloo reports the closed connection)
raises :class:`RankFailure` naming this rank, the op and the tensor; on
gloo a collective that does not complete within ``timeout`` seconds (a
rank stopped without dying) raises :class:`CollectiveTimeout`. Neither is
a ``RuntimeError``, so no replay retries the call.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ._errors import UnsupportedStep
from ._record import Recorder


class RankFailure(Exception):
    """A collective of the step failed on this rank: another rank died or
    left the group. The message names this rank, the collective and the
    tensor."""


class CollectiveTimeout(RankFailure, TimeoutError):
    """A collective of the step did not complete within its timeout."""


def _dist():
    import torch.distributed as dist

    return dist


def _holders(bufs: List[torch.Tensor]) -> List[int]:
    """How many hold each tensor, then how many hold each one's storage,
    then how many Python references each tensor's object has. The last
    matter because a C++ holder (gloo's worker thread) also holds the
    tensor's Python object: when its count falls from two to one, PyTorch
    drops that Python reference, which needs the GIL, so the C++ counts
    are back while the object (and its bytes) is still held until the
    worker gets the GIL (up to Python's switch interval, 5 ms, later)."""
    return ([b._use_count() for b in bufs]
            + [torch._C._storage_Use_Count(b.untyped_storage()._cdata) for b in bufs]
            + [sys.getrefcount(b) for b in bufs])


class Collective:
    """A recorded collective, run at replay on the real tensors it
    updates and reads, over `group`: ``all_reduce`` (sum, of one tensor in
    place), ``broadcast`` (one tensor, from global rank `src`),
    ``all_gather`` (``out``, ``inp``: every rank's `inp` end to end into
    `out`) and ``reduce_scatter`` (``out``, ``inp``: this rank's chunk of
    the ranks' sum of `inp` divided by `divide`, the group's size when
    not given: the mean, FSDP2's ``ReduceOp.AVG``; on gloo `inp` is summed
    in place, so the call updates it too). With `sum_only` (FSDP2's
    ``set_force_sum_reduction_for_comms``) the collective only sums and
    the division follows it. `what` names the tensor in errors. On gloo
    each waits at most `timeout` seconds."""

    __slots__ = ("kind", "group", "src", "timeout", "what", "rank", "gloo", "divide", "sum_only")

    def __init__(self, kind: str, group, what: str, timeout: float, src: int = 0,
                 divide: Optional[float] = None, sum_only: bool = False) -> None:
        dist = _dist()
        self.kind, self.group, self.what, self.timeout, self.src = kind, group, what, float(timeout), src
        self.divide = float(dist.get_world_size(group) if divide is None else divide)
        self.sum_only = bool(sum_only)
        self.rank = dist.get_rank()
        # gloo's works wait at most the timeout; NCCL's wait() only orders
        # the stream (its watchdog enforces the group's timeout).
        self.gloo = dist.get_backend(group) == "gloo"

    def _issue(self, bufs: List[torch.Tensor]):
        dist = _dist()
        if self.kind == "all_reduce":
            return dist.all_reduce(bufs[0], group=self.group, async_op=True)
        if self.kind == "broadcast":
            return dist.broadcast(bufs[0], src=self.src, group=self.group, async_op=True)
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(bufs[0], bufs[1], group=self.group, async_op=True)
        if self.gloo:
            # gloo's reduce-scatter runs only inside wait(), which ignores
            # its timeout: sum the input in place instead (the call updates
            # it: the graph says so) and take this rank's chunk after.
            return dist.all_reduce(bufs[1], group=self.group, async_op=True)
        world = dist.get_world_size(self.group)
        # The mean as NCCL's AVG (FSDP2's default); any other divisor, or
        # sums only, as a sum divided after it (see __call__).
        op = dist.ReduceOp.AVG if self._averages(world) else dist.ReduceOp.SUM
        return dist.reduce_scatter_tensor(bufs[0], bufs[1], op=op, group=self.group, async_op=True)

    def _averages(self, world: int) -> bool:
        """Whether NCCL's reduce-scatter divides itself (AVG)."""
        return world > 1 and self.divide == world and not self.sum_only

    def __call__(self, *tensors: torch.Tensor) -> None:
        bufs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        held = _holders(bufs)
        try:
            work = self._issue(bufs)
            if self.gloo:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            else:
                work.wait()
            del work
            if self.gloo:
                # gloo's worker thread lets go of the tensors a moment after
                # the work completes: wait for it, so their bytes are freed
                # where the plan frees them. On a loaded machine (four ranks
                # on two cores) that moment has come late: a buffer then
                # outlived its place in the plan by a few hundred bytes, so
                # the wait allows 10 s (it ends as soon as they are let go).
                # It counts the holders of each tensor and of its storage
                # (a holder may keep another tensor over the same bytes),
                # and the Python references to each tensor (see _holders).
                # The sleep lets go of the GIL, which the worker may need.
                deadline = time.monotonic() + 10.0
                while any(now > then for now, then in zip(_holders(bufs), held)) and time.monotonic() < deadline:
                    time.sleep(1e-5)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            if "timed out" in first.lower():
                raise CollectiveTimeout(
                    f"rank {self.rank}: {self.kind} of {self.what} did not complete within {self.timeout:g} s: "
                    "another rank of the group failed or stopped (see its output)"
                ) from e
            raise RankFailure(
                f"rank {self.rank}: {self.kind} of {self.what} failed: another rank of the group failed or "
                f"left it (PyTorch: {first})"
            ) from e
        if self.kind == "reduce_scatter" and self.gloo:
            world, rank = dist_world_rank(self.group)
            rows = bufs[0].shape[0]
            torch.div(bufs[1].narrow(0, rank * rows, rows), self.divide, out=bufs[0])
        elif self.kind == "reduce_scatter" and not self._averages(dist_world_rank(self.group)[0]) \
                and self.divide != 1.0:
            bufs[0].div_(self.divide)
        if bufs[0] is not tensors[0]:
            tensors[0].copy_(bufs[0])  # the written tensor, when it was not contiguous

    def __repr__(self) -> str:
        return f"memplan.{self.kind}({self.what})"


def dist_world_rank(group):
    dist = _dist()
    return dist.get_world_size(group), dist.get_rank(group)


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


class RankGroup:
    """The ranks of a process group that capture one step together: what
    they agree on (:meth:`agree`, :meth:`from_first_rank`) and the timeout
    of each collective (seconds)."""

    def __init__(self, group, timeout: float) -> None:
        dist = _dist()
        self.group = group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.backend = dist.get_backend(self.group)
        self.timeout = float(timeout)

    # Recording: what the capture calls, each a no-op unless a kind of
    # parallelism needs it.
    def forwarding(self, rec: Recorder):
        """A context around the recorded forward and backward passes."""
        return contextlib.nullcontext()

    def leaves(self, rec: Recorder, fp: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors the forward pass reads as parameters (recorded in
        this call), and whose gradients the backward pass computes."""
        return fp

    def reduce_gradients(self, rec: Recorder, grad_of: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Records the gradients' reduction; returns what each update reads."""
        return grad_of

    def inputs(self, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors the step holds for the model's parameters."""
        return params

    def check_options(self, kinds: List[str], clip, scaled: bool) -> None:
        """Refuses the capture's options this parallelism cannot record."""

    def clip_norm(self, rec: Recorder, grad_of: Dict[str, torch.Tensor], max_norm: float,
                  norm_type: float) -> Optional[torch.Tensor]:
        """Records ``clip_grad_norm_`` where the gradients the updates read
        are not whole (shards); returns the total norm, or None where the
        single-process recording is right (the gradients are whole)."""
        return None

    # Whether the step may run in an arena (parameters moved into it), and
    # launched as one CUDA graph.
    supports_arena = True
    supports_graph = True

    def placed(self) -> None:
        """Called once the parameters and optimizer state have moved into
        the arena (their ``.data`` re-pointed), for what the wrapper keeps
        over their old bytes."""

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
        if self.backend == "fake":
            return  # PyTorch's fake process group (planning without the ranks): one rank, nothing to compare
        self._barrier("comparing the captured steps")
        sig = _signature(graph)
        digest = hashlib.sha256("\n".join(sig).encode()).hexdigest()
        _same_on_every_rank(sig, digest, self.group, self.world, "of the group")
        replicate = getattr(self, "replicate", None)
        if replicate is not None:  # HSDP: the replicas of one shard hold the same shards, so the same step
            _same_on_every_rank(sig, digest, replicate, dist.get_world_size(group=replicate),
                                "of the replicate group")

    def from_first_rank(self, make: Callable[[], Any], what: str) -> Any:
        """`make()` run on the group's first rank only, its result (or its
        error, raised on every rank) sent to the others."""
        dist = _dist()
        if self.backend == "fake":
            return make()  # PyTorch's fake process group: this process is the only one
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


class DataParallel(RankGroup):
    """What capture needs of a ``DistributedDataParallel`` model: its
    process group, the world size, whether buffers are broadcast, and the
    timeout of each collective (seconds)."""

    def __init__(self, ddp, timeout: float) -> None:
        super().__init__(ddp.process_group, timeout)
        self.ddp = ddp
        if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_mp_stream", None) is not None:
            raise UnsupportedStep("DistributedDataParallel with a communication hook or mixed precision: "
                                  "memplan records DDP's default all-reduce (sum of the gradients times 1/W)")
        if getattr(ddp, "_delay_all_reduce_all_params", False):
            raise UnsupportedStep("DistributedDataParallel(delay_all_reduce_named_params=...) is not supported")
        self.broadcast_buffers = bool(ddp.broadcast_buffers) and bool(getattr(ddp, "require_forward_param_sync",
                                                                            True))
        self.ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())

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

    def reduce_gradients(self, rec: Recorder, grad_of: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
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
        return grad_of

def _signature(graph: Dict[str, Any]) -> List[str]:
    """One line per tensor and op: what every rank's graph must share."""
    # A shard's shape may differ between ranks (FSDP2's last shards are
    # shorter where dim 0 does not divide by W), and so may a view's and an
    # update's temporaries: the ops, the activations and the batch may not.
    ranked = ("parameter", "optimizer_state", "gradient")
    shard_sized = {t for op in graph["ops"] if op["kind"] == "optimizer" for t in op.get("outputs", [])}
    lines = [f"tensor {t['id']} {t.get('dtype')} {t['role']}"
             if "view_of" in t or t["role"] in ranked or t["id"] in shard_sized else
             f"tensor {t['id']} {t.get('dtype')} {t.get('shape')} {t['size']} {t['role']}" for t in graph["tensors"]]
    for op in graph["ops"]:
        lines.append(f"op {op['id']} {op['type']} {op['kind']} in={op.get('inputs', [])} "
                     f"out={op.get('outputs', [])} upd={op.get('updates', [])}")
    return lines


def _same_on_every_rank(sig: List[str], digest: str, group: Any, world: int, which: str) -> None:
    """Refuses, on every rank of `group`, a step whose signature is not the
    same on every rank of it; names the first rank and entry that differ
    (ranks counted in `group`, global ranks in parentheses)."""
    dist = _dist()
    digests: List[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    sigs: List[Any] = [None] * world
    dist.all_gather_object(sigs, sig, group=group)
    other = next(r for r in range(world) if digests[r] != digests[0])
    a, b = sigs[0], sigs[other]
    k = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    first = a[k] if k < len(a) else "(no more ops)"
    theirs = b[k] if k < len(b) else "(no more ops)"
    try:
        ranks = dist.get_process_group_ranks(group)
        where = f" (global rank {ranks[other]})"
    except Exception:  # a group PyTorch cannot list
        where = ""
    raise UnsupportedStep(
        f"the ranks captured different steps: entry {k} of the graph is {first} on rank 0 {which} "
        f"but {theirs} on rank {other} {which}{where} (every rank must capture the same model, optimizer and "
        "batch shapes)"
    )
