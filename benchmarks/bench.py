"""Benchmark: memplan's planned step against eager PyTorch on real models.

    python -m benchmarks.bench                 # small real models, run on the CPU
    python -m benchmarks.bench --gpt2-xl out/  # GPT-2 XL b1 capture + plan (meta)
    python -m benchmarks.bench --max-batch 2   # largest batch in 2 GiB, small models
    python -m benchmarks.bench --max-batch 80 --gpt2-xl-batch   # GPT-2 XL in 80 GiB
    python -m benchmarks.bench --compile       # against torch.compile (Inductor)
    python -m benchmarks.bench --device cuda --with-gpt2-xl   # eager vs the arena step on a GPU
    python -m benchmarks.bench --device cpu --tiny --steps 30  # the replay's per-op overhead

For each small model (Hugging Face GPT-2 and Llama from configs, torchvision
ResNet-50 and ViT) it runs three steps from the same weights and measures
each with the same dispatch-level :class:`StorageTracker` (live tensor
bytes on the CPU, peak over the step):

- ``eager``: ``loss.backward(); optimizer.step(); zero_grad()``, PyTorch as
  users run it;
- ``recorded order``: the captured step replayed in the order it was
  recorded, values dropped after their last use;
- ``memplan``: the captured step in memplan's order.

and prints the plan's max live bytes and lower bound next to them; then
the arena run (``run(..., arena=True)``): the planned arena, and the
tracked peak in that mode (the arena plus the results of ops without an
``out=`` variant, briefly outside it).
``--gpt2-xl DIR`` captures GPT-2 XL (batch 1, sequence 1024) built on the
meta device, traced as a CPU step, plans it, reports the times and writes
the graph to ``DIR/gpt2-xl-b1.json.gz`` for ``memplan compare`` (which
simulates PyTorch's caching allocator on it).
``--device DEV`` runs each model (and GPT-2 XL b1 with ``--with-gpt2-xl``)
on DEV as eager PyTorch and as memplan's arena step, from the same
weights, and prints peak allocated and reserved bytes
(``torch.cuda.max_memory_*`` on CUDA), the planned arena, the bytes
allocated outside it, the step-time ratio and how far losses and
parameters are apart (:func:`on_device`).
``--max-batch GIB`` captures each model at batch 2 and 3 and reports the
largest batch whose step fits GIB GiB (:func:`memplan.torch.max_batch`):
PyTorch eager's in its best configuration and on its default allocator
(caching allocator simulated over the recorded order), eager's with every
block checkpointed (:func:`fully_checkpointed`, its best configuration),
memplan's plan's, and memplan's with recomputation; ``--gpt2-xl-batch``
does it for GPT-2 XL (sequence 1024, built on the meta device).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import gzip
import io
import json
import logging
import os
import re
import time
from typing import Any, Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

import memplan

from memplan.torch import capture, inductor, max_batch
from memplan.torch._run import StorageTracker, allocator_peak
from memplan.torch.export.workloads import classify_loss as _classify
from memplan.torch.export.workloads import hf_gpt2, hf_llama
from memplan.torch.export.workloads import lm_loss as _causal_lm


def models(dropout: float = 0.0):
    """name -> (model, batch, loss_fn), small enough for a CPU. Families
    whose library is not installed (transformers, torchvision) are left
    out with a note on stderr. `dropout` is the probability of every
    dropout the models' configurations have (GPT-2's three, Llama's
    attention dropout, ViT's two; ResNet-50 has none)."""
    import sys

    torch.manual_seed(0)
    cases = {}
    tokens = torch.randint(0, 4096, (4, 256))
    images = (torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)))
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: no Hugging Face models", file=sys.stderr)
    else:
        cases["hf-gpt2-4l-256"] = (hf_gpt2("4l-256", dropout), tokens, _causal_lm)
        cases["hf-llama-4l-256"] = (hf_llama("4l-256", dropout), tokens, _causal_lm)
    try:
        import torchvision
    except ImportError:
        print("torchvision is not installed: no ResNet-50 or ViT", file=sys.stderr)
    else:
        cases["resnet50-64px"] = (torchvision.models.resnet50(num_classes=10), images, _classify)
        cases["vit-4l-256"] = (
            torchvision.models.VisionTransformer(image_size=64, patch_size=8, num_layers=4,
                                                 num_heads=4, hidden_dim=256, mlp_dim=1024,
                                                 num_classes=10, dropout=dropout,
                                                 attention_dropout=dropout), images, _classify)
    if not cases:
        raise SystemExit("no models: install transformers or torchvision")
    return cases


