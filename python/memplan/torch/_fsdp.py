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
  (``saved_tensors_hooks``); where the backward pass reaches the unit's
  output (a hook on its gradient, FSDP2's pre-backward) its parameters are
  gathered again and put in the module in place of the forward's, and the
  markers unpack to views of those: so the forward's gathered bytes die
  with the unit's forward, also when the unit is checkpointed (its
  recomputation reads the module's parameters);
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

Gradient clipping by norm (``capture(..., clip_grad_norm=)``) is recorded
as ``clip_grad_norm_`` runs on FSDP2's DTensor gradients: the shards'
norms, an all-reduce of this rank's total to the power ``p``, its root,
and each shard scaled; clipping by value is elementwise on the shards.

Mixed precision (each unit's ``MixedPrecisionPolicy``) is recorded as
FSDP2 runs it: the shard is cast to ``param_dtype`` and gathered in it (so
the gathered buffer, and its regathers, are ``param_dtype`` bytes); the
unit's floating-point inputs are cast to ``param_dtype`` and its output to
``output_dtype``; each gradient is reduced in ``reduce_dtype`` (the
parameter's own dtype when unset, as FSDP2 upcasts the gradient to it) and
the reduced chunk cast back to the shard's dtype for the update. With a
16-bit ``reduce_dtype`` FSDP2 divides before and after a sum where memplan
averages in one collective: equal up to rounding.

In the arena (``step(batch, arena=True)``) each rank's padded shards and
optimizer state move into the rank's arena like any step input: the
DTensor's local tensor is re-pointed there, and so is FSDP2's flat padded
view of it (``FSDPParam._sharded_param_data``, what FSDP2's own all-gather
reads), so the parameters stay the user's DTensors and FSDP2 eager steps,
``state_dict()`` and ``torch.distributed.checkpoint`` keep working after
memplan's steps.

HSDP (``fully_shard(..., mesh=init_device_mesh(..., (R, S)))``, a 2-D mesh
of replicas of sharded groups) is recorded the same way over the shard
group, and each reduced gradient chunk is then summed over the replicate
group and divided by its size: every replica updates its shards with the
mean over all ranks, as FSDP2's reduce-scatter followed by its all-reduce.

Not yet captured (refused by name): CPU offload, other meshes of more than one dimension, sharding on a
dim other than 0, a root that is not sharded, gradient scaling, optimizers whose update is not elementwise (Adafactor, Muon), and
the step as one CUDA graph (``graph=True``: collectives inside a captured graph are not run yet).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._distributed import Collective, RankGroup, dist_world_rank
from ._errors import UnsupportedStep
from ._record import Recorder
from ._tensors import storage_key

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

    __slots__ = ("name", "fp", "reshard", "unit", "rows", "chunk", "rest", "orig", "param_dtype", "reduce_dtype",
                 "divide", "sum_only")

    def __init__(self, name: str, fp, reshard: bool, policy, unit: str = "", divide: Optional[float] = None,
                 sum_only: bool = False) -> None:
        self.name, self.fp, self.reshard = name, fp, reshard
        self.unit = unit  # the fully_shard module's path ("" for the root)
        # The unit's set_gradient_divide_factor (None: FSDP2's mean over
        # every data-parallel rank) and set_force_sum_reduction_for_comms.
        self.divide, self.sum_only = divide, sum_only
        size = tuple(fp._orig_size)
        self.rows, self.rest = size[0], size[1:]
        self.chunk = tuple(fp.padded_sharded_param_size)[0]  # rows of a padded shard
        # The unit's MixedPrecisionPolicy, as FSDPParam.init_dtype_attrs
        # reads it: the gathered dtype (None: the shard's own), and the
        # dtype the gradient is reduced in (the parameter's unless set).
        self.orig = fp.sharded_param.dtype
        wanted = policy.param_dtype
        self.param_dtype = wanted if wanted is not None and wanted != self.orig and self.orig.is_floating_point \
            else None
        self.reduce_dtype = policy.reduce_dtype or self.orig


class _Regather:
    """A saved tensor that is a view of a gathered parameter (while
    recording): which parameter, and the view."""

    __slots__ = ("name", "shape", "stride", "offset")

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.shape, self.stride, self.offset = name, tuple(t.shape), t.stride(), t.storage_offset()



def _mesh_kind(where: str, mesh_info) -> str:
    """The kind of a unit's mesh (``FSDPMeshInfo``: 1-D, ``HSDPMeshInfo``:
    2-D); refuses the meshes and groups memplan does not capture."""
    kind = type(mesh_info).__name__
    if not ((kind == "FSDPMeshInfo" and mesh_info.mesh.ndim == 1)
            or (kind == "HSDPMeshInfo" and mesh_info.mesh.ndim == 2)):
        raise UnsupportedStep(f"{where}: a {mesh_info.mesh.ndim}-D device mesh ({kind}); memplan.torch "
                              "captures FSDP2 on a 1-D mesh and HSDP on a 2-D (replicate, shard) mesh")
    if getattr(mesh_info, "reduce_scatter_process_group", None) is not None:
        raise UnsupportedStep(f"{where}: a reduce-scatter process group of its own is not captured")
    return kind


def _reshards_after_forward(where: str, is_root: bool, state, pg) -> bool:
    """Whether a unit frees its gathered parameters after its forward.
    FSDP2's root keeps them into the backward (its ``_lazy_init``)."""
    reshard = pg.post_forward_mesh_info is not None
    if is_root and state._auto_reshard_after_forward:
        reshard = False
    if reshard and pg.post_forward_mesh_info is not pg.mesh_info and \
            pg.post_forward_mesh_info.shard_mesh_size != pg.mesh_info.shard_mesh_size:
        raise UnsupportedStep(f"{where}: reshard_after_forward to another world size is not captured yet")
    return reshard


def _check_param(where: str, fp) -> None:
    """Refuses an ``FSDPParam`` sharded in a way memplan does not capture."""
    if getattr(fp, "offload_to_cpu", False):
        raise UnsupportedStep(f"{where}: fully_shard(offload_policy=CPUOffloadPolicy()) is not captured")
    if getattr(fp, "_has_sharded_grad_dtype_override", False):
        raise UnsupportedStep(f"{where}: a parameter with its own grad_dtype is not captured with FSDP2")
    if fp.fsdp_placement.dim != 0:
        raise UnsupportedStep(f"{where}: a parameter sharded on dim {fp.fsdp_placement.dim}; memplan "
                              "captures dim-0 sharding only")


# FSDPParamGroup's settings that memplan's recorded step cannot honour,
# each with the value memplan runs as: (attribute, that value, the
# FSDPModule call that changed it, why memplan does not follow it).
_REFUSED_SETTINGS = (
    ("reduce_grads", True, "set_requires_gradient_sync(False)",
     "memplan's step reduces every gradient once per step; accumulate micro-batches with "
     "capture(..., accumulate=N) instead of skipping the sync"),
    ("all_reduce_grads", True, "set_requires_all_reduce(False)",
     "memplan's HSDP step all-reduces every gradient chunk over the replicas once per step"),
    ("reshard_after_backward", True, "set_reshard_after_backward(False)",
     "memplan frees every gathered parameter within the step; keeping it into the next step is not planned"),
    ("reduce_scatter_unused_params", False, "set_reduce_scatter_unused_params(True)",
     "memplan reduces the gradients the step computes, not zeros for unused parameters"),
    ("unshard_in_backward", True, "set_unshard_in_backward(False)",
     "memplan gathers a resharded unit's parameters again where its backward reads them"),
)


def _check_group(where: str, pg) -> None:
    """Refuses, naming the ``FSDPModule`` call, the settings of a unit's
    ``FSDPParamGroup`` that memplan cannot honour (docs/fsdp-settings.md
    lists each setting and what memplan does with it)."""
    for attr, wanted, call, why in _REFUSED_SETTINGS:
        if getattr(pg, attr, wanted) != wanted:
            raise UnsupportedStep(f"{where}: FSDPModule.{call} is not captured: {why}")
    if getattr(pg, "_all_reduce_hook", None) is not None:
        raise UnsupportedStep(f"{where}: FSDPModule.set_all_reduce_hook(...) is not captured: memplan records "
                              "FSDP2's own reduction; apply the hook's arithmetic in the optimizer instead")
    for attr, default, call in (("_all_gather_comm", "DefaultAllGather", "set_custom_all_gather"),
                                ("_reduce_scatter_comm", "DefaultReduceScatter", "set_custom_reduce_scatter")):
        comm = getattr(pg, attr, None)
        if comm is not None and type(comm).__name__ != default:
            raise UnsupportedStep(f"{where}: a {type(comm).__name__} communicator (FSDPModule.{call}, "
                                  "set_symm_mem_for_comm or set_allocate_memory_from_process_group_for_comm) "
                                  "is not captured: memplan's collectives run on the process group into "
                                  "buffers of its own plan")
    for fp in pg.fsdp_params:
        if getattr(fp, "keep_unsharded_storage", False):
            raise UnsupportedStep(f"{where}: FSDPModule.set_keep_unsharded_storage(True) is not captured: memplan "
                                  "frees each gathered parameter where its plan says")
    factor = getattr(pg, "gradient_divide_factor", None)
    if factor is not None and not (isinstance(factor, (int, float)) and 0 < float(factor) < float("inf")):
        raise UnsupportedStep(f"{where}: set_gradient_divide_factor({factor!r}): memplan divides the summed "
                              "gradients by a positive finite factor")


def _param_groups(state) -> list:
    """A unit's ``FSDPParamGroup``s (PyTorch 2.15 may hold several)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    pg = state._fsdp_param_group
    return [] if pg is None else [pg]


def _read_units(model: torch.nn.Module, units) -> tuple:
    """What :class:`FullySharded` holds, read from FSDP2's state of every
    unit (``units``: (path, module) of each ``FSDPModule``): each
    parameter's :class:`_Param`, the shard group, each unit's policy, the
    resharded units' parameters and HSDP's replicate group; refuses, by
    name, what is not captured."""
    params: Dict[str, _Param] = {}
    policies = []
    resharded: Dict[int, Tuple[torch.nn.Module, List[str]]] = {}
    owner = {id(p): n for n, p in model.named_parameters()}
    group = replicate = None
    for uname, m in units:
        where = uname or "the root"
        state = m._get_fsdp_state()
        policy = state._mp_policy
        policies.append((m, policy))
        for pg in _param_groups(state):
            mesh_info = pg.mesh_info
            kind = _mesh_kind(where, mesh_info)
            _check_group(where, pg)
            reshard = _reshards_after_forward(where, m is model, state, pg)
            factor = getattr(pg, "gradient_divide_factor", None)
            divide = None if factor is None else float(factor)
            sum_only = bool(getattr(pg, "force_sum_reduction_for_comms", False))
            for fp in pg.fsdp_params:
                _check_param(where, fp)
                name = owner.get(id(fp.sharded_param))
                if name is None:
                    raise UnsupportedStep(f"{where}: an FSDP parameter the model does not list (a parameter "
                                          "replaced after fully_shard?)")
                params[name] = _Param(name, fp, reshard, policy, uname, divide, sum_only)
                if reshard:
                    resharded.setdefault(id(m), (m, []))[1].append(name)
            g = mesh_info.shard_process_group
            r = getattr(mesh_info, "replicate_process_group", None) if kind == "HSDPMeshInfo" else None
            if group is not None and (g is not group or r is not replicate):
                raise UnsupportedStep(f"{where}: sharded over another device mesh than the other units")
            group, replicate = g, r
    for n, p in model.named_parameters():
        if n not in params:
            raise UnsupportedStep(f"parameter {n} is not sharded by any fully_shard unit")
        if type(p).__name__ != "DTensor":
            raise UnsupportedStep(f"parameter {n}: not a DTensor; capture before changing FSDP2's parameters")
    return params, group, policies, list(resharded.values()), replicate


class FullySharded(RankGroup):
    """What capture needs of a model whose root is sharded with
    ``fully_shard``: every parameter's ``FSDPParam`` by name, each unit's
    resharding, the process group of the (1-D) mesh."""

    supports_graph = False

    def __init__(self, model: torch.nn.Module, params: Dict[str, _Param], group, policies=(), resharded=(),
                 replicate=None, *, timeout: float) -> None:
        super().__init__(group, timeout)
        self.model = model
        self.params = params
        self.replicate = replicate  # HSDP: the group the shards are replicated (and averaged) over
        self.policies = list(policies)  # each unit's module and MixedPrecisionPolicy (its casts)
        # Each unit that reshards after forward, with its parameters' names.
        self.resharded = list(resharded)
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
        return FullySharded(model, *_read_units(model, units), timeout=timeout)

    def placed(self) -> None:
        """FSDP2 keeps a flat view of each padded shard
        (``_sharded_param_data``: what its own all-gather reads): re-point
        it at the bytes the local shard now lives in (the arena's), so that
        FSDP2 eager steps read the values memplan's steps wrote."""
        for p in self.params.values():
            fp = p.fp
            local, old = fp.sharded_param._local_tensor, fp._sharded_param_data
            if local.untyped_storage().data_ptr() == old.untyped_storage().data_ptr():
                continue
            if local.untyped_storage().nbytes() < (old.storage_offset() + old.numel()) * old.element_size():
                raise UnsupportedStep(f"parameter {p.name}: its shard moved into fewer bytes than FSDP2's padded "
                                      "shard holds")
            fp._sharded_param_data = torch.empty(0, dtype=old.dtype, device=old.device).set_(
                local.untyped_storage(), old.storage_offset(), old.shape, old.stride())

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
        if scaled:
            raise UnsupportedStep("a gradient scaler with FSDP2 is not captured yet")

    def clip_norm(self, rec: Recorder, grad_of: Dict[str, torch.Tensor], max_norm: float,
                  norm_type: float) -> torch.Tensor:
        """Records ``clip_grad_norm_`` over the gradients' shards as it runs
        on FSDP2's DTensor gradients: each shard's norm, this rank's total,
        its ``p``-th power summed over the ranks (an all-reduce) and its
        ``p``-th root: the norm of the whole gradients; then every shard
        scaled by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm."""
        norm_type = float(norm_type)
        if norm_type == float("inf") or norm_type <= 0:
            raise UnsupportedStep(f"clip_grad_norm with norm_type={norm_type:g} and FSDP2: memplan reduces "
                                  "the shards' norms as p-th powers (a finite p > 0)")
        with torch.no_grad():
            grads = list(grad_of.values())
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                             norm_type)
            powered = local.pow(norm_type)
            rec.collective("all_reduce", self._collective("all_reduce", "the gradients' norm"), [powered])
            total = powered.pow(1.0 / norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        return total

    def _collective(self, kind: str, name: str) -> Collective:
        return Collective(kind, self.group, name, self.timeout)

    def _gather(self, rec: Recorder, name: str, local: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """Records the all-gather of parameter `name` from the rank's
        padded shard (`local` is its unpadded view), for the forward or
        (`backward`) a resharded unit's backward; returns the gathered
        parameter (a view of the buffer). Its ops name the unit and the
        pass (attributes ``fsdp_unit``, ``fsdp_pass``): the FSDP2 eager
        baseline issues a unit's gathers together (docs/benchmarks.md)."""
        p = self.params[name]
        with _tagged(rec, fsdp_unit=p.unit, fsdp_pass="backward" if backward else "forward"):
            return self._gather_ops(rec, p, local)

    def _gather_ops(self, rec: Recorder, p: "_Param", local: torch.Tensor) -> torch.Tensor:
        name = p.name
        padded_shape = (p.chunk,) + p.rest
        # Recorded on every rank (ranks whose shard is shorter and ranks
        # whose is not record the same ops).
        padded = torch.as_strided(local, padded_shape, _contiguous_strides(padded_shape), local.storage_offset())
        if p.param_dtype is not None:  # mixed precision: the shard is cast, then gathered
            padded = padded.to(p.param_dtype)
        buf = torch.empty((self.world * p.chunk,) + p.rest, dtype=padded.dtype, device=local.device)
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
        for m, policy in self.policies:
            stack.enter_context(_casts(m, policy))

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
                    g = self._regathered[x.name] = self._gather(rec, x.name, self._local[x.name], True)
            return torch.as_strided(g, x.shape, x.stride, x.offset)

        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        for m, names in self.resharded:
            stack.enter_context(_pre_backward(m, lambda names=names: self._unshard(rec, names)))
        return stack

    def _unshard(self, rec: Recorder, names: List[str]) -> None:
        """A resharded unit's backward begins (FSDP2's pre-backward
        unshard): its parameters gathered again and put in the module in
        place of the forward's, so what the backward reads of them (a
        checkpointed block's recomputation reads the module's parameters,
        not saved tensors) reads the new gathers, and the forward's die
        with the unit's forward."""
        from torch.nn.utils._named_member_accessor import NamedMemberAccessor

        acc = NamedMemberAccessor(self.model)
        with torch.no_grad():
            for n in names:
                g = self._regathered.get(n)
                if g is None:
                    g = self._regathered[n] = self._gather(rec, n, self._local[n], True)
                # As the forward's leaf: a recomputation saves for a
                # parameter that requires grad what the forward saved.
                g.requires_grad_(self.params[n].fp.sharded_param.requires_grad)
                acc.swap_tensor(n, g)

    def reduce_gradients(self, rec: Recorder, grad_of: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Records each gradient's reduce-scatter; returns the local shard
        of each (the first rows of this rank's chunk)."""
        out = {}
        with torch.no_grad():
            for n, g in grad_of.items():
                with _tagged(rec, fsdp_unit=self.params[n].unit):
                    out[n] = self._reduce(rec, n, g)
        self._forward_storage.clear()
        self._regathered.clear()
        return out

    def _reduce(self, rec: Recorder, n: str, g: torch.Tensor) -> torch.Tensor:
        """Records one gradient's padding, reduce-scatter (and HSDP's mean
        over the replicas) and cast; returns the local shard's gradient."""
        p = self.params[n]
        full_shape = (self.world * p.chunk,) + p.rest
        if tuple(g.shape) == full_shape and g.is_contiguous() and g.dtype == p.reduce_dtype:
            padded = g
        else:  # padded with zeros, in the dtype it is reduced in
            padded = g.new_zeros(full_shape, dtype=p.reduce_dtype)
            padded.narrow(0, 0, p.rows).copy_(g)
        chunk = padded.new_empty((p.chunk,) + p.rest)
        # FSDP2's reduction: the sum over every data-parallel rank (the
        # shard group, and HSDP's replicas) divided by the unit's
        # set_gradient_divide_factor, or by the number of those ranks when
        # unset (a mean). The reduce-scatter divides (its `divide`); HSDP's
        # all-reduce then sums over the replicas, and without a factor the
        # chunk is divided by their number.
        replicas = dist_world_rank(self.replicate)[0] if self.replicate is not None else 1
        divide = p.divide if p.divide is not None else float(self.world)
        # The padded gradient is updated too: gloo's form sums it in
        # place (it dies here either way).
        rec.collective("reduce_scatter", Collective("reduce_scatter", self.group, f"the gradient of {n}",
                                                    self.timeout, divide=divide, sum_only=p.sum_only),
                       [chunk, padded])
        if self.replicate is not None:  # HSDP: the chunk summed over the replicas too
            rec.collective("all_reduce", Collective("all_reduce", self.replicate,
                                                    f"the gradient chunk of {n} over the replicas",
                                                    self.timeout), [chunk])
            if p.divide is None and replicas > 1:
                chunk.div_(replicas)
        if chunk.dtype != p.orig:  # reduced in another dtype: the shard's gradient is in its own
            chunk = chunk.to(p.orig)
        return chunk.narrow(0, 0, tuple(p.fp.sharded_size)[0])  # on every rank, as above


@contextlib.contextmanager
def _tagged(rec: Recorder, **attrs):
    """Every op recorded inside gets `attrs` among its attributes (which
    unit and pass an FSDP2 collective's ops serve: the eager baseline's
    order reads them, :mod:`memplan.baselines`)."""
    start = len(rec.ops)
    yield
    for op in rec.ops[start:]:
        op.setdefault("attrs", {}).update(attrs)


def _cast_floats(dtype: torch.dtype, tree):
    """`tree` with its floating-point tensors of another dtype cast to
    `dtype` (FSDP2's ``_cast_fp_tensor`` over a pytree)."""
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


@contextlib.contextmanager
def _casts(module: torch.nn.Module, policy):
    """The casts FSDP2's forward hooks make on unit `module` under its
    MixedPrecisionPolicy: floating-point inputs to ``param_dtype`` (with
    ``cast_forward_inputs``), and its output to ``output_dtype``; the
    hooks that unshard and reshard are set aside (`_WithoutFsdpHooks`)."""
    handles = []
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        def pre(_m, args, kwargs):
            return _cast_floats(policy.param_dtype, args), _cast_floats(policy.param_dtype, kwargs)
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
    if policy.output_dtype is not None:
        handles.append(module.register_forward_hook(lambda _m, _i, out: _cast_floats(policy.output_dtype, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _pre_backward(module: torch.nn.Module, fn):
    """Calls `fn()` once where the backward pass reaches `module`'s forward
    output (a hook on the gradient of each output tensor that requires
    one), as FSDP2's pre-backward hook does."""
    def post_forward(_m, _args, out):
        if not torch.is_grad_enabled():
            return None
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                fn()
            return None

        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
        return None

    h = module.register_forward_hook(post_forward)
    try:
        yield
    finally:
        h.remove()


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
