"""What a captured step took from Python objects rather than from
tensors (modes, hooks, autocast, which tensors the model holds), so that
each run can check it still holds: :class:`AsCaptured`."""

from __future__ import annotations

import contextlib
from typing import Callable, List, Tuple

import torch
import torch.nn.modules.module as _module

from ._errors import UnsupportedStep

_AUTOCAST_DEVICES = ("cpu", "cuda")
# Module attributes the graph may have taken as constants: dropout's `p`,
# a norm's `eps`, a block's drop-path rate, a checkpointing switch.
_PLAIN = (bool, int, float, str)
_MISSING = object()


class AsCaptured:
    """What the recorded graph took from the model's Python state rather
    than from its tensors, checked before each run: which tensors and
    submodules the model's modules hold, every module's train/eval mode
    (dropout, batch norm's statistics) and plain attributes (numbers,
    strings and switches: dropout's `p`), its hooks (and the global module
    hooks), which parameters require grad, every parameter's gradient
    hooks, and the autocast around the call (``torch.autocast`` around the
    capture records its casts as ops; the step must then be called under
    the same autocast, and it replays those ops with autocast off, as
    recorded).

    A hook registered with ``p.register_hook`` runs on the parameter's
    gradient before it is accumulated, and what it returns replaces the
    gradient: the capture registers it on the parameter's fake stand-in
    (:meth:`hooks_of`), so the recorded backward runs it (once per
    micro-batch, as eager does). ``register_post_accumulate_grad_hook``
    hooks read and write ``p.grad``, which the captured step never sets:
    refused. A mode switched or a hook added or removed after capture is
    not in the recorded graph: refused, rather than running a step other
    than eager's."""

    _MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = list(model.named_modules())
        self._params = list(model.named_parameters())
        self._modes = [m.training for _, m in self._modules]
        self._hooks = self._gradient_hooks()
        # The dicts PyTorch keeps module hooks in: (module name, kind, dict).
        self._hook_dicts = [("", kind, getattr(_module, "_global" + kind)) for kind in self._MODULE_HOOKS
                            if hasattr(_module, "_global" + kind)]
        self._hook_dicts += [(name, kind, m.__dict__[kind]) for name, m in self._modules
                             for kind in self._MODULE_HOOKS if kind in m.__dict__]
        self._module_hooks = self._hooks_on_modules()
        self._autocast = self._autocast_around()
        self._trainable = [p.requires_grad for _, p in self._params]
        # Where each parameter, buffer and submodule sits: its module's
        # dict, its name there, the object, its full name; and how many
        # each module has (one added since is not in the graph).
        self._dicts = [d for _, m in self._modules for d in (m._parameters, m._buffers, m._modules)]
        self._held = [(d, n, x, f"{self._modules[i // 3][0]}.{n}".lstrip("."))
                      for i, d in enumerate(self._dicts) for n, x in d.items() if x is not None]
        self._sizes = list(map(len, self._dicts))
        # Each module's plain attributes (its train/eval mode has a check
        # of its own): (module name, its __dict__, the names).
        self._attr_names = [(name, m.__dict__, [k for k, v in m.__dict__.items()
                                                if type(v) in _PLAIN and k != "training"])
                            for name, m in self._modules]
        self._attrs = self._plain_attributes()

    @staticmethod
    def hooks_of(name: str, p: torch.Tensor) -> List[Callable]:
        """`p`'s gradient hooks, in the order they run; refuses a
        post-accumulate-grad hook."""
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise UnsupportedStep(
                f"parameter {name} has a post-accumulate-grad hook (register_post_accumulate_grad_hook): "
                "it works on p.grad, which the captured step never sets. If it runs the optimizer in the "
                "backward pass, drop it: memplan already places each update as early as its gradient allows"
            )
        return list((p._backward_hooks or {}).values())

    def _gradient_hooks(self) -> List[Tuple[str, tuple, tuple]]:
        return [(n, tuple((p._backward_hooks or {}).values()),
                 tuple(getattr(p, "_post_accumulate_grad_hooks", None) or ()))
                for n, p in self._params
                if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]

    def _hooks_on_modules(self) -> List[Tuple[str, str, tuple]]:
        """The handles of every module's hooks and of the global ones."""
        return [(name, kind, tuple(d)) for name, kind, d in self._hook_dicts if d]

    @staticmethod
    def _autocast_around() -> List[Tuple[str, torch.dtype]]:
        return [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]

    @staticmethod
    def without_autocast():
        """A context in which no device type autocasts."""
        stack = contextlib.ExitStack()
        for d in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(d, enabled=False))
        return stack

    def _plain_attributes(self) -> list:
        return [d.get(k, _MISSING) for _, d, ks in self._attr_names for k in ks]

    def check(self) -> None:
        """Raises :class:`UnsupportedStep` naming what changed since capture."""
        self._same_tensors()
        self._same_autocast()
        if [m.training for _, m in self._modules] != self._modes:
            self._mode_changed()
        if self._plain_attributes() != self._attrs:
            self._attribute_changed()
        if [p.requires_grad for _, p in self._params] != self._trainable:
            self._trainable_changed()
        self._same_hooks()

    def _same_tensors(self) -> None:
        for d, n, x, name in self._held:
            if n in d and d[n] is x:  # (a scripted module's dicts have no .get)
                continue
            if isinstance(x, torch.nn.Module):
                raise UnsupportedStep(
                    f"module {name} is another module than the one captured (replaced or removed since); "
                    "the step runs the modules it was captured with. Capture the step again"
                )
            raise UnsupportedStep(
                f"{name} is another tensor than the one captured (assigned since: a replaced module, "
                "load_state_dict(..., assign=True)); the step updates the tensors it was captured with. "
                "Capture the step again (with an optimizer over the new parameters)"
            )
        if list(map(len, self._dicts)) != self._sizes:
            i = next(i for i, (d, k) in enumerate(zip(self._dicts, self._sizes)) if len(d) != k)
            name = self._modules[i // 3][0]
            raise UnsupportedStep(
                f"{'module ' + name if name else 'the model'} has other parameters, buffers or submodules than "
                "when the step was captured (one added or removed since is not in the recorded graph); "
                "capture the step again"
            )

    def _same_autocast(self) -> None:
        autocast = self._autocast_around()
        if autocast == self._autocast:
            return

        def say(a):
            return " and ".join(f"torch.autocast({d!r}, dtype={t})" for d, t in a) or "no autocast"

        raise UnsupportedStep(
            f"the step is called under {say(autocast)} and was captured under {say(self._autocast)}: the "
            "capture records autocast's casts as ops. Call it as it was captured (or put the autocast "
            "inside loss_fn, where the capture records it)"
        )

    def _attribute_changed(self) -> None:
        now = iter(self._plain_attributes())
        was = iter(self._attrs)
        for name, d, ks in self._attr_names:
            for k in ks:
                a, b = next(was), next(now)
                if a is not b and a != b:
                    shown = "deleted" if b is _MISSING else repr(b)
                    raise UnsupportedStep(
                        f"{name + '.' if name else ''}{k} is {shown} and was {a!r} when the step was captured: the "
                        "recorded graph took it as a constant (a dropout probability, a drop-path rate...); "
                        "capture the step again after such a change"
                    )

    def _trainable_changed(self) -> None:
        n, p = next((n, p) for (n, p), was in zip(self._params, self._trainable) if p.requires_grad != was)
        raise UnsupportedStep(
            f"parameter {n} has requires_grad={p.requires_grad} and had {not p.requires_grad} at capture (the "
            "captured backward computes the gradients of the parameters that required them then); "
            "capture the step again"
        )

    def _same_hooks(self) -> None:
        if self._gradient_hooks() != self._hooks:
            raise UnsupportedStep(
                "the parameters' gradient hooks changed after capture (the captured step runs the hooks "
                "that were there at capture); capture the step again"
            )
        now = self._hooks_on_modules()
        if now != self._module_hooks:
            name, kind, _ = next(iter(set(now) ^ set(self._module_hooks)))
            where = f"module {name}'s" if name else "the global module"
            raise UnsupportedStep(
                f"{where} {kind.strip('_').replace('_', ' ')} changed after capture (the captured step ran "
                "the hooks that were there at capture); capture the step again"
            )

    def _mode_changed(self) -> None:
        mode = {True: "training", False: "eval"}
        name, m, was = next((n, m, w) for (n, m), w in zip(self._modules, self._modes) if m.training != w)
        raise UnsupportedStep(
            f"{'module ' + name if name else 'the model'} is in {mode[m.training]} mode, and was in "
            f"{mode[was]} mode when the step was captured (dropout and batch norm were recorded so); "
            "set the mode back, or capture the step in the mode it trains in"
        )
