"""The graph tensors of one recording, followed by storage.

A tensor whose storage no earlier tensor holds is a **root**: a graph
tensor of the storage's size (0 off the planned device). A tensor over the
bytes of an earlier one (a view, ``.data``, a registered input sharing a
parameter's storage) is a ``view_of`` it, of size 0. :class:`TensorTable`
keeps, per graph tensor, its entry of the graph document, what it is a view
of, its :class:`Layout` and the phase it was made in; and, to find the
graph tensor a torch tensor stands for, the objects and storages seen. Its
roles are the driver's (:meth:`TensorTable.register`,
:meth:`TensorTable.mark`) or, for the rest, follow from the phases that
made and used it (:meth:`TensorTable.assign_roles`).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from ._errors import UnsupportedStep

# The package's one element-type table: each torch dtype's name in memplan's
# graphs (docs/graph-format.md; the Rust core's `memplan::dtype` reads the
# same names). Widths come from torch itself (`dtype.itemsize`).
DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_itemsize(name: str, default: torch.dtype) -> int:
    """Bytes of one element of the dtype named `name` in a graph, or of
    `default` for a name the table lacks."""
    return TORCH_DTYPES.get(name, default).itemsize



class Layout(NamedTuple):
    """How a graph tensor sits in its storage, as recorded."""

    shape: tuple
    stride: tuple
    offset: int  # storage offset, in elements
    dtype: torch.dtype
    device: torch.device


def storage_key(t: torch.Tensor) -> int:
    """Identity of `t`'s storage (shared by all views of it)."""
    return StorageWeakRef(t.untyped_storage()).cdata


