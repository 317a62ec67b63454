"""Models with ``torch.compile``d parts: what :func:`memplan.torch.capture`
records through them, and which of their compile settings the planned
step honours.

The recorder is a dispatch mode, and Dynamo does not trace under one: a
block compiled with ``fullgraph=True`` (torchtitan's ``apply_compile``)
would fail with PyTorch's "found no compiled frames". So the step is
recorded under ``torch.compiler.set_stance("force_eager")``
(:func:`recording`): every compiled module and function runs its Python
code, and the recorder sees the aten ops it computes, the same math as
eager. What was compiled is remembered (:func:`compiled_parts`: an
``OptimizedModule`` anywhere in the model, or a module whose
``.compile()`` was called), with its backend and settings.

The planned step then runs with the kernels the caller asks for
(:func:`kernel_options`):

- ``kernels="eager"``: aten's kernels, one call per op. A model with
  compiled parts gets a warning naming them, since their compiled speed is
  not what runs.
- ``kernels="inductor"``: memplan compiles regions of its planned order
  with Inductor (:mod:`memplan.torch._fused`). The parts' Inductor options
  (``mode``, ``options``) apply to every region. A setting that cannot be
  honoured is refused by name: another backend than Inductor, dynamic
  shapes (the step's shapes are fixed at capture), CUDA graphs
  (``mode="reduce-overhead"``: ``Step.run(graph=True)`` launches the whole
  step as one), and parts whose options disagree.

``torch.compile``d functions that are not modules (called by the loss)
run eagerly while recording too, but cannot be found in the model: their
settings are not read.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import torch

from ._errors import UnsupportedStep

KERNELS = ("eager", "inductor")


class CompiledPart(NamedTuple):
    """One compiled module of the model: its path (``""``: the model
    itself), its backend's name, its Inductor option patches (``mode`` as
    the options it stands for), ``dynamic`` and ``fullgraph``."""

    name: str
    backend: str
    options: Dict[str, Any]
    dynamic: Optional[bool]
    fullgraph: bool


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def _backend(ctx) -> Any:
    """The ``torch.compile`` backend wrapper behind a Dynamo context."""
    b = getattr(ctx, "callback", None)
    for _ in range(8):
        inner = getattr(b, "_torchdynamo_orig_backend", None)
        if inner is None or inner is b:
            break
        b = inner
    return b


def _context_of(module: torch.nn.Module):
    """The Dynamo context compiling `module`, or None."""
    ctx = getattr(module, "dynamo_ctx", None)
    if ctx is not None and type(module).__name__ == "OptimizedModule":
        return ctx
    impl = getattr(module, "_compiled_call_impl", None)  # module.compile()
    for cell in getattr(impl, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "callback") and hasattr(value, "fullgraph"):
            return value
    return None


def compiled_parts(model: torch.nn.Module) -> List[CompiledPart]:
    """Every compiled module of `model`, outermost first."""
    parts = []
    for name, m in model.named_modules(remove_duplicate=True):
        ctx = _context_of(m)
        if ctx is None:
            continue
        b = _backend(ctx)
        backend = getattr(b, "compiler_name", None) or getattr(b, "__name__", None) or type(b).__name__
        parts.append(CompiledPart(_clean(name), str(backend), dict(getattr(b, "config", None) or {}),
                                  getattr(b, "dynamic", None), bool(getattr(ctx, "fullgraph", False))))
    return parts


def recording():
    """The context the step is recorded in: compiled code runs eagerly."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover - PyTorch before 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


def _label(p: CompiledPart) -> str:
    return f"module {p.name!r}" if p.name else "the model"


def kernel_options(kernels: str, parts: List[CompiledPart]) -> Dict[str, Any]:
    """Checks `kernels` against the model's compiled parts (module docs) and
    returns the Inductor options every region is compiled with."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, not {kernels!r}")
    if kernels == "eager":
        if parts:
            names = ", ".join(_label(p) for p in parts[:4]) + (" ..." if len(parts) > 4 else "")
            warnings.warn(f"{names} {'is' if len(parts) == 1 else 'are'} compiled with torch.compile; memplan "
                          "records the ops they compute and runs its planned step with eager kernels: pass "
                          "kernels='inductor' to run it with Inductor's", stacklevel=3)
        return {}
    options: Dict[str, Any] = {}
    owner: Dict[str, str] = {}
    for p in parts:
        if p.backend != "inductor":
            raise UnsupportedStep(f"{_label(p)} is compiled with backend {p.backend!r}; kernels='inductor' "
                                  "compiles the planned step with Inductor: compile it with the default backend, "
                                  "or pass kernels='eager'")
        if p.dynamic:
            raise UnsupportedStep(f"{_label(p)} is compiled with dynamic=True; a captured step has the shapes "
                                  "of its example batch, and its regions are compiled for them: compile with "
                                  "dynamic=False (or leave it unset)")
        for k, v in p.options.items():
            if k.startswith("triton.cudagraph") and v:
                raise UnsupportedStep(f"{_label(p)} is compiled with CUDA graphs ({k}, mode='reduce-overhead'); "
                                      "memplan launches the whole planned step as one CUDA graph with "
                                      "Step.run(graph=True): compile without them")
            if k in options and options[k] != v:
                raise UnsupportedStep(f"{_label(p)} is compiled with {k}={v!r} but {owner[k]} with "
                                      f"{k}={options[k]!r}; memplan compiles every region of the step with one "
                                      "set of options: compile the parts alike")
            options[k], owner[k] = v, _label(p)
    return options
