"""memplan for PyTorch: capture a training step, plan it, run it in the plan.

    import memplan.torch
    step = memplan.torch.capture(model, optimizer, batch, loss_fn)
    for batch in data:
        loss = step(batch)          # forward, backward, optimizer update
    step.stats                      # planned peak, lower bound, tracked peak

:func:`capture` records one whole training step at the aten level, on fake
tensors (no memory, no arithmetic): the forward pass and the loss
(``loss_fn(model, batch)``), the backward pass (``torch.autograd.grad``), and
the optimizer's update written **one parameter at a time** (PyTorch's
single-tensor arithmetic; see :mod:`memplan.torch._optim`), so each update
can run as soon as its gradient is complete. The record is memplan's graph
(docs/graph-format.md) and a program of aten calls. memplan plans the graph
(the order of the ops and each tensor's offset), and the returned
:class:`Step` runs the program in the planned order on the model's own
parameters, buffers and optimizer state, updating them in place as
``optimizer.step()`` would, and drops every value after its last use, so
the live bytes of the run are the plan's.

``step(batch, arena=True)`` makes every planned tensor at its offset in
one buffer of the planned size (:class:`~memplan.torch._run.Arena`), and
``step(batch, graph=True)`` records that arena step once as a CUDA graph
and launches it as one (:mod:`memplan.torch._graph`).

What is outside the plan: memory that kernels allocate for themselves
(library workspaces) and the caller's tensors (parameters, buffers,
optimizer state and the batch, which the plan counts as live for the whole
step).

Random ops (dropout) are kept in eager's sequence by every plan and never
recomputed, so a step draws what eager draws from the same generator
state. What cannot be captured raises :class:`UnsupportedStep` naming the
op: reading values into Python (``.item()``, data-dependent shapes),
optimizers other than those :mod:`memplan.torch._optim` writes. A batch of
another shape than the captured one is refused at run time (capture again).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from memplan._optional import require

# Without PyTorch, a MemplanError that says what to install (before any
# submodule's own `import torch`).
torch = require("torch", "memplan.torch")

import memplan  # noqa: E402

from . import _compiled, _distributed, _estimate, _optim, _parallel, _scaler
from ._capture import Captured, _callers_line, _Inputs, _step_device, _trace
from ._clipping import Clipping
from ._distributed import CollectiveTimeout, RankFailure
from ._placement import Placement
from ._planning import Planning
from ._errors import UnsupportedStep
from ._record import Recorder
from ._run import Arena, Program
from ._stepping import Running

__all__ = ["capture", "train_step", "compile", "max_batch", "estimate", "Step", "UnsupportedStep", "RankFailure", "CollectiveTimeout"]


class Step:
    """A captured, planned training step. Calling it with a batch of the
    captured shapes runs forward, loss, backward and the optimizer update in
    the planned order and returns the loss (a tensor).

    Its three roles are objects, one module each, and each owns its state:
    planning, fitting and the program (:class:`~memplan.torch._planning.Planning`),
    the arena and the binding of the caller's tensors
    (:class:`~memplan.torch._placement.Placement`, which reads the plan),
    and the run (:class:`~memplan.torch._stepping.Running`, which reads
    both). This class holds what they share (the caller's model, optimizers
    and tensors, the data-parallel group) and the public names."""

    def __init__(self, model, optimizer: _optim.Optimizers, hyper: _optim.Hyper, captured: Captured,
                 scaling: Optional[_scaler.Scaling] = None,
                 dist: Optional[_distributed.DataParallel] = None) -> None:
        c = captured
        self.model = model
        # Data parallel (DDP, FSDP2): plans and fits are made on the group's
        # first rank and sent to the others, so every rank runs one order.
        self._dist = dist
        self._optimizers = optimizer  # _optim.Optimizers over what the caller gave
        self.optimizer = optimizer.members[0] if len(optimizer.members) == 1 else list(optimizer.members)
        self.device = c.device
        self._bound = c.bound  # graph tensor index -> caller's tensor
        self.capture_seconds = c.seconds
        self._planning = Planning(c, scaling, dist)
        self._placement = Placement(c, self._planning, optimizer, dist)
        self._running = Running(c, model, optimizer, hyper, self._planning, self._placement, scaling, dist)

    # Planning: the graph the step runs, its plan, fitting and splitting.
    @property
    def graph(self) -> Dict[str, Any]:
        """The graph the step runs (as captured, split or fitted)."""
        return self._planning.graph

    @property
    def plan(self) -> Optional[Dict[str, Any]]:
        """The graph's plan (None until planned)."""
        return self._planning.plan

    @property
    def plan_seconds(self) -> float:
        """What the last plan, split or fit took."""
        return self._planning.plan_seconds

    @property
    def fitted(self) -> Optional[Dict[str, Any]]:
        """What the last :meth:`fit` reported (None before one)."""
        return self._planning.fitted

    @property
    def split(self) -> Optional[Dict[str, Any]]:
        """What :meth:`split_loss` chose and tried (None before it)."""
        return self._planning.split

    def make_plan(self, time_limit: float = 10.0) -> Dict[str, Any]:
        return self._planning.make_plan(time_limit)

    make_plan.__doc__ = Planning.make_plan.__doc__

    def split_loss(self, split: Any = "auto", time_limit: float = 10.0, *,
                   only_if_lower: bool = True) -> Dict[str, Any]:
        self._refuse_when_placed("split the step before fitting it or running it in its arena")
        return self._planning.split_loss(split, time_limit, only_if_lower=only_if_lower)

    split_loss.__doc__ = Planning.split_loss.__doc__

    def fit(self, budget: Optional[int] = None, time_limit: float = 60.0, minimise: str = "time",
            *, max_added: Optional[float] = None, offload: Any = None,
            max_slowdown: Optional[float] = None) -> Dict[str, Any]:
        self._refuse_when_placed("the step already runs in its arena; fit before the first arena run")
        return self._planning.fit(budget, time_limit, minimise, max_added=max_added, offload=offload,
                                  max_slowdown=max_slowdown)

    fit.__doc__ = Planning.fit.__doc__

    def program(self, order: str = "planned") -> Program:
        return self._planning.program(order)

    @property
    def kernels(self) -> str:
        """What runs the planned step: ``"eager"`` (aten's kernels) or
        ``"inductor"`` (regions of the planned order compiled with
        Inductor, docs/compiled.md). Setting it makes the planned program
        again on the next run (the recorded order always runs eagerly)."""
        return self._planning.kernels

    @kernels.setter
    def kernels(self, value: str) -> None:
        p = self._planning
        p.inductor_options = _compiled.kernel_options(value, p.compiled_parts) if value != "eager" else {}
        p.kernels = value
        self._planning.fused = None
        self._planning.programs.pop("planned", None)

    program.__doc__ = Planning.program.__doc__

    def _refuse_when_placed(self, why: str) -> None:
        if self._placement.arena is not None:
            raise ValueError(why)

    # Placement: the arena.
    def place(self) -> Arena:
        return self._placement.place()

    place.__doc__ = Placement.place.__doc__

    # Running: one step, and what it leaves behind.
    def run(self, batch, order: str = "planned", track: bool = False, arena: bool = False,
            graph: bool = False) -> torch.Tensor:
        return self._running.run(batch, order, track=track, arena=arena, graph=graph)

    run.__doc__ = Running.run.__doc__
    __call__ = run

    @property
    def accumulate(self) -> int:
        """Micro-batches per step."""
        return self._running.accumulate

    @property
    def scaler(self):
        """The gradient scaler the step was captured with (None without one)."""
        scaling = self._running.scaling
        return scaling.scaler if scaling is not None else None

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The last run's total gradient norm before clipping (with `clip_grad_norm`)."""
        return self._running.grad_norm

    @property
    def skipped_update(self) -> Any:
        """Whether the last run's scaler skipped the update (one per optimizer for a list)."""
        return self._running.skipped_update

    @property
    def tracked_peak_bytes(self) -> Optional[int]:
        """The last tracked run's peak of live bytes on the step's device."""
        return self._running.tracked_peak_bytes

    @property
    def tracked_peak_contents(self) -> Optional[List[Tuple[int, Optional[str]]]]:
        """What that peak held: (bytes, the op that made it, or None for a
        tensor held before the step) per storage, largest first."""
        return self._running.tracked_peak_contents

    @property
    def stats(self) -> Dict[str, Any]:
        """The plan's figures and the last run's tracked peak (bytes)."""
        s: Dict[str, Any] = {"capture_seconds": self.capture_seconds, "plan_seconds": self.plan_seconds,
                             "ops": len(self._planning.calls)}
        if self.plan is not None:
            ps = self.plan["stats"]
            s.update(
                arena_bytes=self.plan["arena_bytes"],
                max_live_bytes=ps["max_live_bytes"],
                lower_bound_bytes=ps["lower_bound_bytes"],
            )
        if self.tracked_peak_bytes is not None:
            s["tracked_peak_bytes"] = self.tracked_peak_bytes
        if self._planning.fused is not None:
            s["inductor"] = self._planning.fused.stats()
        g = self._running.graphed
        if g is not None:
            s.update(graph_recordings=g.recordings, graph_launches=g.launches, graph_refused=g.refused)
        return s


