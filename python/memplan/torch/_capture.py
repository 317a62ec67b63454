"""Recording a training step: what :func:`memplan.torch.capture` registers
as the step's inputs (:class:`_Inputs`: parameters, buffers, optimizer
state, the batch, as fake tensors) and how it drives the model under the
:class:`~memplan.torch._record.Recorder` (:func:`_trace`): the forward pass
and loss, the backward pass (each micro-batch's, accumulated), data-parallel
reductions (:mod:`memplan.torch._distributed`), the gradient scaler's
unscaling, clipping and each parameter's update."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_unflatten

import memplan

from . import _distributed, _optim, _scaler
from ._captured import AsCaptured
from ._calls import Call
from ._clipping import Clipping
from ._errors import UnsupportedStep
from ._generators import GeneratorStates
from ._record import Recorder
from ._tensors import Layout


def local_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and optimizer state),
    or the tensor itself."""
    return x._local_tensor if type(x).__name__ == "DTensor" else x


class BatchInput(NamedTuple):
    """One tensor of the batch: its graph tensor and the layout every
    batch must have there, with its name in the batch (``[0]``, ``x``)."""

    tensor: int
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    name: str


class StateSlot(NamedTuple):
    """An optimizer state tensor the graph reads: ``optimizer.state[param][key]``."""

    tensor: int
    param: torch.Tensor
    key: str


class GroupSlot(NamedTuple):
    """A param group's tensor the graph reads: ``param_groups[group][key]``
    (a capturable Adam's tensor learning rate)."""

    tensor: int
    group: int
    key: str


@dataclasses.dataclass(frozen=True)
class Captured:
    """One recorded step, as :func:`memplan.torch.capture` hands it to
    :class:`memplan.torch.Step`: the graph and the program of calls (one
    per op, in the graph's op order), each graph tensor's layout, and how
    the step meets the caller's objects."""

    graph: Dict[str, Any]
    calls: List[Call]
    layouts: List[Layout]
    device: str  # the device type whose memory is planned
    bound: Dict[int, torch.Tensor]  # graph tensor -> the caller's tensor (all inputs but the batch)
    sources: Dict[int, torch.Tensor]  # a constant -> the caller's tensor it was copied from
    batch_spec: Any  # the batch's pytree structure
    batch_layouts: List[BatchInput]  # per batch tensor (each micro-batch's in turn)
    loss: int  # the loss's graph tensor
    norm: Optional[int]  # the clipped gradients' total norm's, when clipping
    updated: List[torch.Tensor]  # the parameters the step updates
    optimizer_calls: List[bool]  # per call: whether it reads the optimizer's numbers
    accumulate: int  # micro-batches per step
    state_slots: Tuple[StateSlot, ...]  # optimizer state the graph reads
    group_slots: Tuple[GroupSlot, ...]  # param groups' tensors the graph reads
    seconds: float  # what capture took
    meta: bool = False  # traced from a model on the meta device: planned, never run


def _path_name(path) -> str:
    return "".join(str(k) for k in path) or "batch"


def _step_device(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: Dict[str, Any],
                 meta_device: str):
    """The device type the step is traced for, and the device a ``meta``
    model is traced as (else None). Refuses a model on several device
    types and a param group holding a tensor that is not a parameter."""
    devices = {p.device.type for p in params.values()} | {b.device.type for b in model.buffers()}
    if not devices:
        raise UnsupportedStep(f"the model ({type(model).__name__}) has no parameters or buffers: there is no "
                              "training step to capture")
    if len(devices) != 1:
        raise UnsupportedStep(f"the model's tensors are on several device types: {sorted(devices)}")
    device = devices.pop()
    traced = torch.device(meta_device) if device == "meta" else None
    ids = {id(p) for p in params.values()}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in ids:
                raise UnsupportedStep(f"param group {g} holds a tensor that is not a parameter of the model")
    return (traced.type if traced is not None else device), traced


