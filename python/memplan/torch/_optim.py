"""The optimizer update, one parameter at a time, as ops memplan can move.

PyTorch's ``optimizer.step()`` updates every parameter after the whole
backward pass, and on CUDA in ``_foreach_*`` ops that take all parameters at
once, so no gradient can die before the last one is made. The captured step
instead runs each parameter's update as its own ops (the arithmetic of
PyTorch's single-tensor implementation of each optimizer, op for op, so the
result is the same bits), and memplan places each update right after the
parameter's gradient is complete.

Each optimizer PyTorch ships that memplan captures is a :class:`Kind`: the
per-group numbers its update reads, the settings that change which ops it
runs (its *structure*), the state it keeps per parameter, and the update
itself. Hyperparameters change between steps (learning-rate schedules,
Adam's bias correction, which depends on the step count). They are Python
numbers in PyTorch's update, and a recorded program would keep the numbers
of the step it was recorded on. So the update is recorded with **markers**:
distinct odd float values standing for "this group's ``neg_step_size``",
etc. The recorder keeps them in the calls' arguments; before each step,
:meth:`Hyper.values` computes every marker's value from the optimizer's
current ``param_groups`` and step count exactly as PyTorch would, and the
runner substitutes them. Tensors are fake while recording, so the markers
never reach a kernel.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ._errors import UnsupportedStep


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _host_step() -> torch.Tensor:
    """A step counter where PyTorch keeps it when neither fused nor
    capturable: a 0-d tensor on the host."""
    from torch.optim.optimizer import _get_scalar_dtype

    return torch.tensor(0.0, dtype=_get_scalar_dtype())


class Kind:
    """One optimizer's update, as PyTorch's single-tensor implementation
    writes it. `numbers` are the per-group values the update reads (as
    markers while recording); `flags` the boolean settings it honours."""

    numbers: Tuple[str, ...] = ()
    flags: Tuple[str, ...] = ("maximize",)

    def structure(self, group: Dict[str, Any]) -> Tuple:
        """The settings that choose which ops the update runs: a change
        after capture needs a new capture."""
        return (tuple(bool(group.get(f)) for f in self.flags) + (group.get("weight_decay", 0) != 0,)
                + (isinstance(group.get("lr"), torch.Tensor),))

    def values(self, group: Dict[str, Any], counts: Dict[str, float]) -> Dict[str, float]:
        """The numbers' values for a step; `counts["step"]` is the group's
        step count after its increment (absent for optimizers that keep
        none)."""
        raise NotImplementedError

    def advance(self, group: Dict[str, Any], states: List[Dict[str, Any]], step: float) -> Dict[str, float]:
        """Updates the host-side state PyTorch updates with the step count
        (beside the counter itself) of the group's updated parameters;
        returns what `values` reads of it."""
        return {}

    def state_keys(self, group: Dict[str, Any]) -> Tuple[str, ...]:
        """The device tensors of a parameter's state the update reads and
        writes."""
        raise NotImplementedError

    def init_state(self, group: Dict[str, Any], p: torch.Tensor, st: Dict[str, Any]) -> None:
        """Makes the state PyTorch makes on the first step, so the captured
        step reads it as a step input: by default a step counter on the
        host and zeros for each of :meth:`state_keys`."""
        if st:
            return
        st["step"] = _host_step()
        for k in self.state_keys(group):
            st[k] = _zeros(p)

    def update(self, group: Dict[str, Any], m: Dict[str, float], p, g, st) -> None:
        """One parameter's update with the group's numbers as markers `m`
        (p, g and the state are fake tensors)."""
        raise NotImplementedError

    @staticmethod
    def grad(group: Dict[str, Any], m: Dict[str, float], p, g, coupled: bool = True):
        """The gradient as the update reads it: negated for `maximize`,
        plus L2 weight decay where the decay is coupled."""
        if group.get("maximize"):
            g = -g
        if coupled and group.get("weight_decay", 0) != 0:
            g = g.add(p, alpha=m["wd"])
        return g


def _as_real(p, g, st):
    """A complex parameter, its gradient and its state as PyTorch's
    single-tensor updates take them from some point on: as real pairs
    (``torch.view_as_real``, views over the same bytes). Each kind calls
    this where PyTorch does, since weight decay before it is complex
    arithmetic."""
    if not p.is_complex():
        return p, g, st
    return torch.view_as_real(p), torch.view_as_real(g), {
        k: torch.view_as_real(v) if isinstance(v, torch.Tensor) and v.is_complex() else v for k, v in st.items()}


def _refuse_complex(name: str, p) -> None:
    if p.is_complex():
        raise UnsupportedStep(f"{name} does not take complex parameters (PyTorch's {name} refuses them too)")


def _moments(group: Dict[str, Any], m: Dict[str, float], p, g, st, decoupled: bool):
    """What the Adam family's updates begin with, in PyTorch's order: the
    gradient as read (negated, L2 decay where `decoupled` is off), the
    parameter's decoupled decay, a complex parameter seen as real pairs
    from here on, both moments updated. Returns parameter, gradient and
    state as the rest of the update reads them."""
    g = Kind.grad(group, m, p, g, coupled=not decoupled)
    if decoupled and group["weight_decay"] != 0:
        # A tensor learning rate (capturable Adam) is a step input: the
        # factor is computed from it on the device, as PyTorch does.
        lr = m.get("lr")
        p.mul_(1 - lr * m["wd"] if isinstance(lr, torch.Tensor) else m["decay"])
    p, g, st = _as_real(p, g, st)
    st["exp_avg"].lerp_(g, m["one_minus_beta1"])
    st["exp_avg_sq"].mul_(m["beta2"]).addcmul_(g, g, value=m["one_minus_beta2"])
    return p, g, st


class Adam(Kind):
    """Adam and AdamW (`decoupled` weight decay), `amsgrad` included."""

    numbers = ("decay", "wd", "one_minus_beta1", "beta2", "one_minus_beta2", "bc2_sqrt", "eps", "neg_step_size",
               "lr", "beta1")
    flags = ("maximize", "amsgrad", "capturable")

    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled

    def values(self, group, counts):
        # With `capturable` the update computes the bias corrections from
        # its step counter on the device (see update), so no number it
        # reads changes from step to step.
        step = 1.0 if group.get("capturable") else counts.get("step", 1.0)
        # A tensor learning rate is read by the update on the device, never
        # here (no host read per step); its markers' values go unused.
        lr = 1.0 if isinstance(group["lr"], torch.Tensor) else float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        return {
            "lr": lr,
            "beta1": beta1,
            "decay": 1 - lr * group["weight_decay"],
            "wd": group["weight_decay"],
            "one_minus_beta1": 1 - beta1,
            "beta2": beta2,
            "one_minus_beta2": 1 - beta2,
            "bc2_sqrt": (1 - beta2**step) ** 0.5,
            "eps": group["eps"],
            "neg_step_size": -(lr / (1 - beta1**step)),
        }

    def state_keys(self, group):
        return (("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
                + (("step",) if group.get("capturable") else ()))

    def init_state(self, group, p, st):
        if st:
            return
        # Where PyTorch keeps it: with the parameter for the fused and the
        # capturable kernels, on the host otherwise.
        on_device = group.get("fused") or group.get("capturable")
        st["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if on_device else "cpu")
        st["exp_avg"], st["exp_avg_sq"] = _zeros(p), _zeros(p)
        if group.get("amsgrad"):
            st["max_exp_avg_sq"] = _zeros(p)

    def update(self, group, m, p, g, st):
        p, g, st = _moments(group, m, p, g, st, self.decoupled)
        if group.get("capturable"):
            self.capturable_tail(group, m, p, st)
            return
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        if group.get("amsgrad"):
            torch.maximum(st["max_exp_avg_sq"], exp_avg_sq, out=st["max_exp_avg_sq"])
            exp_avg_sq = st["max_exp_avg_sq"]
        denom = (exp_avg_sq.sqrt() / m["bc2_sqrt"]).add_(m["eps"])
        p.addcdiv_(exp_avg, denom, value=m["neg_step_size"])

    @staticmethod
    def capturable_tail(group, m, p, st):
        """The step with ``capturable=True``, as PyTorch's single-tensor
        Adam writes it: the bias corrections are computed on the device
        from the parameter's step counter (a state tensor the step reads),
        so the update's numbers are the same every step and a CUDA graph
        of the step stays valid (``step(batch, graph=True)``)."""
        step = st["step"]
        bias_correction1 = 1 - m["beta1"] ** step
        bias_correction2 = 1 - m["beta2"] ** step
        step_size_neg = (m["lr"] / bias_correction1).neg()
        bias_correction2_sqrt = bias_correction2.sqrt()
        exp_avg_sq = st["exp_avg_sq"]
        if group.get("amsgrad"):
            st["max_exp_avg_sq"].copy_(torch.maximum(st["max_exp_avg_sq"], exp_avg_sq))
            exp_avg_sq = st["max_exp_avg_sq"]
        denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(m["eps"] / step_size_neg)
        p.addcdiv_(st["exp_avg"], denom)


class SGD(Kind):
    """SGD with momentum, dampening, Nesterov and weight decay."""

    numbers = ("wd", "momentum", "one_minus_dampening", "neg_lr")
    flags = ("maximize", "nesterov")

    def structure(self, group):
        return super().structure(group) + (group["momentum"] != 0,)

    def values(self, group, counts):
        return {"wd": group["weight_decay"], "momentum": group["momentum"],
                "one_minus_dampening": 1 - group["dampening"], "neg_lr": -float(group["lr"])}

    def state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def init_state(self, group, p, st):
        if group["momentum"] == 0 or st.get("momentum_buffer") is not None:
            return
        if group["dampening"] != 0:
            raise UnsupportedStep(
                "SGD with dampening makes its momentum buffer on the first step as a copy of "
                "the gradient; run one eager step before capturing"
            )
        # buf * momentum + grad * (1 - 0) equals the first step's copy.
        st["momentum_buffer"] = _zeros(p)

    def update(self, group, m, p, g, st):
        g = self.grad(group, m, p, g)
        if group["momentum"] != 0:
            buf = st["momentum_buffer"]
            buf.mul_(m["momentum"]).add_(g, alpha=m["one_minus_dampening"])
            g = g.add(buf, alpha=m["momentum"]) if group["nesterov"] else buf
        p.add_(g, alpha=m["neg_lr"])


class RMSprop(Kind):
    """RMSprop, `centered` and with momentum included."""

    numbers = ("wd", "alpha", "one_minus_alpha", "eps", "momentum", "neg_lr")
    flags = ("maximize", "centered")

    def structure(self, group):
        return super().structure(group) + (group["momentum"] > 0,)

    def values(self, group, counts):
        return {"wd": group["weight_decay"], "alpha": group["alpha"], "one_minus_alpha": 1 - group["alpha"],
                "eps": group["eps"], "momentum": group["momentum"], "neg_lr": -float(group["lr"])}

    def state_keys(self, group):
        return (("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ())
                + (("grad_avg",) if group["centered"] else ()))

    def update(self, group, m, p, g, st):
        g = self.grad(group, m, p, g)
        p, g, st = _as_real(p, g, st)
        square_avg = st["square_avg"]
        square_avg.mul_(m["alpha"]).addcmul_(g, g, value=m["one_minus_alpha"])
        if group["centered"]:
            grad_avg = st["grad_avg"]
            grad_avg.lerp_(g, m["one_minus_alpha"])
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(m["eps"])
        if group["momentum"] > 0:
            buf = st["momentum_buffer"]
            buf.mul_(m["momentum"]).addcdiv_(g, avg)
            p.add_(buf, alpha=m["neg_lr"])
        else:
            p.addcdiv_(g, avg, value=m["neg_lr"])


class Adagrad(Kind):
    """Adagrad with learning-rate decay and an initial accumulator."""

    numbers = ("wd", "eps", "neg_clr")

    def values(self, group, counts):
        step = counts.get("step", 1.0)
        return {"wd": group["weight_decay"], "eps": group["eps"],
                "neg_clr": -(float(group["lr"]) / (1 + (step - 1) * group["lr_decay"]))}

    def state_keys(self, group):
        return ("sum",)

    def init_state(self, group, p, st):
        # Adagrad makes its state in its constructor; this only restores a
        # cleared one.
        if st:
            return
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if group.get("fused") else _host_step()
        st["sum"] = torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.preserve_format)

    def update(self, group, m, p, g, st):
        g = self.grad(group, m, p, g)
        p, g, st = _as_real(p, g, st)
        st["sum"].addcmul_(g, g, value=1)
        std = st["sum"].sqrt().add_(m["eps"])
        p.addcdiv_(g, std, value=m["neg_clr"])


class Adamax(Kind):
    """Adamax: Adam with the infinity norm."""

    numbers = ("wd", "one_minus_beta1", "beta2", "eps", "neg_clr")

    def values(self, group, counts):
        step = counts.get("step", 1.0)
        beta1, beta2 = (float(b) for b in group["betas"])
        return {"wd": group["weight_decay"], "one_minus_beta1": 1 - beta1, "beta2": beta2, "eps": group["eps"],
                "neg_clr": -(float(group["lr"]) / (1 - beta1**step))}

    def state_keys(self, group):
        return ("exp_avg", "exp_inf")

    def update(self, group, m, p, g, st):
        g = self.grad(group, m, p, g)
        p, g, st = _as_real(p, g, st)
        exp_avg, exp_inf = st["exp_avg"], st["exp_inf"]
        exp_avg.lerp_(g, m["one_minus_beta1"])
        torch.maximum(exp_inf.mul_(m["beta2"]), g.abs().add_(m["eps"]), out=exp_inf)
        p.addcdiv_(exp_avg, exp_inf, value=m["neg_clr"])


class Adadelta(Kind):
    """Adadelta."""

    numbers = ("wd", "rho", "one_minus_rho", "eps", "neg_lr")

    def values(self, group, counts):
        return {"wd": group["weight_decay"], "rho": group["rho"], "one_minus_rho": 1 - group["rho"],
                "eps": group["eps"], "neg_lr": -float(group["lr"])}

    def state_keys(self, group):
        return ("square_avg", "acc_delta")

    def update(self, group, m, p, g, st):
        g = self.grad(group, m, p, g)
        _, g, st = _as_real(p, g, st)  # the parameter itself stays complex
        square_avg, acc_delta = st["square_avg"], st["acc_delta"]
        square_avg.mul_(m["rho"]).addcmul_(g, g, value=m["one_minus_rho"])
        std = square_avg.add(m["eps"]).sqrt_()
        delta = acc_delta.add(m["eps"]).sqrt_()
        delta.div_(std).mul_(g)
        acc_delta.mul_(m["rho"]).addcmul_(delta, delta, value=m["one_minus_rho"])
        if p.is_complex():
            delta = torch.view_as_complex(delta)
        p.add_(delta, alpha=m["neg_lr"])


class NAdam(Kind):
    """NAdam: Adam with Nesterov momentum whose coefficient `mu` warms up
    with the step count. PyTorch keeps the product of the `mu`s so far per
    parameter as a host tensor; :meth:`advance` multiplies it as
    ``optimizer.step()`` does, and the update's two step sizes are
    computed from it."""

    numbers = ("decay", "wd", "one_minus_beta1", "beta2", "one_minus_beta2", "bc2", "eps", "neg_grad_step",
               "neg_avg_step")
    flags = ("maximize", "decoupled_weight_decay")

    @staticmethod
    def mus(group: Dict[str, Any], step: float) -> Tuple[float, float]:
        beta1, decay = float(group["betas"][0]), group["momentum_decay"]
        return (beta1 * (1.0 - 0.5 * (0.96 ** (step * decay))),
                beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * decay))))

    def advance(self, group, states, step):
        mu, _ = self.mus(group, step)
        products = [st["mu_product"] for st in states]
        for t in products:
            t.mul_(mu)  # as PyTorch: the host tensor's own rounding
        return {"mu_product": _one_value(products, "a different product of momentum coefficients")}

    def values(self, group, counts):
        step = counts.get("step", 1.0)
        lr, wd = float(group["lr"]), group["weight_decay"]
        beta1, beta2 = (float(b) for b in group["betas"])
        mu, mu_next = self.mus(group, step)
        vals = {"decay": 1 - lr * wd, "wd": wd, "one_minus_beta1": 1 - beta1, "beta2": beta2,
                "one_minus_beta2": 1 - beta2, "bc2": 1 - beta2**step, "eps": group["eps"],
                "neg_grad_step": 0.0, "neg_avg_step": 0.0}  # unused by a group no parameter of which updates
        product = counts.get("mu_product")
        if product is not None:
            vals["neg_grad_step"] = -lr * (1.0 - mu) / (1.0 - product)
            vals["neg_avg_step"] = (-lr * mu_next) / (1.0 - product * mu_next)
        return vals

    def state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def init_state(self, group, p, st):
        if not st:
            super().init_state(group, p, st)
            st["mu_product"] = _host_step().add_(1.0)

    def update(self, group, m, p, g, st):
        # NAdam and RAdam see a complex parameter as real pairs from the start.
        p, g, st = _moments(group, m, *_as_real(p, g, st), bool(group["decoupled_weight_decay"]))
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        denom = exp_avg_sq.div(m["bc2"]).sqrt()
        denom.add_(m["eps"])
        p.addcdiv_(g, denom, value=m["neg_grad_step"])
        p.addcdiv_(exp_avg, denom, value=m["neg_avg_step"])


class RAdam(Kind):
    """RAdam: Adam whose adaptive step is switched on (and rectified) once
    the variance estimate is trusted, after about five steps. PyTorch
    picks one of two sets of operations per step; the captured step is one
    program for every step, so it records the rectified form with the
    adaptive factor raised to a number `rectified`, 1 or 0:
    ``x.pow(1)`` is `x` and ``x.pow(0)`` is 1 exactly, and so is a product
    with 1, so both of PyTorch's forms come out to the bit (at the cost of
    one product more per parameter while unrectified)."""

    numbers = ("decay", "wd", "one_minus_beta1", "beta2", "one_minus_beta2", "bc1", "lr", "eps", "bc2_sqrt",
               "rectified", "rect")
    flags = ("maximize", "decoupled_weight_decay")

    def values(self, group, counts):
        step = counts.get("step", 1.0)
        lr, wd = float(group["lr"]), group["weight_decay"]
        beta1, beta2 = (float(b) for b in group["betas"])
        bc2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bc2
        on = rho_t > 5.0
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5 if on else 1.0
        return {"decay": 1 - lr * wd, "wd": wd, "one_minus_beta1": 1 - beta1, "beta2": beta2,
                "one_minus_beta2": 1 - beta2, "bc1": 1 - beta1**step, "lr": lr, "eps": group["eps"],
                "bc2_sqrt": bc2**0.5, "rectified": 1.0 if on else 0.0, "rect": rect}

    def state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def update(self, group, m, p, g, st):
        p, g, st = _moments(group, m, *_as_real(p, g, st), bool(group["decoupled_weight_decay"]))
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        x = exp_avg / m["bc1"] * m["lr"]
        # PyTorch's `bias_correction2**0.5 / sqrt_` is `sqrt_.reciprocal() * ...`.
        adaptive = exp_avg_sq.sqrt().add_(m["eps"]).reciprocal() * m["bc2_sqrt"]
        p.add_(x * adaptive.pow(m["rectified"]) * m["rect"], alpha=-1.0)


class Adafactor(Kind):
    """Adafactor: second moments factored into a row and a column vector
    per matrix. PyTorch's update reads two norms into Python every step
    (the parameter's, for the step size, and the update's, to cap it);
    the captured step keeps them on the device as 0-d float64 tensors
    with eager's double-precision arithmetic, so it makes no host read,
    and applies the step with ``addcmul_`` by that tensor (rounded to the
    parameter's dtype, as eager's ``add_(update, alpha=s)`` rounds `s`).
    On the CPU this equals eager's single-tensor update to the bit in
    every test (`OtherOptimizers`, a Hugging Face Llama); a kernel that
    fuses eager's multiply-add could differ from it by rounding."""

    numbers = ("decay", "one_minus_beta2_t", "rho_t", "eps2")

    def structure(self, group):
        return super().structure(group) + (group["eps"][0], group["d"])

    def values(self, group, counts):
        step = counts.get("step", 1.0)
        lr = float(group["lr"])
        return {"decay": 1 - lr * group["weight_decay"], "one_minus_beta2_t": step ** group["beta2_decay"],
                "rho_t": min(lr, 1 / (step**0.5)), "eps2": group["eps"][1]}

    def state_keys(self, group):
        return ("row_var", "col_var", "variance")

    def init_state(self, group, p, st):
        if st:
            return
        st["step"] = _host_step()
        if p.dim() > 1:
            st["row_var"] = p.new_zeros(p.shape[:-1] + (1,))
            st["col_var"] = p.new_zeros(p.shape[:-2] + (1,) + p.shape[-1:])
        else:
            st["variance"] = _zeros(p)

    def update(self, group, m, p, g, st):
        _refuse_complex("Adafactor", p)
        g = self.grad(group, m, p, g, coupled=False)
        eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
        # max(eps2, |p| / sqrt(n)) * rho_t, in double as eager's Python.
        alpha = (p.norm(2).double() / p.numel() ** 0.5).clamp_(min=m["eps2"]).mul_(m["rho_t"])
        if group["weight_decay"] != 0:
            p.mul_(m["decay"])
        if g.dim() > 1:
            row_var, col_var = st["row_var"], st["col_var"]
            row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            row_var.lerp_(row_mean, m["one_minus_beta2_t"])
            col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            col_var.lerp_(col_mean, m["one_minus_beta2_t"])
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            st["variance"].lerp_(g * g, m["one_minus_beta2_t"])
            var_estimate = st["variance"].clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(g)
        denom = (update.norm(2).double() / (update.numel() ** 0.5 * group["d"])).clamp_(min=1.0)
        p.addcmul_(update, alpha.neg_().div_(denom).to(p.dtype))


