"""The real tensors a step reads from outside it, while it is recorded on
fake tensors: a parameter or buffer reached through a reference held from
before capture (read as the step input it is), and any other tensor (class
weights in a loss, a mask made before the step: a constant input, its
value copied at capture and bound at every run)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ._aten import DETACHING
from ._errors import UnsupportedStep
from ._recording import Recording
from ._tensors import storage_key


class Outside:
    """What the recorder `rec` reads in place of real tensors. ``fake_mode``
    is the capture's ``FakeTensorMode`` (set by the driver; None: no
    tensor is replaced); ``roots`` are the constant inputs made here, which
    no op of the step may write."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.fake_mode = None
        self.roots: set = set()
        self._fakes: Dict[int, torch.Tensor] = {}  # id of a real tensor -> its fake stand-in
        # Real storage of each parameter and buffer -> its fake and graph id.
        self._inputs_by_storage: Dict[int, Tuple[torch.Tensor, str]] = {}

    def stands_for(self, real: torch.Tensor, fake: torch.Tensor, id: str) -> None:
        """Makes `fake`, registered as `id`, what the step reads wherever it
        reads the real parameter or buffer `real` (or a tensor over its
        bytes, ``p.data``, ``p.detach()``) from outside the model it was
        given: a list made before capture, a gradient hook's closure."""
        self._inputs_by_storage.setdefault(storage_key(real), (fake, id))

    def read(self, x, func):
        """A real tensor the step reads from outside it (class weights in a
        loss, a mask made before the step) becomes a constant input: its
        value, copied at capture, is bound at every run, and a fake
        stand-in takes its place while recording. A tensor over a
        parameter's or buffer's bytes is read as that step input instead
        (:meth:`_as_step_input`)."""
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        known = self._inputs_by_storage.get(storage_key(x))
        if known is not None:
            return self._as_step_input(x, func, *known)
        fake = self._fakes.get(id(x))
        if fake is None:
            if x.requires_grad:
                raise UnsupportedStep(
                    f"{func}: reads a tensor of shape {tuple(x.shape)} that requires grad but is not a "
                    "parameter of the model (make it one, or detach it)"
                )
            with _disable_current_modes():
                value = x.detach().clone()
                fake = self.fake_mode.from_tensor(value)
            table = self.rec.table
            i = table.new_input(fake, f"const{len(table.constants)}")
            table.constants[i] = value
            table.sources[i] = x
            self._fakes[id(x)] = fake
            self.roots.add(i)
            table.keep(x)  # its id stays its own while recording
        return fake

    def _as_step_input(self, x: torch.Tensor, func, fake: torch.Tensor, id: str) -> torch.Tensor:
        """The fake step input `fake` (or the view of it that `x` is) for
        a real tensor `x` over the bytes of the parameter or buffer `id`:
        its value is the step's at every run, as eager reads it. Refused
        where autograd would record the read: the gradient would go to the
        real tensor, not to the step's parameter."""
        if x.requires_grad and torch.is_grad_enabled() and func not in DETACHING:
            raise UnsupportedStep(
                f"{func}: reads {id} through a reference held from outside the model given to loss_fn "
                "(a list of parameters made before capture, a closure), so its gradient would be lost; "
                "reach it through the model loss_fn is given (model.parameters(), model.<name>), or detach it"
            )
        if x.dtype != fake.dtype:
            raise UnsupportedStep(f"{func}: reads {id}'s bytes as {x.dtype}, not as its {fake.dtype}")
        if (x.shape, x.stride(), x.storage_offset()) == (fake.shape, fake.stride(), fake.storage_offset()):
            return fake
        view = torch.ops.aten.as_strided.default
        return self.rec.__torch_dispatch__(view, (), (fake, tuple(x.shape), tuple(x.stride()), x.storage_offset()), {})

    def release(self) -> None:
        self._fakes.clear()
        self.roots.clear()