class _Inputs:
    """What a step reads, registered with the recorder as fake tensors:
    parameters (`fp`), buffers (`fb`), optimizer state (`fstate`, by
    parameter id) and the batch (`fbatches`, one per micro-batch, with
    their pytree `spec` and each leaf's layout). `bound` maps a graph
    tensor to the real tensor it is (every input but the batch, which each
    call binds anew)."""

    def __init__(self, rec: Recorder, traced: Optional[torch.device], params: Dict[str, Any],
                 buffers: Dict[str, Any], optimizer: torch.optim.Optimizer, example_batch: Any,
                 micro: int = 1) -> None:
        self.rec, self.traced = rec, traced
        self.fake = FakeTensorMode()
        self.bound: Dict[int, torch.Tensor] = {}
        self.fp = {n: self.reg(p, f"param:{n}", "parameter") for n, p in params.items()}
        self.fb = {n: self.reg(b, f"buffer:{n}", "parameter") for n, b in buffers.items()}
        self.optimizer = optimizer
        self.fstate: Dict[int, Dict[str, torch.Tensor]] = {}
        self.state_slots: List[StateSlot] = []
        self.fgroup: Dict[int, torch.Tensor] = {}  # group index -> its tensor learning rate, fake
        self.group_slots: List[GroupSlot] = []
        self.fscaler: Optional[Tuple[torch.Tensor, torch.Tensor, Tuple[float, float, int]]] = None
        leaves, self.spec = torch.utils._pytree.tree_flatten_with_path(example_batch)
        self.batch_layouts: List[BatchInput] = []
        self.fbatches = []  # one fake batch per micro-batch
        for k in range(micro):
            fleaves = []
            for path, x in leaves:
                nm = _path_name(path) if micro == 1 else f"[{k}]{_path_name(path)}"
                if not isinstance(x, torch.Tensor):
                    raise UnsupportedStep(_not_a_tensor(nm, x))
                # Each micro-batch is an input of its own (the example's copy
                # stands for the later ones' values while recording).
                f = self.reg(x if k == 0 else x.clone(), f"input:{nm}", "input")
                fleaves.append(f)
                i = rec.table.index_of(f)
                del self.bound[i]  # each call binds its own batch
                self.batch_layouts.append(BatchInput(i, tuple(x.shape), x.dtype, x.device, nm))
            self.fbatches.append(tree_unflatten(fleaves, self.spec))
        for (n, p), f in zip(params.items(), self.fp.values()):
            f.requires_grad_(p.requires_grad)
            for hook in AsCaptured.hooks_of(n, p):
                f.register_hook(hook)  # autograd.grad runs them on the gradient, as .backward() does

    def scaler(self, scaler, tensors: Tuple[torch.Tensor, torch.Tensor]) -> None:
        """The gradient scaler's scale and growth tracker as step inputs
        (`fscaler`, with the settings its update reads)."""
        scale, growth = tensors
        self.fscaler = (self.reg(scale, "scaler:scale", "optimizer_state"),
                        self.reg(growth, "scaler:growth_tracker", "optimizer_state"), _scaler.settings(scaler))

    def state(self, p: torch.Tensor, n: str) -> Dict[str, torch.Tensor]:
        """Parameter `p`'s optimizer state as fake tensors, made as PyTorch
        makes it on the first step (:meth:`_optim.Kind.init_state`) and
        registered when its update is recorded: a parameter that gets no
        gradient keeps none, as in eager. Called while recording, so with
        the recorder and fake mode set aside."""
        with _disable_current_modes():
            _optim.ensure_state(self.optimizer, p)
            self.fstate[id(p)] = {k: self.reg(local_tensor(v), f"state:{n}.{k}", "optimizer_state")
                                  for k, v in _optim.state_tensors(self.optimizer, p).items()}
        self.state_slots += [StateSlot(self.rec.table.index_of(f), p, k) for k, f in self.fstate[id(p)].items()]
        return self.fstate[id(p)]

    def numbers(self, gi: int, group: Dict[str, Any], markers: Dict[str, float]) -> Dict[str, Any]:
        """Group `gi`'s numbers as its update reads them: the markers, and a
        tensor learning rate (capturable Adam) as the step input it is,
        registered on its first use. Called while recording."""
        lr = group.get("lr")
        if not isinstance(lr, torch.Tensor):
            return markers
        if gi not in self.fgroup:
            with _disable_current_modes():
                self.fgroup[gi] = self.reg(lr, f"optimizer:group{gi}.lr", "optimizer_state")
            self.group_slots.append(GroupSlot(self.rec.table.index_of(self.fgroup[gi]), gi, "lr"))
        return {**markers, "lr": self.fgroup[gi]}

    def reg(self, x: torch.Tensor, id: str, role: str) -> torch.Tensor:
        """`x` as a fake tensor the recorder knows as `id`."""
        if self.traced is not None and x.device.type == "meta":
            f = FakeTensor(self.fake, x.detach(), self.traced)
        else:
            f = self.fake.from_tensor(x)
        self.bound[self.rec.table.register(f, id, role)] = x
        if role == "parameter":  # parameters and buffers, also when read from outside the model
            self.rec.outside.stands_for(x, f, id)
        return f