class Muon(Kind):
    """torch.optim.Muon: momentum (Nesterov's by default), the
    Newton-Schulz orthogonalisation (PyTorch's own function, recorded op
    for op), decoupled weight decay, a step scaled by the parameter's
    shape. Its learning rate per shape ratio is a number of its own
    (`neg_lr*<ratio>`, added by :class:`Hyper`)."""

    numbers = ("decay", "momentum", "one_minus_momentum")
    flags = ("nesterov",)

    def structure(self, group):
        return (bool(group["nesterov"]), tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"],
                group["adjust_lr_fn"])

    def values(self, group, counts):
        lr = float(group["lr"])
        return {"decay": 1 - lr * group["weight_decay"], "momentum": group["momentum"],
                "one_minus_momentum": 1 - group["momentum"]}

    def state_keys(self, group):
        return ("momentum_buffer",)

    def init_state(self, group, p, st):
        if st.get("momentum_buffer") is None:
            st["momentum_buffer"] = _zeros(p)

    @staticmethod
    def ratios(group: Dict[str, Any]) -> List[float]:
        """The learning-rate ratios PyTorch applies to the group's
        parameters (one per distinct shape)."""
        from torch.optim._muon import _adjust_lr

        return sorted({_adjust_lr(1.0, group["adjust_lr_fn"], p.shape) for p in group["params"]})

    def update(self, group, m, p, g, st):
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        _refuse_complex("Muon", p)
        buf = st["momentum_buffer"]
        buf.lerp_(g, m["one_minus_momentum"])
        u = g.lerp(buf, m["momentum"]) if group["nesterov"] else buf
        u = _zeropower_via_newtonschulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
        p.mul_(m["decay"])
        p.add_(u, alpha=m[f"neg_lr*{_adjust_lr(1.0, group['adjust_lr_fn'], p.shape)!r}"])


