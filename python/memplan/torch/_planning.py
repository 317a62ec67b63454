"""What a :class:`memplan.torch.Step` runs: planning its graph, fitting it
into a budget by recomputation, and the program of calls in the planned or
the recorded order (:class:`Planning`).

A step starts as captured; :meth:`Planning.fit` swaps in the fitted graph,
its plan and its calls (:mod:`memplan.torch._fitting`), and fitting again
starts from the captured step. With data parallelism every plan and fit is
made on the group's first rank and sent to the others
(:meth:`Planning._own_rank`), so every rank runs one order.

:class:`Planning` reads nothing of the step's other roles; the step
refuses to fit or split once its arena is placed, before asking it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional

import memplan

from . import _fitting, _fused, _split
from . import _distributed, _scaler
from ._capture import Captured
from ._calls import Call
from ._run import Gate, Program


class Planning:
    """What a :class:`memplan.torch.Step` plans: it owns the graph the step
    runs (the captured one, the split one or the fitted one), its calls and
    tensor layouts, its plan and its programs. Made from the captured step,
    the gradient scaler's gate (what the programs skip on an overflow) and
    the data-parallel group (None on one process)."""

    def __init__(self, c: Captured, scaling: Optional[_scaler.Scaling],
                 dist: Optional[_distributed.DataParallel]) -> None:
        self.captured = c  # what fit and split_loss start from (the split step once split)
        self._unsplit = c  # the step as captured, before any split
        self.graph = c.graph
        self.calls: List[Call] = c.calls  # one per op of `graph`, in its order
        self.layouts = c.layouts  # per tensor of `graph`
        self.optimizer_calls = c.optimizer_calls  # per call: whether it reads the optimizer's numbers
        self.plan: Optional[Dict[str, Any]] = None
        self.plan_seconds = 0.0
        self.programs: Dict[str, Program] = {}
        self.captured_plan: Optional[Dict[str, Any]] = None  # the plan of the captured graph, once made
        self.fitted: Optional[Dict[str, Any]] = None
        self.split: Optional[Dict[str, Any]] = None  # what split_loss chose and tried
        # What every program keeps to its end: the caller's tensors, the
        # loss and the clipped gradients' norm.
        self._keep = list(c.bound) + [c.loss] + ([c.norm] if c.norm is not None else [])
        self._scaling = scaling
        self._dist = dist
        # Which kernels the planned program runs (docs/compiled.md), the
        # Inductor options of its regions, and what the regions are.
        self.kernels = "eager"
        self.inductor_options: Dict[str, Any] = {}
        self.compiled_parts: list = []  # the model's torch.compiled modules (_compiled.CompiledPart)
        self.fused: Optional[_fused.Fused] = None
        self.host: set = set()  # the graph's tensors in host memory (an offloaded step's)

    def make_plan(self, time_limit: float = 10.0) -> Dict[str, Any]:
        """Plans the graph with memplan (checked by its independent checker)."""
        t0 = time.perf_counter()
        make = lambda: memplan.plan(self.graph, time_limit=time_limit)  # noqa: E731
        if self._dist is None:
            self.plan = make()
        else:
            self.plan = self._own_rank(self.graph, self._dist.from_first_rank(make, "planning the step"))
        self.plan_seconds = time.perf_counter() - t0
        self.programs.pop("planned", None)
        if self.graph is self.captured.graph:
            self.captured_plan = self.plan
        return self.plan

    def split_loss(self, split: Any = "auto", time_limit: float = 10.0, *,
                   only_if_lower: bool = True) -> Dict[str, Any]:
        """Splits the step's loss chain into chunks of rows where that lowers
        the planned arena (:mod:`memplan.torch._split`; docs/splitting.md),
        and plans the step. `split` is ``"auto"`` (2, 4, 8, 16 and 32
        chunks in turn, stopping once doubling no longer lowers the arena)
        or a number of chunks. Without a gain the step stays as captured.
        The step becomes the split one: later plans and fits start from it.
        Each candidate (the unsplit step first) is planned within
        `time_limit` seconds, so the result is never above what
        :meth:`make_plan` finds in that time; on a graph of tens of
        thousands of ops give a number of chunks rather than ``"auto"``.
        Returns (and keeps in :attr:`split`) ``{"chunks", "chains",
        "tried", "arena_bytes", "unsplit_arena_bytes", "added_flops"}``,
        `chains` the chains split (or, when none is, why each candidate
        was refused). With ``only_if_lower=False`` a number of chunks is
        kept even where it does not lower the arena (to measure or test
        the split itself)."""
        if self.fitted is not None:
            raise ValueError("split the step before fitting it or running it in its arena")
        if split == "auto":
            counts = _split.AUTO_CHUNKS
        elif isinstance(split, int) and not isinstance(split, bool) and split >= 2:
            counts = (split,)
        else:
            raise ValueError(f"split takes 'auto' or a number of chunks (2 or more), not {split!r}")
        base = self.captured
        t0 = time.perf_counter()

        def make():
            # Each plan gets the whole limit: a share of it can leave a large
            # graph's plan far from what make_plan finds, and the unsplit
            # plan is what the split ones must beat.
            best = memplan.plan(base.graph, time_limit=time_limit)
            report = {"chunks": 1, "tried": [{"chunks": 1, "arena_bytes": best["arena_bytes"]}],
                      "unsplit_arena_bytes": best["arena_bytes"], "chains": [], "added_flops": 0}
            for k in counts:
                graph, _, _, chains = _split.split_step(base.graph, base.calls, base.layouts, k)
                if not chains:
                    report["chains"] = _split.find_chains(base.graph, base.calls, base.layouts)
                    break
                plan = memplan.plan(graph, time_limit=time_limit)
                report["tried"].append({"chunks": k, "arena_bytes": plan["arena_bytes"]})
                if plan["arena_bytes"] < best["arena_bytes"] or not only_if_lower:
                    best = plan
                    report.update(chunks=k, chains=chains, added_flops=sum(c["added_flops"] for c in chains))
                elif split == "auto":
                    break
            report["plan"] = best
            report["arena_bytes"] = best["arena_bytes"]
            return report

        report = make() if self._dist is None else self._dist.from_first_rank(make, "splitting the step")
        plan = report.pop("plan")
        if report["chunks"] > 1:
            graph, calls, layouts, _ = _split.split_step(base.graph, base.calls, base.layouts, report["chunks"])
            base = dataclasses.replace(base, graph=graph, calls=calls, layouts=layouts,
                                       optimizer_calls=[op["kind"] == "optimizer" for op in graph["ops"]])
            self.captured = base
            self.graph, self.calls, self.layouts = graph, calls, layouts
            self.optimizer_calls = base.optimizer_calls
        self.plan = self._own_rank(self.graph, plan)
        self.captured_plan = self.plan
        self.programs.clear()
        self.plan_seconds = time.perf_counter() - t0
        self.split = report
        return report

    def _drop_split(self, why: str) -> Captured:
        """Undoes :meth:`split_loss`: the step is the captured one again;
        :attr:`split` keeps what was tried, with ``chunks`` 1 and why."""
        base = self._unsplit
        self.captured = base
        self.graph, self.calls, self.layouts = base.graph, base.calls, base.layouts
        self.optimizer_calls = base.optimizer_calls
        self.captured_plan = None
        self.programs.clear()
        self.split = {**self.split, "chunks": 1, "chains": [], "added_flops": 0, "dropped": why}
        return base

    def _own_rank(self, graph: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
        """The first rank's plan as this rank runs it: its order and places,
        checked against this rank's graph (FSDP2's later shards may be
        shorter, or empty: those own no bytes here), with this rank's max
        live."""
        if self._dist is None or self._dist.rank == 0:
            return plan
        empty = {t["id"] for t in graph["tensors"] if t["size"] == 0}
        plan["tensors"] = [t for t in plan["tensors"] if t["id"] not in empty]
        plan["reuse"] = [r for r in plan.get("reuse", []) if r["output"] not in empty and r["input"] not in empty]
        plan["stats"]["max_live_bytes"] = memplan.check(graph, plan)["max_live_bytes"]
        return plan

    def fit(self, budget: Optional[int] = None, time_limit: float = 60.0, minimise: str = "time",
            *, max_added: Optional[float] = None, offload: Any = None,
            max_slowdown: Optional[float] = None) -> Dict[str, Any]:
        """Fits the step into `budget` bytes by recomputation.

        memplan chooses the forward ops to run again in the backward pass
        (:func:`memplan.fit`), and from then on the step runs them: the
        graph, the plan and the program become the fitted step's, so its
        live bytes stay within `budget`. Returns what the fit reports
        (`recomputed_ops`, `added_flops`, `arena_bytes`, ...); raises
        :class:`memplan.MemplanError` with the bound when nothing fits.
        Fitting again starts from the captured step. Where the step's own
        plan (of the captured graph) is no larger than what the fit finds
        and within `budget`, the step keeps it (no op recomputed;
        ``kept_unfitted`` in the report).

        With `max_added` instead of a budget, the step becomes the smallest
        memplan finds whose recomputation adds at most that share of the
        step's cost: ``step.fit(max_added=0.001, minimise="flops")`` is at
        most 0.1% more FLOPs, recomputing cheap ops as ``torch.compile``
        does by default. On a split step (:meth:`split_loss`) the share is
        of the step as captured, and what the split added counts against
        it (the report's ``split_added_flops``; its ``added_flops`` are the
        recomputation's). A split whose own FLOPs exceed the share is
        undone (as ``memplan fit --split --max-added`` leaves such a split
        out): the step is fitted as captured, and :attr:`split` says so
        (``chunks`` 1, ``dropped``).

        With `offload` (``True``, or a dict of ``device``, ``link_gbps``,
        ``host_memory`` as :func:`memplan.fit` takes), host memory is a
        lever too (docs/offload.md): memplan chooses which tensors leave
        the device and when they come back, with recomputation, for the
        least modeled time within `budget`, or, with `max_slowdown`
        (``0.05``: 5%) instead of a budget, the smallest device arena
        within that modeled slowdown. The step then runs the copies
        (:mod:`memplan.torch._offload`; on the CPU only so far, outside the
        arena), and the report has the figures under ``offload``.
        """
        return _fitting.fit(self, budget, time_limit, minimise, max_added, offload, max_slowdown)
    def program(self, order: str = "planned") -> Program:
        """The program in the planned order or in the recorded (eager) one."""
        if order not in self.programs:
            if order == "eager":
                seq = list(range(len(self.calls)))
            elif order == "planned":
                if self.plan is None:
                    self.make_plan()
                index = {op["id"]: k for k, op in enumerate(self.graph["ops"])}
                seq = [index[op] for op in self.plan["order"]]
            else:
                raise ValueError(f"order must be 'planned' or 'eager', not {order!r}")
            takes = self._taken_reuses() if order == "planned" else None
            calls = self.calls
            if order == "planned" and self.kernels == "inductor":
                calls, seq, self.fused = _fused.planned(self, seq)
            self.programs[order] = Program(calls, seq, self._keep, takes, self._gate())
        return self.programs[order]

    def _gate(self) -> Optional[Gate]:
        """The gradient scaler's gate over this graph's update calls."""
        if self._scaling is None:
            return None
        return Gate(self._scaling.flags, [frozenset(k for k, op in enumerate(self.graph["ops"]) if op["id"] in gated)
                                          for gated in self._scaling.gated])

    def _taken_reuses(self) -> Dict[int, tuple]:
        """The plan's taken reuses as call index -> (output, input) tensor
        indices: the call that makes the output writes it over the input.
        The plan names the input's root (the tensor owning the bytes); the
        call reads the tensor its hint names, maybe a view of that root."""
        index = {t["id"]: i for i, t in enumerate(self.graph["tensors"])}
        hinted = {}
        for k, op in enumerate(self.graph["ops"]):
            for r in op.get("reuse", []):
                hinted[r["output"]] = (k, index[r["output"]], index[r["input"]])
        takes = {}
        for r in self.plan.get("reuse", []):
            k, o, i = hinted[r["output"]]
            takes[k] = (o, i)
        return takes