def _trace(rec: Recorder, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hyper, loss_fn,
           inputs: _Inputs, clip: Optional[Clipping] = None,
           dist: Optional[_distributed.DataParallel] = None):
    """Records forward and backward (of every micro-batch, gradients
    accumulated), gradient clipping (`clip`) and each parameter's update on the fake
    inputs; returns the loss's graph tensor, the parameters updated, the
    total norm's graph tensor (or None) and, with a gradient scaler, each
    optimizer's overflow flag's graph tensor and the ids of the update ops
    it gates (or None)."""
    params = dict(model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    fp = inputs.fp
    trainable = [n for n, p in params.items() if p.requires_grad]
    scale = inputs.fscaler[0] if inputs.fscaler is not None else None
    with contextlib.ExitStack() as stack:
        for ctx in (inputs.fake, rec, GeneratorStates(rec)):
            stack.enter_context(ctx)
        # What the forward reads as parameters, whose gradients the backward
        # computes: the parameters themselves, or (FSDP2) their all-gathers.
        leaves = dist.leaves(rec, fp) if dist is not None else fp
        stack.enter_context(_reparametrize_module(model, {**leaves, **inputs.fb}, tie_weights=True))
        if dist is not None:
            stack.enter_context(dist.forwarding(rec))
        if len(inputs.fbatches) == 1:
            loss, grad_of = _forward_backward(rec, model, loss_fn, inputs.fbatches[0], leaves, trainable, 1, scale)
        else:
            loss, grad_of = _accumulate(rec, model, loss_fn, inputs.fbatches, leaves, trainable, scale)
        if dist is not None:
            grad_of = dist.reduce_gradients(rec, grad_of)
        loss_index = rec.table.mark(loss, "output", persistent=True)
        for g in grad_of.values():
            r = rec.table.root(rec.table.index_of(g))
            if rec.table.tensors[r]["role"] != "parameter":
                rec.table.tensors[r]["role"] = "gradient"
        rec.phase = "optimizer"
        flags = []
        if scale is not None:
            with torch.no_grad():  # scaler.unscale_(o) for each optimizer
                flags = [_scaler.unscale([(name_of[id(p)], grad_of[name_of[id(p)]]) for group in o.param_groups
                                          for p in group["params"] if name_of[id(p)] in grad_of], scale)
                         for o in optimizer.members]
        norm_index = None
        total = dist.clip_norm(rec, grad_of, clip.limit, clip.norm_type) if (
            dist is not None and clip is not None and clip.kind == "norm") else None
        if total is not None:
            norm_index = rec.table.mark(total, "output", persistent=True)
        elif clip is not None:
            norm_index = clip.record(rec, fp, grad_of)
        updated, spans = _updates(rec, optimizer, hyper, name_of, fp, grad_of, inputs)
        gate = None
        if flags:
            with torch.no_grad():
                gate = _scaler.gate(rec, spans, flags)
                _scaler.update_scale(scale, inputs.fscaler[1], flags, inputs.fscaler[2])
        _keep_reassigned_buffers(model, inputs.fb)
    return loss_index, updated, norm_index, gate


def _not_a_tensor(name: str, x: Any) -> str:
    """Why batch element `name` is refused, with what to pass instead."""
    import collections.abc
    import dataclasses

    why = f"batch element {name}: expected a tensor, got {type(x).__name__}"
    if isinstance(x, collections.abc.Mapping):  # a tokenizer's BatchEncoding
        return why + " (a mapping torch's pytree does not open: pass dict(batch))"
    if dataclasses.is_dataclass(x):
        return why + (" (a dataclass torch's pytree does not open: pass dataclasses.asdict(batch), or register "
                      "the class with torch.utils._pytree.register_dataclass)")
    return why + " (a batch is a tensor, or tuples, lists and dicts of tensors)"


def _callers_line(tb) -> Optional[str]:
    """The innermost line of a traceback in neither torch nor memplan: the
    caller's model or loss code that made the step refuse."""
    import os
    import traceback

    ours = [os.path.dirname(torch.__file__), os.path.dirname(memplan.__file__)]
    frames = [f for f in traceback.extract_tb(tb) if not any(f.filename.startswith(d) for d in ours)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno}, in {f.name}: {f.line}"


def _keep_reassigned_buffers(model: torch.nn.Module, fb: Dict[str, torch.Tensor]) -> None:
    """A buffer the forward pass reassigns (``self.n = self.n + 1``) rather
    than updates in place leaves eager's module holding the new tensor;
    the capture's module is given back its own buffers, so the step copies
    each such buffer's last value into it, as the step's last use of the
    buffer (every op that read the old value runs before: the graph
    keeps an update after the reads listed before it)."""
    with torch.no_grad():
        for name, f in fb.items():
            try:
                now = model.get_buffer(name)
            except AttributeError:  # set to None
                now = None
            if now is f:
                continue
            if not isinstance(now, torch.Tensor) or (now.shape, now.dtype) != (f.shape, f.dtype):
                got = f"{now.dtype} {list(now.shape)}" if isinstance(now, torch.Tensor) else type(now).__name__
                raise UnsupportedStep(
                    f"buffer {name}: the forward pass replaces it with a {got}, not a {f.dtype} {list(f.shape)} "
                    "tensor; memplan keeps each buffer at its shape and dtype (update it in place, or keep the "
                    "new shape from the start)"
                )
            f.copy_(now)


def _updates(rec: Recorder, optimizer, hyper, name_of: Dict[int, str], fp: Dict[str, torch.Tensor],
             grad_of: Dict[str, torch.Tensor], inputs: "_Inputs"):
    """Records each parameter's update, optimizer by optimizer; returns the
    parameters updated and each optimizer's span of ops."""
    updated, spans = [], []
    gi = 0
    with torch.no_grad():
        for o in optimizer.members:
            first = len(rec.ops)
            for group in o.param_groups:
                for p in group["params"]:
                    n = name_of[id(p)]
                    if n in grad_of:
                        _optim.update(hyper.kinds[gi], group, inputs.numbers(gi, group, hyper.markers[gi]),
                                      fp[n], grad_of[n], inputs.state(p, n))
                        updated.append(p)
                gi += 1
            spans.append((first, len(rec.ops)))
    return updated, spans


def _forward_backward(rec: Recorder, model, loss_fn, fbatch, fp: Dict[str, torch.Tensor], trainable: List[str],
                      micro: int, scale: Optional[torch.Tensor] = None):
    """Records ``loss_fn(model, fbatch)`` (divided by `micro`, the number
    of micro-batches, when there are several) and its gradients (of the
    loss times the gradient scaler's `scale`, if any); returns the loss
    and the gradient of each trainable parameter that has one."""
    rec.phase = "forward"
    loss = loss_fn(model, fbatch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UnsupportedStep("loss_fn must return a scalar tensor")
    if micro != 1:
        loss = loss / micro
    scaled = loss * scale if scale is not None else loss  # scaler.scale(loss)
    rec.phase = "backward"
    try:
        grads = torch.autograd.grad(scaled, [fp[n] for n in trainable], allow_unused=True)
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise UnsupportedStep(
            "torch.utils.checkpoint(..., use_reentrant=True): its backward cannot be recorded "
            "through torch.autograd.grad; pass use_reentrant=False (PyTorch's recommendation), "
            "or drop the checkpointing and let memplan choose what to recompute "
            "(capture(..., budget=N) or step.fit)"
        ) from None
    return loss, {n: g for n, g in zip(trainable, grads) if g is not None}


def _accumulate(rec: Recorder, model, loss_fn, fbatches: List[Any], fp: Dict[str, torch.Tensor],
                trainable: List[str], scale: Optional[torch.Tensor] = None):
    """Records gradient accumulation over `fbatches` as eager PyTorch runs
    ``(loss_fn(model, mb) / N).backward()`` for each micro-batch: the first
    micro-batch's gradients become the accumulators (copied, as autograd's
    ``AccumulateGrad`` copies them, where one is shared with another
    parameter's or laid out otherwise than its parameter), each later one
    is added in place. Returns the sum of the divided losses and the
    accumulated gradients."""
    total = None
    acc: Dict[str, torch.Tensor] = {}
    for fbatch in fbatches:
        loss, grads = _forward_backward(rec, model, loss_fn, fbatch, fp, trainable, len(fbatches), scale)
        roots = collections.Counter(rec.table.root(rec.table.index_of(g)) for g in grads.values())
        with torch.no_grad():
            total = loss if total is None else total + loss
            for n, g in grads.items():
                if n in acc:
                    acc[n].add_(g)
                    continue
                i = rec.table.index_of(g)
                owned = rec.table.root(i) == i and roots[i] == 1 and g.stride() == fp[n].stride()
                acc[n] = g if owned else g.clone(memory_format=torch.preserve_format)
    return total, acc
