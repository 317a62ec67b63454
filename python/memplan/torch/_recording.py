"""What the recorder's helpers (:mod:`._generators`, :mod:`._outside`)
may ask of the recorder that owns them: a structural type, so they need
not import :mod:`._record`, which imports them."""

from __future__ import annotations

from typing import Any, Dict, List, Protocol

from ._calls import Call
from ._tensors import TensorTable


class Recording(Protocol):
    """The part of :class:`memplan.torch._record.Recorder` its helpers use."""

    table: TensorTable
    generators: Any  # its Generators

    def emit(self, type: str, fields: Dict[str, List[int]], call: Call) -> Dict[str, Any]:
        """Records an op the driver makes, with its call."""
        ...

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Records one aten call (the dispatch mode's entry)."""
        ...