def _autocast(loss_fn, device: str, dtype: torch.dtype = torch.bfloat16):
    """`loss_fn` with its forward under `dtype` autocast on `device`."""
    kind = torch.device(device).type

    def under_autocast(model, batch):
        with torch.autocast(kind, dtype=dtype):
            return loss_fn(model, batch)
    return under_autocast


def tiny_models(dropout: float = 0.0):
    """name -> (model, batch, loss_fn): the decoders of :func:`models` at
    width 32, 4 tokens of 16, where each op's work is a few microseconds and
    a step's time is what calling the ops costs: the replay's overhead per
    op against eager's (``--device cpu --tiny``; on a GPU, where eager is
    bound by launches at this size). `dropout` as for :func:`models`."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16))
    return {
        "tiny-gpt2-4l-32": (hf_gpt2("tiny-32", dropout), tokens, _causal_lm),
        "tiny-llama-4l-32": (hf_llama("tiny-32", dropout), tokens, _causal_lm),
    }


def eager_tracked(model, opt, batch, loss_fn) -> int:
    """Live tensor bytes of one eager step (after a warm-up step, so the
    optimizer state exists as in the captured step)."""
    tracker = StorageTracker("cpu")
    for t in list(model.parameters()) + list(model.buffers()):
        tracker.track(t)
    for st in opt.state.values():
        for v in st.values():
            tracker.track(v)
    for x in torch.utils._pytree.tree_flatten(batch)[0]:
        tracker.track(x)
    tracker.measure()
    with tracker:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes


class InductorEstimates(logging.Handler):
    """Inductor's own peak estimates, one per graph it compiles: the peak of
    the order its ``reorder_for_peak_memory`` pass keeps (the least over
    the orders it tries), read from the pass's log. An estimate covers the
    buffers of one graph, not the tensors alive outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs = []
        # Per graph: each method's estimate ("Baseline", "topological_sort_lpmf", ..., "memplan").
        self.methods = []

    def emit(self, record) -> None:
        msg = record.getMessage()
        if msg.startswith("Reordering for peak memory"):
            self.graphs.append(None)
            self.methods.append({})
        m = re.match(r"(\w+) peak memory: (\d+)", msg)
        if m and self.graphs:
            v = int(m.group(2))
            self.methods[-1][m.group(1)] = v
            self.graphs[-1] = v if self.graphs[-1] is None else min(self.graphs[-1], v)

    def __enter__(self):
        log = logging.getLogger("torch._inductor.memory")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        log = logging.getLogger("torch._inductor.memory")
        log.removeHandler(self)
        log.setLevel(self._level)


