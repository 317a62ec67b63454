"""What experts run, measured: eager PyTorch in the configurations a
knowledgeable user would choose, against memplan's planned and fitted step,
on real Hugging Face models on the CPU.

    python -m benchmarks.bench_baselines                     # GPT-2 and Llama, small configs
    python -m benchmarks.bench_baselines --cap 64 --json     # and the largest batch in 64 MiB

(the command is :mod:`benchmarks.bench_baselines`; the sides are here).

For each model every side runs from the same weights on the same batches
(three steps; the same losses are checked), and each side's peak is the
allocator's, over its second step (the first makes the optimizer state):
the bytes of the tensors held across steps (parameters, optimizer state,
the batch) plus the highest running sum of the allocator's events
(:func:`memplan.torch._run.allocator_peak`). The sides:

- ``eager``: ``loss.backward(); optimizer.step(); zero_grad()``;
- ``eager-optimizer-in-backward``: torchtune's way of freeing each gradient
  as soon as it is complete: one optimizer per parameter, stepped in the
  parameter's ``register_post_accumulate_grad_hook``;
- ``eager-selective-ac``: every decoder block checkpointed with an
  op-level policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
  that saves the outputs of matrix products and attention and recomputes
  the rest, as torchtitan's op-level selective checkpointing does (without
  its "every other ``mm``" refinement);
- ``eager-full-ac``: every decoder block checkpointed whole;
- ``eager-selective-ac+optimizer-in-backward``,
  ``eager-full-ac+optimizer-in-backward``: each checkpointing with the
  optimizer in the backward pass, as torchtune's recipes combine them
  (``enable_activation_checkpointing`` with ``optimizer_in_bwd``): once
  the activations are recomputed, the gradients held until the update are
  often the peak, and these sides do not hold them;
- ``eager-compile`` (with ``--compile``): ``torch.compile`` with Inductor's
  defaults, the optimizer's step compiled too;
- ``memplan``: the captured step in memplan's order;
- ``memplan-fit-0.1%``: fitted by recomputation to the least memplan finds
  for at most 0.1% more FLOPs;
- ``memplan-fit@<side>``: fitted to each checkpointing side's measured
  peak, with the FLOPs it adds beside theirs.

Added FLOPs are counted on captured graphs: a checkpointing side's step
is captured with its checkpointing (the recomputation is recorded like any
op) and compared with the plain step's FLOPs; memplan's are the FLOPs the
captured step records for the ops its fit runs again (:func:`flops_of`).
The graph counts the FLOPs of matrix products and attention only, so on
both sides elementwise ops run again add none: the ops run again are
listed beside. (A fit's ``max_added`` share is of its cost model, which
prices elementwise ops too: ``cost_model_added_share``.)

With ``--cap MIB``: the largest batch whose step fits MIB MiB, for each
eager side by its measured peak (batches tried in turn) and for memplan by
its plan and by its fit at 0.1% (:func:`memplan.torch.max_batch`). No
timing on the CPU (a CPU's step time says nothing about a GPU's); on a GPU
the same sides would be timed with ``expandable_segments`` on and off,
each in its own process: not run here.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

import memplan

from memplan.torch import capture, max_batch
from memplan.torch._run import allocator_peak
from memplan.torch.export.workloads import GPT2_SHAPES, LLAMA_SHAPES, hf_gpt2, hf_llama, lm_loss, lm_loss_bf16

IN_BACKWARD = "optimizer-in-backward"
_AC = ("eager-selective-ac", "eager-full-ac")
CHECKPOINTING = (*_AC, *(f"{ac}+{IN_BACKWARD}" for ac in _AC))
EAGER_SIDES = ("eager", f"eager-{IN_BACKWARD}", *CHECKPOINTING)


def checkpointing_of(side: str) -> Optional[str]:
    """The checkpointing side `side` runs (``eager-selective-ac`` or
    ``eager-full-ac``, with or without the optimizer in the backward), or
    None."""
    base = side.split("+")[0]
    return base if base in _AC else None


def optimizer_in_backward(side: str) -> bool:
    """Whether `side` steps each parameter's optimizer in the backward pass."""
    return side.endswith(IN_BACKWARD)


_lm, _lm_bf16 = lm_loss, lm_loss_bf16


def loss_fn(bf16: bool = False):
    return _lm_bf16 if bf16 else _lm


# --size: the catalogue's shape of each model (memplan.torch.export.workloads).
SIZES = {
    "tiny": ("tiny-64", "tiny-64", {}),  # for the tests
    "small": ("4l-256-v8192", "4l-256-v8192", {}),
    "medium": ("8l-1024", "8l-1024", {}),  # for a GPU: about 150M parameters each
    # for a GPU: GPT-2 XL (1.56B) and Llama 3.2 1B's shape (tied, 1.24B), at longer sequences
    "1b": ("xl", "1b", {"gpt2": {"n_positions": 2048}, "llama": {"max_position_embeddings": 4096}}),
}


