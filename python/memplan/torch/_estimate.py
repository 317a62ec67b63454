"""What one rank of a training configuration needs, before renting the
GPUs: :func:`estimate` (``memplan.torch.estimate``; its command line is
``python -m memplan.torch.estimate``, :mod:`memplan.torch.estimate`).

One rank's step is captured in this process, on the meta device (nothing
is allocated, nothing runs), under PyTorch's fake process group of the
configuration's world size: the model made as its framework makes it,
checkpointed and wrapped with FSDP2 as its framework does
(:mod:`memplan.torch._estimate_model`), and captured by
:func:`memplan.torch.capture` as a real rank's step is. The figures are
the Rust core's: FSDP2 eager's order through the caching allocator's
simulation (:func:`memplan.baselines`), memplan's plan, its fit at 0.1%
more FLOPs (:func:`memplan.fit`), the lower bound, and the largest
micro-batch under a device memory (:func:`memplan.max_batch`).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import memplan
from memplan import MemplanError

from . import _estimate_model as em

OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
PRECISIONS = ("bf16", "fp32")
# The rows of the table: (key, what it is).
ROWS = (
    ("fsdp2-eager-default", "FSDP2 eager, PyTorch's caching allocator (reserved)"),
    ("fsdp2-eager-expandable-segments", "FSDP2 eager, expandable_segments:True (reserved)"),
    ("fsdp2-eager-allocated", "FSDP2 eager, its tensors (allocated)"),
    ("memplan-plan", "memplan's plan (its tensors)"),
    ("memplan-plan-arena", "memplan's plan in one arena"),
    ("memplan-fit-0.1%", "memplan's fit, <= 0.1% more FLOPs (its tensors)"),
    ("lower-bound", "lower bound: any order, no recomputation"),
)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemplanError(f"{name}: {value!r} is not a whole number >= 1")
    return value


def _mesh(world: Optional[int], dp_shard: Optional[int], dp_replicate: int, tp: int) -> Dict[str, int]:
    """The mesh's sizes; `dp_shard` defaults to what `world` leaves."""
    for name, v in (("dp_replicate", dp_replicate), ("tp", tp)):
        _positive(name, v)
    if dp_shard is None:
        if world is None:
            raise MemplanError("give the world size (world=) or the mesh (dp_shard=, dp_replicate=, tp=)")
        _positive("world", world)
        if world % (dp_replicate * tp):
            raise MemplanError(f"world {world} is not a multiple of dp_replicate x tp = {dp_replicate * tp}")
        dp_shard = world // (dp_replicate * tp)
    _positive("dp_shard", dp_shard)
    size = dp_shard * dp_replicate * tp
    if world is not None and size != world:
        raise MemplanError(f"the mesh dp_replicate {dp_replicate} x dp_shard {dp_shard} x tp {tp} is {size} ranks, "
                           f"the world {world}: {'larger than' if size > world else 'not'} the world")
    return {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "world": size}


def _refuse(source: em.Source, mesh: Dict[str, int], pp: int, ep: int) -> None:
    """Configurations that cannot be, or that memplan does not capture,
    refused by name before anything is made."""
    tp = mesh["tp"]
    for what, n in (("attention heads", source.heads), ("key/value heads", source.kv_heads)):
        if n is not None and n % tp:
            raise MemplanError(f"{source.name}: {n} {what} do not divide over tp {tp}: tensor parallelism splits "
                               "the heads evenly; choose a tp that divides them")
    if pp != 1:
        raise MemplanError(f"pp {pp}: pipeline parallelism is not captured by memplan; estimate one stage's "
                           "model (its layers) with pp 1", "unsupported")
    if ep != 1:
        raise MemplanError(f"ep {ep}: expert parallelism (MoE all-to-all) is not captured by memplan",
                           "unsupported")
    if source.experts and mesh["world"] > 1:
        raise MemplanError(f"{source.name}: a mixture of {source.experts} experts; its expert routing under "
                           "FSDP2 is not captured by memplan yet (it is data-dependent)", "unsupported")
    if tp != 1:
        raise MemplanError(f"tp {tp}: tensor parallelism (DTensor's redistributions) is not captured by memplan "
                           "yet; estimate with tp 1 (FSDP2 or HSDP)", "unsupported")


class _Progress:
    """A progress bar over the estimate's phases (tqdm's, on stderr), or
    nothing."""

    def __init__(self, phases: List[str], show: bool) -> None:
        self.bar = None
        if show:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=len(phases), file=sys.stderr, unit="phase", leave=False,
                                bar_format="{desc:<34} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
            except ImportError:  # no tqdm: a line per phase
                self.bar = False

    def phase(self, what: str) -> None:
        if self.bar is False:
            print(f"memplan estimate: {what}...", file=sys.stderr, flush=True)
        elif self.bar is not None:
            if self.bar.desc:
                self.bar.update(1)
            self.bar.set_description_str(what)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


