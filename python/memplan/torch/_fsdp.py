"""Sharded steps: a model sharded with FSDP2's ``fully_shard`` (the root and
any of its modules, as torchtitan wraps each transformer block and then the
root), captured on every rank as the step that rank runs.

What FSDP2 computes in a step, per parameter (``FSDPParam``): each rank
holds dim-0 chunk ``r`` of the parameter, padded to ``⌈rows/W⌉`` rows
(``_sharded_param_data``); before a unit's forward the chunks are
all-gathered and the padding cut off; after the unit's forward the
gathered parameters are freed (``reshard_after_forward``, the default but
for the root) and gathered again for its backward; each gradient, padded to
``W·⌈rows/W⌉`` rows, is reduce-scattered (the ranks' mean) into this rank's
chunk, whose first rows are the sharded gradient the optimizer updates the
shard with.

:class:`FullySharded` records that arithmetic per parameter into the
rank's graph:

- before the forward pass, per parameter, an ``empty`` buffer of ``W`` padded
  chunks and an ``all_gather`` (collective) of the rank's padded chunk into
  it; the forward reads its first ``rows`` rows (a view);
- for units that reshard after forward, every tensor autograd saves that is
  a view of a gathered parameter is saved as a marker
  (``saved_tensors_hooks``), and the backward gathers the parameter again
  when it first unpacks one: so the forward's gathered bytes die with the
  unit's forward, and the backward's are gathered where it needs them;
- after the backward pass, per gradient, its padding (zeros), a
  ``reduce_scatter`` into a chunk-sized buffer, and the update of the local
  shard (a view of FSDP2's own padded storage, so the ``DTensor`` parameter
  is updated in place) with the chunk's first rows.

All of these are ops the planner orders: when each all-gather is issued
(prefetch) and when each gathered parameter dies follow from the memory
objective, not from a fixed depth; each shard's update runs once its
reduce-scatter is done. FSDP2's own hooks are set aside while recording
(the model's forward is called with the gathered parameters in place of
the sharded ones), and the step never calls them.

Why the capture records the sharding itself instead of rewriting the
captured single-device graph with ``src/models/fsdp.rs``: that transform
rewrites steps whose updates are single ``adam`` ops of memplan's own op
vocabulary, for memplan's executor; a captured step's ops are aten calls
that Python replays, its updates are the optimizer's arithmetic recorded op
by op, and the sharded update must run on the shards FSDP2 owns (its
padding, its ``DTensor`` state) through the user's process group. Recording
at capture reads those from FSDP2's own objects, so the step's results are
FSDP2 eager's (tests: ``test_torch_distributed.py``).

Not yet captured (refused by name): mixed precision
(``MixedPrecisionPolicy`` with ``param_dtype``/``reduce_dtype``), CPU
offload, HSDP and other meshes of more than one dimension, sharding on a
dim other than 0, a root that is not sharded, gradient clipping, gradient
scaling, optimizers whose update is not elementwise (Adafactor, Muon), and
the arena (``arena=True``/``graph=True``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._distributed import Collective, RankGroup
from ._record import Recorder, UnsupportedStep, storage_key

# Optimizers whose update is elementwise on a parameter, its gradient and
# state of its shape: run on a shard, it is the shard of the full update.
ELEMENTWISE = {"adamw", "adam", "sgd", "rmsprop", "adagrad", "adamax", "adadelta", "nadam", "radam"}


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older PyTorch
        return None
    return FSDPModule


class _Param:
    """One sharded parameter: its module path `name`, FSDP2's
    ``FSDPParam`` and whether its unit reshards after forward."""

    __slots__ = ("name", "fp", "reshard", "rows", "chunk", "rest")

    def __init__(self, name: str, fp, reshard: bool) -> None:
        self.name, self.fp, self.reshard = name, fp, reshard
        size = tuple(fp._orig_size)
        self.rows, self.rest = size[0], size[1:]
        self.chunk = tuple(fp.padded_sharded_param_size)[0]  # rows of a padded shard


class _Regather:
    """A saved tensor that is a view of a gathered parameter (while
    recording): which parameter, and the view."""

    __slots__ = ("name", "shape", "stride", "offset")

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.shape, self.stride, self.offset = name, tuple(t.shape), t.stride(), t.storage_offset()


class FullySharded(RankGroup):
    """What capture needs of a model whose root is sharded with
    ``fully_shard``: every parameter's ``FSDPParam`` by name, each unit's
    resharding, the process group of the (1-D) mesh."""

    supports_arena = False

    def __init__(self, model: torch.nn.Module, params: Dict[str, _Param], group, timeout: float) -> None:
        super().__init__(group, timeout)
        self.model = model
        self.params = params
        # While recording: the gathered buffer's storage of each parameter
        # whose unit reshards (forward), and the backward's gathers.
        self._forward_storage: Dict[int, str] = {}
        self._regathered: Dict[str, torch.Tensor] = {}

    @staticmethod
    def of(model: torch.nn.Module, timeout: float) -> Optional["FullySharded"]:
        """None for a model without FSDP2 modules; refuses, by name, what
        is not captured yet."""
        cls = _fsdp_module_class()
        if cls is None:
            return None
        units = [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]
        if not units:
            return None
        if not isinstance(model, cls):
            raise UnsupportedStep(f"{units[0][0]} is sharded with fully_shard but the model's root is not: shard the "
                                  "root too (fully_shard(model) after its blocks, as torchtitan does)")
        params: Dict[str, _Param] = {}
        owner = {id(p): n for n, p in model.named_parameters()}
        group = None
        for uname, m in units:
            where = uname or "the root"
            state = m._get_fsdp_state()
            pg = state._fsdp_param_group
            policy = state._mp_policy
            if policy.param_dtype is not None or policy.reduce_dtype is not None:
                raise UnsupportedStep(f"{where}: fully_shard with MixedPrecisionPolicy(param_dtype="
                                      f"{policy.param_dtype}, reduce_dtype={policy.reduce_dtype}) is not captured "
                                      "yet (memplan's own executor plans mixed-precision FSDP2 built-in steps)")
            if pg is None:
                continue
            mesh_info = pg.mesh_info
            if type(mesh_info).__name__ != "FSDPMeshInfo" or mesh_info.mesh.ndim != 1:
                raise UnsupportedStep(f"{where}: a {mesh_info.mesh.ndim}-D device mesh ({type(mesh_info).__name__}); "
                                      "memplan.torch captures FSDP2 on a 1-D mesh only (HSDP is not captured yet)")
            reshard = pg.post_forward_mesh_info is not None
            if m is model and state._auto_reshard_after_forward:
                reshard = False  # FSDP2's root keeps its parameters into the backward (its _lazy_init)
            if reshard and pg.post_forward_mesh_info is not mesh_info and \
                    pg.post_forward_mesh_info.shard_mesh_size != mesh_info.shard_mesh_size:
                raise UnsupportedStep(f"{where}: reshard_after_forward to another world size is not captured yet")
            for fp in pg.fsdp_params:
                if getattr(fp, "offload_to_cpu", False):
                    raise UnsupportedStep(f"{where}: fully_shard(offload_policy=CPUOffloadPolicy()) is not captured")
                if fp.fsdp_placement.dim != 0:
                    raise UnsupportedStep(f"{where}: a parameter sharded on dim {fp.fsdp_placement.dim}; memplan "
                                          "captures dim-0 sharding only")
                name = owner.get(id(fp.sharded_param))
                if name is None:
                    raise UnsupportedStep(f"{where}: an FSDP parameter the model does not list (a parameter "
                                          "replaced after fully_shard?)")
                params[name] = _Param(name, fp, reshard)
            g = mesh_info.mesh.get_group()
            if group is not None and g is not group:
                raise UnsupportedStep(f"{where}: sharded over another process group than the other units")
            group = g
        for n, p in model.named_parameters():
            if n not in params:
                raise UnsupportedStep(f"parameter {n} is not sharded by any fully_shard unit")
            if type(p).__name__ != "DTensor":
                raise UnsupportedStep(f"parameter {n}: not a DTensor; capture before changing FSDP2's parameters")
        return FullySharded(model, params, group, timeout)

    # ---- what capture asks -------------------------------------------------

    def inputs(self, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors the step holds for the parameters: each rank's local
        shard (a view of FSDP2's padded storage), updated in place."""
        return {n: self.params[n].fp.sharded_param._local_tensor for n in params}

    def check_options(self, kinds: List[str], clip, scaled: bool) -> None:
        bad = [k for k in kinds if k not in ELEMENTWISE]
        if bad:
            raise UnsupportedStep(f"{bad[0]}: its update is not elementwise, so it cannot run on FSDP2's shards "
                                  f"one by one; memplan captures {', '.join(sorted(ELEMENTWISE))} with FSDP2")
        if clip is not None:
            raise UnsupportedStep("gradient clipping with FSDP2 is not captured yet (it needs the norm's "
                                  "all-reduce over the shards)")
        if scaled:
            raise UnsupportedStep("a gradient scaler with FSDP2 is not captured yet")

    def _collective(self, kind: str, name: str) -> Collective:
        return Collective(kind, self.group, name, self.timeout)

    def _gather(self, rec: Recorder, name: str, local: torch.Tensor) -> torch.Tensor:
        """Records the all-gather of parameter `name` from the rank's
        padded shard (`local` is its unpadded view); returns the gathered
        parameter (a view of the buffer)."""
        p = self.params[name]
        padded_shape = (p.chunk,) + p.rest
        # Recorded on every rank (ranks whose shard is shorter and ranks
        # whose is not record the same ops).
        padded = torch.as_strided(local, padded_shape, _contiguous_strides(padded_shape), local.storage_offset())
        buf = torch.empty((self.world * p.chunk,) + p.rest, dtype=local.dtype, device=local.device)
        rec.collective("all_gather", self._collective("all_gather", f"parameter {name}"), [buf], [padded])
        return buf if p.rows == self.world * p.chunk else buf.narrow(0, 0, p.rows)

    def leaves(self, rec: Recorder, fp: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Records the forward's all-gathers; returns the gathered
        parameters (leaves requiring grad where the parameter does)."""
        self._local = fp
        full = {}
        with torch.no_grad():
            for n, local in fp.items():
                t = self._gather(rec, n, local)
                if self.params[n].reshard:
                    self._forward_storage[storage_key(t)] = n
                full[n] = t
        for n, t in full.items():
            t.requires_grad_(self.params[n].fp.sharded_param.requires_grad)
        return full

    def forwarding(self, rec: Recorder):
        """FSDP2's forward hooks set aside, and the saved views of
        resharded parameters gathered again when the backward unpacks them."""
        stack = contextlib.ExitStack()
        stack.enter_context(_WithoutFsdpHooks(self.model))

        def pack(t):
            if isinstance(t, torch.Tensor):
                name = self._forward_storage.get(storage_key(t))
                if name is not None:
                    return _Regather(name, t)
            return t

        def unpack(x):
            if not isinstance(x, _Regather):
                return x
            g = self._regathered.get(x.name)
            if g is None:
                with torch.no_grad():
                    g = self._regathered[x.name] = self._gather(rec, x.name, self._local[x.name])
            return torch.as_strided(g, x.shape, x.stride, x.offset)

        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        return stack

    def reduce_gradients(self, rec: Recorder, grad_of: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Records each gradient's reduce-scatter; returns the local shard
        of each (the first rows of this rank's chunk)."""
        out = {}
        with torch.no_grad():
            for n, g in grad_of.items():
                p = self.params[n]
                full_shape = (self.world * p.chunk,) + p.rest
                if tuple(g.shape) == full_shape and g.is_contiguous():
                    padded = g
                else:
                    padded = g.new_zeros(full_shape)
                    padded.narrow(0, 0, p.rows).copy_(g)
                chunk = g.new_empty((p.chunk,) + p.rest)
                # The padded gradient is updated too: gloo's form sums it in
                # place (it dies here either way).
                rec.collective("reduce_scatter", self._collective("reduce_scatter", f"the gradient of {n}"),
                               [chunk, padded])
                out[n] = chunk.narrow(0, 0, tuple(p.fp.sharded_size)[0])  # on every rank, as above
        self._forward_storage.clear()
        self._regathered.clear()
        return out


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class _WithoutFsdpHooks:
    """Sets aside the forward hooks FSDP2 registered on its modules (its
    unsharding and resharding) while the step is recorded."""

    HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._saved: List[Tuple[torch.nn.Module, str, Any]] = []

    def __enter__(self):
        cls = _fsdp_module_class()
        for m in self.model.modules():
            if not isinstance(m, cls):
                continue
            state = m._get_fsdp_state()
            ids = set()
            for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
                for one in getattr(h, "handles", (h,)):
                    ids.add(one.id)
            for attr in self.HOOK_DICTS:
                d = getattr(m, attr, None)
                if d is None or not any(k in ids for k in d):
                    continue
                self._saved.append((m, attr, d))
                setattr(m, attr, type(d)((k, v) for k, v in d.items() if k not in ids))
        return self

    def __exit__(self, *exc) -> None:
        for m, attr, d in reversed(self._saved):
            setattr(m, attr, d)
        self._saved.clear()
