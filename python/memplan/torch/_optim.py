"""The optimizer update, one parameter at a time, as ops memplan can move.

PyTorch's ``optimizer.step()`` updates every parameter after the whole
backward pass, and on CUDA in ``_foreach_*`` ops that take all parameters at
once, so no gradient can die before the last one is made. The captured step
instead runs each parameter's update as its own ops (the arithmetic of
PyTorch's single-tensor ``Adam``/``AdamW``/``SGD``/``Muon``, op for op, so
the result is the same bits), and memplan places each update right after the
parameter's gradient is complete.

Hyperparameters change between steps (learning-rate schedules, Adam's bias
correction, which depends on the step count). They are Python numbers in
PyTorch's update, and a recorded program would keep the numbers of the step
it was recorded on. So the update is recorded with **markers**: distinct
odd float values standing for "this group's ``neg_step_size``", etc. The
recorder keeps them in the calls' arguments; before each step,
:meth:`Hyper.values` computes every marker's value from the optimizer's
current ``param_groups`` and state exactly as PyTorch would, and the runner
substitutes them. Tensors are fake while recording, so the markers never
reach a kernel.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ._record import UnsupportedStep

# Names of the per-group numbers each optimizer's update reads.
ADAM_NUMBERS = ("decay", "wd", "one_minus_beta1", "beta2", "one_minus_beta2", "bc2_sqrt", "eps",
                "neg_step_size")
SGD_NUMBERS = ("wd", "momentum", "one_minus_dampening", "neg_lr")
MUON_NUMBERS = ("decay", "momentum", "one_minus_momentum")  # and "neg_lr*<ratio>" per shape ratio
NAMES = {"adam": ADAM_NUMBERS, "adamw": ADAM_NUMBERS, "sgd": SGD_NUMBERS, "muon": MUON_NUMBERS}


class Optimizers:
    """One optimizer, or several over disjoint parameters, seen as one:
    their param groups in order (`param_groups`, each with its `kinds`
    entry) and each parameter's state in the optimizer that owns it
    (`state`). Several are how Muon is used: Muon for the hidden layers'
    matrices, AdamW for embeddings, norms and biases."""

    def __init__(self, optimizer) -> None:
        self.members = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self.param_groups: List[Dict[str, Any]] = []
        self.kinds: List[str] = []
        self._owner: Dict[int, torch.optim.Optimizer] = {}
        for o in self.members:
            kind = _kind(o)
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) in self._owner:
                        raise UnsupportedStep(f"a parameter of shape {tuple(p.shape)} is in two param groups")
                    self._owner[id(p)] = o
                self.param_groups.append(group)
                self.kinds.append(kind)
        self.state = _State(self._owner)

    @property
    def name(self) -> str:
        return "+".join(type(o).__name__ for o in self.members)


class _State:
    """`Optimizers.state`: a parameter's state in its own optimizer (empty,
    and not stored, for a parameter none of them owns)."""

    def __init__(self, owner: Dict[int, torch.optim.Optimizer]) -> None:
        self._owner = owner

    def __getitem__(self, p) -> Dict[str, Any]:
        o = self._owner.get(id(p))
        return o.state[p] if o is not None else {}

    def get(self, p, default=None):
        o = self._owner.get(id(p))
        return o.state.get(p, default) if o is not None else default


def _marker(group: int, k: int) -> float:
    # Far from any number an update uses, distinct per (group, name).
    return -(1.0 + (group * 64 + k) / 4096.0) * 2.0 ** -1000


class Hyper:
    """The optimizer's numbers as markers while recording, as values when
    running."""

    def __init__(self, optimizer: "Optimizers") -> None:
        self.optimizer = optimizer
        self.kinds = optimizer.kinds
        # Per group, the learning-rate ratios Muon applies by shape (its
        # parameters are fixed at capture).
        self.ratios = [_muon_ratios(g) if k == "muon" else [] for g, k in zip(optimizer.param_groups, self.kinds)]
        self.markers: List[Dict[str, float]] = []
        for g, (group, kind) in enumerate(zip(optimizer.param_groups, self.kinds)):
            names = list(NAMES[kind]) + [f"neg_lr*{r!r}" for r in self.ratios[g]]
            if len(names) > 64:
                raise UnsupportedStep(f"param group {g}: more than {64 - len(NAMES[kind])} parameter shapes")
            self.markers.append({n: _marker(g, k) for k, n in enumerate(names)})
        # What the recorded structure assumed (weight decay on or off...).
        self.shape = [self._structure(g, k) for g, k in zip(optimizer.param_groups, self.kinds)]

    @staticmethod
    def _structure(group: Dict[str, Any], kind: str) -> Tuple:
        if kind in ("adam", "adamw"):
            return (group["weight_decay"] != 0,)
        if kind == "muon":
            return (bool(group["nesterov"]), tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"],
                    group["adjust_lr_fn"])
        return (group["weight_decay"] != 0, group["momentum"] != 0, bool(group["nesterov"]))

    def values(self, steps: Dict[int, float]) -> Dict[float, float]:
        """marker -> value for this step; `steps[g]` is group g's step count
        after its increment."""
        out: Dict[float, float] = {}
        for g, group in enumerate(self.optimizer.param_groups):
            if self._structure(group, self.kinds[g]) != self.shape[g]:
                raise UnsupportedStep(
                    f"param group {g}: weight decay, momentum or nesterov was switched on or off "
                    "(or Muon's iteration settings changed) after capture; capture the step again"
                )
            vals = self._group_values(group, self.kinds[g], steps.get(g, 1.0), self.ratios[g])
            for n, v in vals.items():
                out[self.markers[g][n]] = v
        return out

    @staticmethod
    def _group_values(group: Dict[str, Any], kind: str, step: float, ratios: List[float]) -> Dict[str, float]:
        lr = float(group["lr"])
        if kind == "muon":
            # As torch.optim.Muon: `lr * ratio` for each shape, then negated.
            vals = {"decay": 1 - lr * group["weight_decay"], "momentum": group["momentum"],
                    "one_minus_momentum": 1 - group["momentum"]}
            for r in ratios:
                vals[f"neg_lr*{r!r}"] = -(lr * r)
            return vals
        if kind in ("adam", "adamw"):
            beta1, beta2 = (float(b) for b in group["betas"])
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            return {
                "decay": 1 - lr * group["weight_decay"],
                "wd": group["weight_decay"],
                "one_minus_beta1": 1 - beta1,
                "beta2": beta2,
                "one_minus_beta2": 1 - beta2,
                "bc2_sqrt": bias_correction2**0.5,
                "eps": group["eps"],
                "neg_step_size": -step_size,
            }
        return {
            "wd": group["weight_decay"],
            "momentum": group["momentum"],
            "one_minus_dampening": 1 - group["dampening"],
            "neg_lr": -lr,
        }


def _kind(opt: torch.optim.Optimizer) -> str:
    name = type(opt).__name__
    kinds = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Muon": "muon"}
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, getattr(torch.optim, "Muon", None)):
        raise UnsupportedStep(
            f"optimizer {name}: memplan.torch captures torch.optim.AdamW, Adam, SGD and Muon"
        )
    for g, group in enumerate(opt.param_groups):
        # `fused` and `foreach` choose PyTorch's kernels, not the update:
        # the captured step runs the single-tensor arithmetic either way
        # (equal to the fused kernels to rounding: python/README.md).
        for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group.get(flag):
                raise UnsupportedStep(f"optimizer {name}, param group {g}: {flag}=True is not supported")
        for k in ("lr", "weight_decay", "momentum", "dampening", "eps"):
            if isinstance(group.get(k), torch.Tensor):
                raise UnsupportedStep(f"optimizer {name}, param group {g}: a tensor {k} is not supported")
    kind = kinds[name]
    if kind == "adam" and type(opt) is torch.optim.Adam:
        if any(g.get("decoupled_weight_decay") for g in opt.param_groups):
            kind = "adamw"
    return kind


def ensure_state(opt: Optimizers) -> None:
    """Makes the optimizer state PyTorch makes on the first step (zeros), so
    the captured step reads it as a step input."""
    for group, kind in zip(opt.param_groups, opt.kinds):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            st = opt.state[p]
            if kind == "muon":
                if st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif kind in ("adam", "adamw"):
                if not st:
                    # Where PyTorch keeps it: with the parameter for the
                    # fused kernels, on the host otherwise.
                    where = p.device if group.get("fused") else "cpu"
                    st["step"] = torch.tensor(0.0, dtype=torch.float32, device=where)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif group["momentum"] != 0 and st.get("momentum_buffer") is None:
                if group["dampening"] != 0:
                    raise UnsupportedStep(
                        "SGD with dampening makes its momentum buffer on the first step as a copy of "
                        "the gradient; run one eager step before capturing"
                    )
                # buf * momentum + grad * (1 - 0) equals the first step's copy.
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The device tensors of `p`'s state the update reads and writes."""
    st = opt.state[p]
    keys = ("exp_avg", "exp_avg_sq") if "exp_avg" in st else ("momentum_buffer",)
    return {k: st[k] for k in keys if isinstance(st.get(k), torch.Tensor)}