class TensorTable:
    """The graph tensors of a recording. ``device`` is the device type
    whose memory is planned (other devices' tensors have size 0); ``align``
    is every tensor's alignment; ``phase`` is the phase of the step being
    recorded (forward, backward, optimizer), which every new tensor notes.
    ``constants`` maps a graph tensor to the value bound to it at every run
    (a constant of the step), ``sources`` a constant to the caller's tensor
    it was copied from."""

    def __init__(self, device: str, align: int) -> None:
        self.device = device
        self.align = align
        self.phase = "forward"
        self.tensors: List[Dict[str, Any]] = []
        self.parent: List[Optional[int]] = []  # per tensor: what it is a view of
        self.layouts: List[Layout] = []
        self.constants: Dict[int, torch.Tensor] = {}
        self.sources: Dict[int, torch.Tensor] = {}
        self._by_object = WeakIdKeyDictionary()
        self._root_of_storage: Dict[int, int] = {}
        self._kept: List[Any] = []  # storages kept alive while recording
        self._phase_of: Dict[int, str] = {}
        self._used_in: Dict[int, set] = {}
        self._fixed_role: Dict[int, str] = {}

    # ---- making tensors -------------------------------------------------

    def add(self, x: torch.Tensor, id: str, size: int, role: str, lifetime: str,
            view_of: Optional[int]) -> int:
        """A graph tensor `id` for `x`, a view of tensor `view_of` or
        (None) a root of `size` bytes."""
        t: Dict[str, Any] = {"id": id, "size": int(size), "role": role, "lifetime": lifetime}
        if self.align != 1:
            t["align"] = self.align
        if view_of is not None:
            t["view_of"] = self.tensors[view_of]["id"]
        t["dtype"] = DTYPE_NAMES.get(x.dtype, str(x.dtype).replace("torch.", ""))
        t["shape"] = [int(d) for d in x.shape]
        layout = Layout(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype, x.device)
        i = self.add_entry(t, view_of, layout)
        self._by_object[x] = i
        return i

    def add_entry(self, entry: Dict[str, Any], view_of: Optional[int], layout: Layout) -> int:
        """A graph tensor with the document entry `entry`, standing for no
        torch tensor (a generator, a generator state)."""
        self.tensors.append(entry)
        self.parent.append(view_of)
        self.layouts.append(layout)
        i = len(self.tensors) - 1
        self._phase_of[i] = self.phase
        return i

    def new_root(self, x: torch.Tensor, id: str, role: str, lifetime: str) -> int:
        """A root for `x`'s storage, kept alive until :meth:`release`."""
        size = 0 if x.device.type != self.device else x.untyped_storage().nbytes()
        i = self.add(x, id, size, role, lifetime, None)
        self._root_of_storage[storage_key(x)] = i
        self._kept.append(x.untyped_storage())
        return i

    def new_input(self, x: torch.Tensor, id: str) -> int:
        """A root for `x` that the step reads but did not make: a
        persistent input, there before the step (a constant)."""
        i = self.new_root(x, id, "input", "persistent")
        self.fix(i, "input")
        return i

    def fix(self, i: int, role: str) -> None:
        """Tensor `i` is a step input of `role`, there before the step."""
        self._fixed_role[i] = role
        self._phase_of[i] = "before"

    def register(self, x: torch.Tensor, id: str, role: str) -> int:
        """Registers a step input (parameter, buffer, optimizer state, batch,
        host scalar): persistent, owned by the caller. A tensor sharing the
        storage of one registered before becomes a view of it."""
        root = self._root_of_storage.get(storage_key(x))
        if root is not None:
            i = self.add(x, id, 0, role, "transient", root)
        else:
            i = self.new_root(x, id, role, "persistent")
        self.fix(i, role)
        return i

    def alias(self, x: torch.Tensor, src: int) -> int:
        """A view of tensor `src` for `x`, which a fake kernel gave bytes of
        its own though the real op returns its argument: `x`'s storage
        stands for `src`'s from now on."""
        self._root_of_storage[storage_key(x)] = self.root(src)
        self._kept.append(x.untyped_storage())
        return self.add(x, f"t{len(self.tensors)}", 0, "activation", "transient", src)

    def keep(self, obj: Any) -> None:
        """Keeps `obj` alive (and its ``id`` its own) while recording."""
        self._kept.append(obj)

    # ---- finding tensors ------------------------------------------------

    def find(self, x: torch.Tensor) -> Optional[int]:
        """The graph tensor `x` is, or one over its bytes; None if unseen.
        A new object over known bytes (``.data``) is remembered as its
        root."""
        i = self._by_object.get(x)
        if i is not None:
            return i
        r = self._root_of_storage.get(storage_key(x))
        if r is not None:
            self._by_object[x] = r
        return r

    def seen(self, x: torch.Tensor) -> Optional[int]:
        """The graph tensor made for the object `x` itself, or None."""
        return self._by_object.get(x)

    def index_of(self, x: torch.Tensor) -> int:
        i = self._by_object.get(x)
        if i is None:
            raise KeyError("the tensor was not recorded")
        return i

    def root_of(self, x: torch.Tensor) -> Optional[int]:
        """The root tensor holding `x`'s bytes, if any op or registration
        made them (a gradient the autograd engine hands over as a new
        object over an op's output)."""
        return self._root_of_storage.get(storage_key(x))

    def root(self, i: int) -> int:
        """The root tensor whose bytes tensor `i` uses."""
        while self.parent[i] is not None:
            i = self.parent[i]
        return i

    # ---- roles ------------------------------------------------------------

    def mark(self, x: torch.Tensor, role: str, persistent: bool = False) -> int:
        """Sets the role (and the lifetime) of the tensor `x` stands for."""
        i = self.index_of(x)
        t = self.tensors[i]
        if "view_of" in t:
            raise UnsupportedStep(f"the {role} is a view of another tensor; return a fresh tensor")
        t["role"] = role
        if persistent:
            t["lifetime"] = "persistent"
        self._fixed_role[i] = role
        return i

    def used(self, ids: List[int]) -> None:
        """The tensors `ids` are used by an op of the current phase."""
        for i in ids:
            self._used_in.setdefault(self.root(i), set()).add(self.phase)

    def assign_roles(self) -> None:
        """Gives the tensors whose role the driver did not set theirs: made
        in the forward and used in the backward, an activation; otherwise a
        temporary. A view takes its root's role."""
        for i, t in enumerate(self.tensors):
            if "view_of" in t or i in self._fixed_role:
                continue
            made = self._phase_of.get(i)
            if made == "forward":
                used_later = "backward" in self._used_in.get(i, ())
                t["role"] = "activation" if used_later else "temporary"
            elif made == "optimizer":
                t["role"] = "temporary"
        for i, t in enumerate(self.tensors):
            if "view_of" in t:
                t["role"] = self.tensors[self.root(i)]["role"]

    def release(self) -> None:
        """Lets go of the storages kept while recording."""
        self._kept.clear()
        self._root_of_storage.clear()