class _FakeGroup:
    """PyTorch's fake process group of `world` ranks, this process rank 0,
    for as long as the estimate runs; refused if a group exists."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __enter__(self):
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise MemplanError("estimate makes its own (fake) process group: call it where none is initialized "
                               "(a process of its own, not a rank of a run)", "unsupported")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def estimate(capture: Callable, config: Any = None, *, torchtitan: Optional[str] = None,
             model_class: Optional[Callable] = None, model_args: Optional[Dict[str, Any]] = None,
             layers: Optional[int] = None, world: Optional[int] = None,
             dp_shard: Optional[int] = None, dp_replicate: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
             seq: int = 2048, micro_batch: int = 1, accumulate: int = 1, mixed_precision: str = "bf16",
             ac: str = "none", optimizer: str = "adamw", clip_grad_norm: Optional[float] = None,
             device: str = "cuda", device_memory: Optional[int] = None, time_limit: float = 30.0,
             progress: bool = False) -> Dict[str, Any]:
    """:func:`memplan.torch.estimate`, capturing with `capture`
    (:func:`memplan.torch.capture`, given by the package, which this
    module does not import: no import ring)."""
    source = _source(config, torchtitan, model_class, model_args, layers)
    mesh = _mesh(world, dp_shard, dp_replicate, tp)
    _refuse(source, mesh, pp, ep)
    for name, v in (("seq", seq), ("micro_batch", micro_batch), ("accumulate", accumulate)):
        _positive(name, v)
    _choice("mixed_precision", mixed_precision, PRECISIONS)
    _choice("ac", ac, em.AC_MODES)
    _choice("optimizer", optimizer, tuple(OPTIMIZERS))
    _choice("device", device, ("cuda", "cpu"))
    if clip_grad_norm is None and source.kind == "torchtitan":
        clip_grad_norm = 1.0
    budget = None if device_memory is None else memplan._budget(device_memory, "device_memory")
    phases = ["making the model", "capturing one rank's step", "planning", "fitting (0.1% FLOPs)",
              "simulating FSDP2 eager"] + (["largest micro-batch"] if budget is not None else [])
    bar = _Progress(phases, progress)
    conf = dict(model=source.name, **mesh, seq=seq, micro_batch=micro_batch, accumulate=accumulate,
                mixed_precision=mixed_precision, ac=ac, optimizer=optimizer, clip_grad_norm=clip_grad_norm,
                device=device)
    try:
        with _FakeGroup(mesh["world"]):
            out = _run(capture, source, mesh, conf, bar, budget, time_limit)
    finally:
        bar.close()
    return out


def _source(config, torchtitan, model_class, model_args, layers) -> em.Source:
    given = [k for k, v in (("config", config), ("torchtitan", torchtitan), ("model_class", model_class))
             if v is not None]
    if len(given) != 1:
        raise MemplanError("give one model: config= (Hugging Face), torchtitan= (a flavor) or model_class= "
                           f"(and model_args=); got {', '.join(given) or 'none'}")
    if layers is not None:
        _positive("layers", layers)
        if model_class is not None:
            raise MemplanError("layers: give the depth in model_args for a model class")
    if config is not None:
        return em.hf_source(config, layers)
    if torchtitan is not None:
        return em.torchtitan_source(torchtitan, layers)
    return em.class_source(model_class, dict(model_args or {}))


def _choice(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise MemplanError(f"{name}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _capture(capture: Callable, source: em.Source, mesh: Dict[str, int], conf: Dict[str, Any],
             micro_batch: int, time_limit: float):
    """One rank's step at `micro_batch`, captured (not planned) on the
    meta device under the fake group."""
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device("meta"):
        model = source.make(conf["seq"])
    em.checkpoint(model, source, conf["ac"])
    if mesh["dp_replicate"] > 1:
        dm = init_device_mesh("cpu", (mesh["dp_replicate"], mesh["dp_shard"]),
                              mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        dm = init_device_mesh("cpu", (mesh["dp_shard"],), mesh_dim_names=("dp_shard",))
    em.shard(model, source, dm, conf["mixed_precision"])
    opt = getattr(torch.optim, OPTIMIZERS[conf["optimizer"]])(model.parameters(), lr=1e-4)
    global_tokens = micro_batch * conf["seq"] * (mesh["dp_shard"] * mesh["dp_replicate"]) * conf["accumulate"]
    batch, loss = em.batch_and_loss(source, micro_batch, conf["seq"], global_tokens)
    return capture(model, opt, batch, loss, plan=False, time_limit=time_limit, accumulate=conf["accumulate"],
                      clip_grad_norm=conf["clip_grad_norm"])


def _run(capture, source, mesh, conf, bar: _Progress, budget: Optional[int], time_limit: float) -> Dict[str, Any]:
    mb = conf["micro_batch"]
    bar.phase("making the model")
    t0 = time.perf_counter()
    bar.phase("capturing one rank's step")
    step = _capture(capture, source, mesh, conf, mb, time_limit)
    t1 = time.perf_counter()
    bar.phase("planning")
    step.make_plan(time_limit=time_limit)
    t2 = time.perf_counter()
    st = step.stats
    bar.phase("fitting (0.1% FLOPs)")
    fit = memplan.fit(step.graph, max_added=0.001, minimise="flops", time_limit=time_limit)
    bar.phase("simulating FSDP2 eager")
    base = memplan.baselines(step.graph, conf["device"])["baselines"]
    # Allocated: on CUDA the caching allocator's (blocks rounded to 512
    # bytes), on the CPU the tensors' own bytes, as the CPU allocator sees.
    allocated = "pytorch-allocated" if conf["device"] == "cuda" else "program-order"
    rows = {"fsdp2-eager-default": base["pytorch-reserved"]["footprint_bytes"],
            "fsdp2-eager-expandable-segments": base["pytorch-expandable-segments"]["footprint_bytes"],
            "fsdp2-eager-allocated": base[allocated]["footprint_bytes"],
            "memplan-plan": st["max_live_bytes"], "memplan-plan-arena": st["arena_bytes"],
            "memplan-fit-0.1%": fit["plan"]["stats"]["max_live_bytes"], "lower-bound": st["lower_bound_bytes"]}
    out: Dict[str, Any] = {"configuration": conf, "ops": st["ops"], "capture_seconds": t1 - t0,
                           "plan_seconds": t2 - t1, "rows": rows, "descriptions": dict(ROWS),
                           "fit_added_flops_share": fit["added_flops"] / fit["step_flops"]}
    if budget is not None:
        bar.phase("largest micro-batch")
        out["max_micro_batch"] = _max_micro_batch(capture, step, source, mesh, conf, budget, time_limit)
    return out


def _max_micro_batch(capture, step, source, mesh, conf, budget: int, time_limit: float) -> Dict[str, Any]:
    """The largest micro-batch each side fits in `budget`: the step
    captured at two micro-batches (this one and the next, or 2 and 3 from
    1: PyTorch can trace a batch of 1 otherwise) and extrapolated along
    the line through them (:func:`memplan.max_batch`)."""
    mb = conf["micro_batch"]
    b1, b2 = (mb, mb + 1) if mb >= 2 else (2, 3)
    graphs = [step.graph if b == mb else _capture(capture, source, mesh, conf, b, time_limit).graph for b in (b1, b2)]
    r = memplan.max_batch(graphs[0], graphs[1], budget, batches=(b1, b2), probe_time=min(5.0, time_limit))
    return {k: r[k] for k in ("eager", "eager_configuration", "eager_default", "planned", "fitted",
                              "budget_bytes", "cap")}


def table(result: Dict[str, Any]) -> str:
    """The estimate as the command line prints it."""
    c = result["configuration"]
    mesh = f"dp_shard {c['dp_shard']}" + (f" x dp_replicate {c['dp_replicate']}" if c["dp_replicate"] > 1 else "")
    lines = [f"{c['model']} on {c['world']} ranks ({mesh}), seq {c['seq']}, micro-batch {c['micro_batch']}"
             f"{' x ' + str(c['accumulate']) + ' accumulated' if c['accumulate'] > 1 else ''}, "
             f"{c['mixed_precision']}, AC {c['ac']}, {OPTIMIZERS[c['optimizer']]}"
             f"{', clipped at %g' % c['clip_grad_norm'] if c['clip_grad_norm'] is not None else ''}",
             f"one rank's step: {result['ops']:,} ops, captured in {result['capture_seconds']:.1f} s, planned in "
             f"{result['plan_seconds']:.1f} s (FSDP2 eager simulated for {c['device']})", ""]
    rows = result["rows"]
    ref = rows["fsdp2-eager-default"]
    width = max(len(d) for _, d in ROWS)
    unit, scale = _unit(ref)
    lines.append(f"{'per rank':<{width}}  {unit:>9}  {'vs eager':>8}")
    for key, what in ROWS:
        lines.append(f"{what:<{width}}  {rows[key] / scale:9.3f}  {rows[key] / ref:8.3f}")
    m = result.get("max_micro_batch")
    if m is not None:
        def at(n):
            return f">= {n}" if n == m["cap"] else str(n) if n else "none"

        how = f"{m['eager_configuration']}; " if m["eager_configuration"] else ""
        lines += ["", f"largest micro-batch in {m['budget_bytes'] / _unit(m['budget_bytes'])[1]:g} "
                  f"{_unit(m['budget_bytes'])[0]}: FSDP2 eager {at(m['eager'])} "
                  f"({how}default allocator {at(m['eager_default'])}), memplan's plan "
                  f"{at(m['planned'])}, its fit {at(m['fitted'])}"]
    return "\n".join(lines)


def _unit(n: int):
    """The largest binary unit `n` holds at least one of, and its size."""
    return next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if n >= s or s == 1)