def capture(model: torch.nn.Module, optimizer, example_batch: Any,
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, plan: bool = True,
            time_limit: float = 10.0, align: int = 256, name: Optional[str] = None,
            meta_device: str = "cpu", budget: Optional[int] = None,
            max_added: Optional[float] = None, clip_grad_norm: Optional[float] = None,
            norm_type: float = 2.0, accumulate: int = 1, scaler=None,
            clip_grad_value: Optional[float] = None, collective_timeout: float = 300.0,
            split: Any = None, kernels: str = "eager", offload: Any = None) -> Step:
    """Captures one training step of `model` and plans it.

    `loss_fn(model, batch)` returns the scalar loss; `example_batch` is a
    tensor or a tuple, list or dict of tensors (the shapes every later batch
    must have). `optimizer` is one of ``torch.optim``'s ``AdamW``, ``Adam``,
    ``SGD``, ``RMSprop``, ``Adagrad``, ``Adamax``, ``Adadelta``, ``NAdam``,
    ``RAdam``, ``Adafactor`` and ``Muon`` over the model's parameters, or a
    list of them over disjoint parameters (Muon for the matrices, AdamW for
    the rest); a parameter's state is made as its first ``step()`` would
    make it. With ``plan=False`` the step is not planned until :meth:`Step.make_plan` or the first planned run. With
    `budget` (bytes), the step is fitted into it by recomputation instead
    (:meth:`Step.fit`, within `time_limit` seconds); with `max_added` (a
    share of the step's FLOPs, e.g. 0.001), it becomes the smallest step
    memplan finds for at most that many more FLOPs
    (``Step.fit(max_added=..., minimise="flops")``). With `budget` and
    ``offload=True`` (or :func:`memplan.fit`'s offload options), host
    memory is a lever too: ``Step.fit(budget, offload=...)``, docs/offload.md.

    A model wrapped with ``DistributedDataParallel`` is captured, in each
    process of its group, as the step that rank runs: its forward and
    backward pass, DDP's reduction of each gradient (times ``1/W``, then an
    all-reduce) and broadcast of the buffers as collective ops the planner
    orders, and the update (:mod:`memplan.torch._distributed`). Every rank
    must call capture (and later the step) with batches of the same shapes;
    the ranks' graphs are compared and the plan is made on the group's
    first rank. A collective that fails raises :class:`RankFailure`, one
    that does not complete within `collective_timeout` seconds (gloo)
    :class:`CollectiveTimeout`.

    With `split` (``"auto"`` or a number of chunks), the loss chain (the LM
    head's product, the log-softmax and the loss, and their backward ops)
    runs on chunks of the tokens in turn where that lowers the planned
    arena, the same math (:meth:`Step.split_loss`, docs/splitting.md);
    later fits start from the split step.

    With `clip_grad_norm` (``max_norm``), the gradients are clipped between
    the backward pass and the update as ``loss.backward();
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type);
    optimizer.step()`` does (PyTorch's own function is what is recorded);
    after each run :attr:`Step.grad_norm` holds the total norm before
    clipping, what ``clip_grad_norm_`` returns. Every update then waits for
    every gradient, as in eager PyTorch.

    With `clip_grad_value` (``clip_value``), each gradient is clamped to
    ``[-clip_value, clip_value]`` as ``torch.nn.utils.clip_grad_value_``
    does (its kernels, ``_foreach_clamp_min_``/``_foreach_clamp_max_``,
    one gradient at a time): a gradient's update then waits for that
    gradient only, so the updates still run inside the backward pass.
    Give at most one of `clip_grad_norm` and `clip_grad_value`; each is a
    finite number ≥ 0 and `norm_type` a number > 0 (``inf``: the largest
    element), else :class:`memplan.MemplanError` names the option
    (:class:`~memplan.torch._clipping.Clipping`).

    With `accumulate` = N > 1 the step accumulates gradients over N
    micro-batches of `example_batch`'s shapes before clipping and updating,
    as eager PyTorch does with ``(loss_fn(model, mb) / N).backward()`` for
    each micro-batch and one ``optimizer.step()``: the step is called with
    a list of N batches and returns the sum of the divided losses (their
    mean). The graph holds every micro-batch's forward and backward, so
    memplan orders across them (each update can run in the last backward
    pass), and each micro-batch is an input the caller holds for the whole
    step.

    With `scaler` (a ``torch.amp.GradScaler``: float16 autocast in
    `loss_fn`), the step scales the loss, unscales and checks the
    gradients (before clipping), skips the update when one overflowed and
    updates the scale, as ``scaler.scale(loss).backward();
    scaler.unscale_(optimizer); clip...; scaler.step(optimizer);
    scaler.update()`` does (each optimizer of a list skips on its own
    gradients' overflow, as ``scaler.step(o)`` for each);
    :attr:`Step.skipped_update` says whether the last run skipped it (one
    per optimizer for a list). The scaler's tensors are the step's,
    updated in place (``scaler.get_scale()`` reads them).

    The graph's metadata records the batch size (``"batch"``: the leading
    dimension every batch tensor shares), which :func:`max_batch` uses.

    A model built on the ``meta`` device (no memory: how a GPT-2 XL step is
    planned on a laptop) is traced as if it were on `meta_device`, so the
    kernels that device's dispatcher picks (e.g. CPU flash attention) are
    the ones recorded; such a step can be planned but not run.

    A model with ``torch.compile``d parts (the whole model, or blocks
    compiled with ``fullgraph=True`` as torchtitan does) is recorded
    through them: the aten ops they compute, the same math as eager
    (:mod:`memplan.torch._compiled`). `kernels` says what runs the planned
    step: ``"eager"`` (aten's kernels, one call per op; a model with
    compiled parts gets a warning naming them) or ``"inductor"``
    (regions of the planned order compiled with Inductor on the first
    run, never above the plan's max live; :attr:`Step.kernels`,
    docs/compiled.md). The compiled parts' Inductor options apply to
    every region; another backend, ``dynamic=True`` and CUDA graphs are
    refused by name.
    """
    if budget is not None and max_added is not None:
        raise TypeError("give either budget (bytes) or max_added (a share of the step's FLOPs)")
    if offload and budget is None:
        raise TypeError("offload goes with budget (bytes); for the smallest step within a slowdown, "
                        "call step.fit(offload=True, max_slowdown=0.05) on the captured step")
    clip = Clipping.of(clip_grad_norm, norm_type, clip_grad_value)
    t0 = time.perf_counter()
    parts = _compiled.compiled_parts(model)
    inductor_options = _compiled.kernel_options(kernels, parts)
    dist = _parallel.rank_group(model, collective_timeout)
    optimizer = _optim.Optimizers(optimizer)  # one, or several over disjoint parameters
    hyper = _optim.Hyper(optimizer)
    params = dict(model.named_parameters())
    device, traced = _step_device(model, optimizer, params, meta_device)
    rec = Recorder(device, align)
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive number of micro-batches, not {accumulate!r}")
    if dist is not None:
        dist.check_options(hyper.kinds, clip, _scaler.active(scaler))
    held = dist.inputs(params) if dist is not None else params  # FSDP2: each rank's local shards
    inputs = _Inputs(rec, traced, held, dict(model.named_buffers()), optimizer, example_batch, accumulate)
    rec.outside.fake_mode = inputs.fake
    if _scaler.active(scaler):
        inputs.scaler(scaler, _scaler.prepare(scaler, next(iter(params.values())).device))
    try:
        with _compiled.recording():
            loss_index, updated, norm_index, gate = _trace(rec, model, optimizer, hyper, loss_fn, inputs, clip, dist)
    except UnsupportedStep as e:
        where = _callers_line(e.__traceback__)
        if where is None:
            raise
        raise UnsupportedStep(f"{e} [at {where}]").with_traceback(e.__traceback__) from None
    for i, value in rec.table.constants.items():
        where = rec.table.layouts[i].device
        inputs.bound[i] = value.to(where) if value.device != where else value
    label = name or f"{type(model).__name__}-step"
    meta = {"source": "memplan.torch.capture", "torch": torch.__version__, "device": device,
            "optimizer": optimizer.name}
    leading = {shape[0] if shape else None for _, shape, *_ in inputs.batch_layouts}
    if len(leading) == 1 and None not in leading:
        meta["batch"] = leading.pop()
    if accumulate > 1:
        meta["accumulate"] = accumulate
    if dist is not None:
        meta["world_size"] = dist.world
    graph = rec.finish(label, meta)
    if dist is not None:
        dist.agree(graph)
    optimizer_calls = [op["kind"] == "optimizer" for op in rec.ops]
    scaling = _scaler.Scaling(scaler, _scaler.settings(scaler), *gate) if gate is not None else None
    captured = Captured(graph=graph, calls=rec.calls, layouts=rec.table.layouts, device=rec.device, bound=inputs.bound,
                        sources=dict(rec.table.sources), batch_spec=inputs.spec, batch_layouts=inputs.batch_layouts,
                        loss=loss_index, norm=norm_index, updated=updated, optimizer_calls=optimizer_calls,
                        accumulate=accumulate, state_slots=tuple(inputs.state_slots),
                        group_slots=tuple(inputs.group_slots), seconds=time.perf_counter() - t0,
                        meta=traced is not None)
    step = Step(model, optimizer, hyper, captured, scaling=scaling, dist=dist)
    step._planning.kernels, step._planning.inductor_options = kernels, inductor_options
    step._planning.compiled_parts = parts
    if split not in (None, "off", 1):
        step.split_loss(split, time_limit=time_limit)
    if budget is not None:
        step.fit(budget, time_limit=time_limit, offload=offload)
    elif max_added is not None:
        step.fit(max_added=max_added, minimise="flops", time_limit=time_limit)
    elif plan and step.plan is None:
        step.make_plan(time_limit)
    return step