def compiled(model, batch, loss_fn):
    """The step as ``torch.compile`` users run it: the model compiled with
    Inductor's defaults (``reorder_for_peak_memory`` on), ``backward()``,
    the AdamW step compiled too, ``zero_grad``. Returns the step's peak
    bytes measured by the allocator's events (after two steps that compile
    and make the optimizer state), the largest of Inductor's per-graph
    estimates, and the compile time."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    cm = torch.compile(model)

    @torch.compile
    def update():
        opt.step()

    def step():
        loss_fn(cm, batch).backward()
        update()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    # No cached graphs: Inductor's memory pass (and its estimate) runs only
    # when it compiles.
    with InductorEstimates() as est, torch.compiler.config.patch(force_disable_caches=True):
        step()
        step()
    seconds = time.perf_counter() - t0
    resident = (list(model.parameters()) + list(model.buffers()) + tree_flatten(batch)[0]
                + [v for st in opt.state.values() for v in st.values()])
    peak = allocator_peak(step, resident)
    estimate = max((g for g in est.graphs if g is not None), default=0)
    return peak, estimate, seconds


def against_compile(time_limit: float):
    """torch.compile (Inductor) next to memplan's plan, next to memplan's
    smallest step within 0.1% more FLOPs (``<=0.1%``: Inductor's
    partitioner recomputes cheap ops in the backward too, unasked), and
    next to memplan fitted by recomputation into the compiled step's peak
    (``fitted``). ``+mp ord`` and
    ``+mp est`` are the compiled step again with memplan among the orders
    Inductor's peak-memory pass tries (:mod:`memplan.torch.inductor`):
    the measured peak and Inductor's largest per-graph estimate."""
    mib = 1 << 20
    print(f"{'model':18} {'eager':>8} {'compile':>8} {'ind.est':>8} {'+mp ord':>8} {'+mp est':>8} "
          f"{'memplan':>8} {'<=0.1%':>8} {'+FLOPs':>7} {'fitted':>8} {'+FLOPs':>7} {'compile s':>9}")
    for name, (model, batch, loss_fn) in models().items():
        model.train()
        comp = copy.deepcopy(model)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01)
        loss_fn(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        eager = eager_tracked(ref, ref_opt, batch, loss_fn)
        tracked, estimate, seconds = compiled(comp, batch, loss_fn)
        # The same, with memplan as one of the orders Inductor's pass tries.
        with inductor.ordering(time_limit=min(time_limit, 5.0)):
            with_memplan, estimate_mp, _ = compiled(copy.deepcopy(model), batch, loss_fn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        step = capture(model, opt, batch, loss_fn, time_limit=time_limit)
        step.run(batch, track=True)
        planned = step.tracked_peak_bytes
        f = step.fit(max_added=0.001, time_limit=max(time_limit, 20.0), minimise="flops")
        step.run(batch, track=True)
        within = step.tracked_peak_bytes
        within_flops = f"{100 * f['added_flops'] / f['step_flops']:6.2f}%"
        fitted, flops = "-", "-"
        if planned > tracked:
            try:
                f = step.fit(tracked, time_limit=max(time_limit, 30.0), minimise="flops")
                step.run(batch, track=True)
                fitted = f"{step.tracked_peak_bytes / mib:7.1f}M"
                flops = f"{100 * f['added_flops'] / f['step_flops']:6.2f}%"
            except memplan.MemplanError:
                fitted = "no fit"
        print(f"{name:18} {eager / mib:7.1f}M {tracked / mib:7.1f}M {estimate / mib:7.1f}M "
              f"{with_memplan / mib:7.1f}M {estimate_mp / mib:7.1f}M "
              f"{planned / mib:7.1f}M {within / mib:7.1f}M {within_flops:>7} "
              f"{fitted:>8} {flops:>7} {seconds:8.1f}s", flush=True)


def small(time_limit: float):
    rows = []
    for name, (model, batch, loss_fn) in models().items():
        model.train()
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01)
        loss_fn(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        eager = eager_tracked(ref, ref_opt, batch, loss_fn)
        step = capture(model, opt, batch, loss_fn, time_limit=time_limit)
        step.run(batch, order="eager", track=True)
        recorded = step.tracked_peak_bytes
        step.run(batch, track=True)
        s = step.stats
        step.run(batch, arena=True, track=True)
        rows.append((name, s["ops"], s["capture_seconds"], s["plan_seconds"], eager, recorded,
                     s["tracked_peak_bytes"], s["max_live_bytes"], s["lower_bound_bytes"],
                     s["arena_bytes"], step.tracked_peak_bytes))
    mib = 1 << 20
    print(f"{'model':18} {'ops':>6} {'capture':>8} {'plan':>6} {'eager':>9} {'recorded':>9} "
          f"{'memplan':>9} {'plan live':>9} {'bound':>9} {'memplan/eager':>13} {'arena':>9} {'in arena':>9}")
    for r in rows:
        print(f"{r[0]:18} {r[1]:6} {r[2]:7.2f}s {r[3]:5.2f}s {r[4] / mib:8.1f}M {r[5] / mib:8.1f}M "
              f"{r[6] / mib:8.1f}M {r[7] / mib:8.1f}M {r[8] / mib:8.1f}M {r[6] / r[4]:13.3f} "
              f"{r[9] / mib:8.1f}M {r[10] / mib:8.1f}M")


def _to(batch, device):
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def _timed(fn, device: torch.device, steps: int, resident):
    """Runs `fn` `steps` times; returns (peak bytes, peak reserved bytes or
    None, median seconds). On CUDA the peaks are the caching allocator's
    ``max_memory_allocated`` / ``max_memory_reserved`` over the timed steps
    (cache emptied and peaks reset first); elsewhere the peak is measured
    from the allocator's events over one more step (:func:`allocator_peak`,
    with `resident` the tensors alive around it) and there is no reserved
    figure."""
    cuda = device.type == "cuda"
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    if cuda:
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), median
    return allocator_peak(fn, resident(), device.type), None, median


class _AllocatedByOp(TorchDispatchMode):
    """Per op: the bytes the caching allocator held at the op's peak
    beyond what it held before the op (the op's results and whatever its
    kernels allocated for themselves)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.most: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = func(*args, **(kwargs or {}))
        grew = torch.cuda.max_memory_allocated(self.device) - before
        name = str(func)
        self.most[name] = max(self.most.get(name, 0), grew)
        return out


def _outside_by_op(step_fn, device: torch.device, top: int = 3) -> List[List[Any]]:
    """The `top` ops that allocated the most during one call of `step_fn`
    (an arena step, whose planned tensors allocate nothing), as [op,
    bytes]."""
    torch.cuda.synchronize(device)
    with _AllocatedByOp(device) as seen:
        step_fn()
    torch.cuda.synchronize(device)
    return [[n, b] for n, b in sorted(seen.most.items(), key=lambda kv: -kv[1])[:top] if b > 0]


def _held_bytes(device: torch.device) -> Optional[int]:
    """Bytes of tensors alive on `device` between steps (CUDA; None
    elsewhere): for eager its parameters, optimizer state and batch, for
    memplan the arena and the batch."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _rng_states(restore=None):
    """The CPU's and every CUDA device's generator states; with `restore`,
    sets them to those instead."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if restore is not None:
        torch.set_rng_state(restore[0])
        if restore[1] is not None:
            torch.cuda.set_rng_state_all(restore[1])
        return restore
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None


def on_device(device: str, steps: int, time_limit: float, cases=None, max_added=None, clip=None,
              fused: bool = False, scaled: bool = False, optimizer: str = "adamw", exact: bool = False,
              graph: bool = False):
    """Each model's training step in eager PyTorch and as memplan's planned
    step in its arena (``step(batch, arena=True)``), on `device`, from the
    same weights and batch: peak allocated and reserved bytes (CUDA), the
    median step time, the planned arena, and how far the losses and final
    parameters are apart. Returns one dict per model.

    Memory outside the arena in the memplan run is ``allocated - arena``:
    the batch, the results of ops without an ``out=`` overload while they
    are copied into place, and what kernels allocate for themselves
    (cuBLAS workspaces). Issue 12's GPU targets read off these rows:
    ``allocated <= arena * 1.01 + outside``, reserved against eager's, and
    the time ratio.

    With `max_added` (a share of the step's FLOPs) the captured step is
    first made the smallest memplan finds for at most that many more FLOPs
    (``step.fit(max_added=..., minimise="flops")``), so the rows show what
    cheap recomputation costs in time and saves in memory.

    Both sides start from the same generator states (CPU and every CUDA
    device) and run as many steps, so models with dropout draw the same
    masks in eager and in memplan's step and are compared like the
    others.

    With `clip` (``max_norm``) both sides clip the gradients' norm before
    the update (``clip_grad_norm_`` in eager, ``capture(...,
    clip_grad_norm=clip)`` for memplan).

    With `fused` both sides use ``AdamW(fused=True)``: eager runs PyTorch's
    fused kernel, memplan its single-tensor arithmetic (equal to rounding).

    `optimizer` names how both sides' optimizer is made (``OPTIMIZERS``;
    AdamW by default). Eager takes PyTorch's default implementation on the
    device (foreach kernels on CUDA), memplan its single-tensor arithmetic.

    With `exact` eager runs the optimizer's single-tensor arithmetic
    (``foreach=False``, the arithmetic memplan records) and both sides
    take cuDNN's deterministic algorithms, so the two should agree to the
    bit: what remains is memplan's doing. Without it, eager's foreach
    kernels round differently, and cuDNN's batch-norm and convolution
    backward may differ from run to run (ResNet's rows).

    On CUDA each row lists the ops that allocated the most outside the
    arena during one more memplan step (``outside_ops``, op and bytes):
    what kernels allocate for themselves (cuBLAS workspaces, an ``out=``
    overload that computes its result elsewhere and copies it).

    With `scaled` both sides scale the loss with a ``torch.amp.GradScaler``
    (float16 training: `cases` under float16 autocast), eager through
    ``scaler.scale/unscale_/step/update``, memplan through ``capture(...,
    scaler=)``, both from the same initial scale; each row counts the
    updates memplan's step skipped (``skipped_updates``) and eager's
    (``eager_skipped_updates``).

    With `graph` memplan's step runs as one CUDA graph (``step(batch,
    graph=True)``), and both sides' Adam or AdamW is made with
    ``capturable=True`` (eager then runs PyTorch's capturable kernels:
    foreach, or single-tensor with `exact`); rows record the graph's
    ``graph_recordings``, ``graph_launches`` and ``graph_refused``.

    Each row also has the bytes ``torch.save`` writes for the memplan
    model's state dict after the run (``checkpoint_bytes``), beside the
    parameters' own bytes (``parameter_bytes``): the arena's tensors own
    their bytes, so the two differ by pickle's framing only."""
    run = _Run(torch.device(device), steps, time_limit, max_added, clip, fused, scaled, optimizer, exact, graph)
    cases = dict(cases or models())
    if not exact:
        return _on_device(run, cases)
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        return _on_device(run, cases)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@dataclasses.dataclass
class _Run:
    """:func:`on_device`'s settings."""

    dev: torch.device
    steps: int
    time_limit: float
    max_added: Optional[float]
    clip: Optional[float]
    fused: bool
    scaled: bool
    optimizer: str
    exact: bool
    graph: bool

    def make_optimizer(self, params):
        make = OPTIMIZERS[self.optimizer] if not self.fused else (
            lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True))
        return (_capturable(make) if self.graph else make)(params)


