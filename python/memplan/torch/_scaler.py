"""Loss scaling for float16 training (``torch.amp.GradScaler``), recorded.

Eager PyTorch's float16 recipe multiplies the loss by a scale before the
backward pass, so small gradients do not underflow, then divides every
gradient by it (``scaler.unscale_``), checking for infinities and NaNs. If
any gradient overflowed, ``scaler.step(optimizer)`` skips the update, and
``scaler.update()`` halves the scale; after enough clean steps it doubles.

The captured step records the same ops on the scaler's own tensors (its
scale and growth tracker are step inputs, updated in place): the scaled
loss, one ``_amp_foreach_non_finite_check_and_unscale_`` per gradient (the
same kernel eager calls on lists of gradients, so the same bits), and
``_amp_update_scale_``. The skip is the one data-dependent branch of such a
step, taken per optimizer (each has its own flag, over its own
gradients). Every update op takes its optimizer's flag as an input in the
graph, so memplan orders all of them after the last check of that
optimizer's gradients (a gradient cannot die before every other one is
known finite: eager's memory, here too); the runner reads each flag once,
at its optimizer's first update, and when it is set it skips that
optimizer's update ops and leaves its step counters as they were, as eager
does.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

import torch

from ._errors import UnsupportedStep
from ._record import Recorder


class Scaling(NamedTuple):
    """What a step captured with a gradient scaler keeps of it: the
    scaler, its settings at capture (:func:`settings`), each optimizer's
    overflow flag's graph tensor and the ids of the ops that flag gates
    (:func:`gate`)."""

    scaler: Any
    settings: Tuple[float, float, int]
    flags: List[int]
    gated: List[frozenset]


def active(scaler) -> bool:
    """Whether `scaler` scales at all (``GradScaler(enabled=False)`` is the
    identity, and so is no scaler)."""
    if scaler is None:
        return False
    if not isinstance(scaler, torch.amp.GradScaler):
        raise UnsupportedStep(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    return scaler.is_enabled()


def prepare(scaler, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scaler's scale and growth tracker, made as its first
    ``scale()`` makes them if no step ran yet."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    return scaler._scale, scaler._growth_tracker


def settings(scaler) -> Tuple[float, float, int]:
    """What ``scaler.update()`` reads besides its tensors: fixed at capture."""
    return (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())


def unscale(grads: List[Tuple[str, torch.Tensor]], scale: torch.Tensor) -> torch.Tensor:
    """Records ``scaler.unscale_``: the inverse scale (in float64, as eager
    takes it), a zero overflow flag, and each gradient divided in place and
    checked. Returns the flag."""
    inv_scale = scale.double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
    for name, g in grads:
        if g.dtype == torch.float16:
            raise UnsupportedStep(
                f"the gradient of {name} is float16: GradScaler refuses to unscale float16 gradients "
                "(\"Attempting to unscale FP16 gradients\"); keep the parameters in float32 and run the "
                "forward under torch.autocast"
            )
        torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)
    return found_inf


def gate(rec: Recorder, spans: List[Tuple[int, int]], flags: List[torch.Tensor]) -> Tuple[List[int], List[frozenset]]:
    """Makes the ops of each optimizer's updates (``rec.ops[a:b]`` for its
    span) read that optimizer's overflow flag in the graph, so every plan
    runs them after the flag's last check; returns the flags' graph
    tensors and, per optimizer, the ids of the ops its flag gates."""
    indices, gated = [], []
    for (a, b), found_inf in zip(spans, flags):
        i = rec.table.index_of(found_inf)
        flag = rec.table.tensors[i]["id"]
        for op in rec.ops[a:b]:
            inputs = op.setdefault("inputs", [])
            if flag not in inputs and flag not in op.get("updates", []):
                inputs.append(flag)
        indices.append(i)
        gated.append(frozenset(op["id"] for op in rec.ops[a:b]))
    return indices, gated


def update_scale(scale: torch.Tensor, growth: torch.Tensor, flags: List[torch.Tensor],
                 fixed: Tuple[float, float, int]) -> None:
    """Records ``scaler.update()``: the optimizers' flags summed into the
    first (in place, as eager does, after its updates read it), then the
    scale and growth tracker updated."""
    combined = flags[0]
    for f in flags[1:]:
        combined += f
    torch._amp_update_scale_(scale, growth, combined, *fixed)


class Snapshot:
    """What a skipped update puts back: the step counters of its
    optimizer's updated parameters go back by one (exact: they hold whole
    numbers), and NAdam's momentum products, which no division undoes to
    the bit, are copied before the step (only when a NAdam is there, so
    the usual step copies nothing)."""

    def __init__(self, opt, updated) -> None:
        self.opt, self.updated = opt, updated
        self.products: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if "nadam" in opt.kinds:
            for p in updated:
                t = (opt.state.get(p) or {}).get("mu_product")
                if isinstance(t, torch.Tensor):
                    self.products.append((t, t.clone()))

    def restore(self) -> None:
        counters = [st["step"] for st in ((self.opt.state.get(p) or {}) for p in self.updated)
                    if isinstance(st.get("step"), torch.Tensor)]
        with torch.no_grad():
            if counters:
                torch._foreach_sub_(counters, 1.0)
            for t, was in self.products:
                t.copy_(was)


def check_unchanged(scaler, fixed: Tuple[float, float, int]) -> None:
    if settings(scaler) != fixed:
        raise UnsupportedStep(
            f"the gradient scaler's growth factor, backoff factor or growth interval changed after capture "
            f"(captured {fixed}, now {settings(scaler)}); capture the step again"
        )


__all__ = ["Scaling", "active", "prepare", "settings", "unscale", "gate", "update_scale", "Snapshot", "check_unchanged"]