def max_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              make_batch: Callable[[int], Any], loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
              budget: int, *, batches=(2, 3), probe_time: float = 5.0, meta_device: str = "cpu"
              ) -> Dict[str, Any]:
    """The largest batch whose training step fits `budget` bytes: PyTorch
    eager's in its best configuration (caching allocator simulated over the
    recorded order, with and without expandable segments and the optimizer
    in the backward; its default allocator's answer beside it), memplan's
    plan's, and memplan's with recomputation.

    The step is captured at the two batch sizes `batches` (``make_batch(b)``
    returns a batch of `b` samples; nothing runs, so a model on the
    ``meta`` device works) and every other batch is extrapolated along the
    line through them (:func:`memplan.max_batch`). Sizes above 1: PyTorch
    can trace batch 1 differently (squeezed dimensions). Returns
    :func:`memplan.max_batch`'s figures (``eager``, ``eager_configuration``,
    ``eager_default``, ``planned``, ``fitted``, ``budget_bytes``, ``cap``)
    and ``graphs``, the two captured graph documents.
    """
    b1, b2 = batches
    graphs = [capture(model, optimizer, make_batch(b), loss_fn, plan=False, meta_device=meta_device).graph
              for b in (b1, b2)]
    r = memplan.max_batch(graphs[0], graphs[1], budget, batches=(b1, b2), probe_time=probe_time)
    r["graphs"] = graphs
    return r