def update(kind: str, group: Dict[str, Any], m: Dict[str, float], p, g, st) -> None:
    """One parameter's update, PyTorch's single-tensor arithmetic with the
    group's numbers as markers `m` (p, g and the state are fake tensors)."""
    if kind in ("adam", "adamw"):
        if group["weight_decay"] != 0:
            if kind == "adamw":
                p.mul_(m["decay"])
            else:
                g = g.add(p, alpha=m["wd"])
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        exp_avg.lerp_(g, m["one_minus_beta1"])
        exp_avg_sq.mul_(m["beta2"]).addcmul_(g, g, value=m["one_minus_beta2"])
        denom = (exp_avg_sq.sqrt() / m["bc2_sqrt"]).add_(m["eps"])
        p.addcdiv_(exp_avg, denom, value=m["neg_step_size"])
        return
    if kind == "muon":
        _muon_update(group, m, p, g, st)
        return
    if group["weight_decay"] != 0:
        g = g.add(p, alpha=m["wd"])
    if group["momentum"] != 0:
        buf = st["momentum_buffer"]
        buf.mul_(m["momentum"]).add_(g, alpha=m["one_minus_dampening"])
        g = g.add(buf, alpha=m["momentum"]) if group["nesterov"] else buf
    p.add_(g, alpha=m["neg_lr"])