def model_configs(size: str = "small") -> Dict[str, Callable[[], torch.nn.Module]]:
    """name -> a function making the model (the same weights each call)."""
    gpt2, llama, over = SIZES[size]

    def make(build_model, shape, vocab, **cfg):
        def build():
            torch.manual_seed(0)
            return build_model(shape, **cfg).train()
        build.vocab_size = vocab  # (without making a model: seconds at the 1b size)
        return build

    return {"hf-gpt2": make(hf_gpt2, gpt2, GPT2_SHAPES[gpt2]["vocab_size"], **over.get("gpt2", {})),
            "hf-llama": make(hf_llama, llama, LLAMA_SHAPES[llama]["vocab_size"], **over.get("llama", {}))}


def _saved_ops():
    """The ops whose outputs selective checkpointing keeps: matrix products
    and attention (the expensive ones); all else is recomputed."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def configured(make, side: str) -> torch.nn.Module:
    """The model as `side` runs it (checkpointing set on its blocks)."""
    model = make()
    ac = checkpointing_of(side)
    if ac == "eager-full-ac":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif ac == "eager-selective-ac":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": _selective_context})
    return model


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _eager_step(model, side: str, lm=_lm):
    """(one training step on a batch, the tensors it holds between steps),
    its loss `lm(model, batch)`."""
    if optimizer_in_backward(side):
        opts = {p: _adamw([p]) for p in model.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

        def step(b):
            loss = lm(model, b)
            loss.backward()
            return loss.detach()
        held = lambda: [v for o in opts.values() for s in o.state.values() for v in s.values()]  # noqa: E731
        return step, held
    opt = _adamw(model.parameters())

    def step(b):
        loss = lm(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, lambda: [v for s in opt.state.values() for v in s.values()]


def _tensors(x) -> List[torch.Tensor]:
    return [t for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]


def _measure(model, step, held, batches) -> Dict[str, Any]:
    """Runs `step` on each batch; the peak over the second."""
    losses = [float(step(batches[0]))]
    resident = lambda: list(model.parameters()) + list(model.buffers()) + held() + [batches[1]]  # noqa: E731
    out = {}

    def second():
        out["loss"] = float(step(batches[1]))
    peak = allocator_peak(second, resident())
    losses.append(out["loss"])
    losses += [float(step(b)) for b in batches[2:]]
    return {"peak_bytes": peak, "losses": losses}


def _flops(graph) -> int:
    return sum(int(op.get("flops", 0)) for op in graph["ops"])


def flops_of(graph, ops) -> int:
    """The FLOPs `graph` records for the ops named in `ops` (a fit's
    ``recomputed_ops``): matrix products and attention, as :func:`_flops`
    counts a checkpointing side's, so both sides' added FLOPs are in one
    unit. (The fit's own ``added_flops`` also prices the elementwise ops it
    runs again, at a few FLOPs an element; that share is kept as
    ``cost_model_added_share``.)"""
    names = set(ops)  # (a fitted graph keeps the ops it copies, under their names)
    return sum(int(op.get("flops", 0)) for op in graph["ops"] if op["id"] in names)


def measure(make, batch: int, seq: int, vocab: int, time_limit: float = 5.0, compile: bool = False,
            lm=_lm) -> Dict[str, Any]:
    """Every side on one model at `batch` × `seq` tokens: peaks, losses,
    FLOPs (see the module's doc). With `compile`, also ``torch.compile``
    with Inductor's defaults (:func:`benchmarks.bench.compiled`)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(3)]
    rows: Dict[str, Dict[str, Any]] = {}
    if compile:
        from .bench import compiled

        peak, estimate, seconds = compiled(make(), batches[1], lm)
        rows["eager-compile"] = {"peak_bytes": peak, "inductor_estimate_bytes": estimate,
                                 "compile_seconds": seconds}
    counted: Dict[str, tuple] = {}
    for side in EAGER_SIDES:
        model = configured(make, side)
        step, held = _eager_step(model, side, lm)
        rows[side] = _measure(model, step, held, batches)
        ac = checkpointing_of(side)
        if ac is not None:  # its recomputation, counted on its captured graph (once per checkpointing)
            if ac not in counted:
                m2 = configured(make, ac)
                graph = capture(m2, _adamw(m2.parameters()), batches[0], lm, plan=False).graph
                counted[ac] = (_flops(graph), len(graph["ops"]))
            rows[side]["flops"], rows[side]["ops"] = counted[ac]
        model = step = None
    plain = make()
    graph = capture(plain, _adamw(plain.parameters()), batches[0], lm, plan=False).graph
    plain_flops, plain_ops = _flops(graph), len(graph["ops"])
    for side in CHECKPOINTING:
        rows[side]["added_flops_share"] = rows[side]["flops"] / plain_flops - 1
        rows[side]["added_ops"] = rows[side]["ops"] - plain_ops
    targets = [("memplan", None), ("memplan-fit-0.1%", "0.1%")] + [(f"memplan-fit@{s}", s) for s in CHECKPOINTING]
    for side, fit in targets:
        model = make()
        opt = _adamw(model.parameters())
        s = capture(model, opt, batches[0], lm, time_limit=time_limit)
        row: Dict[str, Any] = {}
        try:
            f = None
            if fit == "0.1%":
                f = s.fit(max_added=0.001, minimise="flops", time_limit=time_limit)
            elif fit is not None:
                # The plan counts what the allocator's peak counts, so the
                # checkpointing side's measured peak is the budget.
                f = s.fit(rows[fit]["peak_bytes"], minimise="flops", time_limit=time_limit)
            if f is not None:
                ops = f["recomputed_ops"]
                row["added_flops_share"] = flops_of(s.graph, ops) / plain_flops
                row["cost_model_added_share"] = f["added_flops"] / f["step_flops"]
                row["added_ops"] = len(ops)
        except memplan.MemplanError as e:  # nothing fits: the row says so
            row["error"] = str(e)
        row["max_live_bytes"] = s.plan["stats"]["max_live_bytes"]
        row["lower_bound_bytes"] = s.plan["stats"]["lower_bound_bytes"]
        consts = lambda s=s: list(s._bound.values())  # noqa: E731 - the step's constants, held between steps
        row.update(_measure(model, lambda b, s=s: s(b).detach(),
                            lambda opt=opt, consts=consts: [v for st in opt.state.values() for v in st.values()]
                            + consts(), batches))
        rows[side] = row
        model = opt = s = None
    # Every side computes the same step: its losses against eager's.
    for row in rows.values():
        if "losses" in row:  # (the compiled side is measured on one batch, its losses not kept)
            row["loss_difference"] = max(abs(a - b) for a, b in zip(row["losses"], rows["eager"]["losses"]))
    best = min((k for k in rows if k.startswith("eager")), key=lambda k: rows[k]["peak_bytes"])
    best_no_recompute = min(("eager", f"eager-{IN_BACKWARD}"), key=lambda k: rows[k]["peak_bytes"])
    return {"rows": rows, "best_eager": best, "best_eager_without_recomputation": best_no_recompute,
            "step_flops": plain_flops}


def largest_batches(make, seq: int, vocab: int, cap: int, upto: int = 64, time_limit: float = 5.0,
                    lm=_lm) -> Dict[str, Any]:
    """The largest batch (≤ `upto`) whose step fits `cap` bytes: each eager
    side's by its measured peak, memplan's by its plan and its fit."""
    out: Dict[str, Any] = {"cap_bytes": cap}
    g = torch.Generator().manual_seed(0)
    for side in EAGER_SIDES:
        best = 0
        b = 1
        while b <= upto:
            batches = [torch.randint(0, vocab, (b, seq), generator=g) for _ in range(2)]
            model = configured(make, side)
            step, held = _eager_step(model, side, lm)
            if _measure(model, step, held, batches)["peak_bytes"] > cap:
                break
            best, b = b, b + 1
        out[side] = best
    model = make()
    r = max_batch(model, _adamw(model.parameters()),
                  lambda b: torch.randint(0, vocab, (b, seq), generator=g), lm, cap, probe_time=time_limit)
    out["memplan"], out["memplan-fit-0.1%"] = r["planned"], r["fitted"]
    return out


def report(name: str, r: Dict[str, Any]) -> str:
    rows, mib = r["rows"], 2 ** 20
    best = rows[r["best_eager"]]["peak_bytes"]
    lines = [f"{name}: per-step peak (allocator's events, CPU), against the best eager configuration "
             f"({r['best_eager']})",
             f"{'side':52} {'peak':>10} {'vs best':>9} {'added FLOPs':>12} {'ops run again':>14}"]
    for side, row in rows.items():
        added = row.get("added_flops_share")
        lines.append(f"{side:52} {row['peak_bytes'] / mib:9.2f}M {100 * (row['peak_bytes'] / best - 1):+8.1f}% "
                     f"{'' if added is None else f'{100 * added:.3f}%':>12} {row.get('added_ops', ''):>14}"
                     + (f"  ({row['error']})" if "error" in row else ""))
    return "\n".join(lines)
