"""The arena step as one CUDA graph (``step(batch, graph=True)``).

The arena step is what CUDA graphs need and rarely get: every tensor the
step makes lives at a fixed offset of one buffer, and parameters, optimizer
state and the batch's slots never move. So after the replay has settled
how each op runs (its first arena run), the whole step can be recorded
once with ``torch.cuda.graph`` and then launched as one graph: the Python
per op and the ~10 launches of each parameter's update, which make a small
model's replay slower than eager, are paid once. The batch is copied into
its slots before each launch, outside the graph.

A graph keeps every argument it was recorded with. Tensors are read at
their addresses, so their values may change between steps; Python numbers
are baked in. The update's numbers (the optimizer markers' values) are
therefore part of the graph's key, and a change (a schedule stepping a
float learning rate) records the graph again; a 0-d tensor learning rate
(capturable Adam's) is a step input read on the device, which a schedule
fills in place without a new recording. An update whose numbers change every
step (Adam's bias corrections, unless ``capturable=True`` computes them on
the device from the step counters) would be recorded every step and is
refused up front, as are a gradient scaler (its overflow flags are read on
the host to skip updates) and host tensors among the step's inputs (a
graph reads them once, when recorded). The recording itself runs no
kernel: the step is then launched once. Should recording fail (an op that
waits on the host), the step runs as the plain arena step, the reason is
kept in :attr:`Graphed.refused` and a warning says it once.

Memory: ops whose results are copied into their places (no ``out=``
overload) and kernels' own workspaces allocate during the recording from
the graph's private pool, which the graph keeps reserved, so
``max_memory_reserved`` holds the arena, that pool and the batch.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Sequence

import torch

from ._errors import UnsupportedStep


def _cuda_graph() -> "torch.cuda.CUDAGraph":
    return torch.cuda.CUDAGraph()


class Graphed:
    """One step's CUDA graph: recorded on the first call after the arena
    has settled, launched on the next ones while its key (the inputs'
    addresses and the update's numbers) holds, recorded again when it
    changes. `make_graph` and `recording` stand in for ``CUDAGraph`` and
    ``torch.cuda.graph`` (tests on the CPU)."""

    def __init__(self, make_graph: Callable = _cuda_graph, recording: Optional[Callable] = None) -> None:
        self._make_graph = make_graph
        self._recording = recording or (lambda g: torch.cuda.graph(g))
        self.graph = None
        self.key: Optional[tuple] = None
        self.env: Dict[int, torch.Tensor] = {}
        self.recordings = 0  # how many times the step was recorded
        self.launches = 0
        self.refused: Optional[str] = None

    @staticmethod
    def key_of(env: Dict[int, torch.Tensor], numbers: Dict[float, float]) -> tuple:
        return (tuple(sorted(numbers.items())),
                tuple((i, x.data_ptr(), x.device) for i, x in sorted(env.items())))

    def run(self, arena, prog, placed: Dict[int, torch.Tensor], env: Dict[int, torch.Tensor],
            numbers: Dict[float, float], optimizer_calls) -> Dict[int, torch.Tensor]:
        """Runs one step: records it first when needed, then launches the
        graph. Returns the values the step keeps (its loss...), which the
        graph overwrites on its next launch. Runs the plain arena step
        while the arena is not settled yet and after a refused recording."""
        if self.refused is not None or not arena.settled_for(prog, placed, optimizer_calls):
            self.graph = None  # recorded for another program or arena, if any
            arena.run(prog, placed, env, numbers, optimizer_calls)
            return env
        key = self.key_of(env, numbers)
        if self.graph is None or key != self.key:
            if not self._record(arena, prog, placed, env, numbers, optimizer_calls):
                arena.run(prog, placed, env, numbers, optimizer_calls)
                return env
            self.key = key
        self.graph.replay()
        self.launches += 1
        return self.env

    def _record(self, arena, prog, placed, env, numbers, optimizer_calls) -> bool:
        self.graph = None  # the previous graph's pool goes with it
        graph = self._make_graph()
        recorded = dict(env)
        try:
            with self._recording(graph):
                arena.run(prog, placed, recorded, numbers, optimizer_calls)
        except Exception as e:  # what PyTorch raises for an op that cannot be recorded
            self.refused = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"memplan: the step could not be recorded as a CUDA graph ({self.refused}); "
                          "it runs as the arena step without one", stacklevel=4)
            return False
        self.graph, self.env = graph, recorded
        self.recordings += 1
        return True


def refusal(*, device: Optional[torch.device] = None, scaled: bool = False, track: bool = False,
            order: str = "planned", dependent: Sequence[str] = (), host_inputs: Sequence[str] = ()) -> Optional[str]:
    """Why a step cannot run as a CUDA graph, or None; what is left out is
    not checked (`device` None: checked before)."""
    if device is not None and device.type != "cuda":
        return f"graph=True records the step as a CUDA graph, and this step runs on {device}"
    if order != "planned":
        return "graph=True runs the planned order in the arena"
    if track:
        return "track=True counts tensors op by op, which a CUDA graph's launch does not show: run without graph=True"
    if scaled:
        return ("a step with a gradient scaler reads each overflow flag on the host to skip the update, "
                "which a CUDA graph cannot: run it without graph=True")
    if dependent:
        return (f"{', '.join(dependent)}: the update reads numbers that change every step (Adam's bias "
                "corrections), which a CUDA graph would keep from the step it was recorded on; create the "
                "optimizer with capturable=True, which computes them on the device")
    if host_inputs:
        return (f"{', '.join(host_inputs[:3])}: read by the step from host memory, which a CUDA graph reads "
                "once, when it is recorded; keep them on the GPU")
    return None


def refuse_unless_graphable(**what) -> None:
    """Raises :class:`UnsupportedStep` with :func:`refusal`'s reason."""
    why = refusal(**what)
    if why is not None:
        raise UnsupportedStep(why)
