"""Random numbers in a recorded step.

Each random op also updates one zero-byte tensor per device,
``rng:<device>`` (role ``input``): the state of the generator it draws from
(:meth:`Generators.drawn_by`). Reading and setting a generator's state
(``torch.get_rng_state``, which ``torch.utils.checkpoint`` uses to
recompute dropout with the forward's masks) become ops on the same tensor
(:class:`GeneratorStates`, :meth:`Generators.get_state`,
:meth:`Generators.set_state`), whose calls read and set the real state
when the step runs (:func:`read_generator`, :func:`write_generator`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._calls import Call, Ref
from ._errors import UnsupportedStep
from ._recording import Recording
from ._tensors import Layout



_ORIGINAL_STATE_CALLS = {
    "get": (torch.random.get_rng_state, torch.cuda.random.get_rng_state),
    "set": (torch.random.set_rng_state, torch.cuda.random.set_rng_state),
}


def _cuda_device(device) -> torch.device:
    """`torch.cuda`'s device argument (an index, a name, a device) as a
    device with an index."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def read_generator(device: str) -> torch.Tensor:
    """The state of `device`'s default generator (a recorded
    ``get_rng_state``, run)."""
    cpu_get, cuda_get = _ORIGINAL_STATE_CALLS["get"]
    return cpu_get() if device == "cpu" else cuda_get(device)


def write_generator(state: torch.Tensor, device: str) -> None:
    """Sets `device`'s default generator to `state` (a recorded
    ``set_rng_state``, run)."""
    cpu_set, cuda_set = _ORIGINAL_STATE_CALLS["set"]
    if device == "cpu":
        cpu_set(state)
    else:
        cuda_set(state, device)


class GeneratorStates:
    """While a step is captured, ``torch.get_rng_state``/``set_rng_state``
    and ``torch.cuda``'s become ops of the recorder (:meth:`Generators.get_state`,
    :meth:`Generators.set_state`): how ``torch.utils.checkpoint`` replays
    dropout in its recomputation with the forward's masks. Reseeding
    inside the step (``torch.manual_seed``) is refused."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self._saved: List[Tuple[Any, str, Any]] = []

    def _patch(self, module, name: str, value) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def __enter__(self) -> "GeneratorStates":
        gens = self.rec.generators

        def get_cpu():
            return gens.get_state(torch.device("cpu"))

        def set_cpu(new_state):
            gens.set_state(new_state, torch.device("cpu"))

        def get_cuda(device="cuda"):
            return gens.get_state(_cuda_device(device))

        def set_cuda(new_state, device="cuda"):
            gens.set_state(new_state, _cuda_device(device))

        def reseed(*_args, **_kwargs):
            raise UnsupportedStep("torch.manual_seed inside the step: seed before capturing and running it")

        for module in (torch, torch.random):
            self._patch(module, "get_rng_state", get_cpu)
            self._patch(module, "set_rng_state", set_cpu)
            self._patch(module, "manual_seed", reseed)
        for module in (torch.cuda, torch.cuda.random):
            self._patch(module, "get_rng_state", get_cuda)
            self._patch(module, "set_rng_state", set_cuda)
            self._patch(module, "manual_seed", reseed)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()



class Generators:
    """The ``rng:<device>`` tensors of a recording and the generator
    states read inside the step, as graph tensors of the recorder's
    table."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self._generators: Dict[str, int] = {}  # device -> its rng:<device> tensor
        self._states: Dict[int, int] = {}  # id of a recorded generator state -> its tensor

    def drawn_by(self, func, args: Sequence[torch.Tensor], outs: Sequence[Any], kwargs) -> int:
        """The graph tensor standing for the state of the generator a random
        op draws from: ``rng:<device>``, zero bytes, made on first use. An
        explicit ``generator=`` is its own device's; ops that make a tensor
        from nothing (``rand``) draw on their output's device."""
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator):
            device = gen.device
        else:
            tensors = [x for x in list(args) + list(outs) if isinstance(x, torch.Tensor)]
            if not tensors:
                raise UnsupportedStep(f"{func}: draws random numbers on no tensor's device")
            device = tensors[0].device
        return self.of(torch.device(device))

    def of(self, device: torch.device) -> int:
        """The ``rng:<device>`` tensor, made on first use."""
        key = str(device)
        i = self._generators.get(key)
        if i is None:
            table = self.rec.table
            entry = {"id": f"rng:{key}", "size": 0, "role": "input", "lifetime": "persistent"}
            i = self._generators[key] = table.add_entry(entry, None, Layout((), (), 0, torch.uint8, device))
            table.fix(i, "input")
        return i

    def get_state(self, device: torch.device) -> torch.Tensor:
        """Records reading `device`'s generator state (what
        ``torch.get_rng_state()`` does for ``torch.utils.checkpoint``): an
        op that reads ``rng:<device>`` and makes a state tensor, whose call
        reads the real state when the step runs. Returns a stand-in the
        caller hands back to :meth:`set_state`."""
        rng = self.of(device)
        with _disable_current_modes():
            stand_in = torch.empty(0, dtype=torch.uint8)
        table = self.rec.table
        entry = {"id": f"t{len(table.tensors)}", "size": 0, "role": "activation", "lifetime": "transient",
                 "dtype": "u8", "shape": [0]}
        i = table.add_entry(entry, None, Layout((0,), (1,), 0, torch.uint8, torch.device("cpu")))
        self._states[id(stand_in)] = i
        table.keep(stand_in)
        self.rec.emit("memplan.get_rng_state", {"inputs": [rng], "outputs": [i]},
                      Call(read_generator, (str(device),), {}, [(0, i)]))
        table.used([i])
        return stand_in

    def set_state(self, state: Any, device: torch.device) -> None:
        """Records setting `device`'s generator to a state :meth:`get_state`
        recorded: an op that reads the state and updates ``rng:<device>``."""
        i = self._states.get(id(state))
        if i is None:
            raise UnsupportedStep(
                f"set_rng_state on {device}: the state was not read inside the step, so the step "
                "cannot restore it when it runs again (seed outside the step)"
            )
        rng = self.of(device)
        self.rec.emit("memplan.set_rng_state", {"inputs": [i], "updates": [rng]},
                      Call(write_generator, (Ref(i), str(device)), {}, []))
        self.rec.table.used([i])

    def release(self) -> None:
        self._states.clear()