# PyTorch's optimizer classes memplan captures, by name.
KINDS: Dict[str, Kind] = {
    "adam": Adam(decoupled=False), "adamw": Adam(decoupled=True), "sgd": SGD(), "rmsprop": RMSprop(),
    "adagrad": Adagrad(), "adamax": Adamax(), "adadelta": Adadelta(), "nadam": NAdam(), "radam": RAdam(),
    "adafactor": Adafactor(), "muon": Muon(),
}
_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad",
            "Adamax": "adamax", "Adadelta": "adadelta", "NAdam": "nadam", "RAdam": "radam",
            "Adafactor": "adafactor", "Muon": "muon"}


class Optimizers:
    """One optimizer, or several over disjoint parameters, seen as one:
    their param groups in order (`param_groups`, each with its `kinds`
    entry) and each parameter's state in the optimizer that owns it
    (`state`). Several are how Muon is used: Muon for the hidden layers'
    matrices, AdamW for embeddings, norms and biases."""

    def __init__(self, optimizer) -> None:
        self.members = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self.kinds: List[str] = []
        self._owner: Dict[int, torch.optim.Optimizer] = {}
        self._group_of: Dict[int, int] = {}
        for o in self.members:
            kind = _kind(o)
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) in self._owner:
                        raise UnsupportedStep(f"a parameter of shape {tuple(p.shape)} is in two param groups")
                    self._owner[id(p)] = o
                    self._group_of[id(p)] = len(self.kinds)
                self.kinds.append(kind)
        self.state = _State(self._owner)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The members' param groups as they are now (``load_state_dict``
        gives an optimizer new group dicts, holding the same parameters)."""
        return [g for o in self.members for g in o.param_groups]

    @property
    def name(self) -> str:
        return "+".join(type(o).__name__ for o in self.members)

    def owner(self, p: torch.Tensor):
        """The optimizer that updates `p` (None if none does)."""
        return self._owner.get(id(p))

    def group_of(self, p: torch.Tensor) -> int:
        """The index of `p`'s param group (-1 for a parameter none of them
        owns)."""
        return self._group_of.get(id(p), -1)


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
        self.ratios = [Muon.ratios(g) if k == "muon" else [] for g, k in zip(optimizer.param_groups, self.kinds)]
        self.markers: List[Dict[str, float]] = []
        for g, kind in enumerate(self.kinds):
            names = list(KINDS[kind].numbers) + [f"neg_lr*{r!r}" for r in self.ratios[g]]
            if len(names) > 64:
                raise UnsupportedStep(f"param group {g}: more than {64 - len(KINDS[kind].numbers)} parameter shapes")
            self.markers.append({n: _marker(g, k) for k, n in enumerate(names)})
        # What the recorded structure assumed (weight decay on or off...).
        self.shape = [KINDS[k].structure(g) for g, k in zip(optimizer.param_groups, self.kinds)]
        self.groups = self._groups()

    def _groups(self) -> List[List[tuple]]:
        """Each optimizer's param groups, as the parameters in them."""
        return [[tuple(map(id, g["params"])) for g in o.param_groups] for o in self.optimizer.members]

    def values(self, counts: Dict[int, Dict[str, float]]) -> Dict[float, float]:
        """marker -> value for this step; `counts[g]` is what
        :func:`advance_steps` returned for group g (its step count after
        the increment...)."""
        if self._groups() != self.groups:
            raise UnsupportedStep(
                "the optimizer's param groups changed after capture (add_param_group, parameters added or "
                "removed): the captured step updates the parameters they held then; capture the step again"
            )
        out: Dict[float, float] = {}
        for g, group in enumerate(self.optimizer.param_groups):
            kind = KINDS[self.kinds[g]]
            if kind.structure(group) != self.shape[g]:
                raise UnsupportedStep(
                    f"param group {g}: a setting that chooses the update's operations (weight decay, "
                    f"momentum, {', '.join(kind.flags)}) changed after capture; capture the step again"
                )
            vals = kind.values(group, counts.get(g, {}))
            for r in self.ratios[g]:
                # As torch.optim.Muon: `lr * ratio` for each shape, then negated.
                vals[f"neg_lr*{r!r}"] = -(float(group["lr"]) * r)
            for n, v in vals.items():
                out[self.markers[g][n]] = v
        return out