def estimate(config: Any = None, **options) -> Dict[str, Any]:
    """One rank's memory for a training configuration, estimated in this
    process without the ranks or the GPUs.

    The model is one of: `config`, a Hugging Face config (a ``config.json``
    path, its folder, a dict or a ``PretrainedConfig``: its causal LM);
    `torchtitan`, a torchtitan Llama 3 flavor (``"debugmodel"``, ``"8B"``,
    ``"70B"``); or `model_class` called with `model_args` (a module whose
    ``model(input_ids=, labels=).loss`` is the loss); `layers` overrides
    the depth of the first two (a shallower try of the same model). The mesh is
    `dp_replicate` x `dp_shard` x `tp` ranks (`dp_shard` defaults to
    `world` over the others; HSDP when `dp_replicate` > 1); each rank
    trains `accumulate` micro-batches of `micro_batch` x `seq` tokens per
    step, `mixed_precision` ``"bf16"`` (FSDP2's bf16 parameters, float32
    reduction, as torchtitan's default) or ``"fp32"``, `ac` ``"none"``,
    ``"full"``, ``"selective"`` (torchtitan's: every second block) or
    ``"selective-op"``, `optimizer` ``"adamw"``, ``"adam"`` or ``"sgd"``,
    clipping at `clip_grad_norm` (torchtitan's default: 1.0 for its
    flavors, none otherwise). FSDP2 eager is simulated on `device`
    (``"cuda"``, or ``"cpu"`` to compare with gloo runs on the CPU).

    Returns ``{"configuration", "ops", "capture_seconds",
    "plan_seconds", "rows": {key: bytes}, "descriptions",
    "max_micro_batch"}`` (the last with `device_memory`: the largest
    micro-batch each side fits in it, ``cap`` meaning at least). Tensor,
    pipeline and expert parallelism are refused by name, and an
    impossible mesh (heads that do not divide over tp, a mesh larger than
    the world) before anything is made.

    The keyword options, with their defaults: ``torchtitan``,
    ``model_class``, ``model_args``, ``layers``, ``world``, ``dp_shard``,
    ``dp_replicate=1``, ``tp=1``, ``pp=1``, ``ep=1``, ``seq=2048``,
    ``micro_batch=1``, ``accumulate=1``, ``mixed_precision="bf16"``,
    ``ac="none"``, ``optimizer="adamw"``, ``clip_grad_norm``,
    ``device="cuda"``, ``device_memory`` (bytes, or ``"80GiB"``),
    ``time_limit=30.0`` (seconds for the plan and for the fit, each) and
    ``progress=False`` (a progress bar on stderr). The command line is
    ``python -m memplan.torch.estimate`` (docs/estimate.md).
    """
    return _estimate.estimate(capture, config, **options)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, arena: bool = False,
               graph: bool = False, **options) -> Callable[[Any], torch.Tensor]:
    """A training-step function that captures and plans on its first batch
    (options as for :func:`capture`; with ``accumulate=N`` each call takes
    a list of N micro-batches) and runs the planned step on every batch;
    ``fn.step`` is the :class:`Step` once captured. `arena` and `graph`
    are :meth:`Step.run`'s: every tensor at its planned offset, and the
    step launched as one CUDA graph."""

    def step_fn(batch):
        if step_fn.step is None:
            # With accumulation the batch is the list of micro-batches.
            example = batch[0] if options.get("accumulate", 1) > 1 else batch
            step_fn.step = capture(model, optimizer, example, loss_fn, **options)
        return step_fn.step(batch, arena=arena, graph=graph)

    step_fn.step = None
    return step_fn


def compile(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], **options) -> Callable[[Any], torch.Tensor]:
    """Deprecated name of :func:`train_step` (it is not ``torch.compile``);
    it goes in the next release."""
    import warnings

    warnings.warn("memplan.torch.compile is renamed memplan.torch.train_step (it is not torch.compile); "
                  "the old name goes in the next release", DeprecationWarning, stacklevel=2)
    return train_step(model, optimizer, loss_fn, **options)