def _muon_ratios(group: Dict[str, Any]) -> List[float]:
    """The learning-rate ratios torch.optim.Muon applies to the group's
    parameters (one per distinct shape)."""
    from torch.optim._muon import _adjust_lr

    return sorted({_adjust_lr(1.0, group["adjust_lr_fn"], p.shape) for p in group["params"]})


def _muon_update(group: Dict[str, Any], m: Dict[str, float], p, g, st) -> None:
    """torch.optim.Muon's single-tensor update: momentum (Nesterov's by
    default), the Newton-Schulz orthogonalisation (PyTorch's own function,
    recorded op for op), decoupled weight decay, the shape-scaled step."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    buf = st["momentum_buffer"]
    buf.lerp_(g, m["one_minus_momentum"])
    u = g.lerp(buf, m["momentum"]) if group["nesterov"] else buf
    u = _zeropower_via_newtonschulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
    p.mul_(m["decay"])
    p.add_(u, alpha=m[f"neg_lr*{_adjust_lr(1.0, group['adjust_lr_fn'], p.shape)!r}"])


def advance_steps(opt: Optimizers, updated) -> Dict[int, float]:
    """Increments the step counter of every updated parameter as
    ``optimizer.step()`` does and returns each group's step count (what its
    bias correction uses; the parameters of a group must agree). Counters
    on the device (fused optimizers) are read once per group, not once per
    parameter."""
    ids = {id(p) for p in updated}
    steps: Dict[int, float] = {}
    for gi, group in enumerate(opt.param_groups):
        counters = []
        for p in group["params"]:
            st = opt.state.get(p)
            if id(p) in ids and st and isinstance(st.get("step"), torch.Tensor):
                counters.append(st["step"])
        if not counters:
            continue
        torch._foreach_add_(counters, 1.0)  # one launch, not one per parameter, for fused optimizers
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for c in counters:
            by_device.setdefault(c.device, []).append(c)
        values = set()
        for cs in by_device.values():
            values.update(torch.stack(torch.stack(cs).aminmax()).tolist())  # one read per device
        seen = sorted(values)
        if len(seen) != 1:
            raise UnsupportedStep(
                f"param group {gi}: its parameters have taken different numbers of steps "
                f"({seen[0]:g} and {seen[-1]:g}); memplan's update uses one count per group"
            )
        steps[gi] = seen[0]
    return steps