def step_dependent(opt: "Optimizers") -> List[str]:
    """The param groups (as "group g (Kind)") whose update reads numbers
    that change with the step count (Adam's bias corrections unless
    ``capturable=True``, Adafactor's decay...): a CUDA graph of the step
    would keep one step's values."""
    out = []
    for g, group in enumerate(opt.param_groups):
        kind = KINDS[opt.kinds[g]]
        try:
            changes = kind.values(group, {"step": 1.0}) != kind.values(group, {"step": 2.0})
        except KeyError:  # reads host state kept with the count (NAdam's product of momenta)
            changes = True
        if changes:
            out.append(f"param group {g} ({opt.kinds[g]})")
    return out


def _kind(opt: torch.optim.Optimizer) -> str:
    name = type(opt).__name__
    if name not in _CLASSES or type(opt) is not getattr(torch.optim, name, None):
        raise UnsupportedStep(
            f"optimizer {name}: memplan.torch captures torch.optim's "
            f"{', '.join(sorted(_CLASSES, key=str.lower))}"
        )
    kind = _CLASSES[name]
    if kind == "adam" and any(g.get("decoupled_weight_decay") for g in opt.param_groups):
        kind = "adamw"
    for g, group in enumerate(opt.param_groups):
        # `fused` and `foreach` choose PyTorch's kernels, not the update:
        # the captured step runs the single-tensor arithmetic either way
        # (equal to the fused kernels to rounding: docs/step.md).
        for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group.get(flag) and flag not in KINDS[kind].flags:
                raise UnsupportedStep(f"optimizer {name}, param group {g}: {flag}=True is not supported")
        for k, v in group.items():
            if k in ("params", "initial_lr") or (k == "lr" and _device_lr(kind, group)):
                continue  # `initial_lr`: a scheduler's starting point, which no update reads
            if any(isinstance(x, torch.Tensor) for x in (v if isinstance(v, tuple) else (v,))):
                hint = " (a tensor lr is taken by Adam and AdamW with capturable=True)" if k == "lr" else ""
                raise UnsupportedStep(f"optimizer {name}, param group {g}: a tensor {k} is not supported{hint}")
    return kind