def _on_device(run: _Run, cases) -> List[Dict[str, Any]]:
    rows = []
    while cases:
        # Each side is measured with only its own tensors on the device:
        # the cases wait on the CPU, the memplan twin is moved there once
        # eager's peak is read, and eager's back to the CPU before memplan
        # runs (on CUDA, max_memory_* count every tensor on the device).
        name = next(iter(cases))
        model, batch, loss_fn = cases.pop(name)
        _release(run.dev)  # the last case's tensors (cycles in what capture made)
        model.train()
        batch = _to(batch, run.dev)
        eager_model = copy.deepcopy(model).to(run.dev)
        mine = copy.deepcopy(model)
        del model
        eager = _eager_side(run, eager_model, batch, loss_fn)
        eager_model.to("cpu")
        mine.to(run.dev)
        ours, memplan_step = _memplan_side(run, mine, batch, loss_fn, eager.pop("first_scale"), eager.pop("rng"))
        diffs = _differences(eager.pop("losses"), ours.pop("losses"), eager_model, mine)
        # After the comparisons: one more memplan step, op by op (a CUDA
        # graph launches no op one by one: nothing to see).
        outside = _outside_by_op(memplan_step, run.dev) if run.dev.type == "cuda" and not run.graph else []
        rows.append({"model": name, "device": str(run.dev), "steps": run.steps, **diffs, **eager, **ours,
                     "outside_ops": outside})
        del eager_model, mine, memplan_step
    return rows