def _device_lr(kind: str, group: Dict[str, Any]) -> bool:
    """Whether the group's learning rate is a 0-d tensor that the
    update reads as a step input: Adam's and AdamW's with
    ``capturable=True``, as PyTorch's capturable update reads it, so a
    schedule changes it in place and a CUDA graph of the step stays valid."""
    lr = group.get("lr")
    return (kind in ("adam", "adamw") and bool(group.get("capturable")) and isinstance(lr, torch.Tensor)
            and lr.dim() == 0 and lr.is_floating_point())


def ensure_state(opt: Optimizers, p: torch.Tensor) -> None:
    """Makes `p`'s optimizer state as PyTorch makes it on the first step
    (zeros...), so the captured step reads it as a step input."""
    g = opt.group_of(p)
    if g >= 0 and p.requires_grad:
        KINDS[opt.kinds[g]].init_state(opt.param_groups[g], p, opt.state[p])


def state_tensors(opt: Optimizers, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The device tensors of `p`'s state the update reads and writes."""
    g = opt.group_of(p)
    if g < 0:
        return {}
    st = opt.state[p]
    keys = KINDS[opt.kinds[g]].state_keys(opt.param_groups[g])
    return {k: st[k] for k in keys if isinstance(st.get(k), torch.Tensor)}


def update(kind: str, group: Dict[str, Any], m: Dict[str, float], p, g, st) -> None:
    """One parameter's update, PyTorch's single-tensor arithmetic with the
    group's numbers as markers `m` (p, g and the state are fake tensors)."""
    KINDS[kind].update(group, m, p, g, st)


def advance_steps(opt: Optimizers, updated) -> Dict[int, Dict[str, float]]:
    """Increments the step counter of every updated parameter as
    ``optimizer.step()`` does (and the host state that goes with it:
    :meth:`Kind.advance`) and returns, per group, its step count (what its
    bias correction uses; the parameters of a group must agree) and what
    its kind read of that state. Counters on the device (fused optimizers)
    are read once per group, not once per parameter."""
    ids = {id(p) for p in updated}
    counts: Dict[int, Dict[str, float]] = {}
    for gi, group in enumerate(opt.param_groups):
        states = [opt.state[p] for p in group["params"] if id(p) in ids and opt.state.get(p)]
        counters = [st["step"] for st in states if isinstance(st.get("step"), torch.Tensor)]
        if not counters:
            continue
        torch._foreach_add_(counters, 1.0)  # one launch, not one per parameter, for fused optimizers
        if group.get("capturable"):
            continue  # each update reads its own counter on the device: nothing to read here
        try:
            step = _one_value(counters, "different numbers of steps")
            counts[gi] = {"step": step, **KINDS[opt.kinds[gi]].advance(group, states, step)}
        except _Disagree as e:
            raise UnsupportedStep(
                f"param group {gi}: its parameters have taken {e.what} ({e.seen[0]:g} and {e.seen[-1]:g}); "
                "memplan's update uses one per group"
            ) from None
    return counts


class _Disagree(Exception):
    def __init__(self, what: str, seen: List[float]) -> None:
        super().__init__(what)
        self.what, self.seen = what, seen


def _one_value(tensors: List[torch.Tensor], what: str) -> float:
    """The value all the 0-d `tensors` hold, read once per device; raises
    `_Disagree` (naming `what`) where they differ."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    values = set()
    for ts in by_device.values():
        values.update(torch.stack(torch.stack(ts).aminmax()).tolist())
    seen = sorted(values)
    if len(seen) != 1:
        raise _Disagree(what, seen)
    return seen[0]