def _eager_side(run: _Run, eager_model, batch, loss_fn) -> Dict[str, Any]:
    """Eager's steps (one untimed, then the timed ones): its row fields,
    with its `losses`, the scale of its first step (`first_scale`) and the
    generator states it started from (`rng`), which memplan's side starts
    from too."""
    opt = run.make_optimizer(eager_model.parameters())
    if run.exact:
        for group in opt.param_groups:
            if "foreach" in group:
                group["foreach"] = False
    scaler = torch.amp.GradScaler(run.dev.type) if run.scaled else None
    first_scale = scaler.get_scale() if scaler is not None else None
    losses = []
    updates = []  # one entry per optimizer.step() the scaler let through
    opt.register_step_post_hook(lambda *_: updates.append(True))
    rng = _rng_states()

    def eager_step():
        loss = loss_fn(eager_model, batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if run.clip is not None:
            torch.nn.utils.clip_grad_norm_(eager_model.parameters(), run.clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    eager_step()  # the optimizer state exists from here on, as in the captured step

    def resident():
        return (list(eager_model.parameters()) + list(eager_model.buffers()) + tree_flatten(batch)[0]
                + [v for st in opt.state.values() for v in st.values()])

    alloc, res, seconds = _timed(eager_step, run.dev, run.steps, resident)
    return {"eager_allocated_bytes": alloc, "eager_reserved_bytes": res, "eager_step_seconds": seconds,
            "eager_held_bytes": _held_bytes(run.dev), "eager_skipped_updates": len(losses) - len(updates),
            "losses": losses, "first_scale": first_scale, "rng": rng}


def _memplan_side(run: _Run, mine, batch, loss_fn, first_scale, rng):
    """memplan's captured step in its arena (one untimed run, then the
    timed ones, from eager's generator states): its row fields, with its
    `losses`, and the step as a function of nothing."""
    opt = run.make_optimizer(mine.parameters())
    scaler = torch.amp.GradScaler(run.dev.type, init_scale=first_scale) if run.scaled else None
    step = capture(mine, opt, batch, loss_fn, time_limit=run.time_limit, clip_grad_norm=run.clip, scaler=scaler)
    added = 0.0
    if run.max_added is not None:
        f = step.fit(max_added=run.max_added, minimise="flops", time_limit=max(run.time_limit, 30.0))
        added = f["added_flops"] / f["step_flops"]
    losses = []
    skipped = []

    def memplan_step():
        losses.append(step(batch, arena=True, graph=run.graph).detach().clone())
        skipped.append(step.skipped_update)

    _rng_states(rng)  # the draws of eager's first step, then of its next...
    memplan_step()
    arena = step.place()
    alloc, res, seconds = _timed(memplan_step, run.dev, run.steps, lambda: [arena.buffer] + tree_flatten(batch)[0])
    return {
        "memplan_allocated_bytes": alloc, "memplan_reserved_bytes": res, "memplan_step_seconds": seconds,
        "memplan_held_bytes": _held_bytes(run.dev), "arena_bytes": step.plan["arena_bytes"],
        "outside_arena_bytes": alloc - step.plan["arena_bytes"], "outside_peak_bytes": arena.outside_peak_bytes,
        "lower_bound_bytes": step.plan["stats"]["lower_bound_bytes"],
        "max_added_share": run.max_added, "added_flops_share": added,
        "checkpoint_bytes": _saved_bytes(mine.state_dict()), "skipped_updates": sum(skipped),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in mine.parameters()),
        **{k: v for k, v in step.stats.items() if k.startswith("graph_")},
        "losses": losses,
    }, memplan_step


def _differences(eager_losses, my_losses, eager_model, mine) -> Dict[str, float]:
    """How far the two sides' losses, parameters and floating-point
    buffers (batch norm's running statistics) are apart, relative to
    eager's, after the same number of steps."""
    n = min(len(eager_losses), len(my_losses))
    loss_diff = max(abs(float(a) - float(b)) / max(abs(float(a)), 1e-12)
                    for a, b in zip(eager_losses[:n], my_losses[:n]))
    with torch.no_grad():
        param_diff = max(float((p - q.cpu()).norm() / max(float(p.norm()), 1e-12))
                         for p, q in zip(eager_model.parameters(), mine.parameters()))
        buffer_diff = max([float((b - c.cpu()).norm() / max(float(b.norm()), 1e-12))
                           for b, c in zip(eager_model.buffers(), mine.buffers()) if b.is_floating_point()]
                          or [0.0])
    return {"loss_rel_diff": loss_diff, "param_rel_diff": param_diff, "buffer_rel_diff": buffer_diff}


def _capturable(make):
    """`make` with Adam's bias corrections on the device
    (``capturable=True``), what a CUDA graph of the step needs; other
    optimizers as they are."""

    def made(ps):
        opt = make(ps)
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            for group in opt.param_groups:
                group["capturable"] = True
        return opt
    return made


def _release(device: torch.device) -> None:
    """Frees what is no longer referenced, cycles too, and on CUDA gives
    the cached blocks back, so one case's tensors do not count in the
    next one's peaks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _saved_bytes(obj) -> int:
    """The bytes ``torch.save(obj)`` writes."""
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getbuffer().nbytes


def _print_device_rows(rows):
    mib = 1 << 20
    print(f"{'model':18} {'eager alloc':>11} {'eager res':>10} {'memplan':>10} {'mp res':>10} {'arena':>10} "
          f"{'outside':>9} {'res vs eager':>12} {'time ratio':>10} {'loss diff':>9} {'param diff':>10} "
          f"{'buf diff':>9}")
    for r in rows:
        res = (f"{r['memplan_reserved_bytes'] / r['eager_reserved_bytes'] - 1:+11.1%}"
               if r["eager_reserved_bytes"] else f"{'-':>11}")
        e_res = f"{r['eager_reserved_bytes'] / mib:9.1f}M" if r["eager_reserved_bytes"] else f"{'-':>10}"
        m_res = f"{r['memplan_reserved_bytes'] / mib:9.1f}M" if r["memplan_reserved_bytes"] else f"{'-':>10}"
        print(f"{r['model']:18} {r['eager_allocated_bytes'] / mib:10.1f}M {e_res} "
              f"{r['memplan_allocated_bytes'] / mib:9.1f}M {m_res} {r['arena_bytes'] / mib:9.1f}M "
              f"{r['outside_arena_bytes'] / mib:8.1f}M {res} "
              f"{r['memplan_step_seconds'] / r['eager_step_seconds']:10.2f} {r['loss_rel_diff']:9.1e} "
              f"{r['param_rel_diff']:10.1e} {r['buffer_rel_diff']:9.1e}", flush=True)
    for r in rows:
        if r.get("outside_ops"):
            most = ", ".join(f"{op} {b / mib:.1f}M" for op, b in r["outside_ops"])
            print(f"{r['model']}: allocated outside the arena, most by op: {most}")
        if "graph_launches" in r:
            how = f"refused ({r['graph_refused']})" if r["graph_refused"] else "recorded"
            print(f"{r['model']}: CUDA graph {how}: {r['graph_recordings']} recordings, "
                  f"{r['graph_launches']} launches; eager {r['eager_step_seconds'] * 1e3:.2f} ms, "
                  f"memplan {r['memplan_step_seconds'] * 1e3:.2f} ms per step")


def _gpt2_xl_case(device: str, dropout: float = 0.0):
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_gpt2("xl", dropout)  # initialised where it is fast
    model.to("cpu")  # and kept off the device until measured (on_device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"hf-gpt2-xl-b1": (model, torch.randint(0, 50257, (1, 1024)), _causal_lm)}


# `--optimizer` (with `--gpt2-xl` or `--device`): how the step's optimizer is made.
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def gpt2_xl(out_dir: str, time_limit: float, optimizer: str = "adamw"):
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = hf_gpt2("xl")
        batch = torch.randint(0, 50257, (1, 1024))
    opt = OPTIMIZERS[optimizer](model.parameters())
    built = time.perf_counter() - t0
    step = capture(model, opt, batch, _causal_lm, time_limit=time_limit)
    s = step.stats
    gib = 1 << 30
    print(f"GPT-2 XL b1 s1024 (Hugging Face, traced as CPU, {type(opt).__name__}): {s['ops']} ops; "
          f"model {built:.1f} s, "
          f"capture {s['capture_seconds']:.1f} s, plan {s['plan_seconds']:.1f} s; "
          f"planned {s['arena_bytes'] / gib:.2f} GiB, max live {s['max_live_bytes'] / gib:.2f} GiB, "
          f"bound {s['lower_bound_bytes'] / gib:.2f} GiB")
    os.makedirs(out_dir, exist_ok=True)
    suffix = "" if optimizer == "adamw" else f"-{optimizer}"
    path = os.path.join(out_dir, f"gpt2-xl-b1{suffix}.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump(step.graph, f)
    print(f"graph written to {path}; `memplan compare {path}` sets it against PyTorch's allocator")


def _resized(batch):
    """make_batch for max_batch: `batch`'s first sample repeated `b` times."""
    return lambda b: tree_map(lambda x: x[:1].expand(b, *x.shape[1:]).clone(), batch)


def fully_checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with full per-block activation checkpointing
    (non-reentrant), as a user who checkpoints runs it: Hugging Face's
    ``gradient_checkpointing_enable``, or torch's checkpoint wrapper on each
    residual block of a torchvision ResNet or encoder block of a ViT."""
    m = copy.deepcopy(model)
    if hasattr(m, "gradient_checkpointing_enable"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torchvision.models.resnet import BasicBlock, Bottleneck
    from torchvision.models.vision_transformer import EncoderBlock

    blocks = (BasicBlock, Bottleneck, EncoderBlock)
    if not any(isinstance(x, blocks) for x in m.modules()):
        raise ValueError(f"{type(m).__name__}: no blocks to checkpoint")
    apply_activation_checkpointing(m, check_fn=lambda x: isinstance(x, blocks))
    return m


def largest(gib: float, probe_time: float, xl: bool):
    budget = int(gib * (1 << 30))
    if xl:
        with torch.device("meta"):
            model = hf_gpt2("xl")
        cases = {"gpt2-xl-s1024": (model, lambda b: torch.randint(0, 50257, (b, 1024), device="meta"),
                                   _causal_lm)}
    else:
        cases = {n: (m, _resized(b), f) for n, (m, b, f) in models().items()}
    print(f"largest batch within {gib:g} GiB (captured at batch 2 and 3, extrapolated; "
          f"{probe_time:g} s per fit probe)")
    print("(eager + full AC: every block checkpointed, in the best simulated eager configuration, "
          "the optimizer in the backward among them)")
    print(f"{'model':18} {'best eager':>10} {'default':>7} {'eager+full AC':>13} {'memplan':>8} {'+recompute':>11} "
          f"{'seconds':>8}  best eager configuration / with full AC")
    for name, (model, make, loss_fn) in cases.items():
        t0 = time.perf_counter()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        r = max_batch(model, opt, make, loss_fn, budget, probe_time=probe_time)
        # Eager with every block checkpointed: its own capture, only its
        # eager answer is used (its memplan answers search too, briefly).
        ac = fully_checkpointed(model)
        ac_opt = torch.optim.AdamW(ac.parameters(), lr=1e-4, weight_decay=0.01)
        rc = max_batch(ac, ac_opt, make, loss_fn, budget, probe_time=min(probe_time, 1.0))
        print(f"{name:18} {r['eager']:10} {r['eager_default']:7} {rc['eager']:13} {r['planned']:8} {r['fitted']:11} "
              f"{time.perf_counter() - t0:8.1f}  {r['eager_configuration'] or '-'} / "
              f"{rc['eager_configuration'] or '-'}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2-xl", metavar="DIR", help="capture and plan GPT-2 XL b1, write its graph here")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                    help="with --gpt2-xl or --device: the step's optimizer")
    ap.add_argument("--max-batch", metavar="GIB", type=float,
                    help="the largest batch within GIB GiB, eager vs memplan vs memplan + recomputation")
    ap.add_argument("--gpt2-xl-batch", action="store_true", help="with --max-batch: GPT-2 XL")
    ap.add_argument("--compile", action="store_true",
                    help="the small models against torch.compile (Inductor), measured by allocator events")
    ap.add_argument("--time-limit", type=float, default=10.0,
                    help="seconds to plan (with --max-batch: per fit probe)")
    ap.add_argument("--device", help="run eager and memplan's arena step on this device (e.g. cuda) and "
                    "compare peak allocated/reserved bytes, step time and results")
    ap.add_argument("--steps", type=int, default=5, help="with --device: timed steps per side")
    ap.add_argument("--with-gpt2-xl", action="store_true", help="with --device: GPT-2 XL b1 (seq 1024) too")
    ap.add_argument("--json", metavar="FILE", help="with --device: also write the rows as JSON")
    ap.add_argument("--autocast", action="store_true",
                    help="with --device: each model's forward under bf16 autocast (f32 master weights)")
    ap.add_argument("--fp16", action="store_true",
                    help="with --device: each model's forward under float16 autocast, the loss scaled by a "
                    "torch.amp.GradScaler on both sides (capture(..., scaler=) for memplan)")
    ap.add_argument("--tiny", action="store_true",
                    help="with --device: width-32 decoders instead, whose step time is per-op overhead")
    ap.add_argument("--dropout", metavar="P", type=float, default=0.0,
                    help="with --device: every dropout of the models' configurations at P (GPT-2's "
                    "default is 0.1); eager and memplan draw the same masks")
    ap.add_argument("--clip-grad-norm", metavar="MAX", type=float,
                    help="with --device: clip the gradients' norm to MAX before each update, on both sides")
    ap.add_argument("--fused-optimizer", action="store_true",
                    help="with --device: AdamW(fused=True) on both sides (eager runs PyTorch's fused kernel)")
    ap.add_argument("--exact", action="store_true",
                    help="with --device: eager's optimizer in single-tensor arithmetic (foreach=False) and "
                    "cuDNN's deterministic algorithms on both sides, so the two should agree to the bit")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="with --device cuda: memplan's step as one CUDA graph (step(batch, graph=True)); "
                    "both sides' AdamW with capturable=True")
    ap.add_argument("--max-added", metavar="SHARE", type=float,
                    help="with --device: first make each step the smallest memplan finds for at most "
                    "SHARE more FLOPs (0.001 is 0.1%%), by recomputation")
    args = ap.parse_args(argv)
    if args.cuda_graph and (args.device or "").split(":")[0] != "cuda":
        ap.error("--cuda-graph records CUDA graphs: it needs --device cuda")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.device:
        cases = tiny_models(args.dropout) if args.tiny else models(args.dropout)
        if args.with_gpt2_xl:
            cases.update(_gpt2_xl_case(args.device, args.dropout))
        if args.autocast or args.fp16:
            dtype = torch.float16 if args.fp16 else torch.bfloat16
            suffix = "fp16" if args.fp16 else "bf16"
            cases = {f"{name}-{suffix}": (model, batch, _autocast(loss_fn, args.device, dtype))
                     for name, (model, batch, loss_fn) in cases.items()}
        rows = on_device(args.device, args.steps, args.time_limit, cases, args.max_added, args.clip_grad_norm,
                         args.fused_optimizer, scaled=args.fp16, optimizer=args.optimizer, exact=args.exact,
                         graph=args.cuda_graph)
        _print_device_rows(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    elif args.compile:
        against_compile(args.time_limit)
    elif args.max_batch:
        largest(args.max_batch, args.time_limit, args.gpt2_xl_batch)
    elif args.gpt2_xl:
        gpt2_xl(args.gpt2_xl, args.time_limit, args.optimizer)
    else:
        small(args.time_limit)


if __name__ == "__main__":
    main()
