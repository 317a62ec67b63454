"""Runs a recorded step in a planned order, and measures what it holds.

:class:`Program` is the recorded calls plus, for the chosen order, which
tensors die after each position (a tensor dies after the last op that reads,
writes or makes it or any view of it; the caller's tensors never die). The
runner keeps each value in one table and drops it there, so PyTorch's
allocator gets its bytes back at exactly the point memplan's liveness says.

:class:`StorageTracker` is the independent measurement: a
``TorchDispatchMode`` that sees every op the runner calls, notes each new
storage an op returns (weakly, so it does not keep it alive) and, after each
op, sums the bytes of the storages still alive on the planned device. Its
peak is what the run really held in tensors, whatever the runner believes.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity, profile
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.dlpack import from_dlpack, to_dlpack

from ._aten import out_variant
from ._calls import Call, Ref
from ._errors import UnsupportedStep


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages on `device` (a device type) seen so far."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self._live: Dict[int, Any] = {}  # storage key -> (weak ref, bytes, the op that made it)
        self._op: Any = None  # the op whose outputs are being tracked (None: held before the step)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._peak: List[Tuple[int, Any]] = []  # (bytes, the op that made it) of each storage at the peak
        self._whole: Optional[Tuple[int, int, Any]] = None  # (start, end, arena storage)

    def count_as_one(self, buffer: torch.Tensor) -> None:
        """Counts `buffer`'s storage, and every storage whose bytes lie
        inside it (an arena's parameters have storages of their own over
        its bytes: :meth:`Arena.view`), as that one storage."""
        st = buffer.untyped_storage()
        self._whole = (st.data_ptr(), st.data_ptr() + st.nbytes(), st)
        self.track(buffer)

    def track(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.device.type != self.device:
            return
        st = x.untyped_storage()
        whole = self._whole
        if whole is not None and whole[0] <= st.data_ptr() < whole[1]:
            st = whole[2]
        ref = StorageWeakRef(st)
        seen = self._live.get(ref.cdata)
        if seen is None or seen[0].expired():  # new, or a dead one's address reused
            self._live[ref.cdata] = (ref, st.nbytes(), self._op)

    def measure(self) -> int:
        total = 0
        for key in [k for k, (r, _, _) in self._live.items() if r.expired()]:
            del self._live[key]
        for _, n, _ in self._live.values():
            total += n
        self.live_bytes = total
        if total > self.peak_bytes:
            self.peak_bytes = total
            self._peak = [(n, op) for _, n, op in self._live.values()]
        return total

    def peak_contents(self) -> List[Tuple[int, Optional[str]]]:
        """The storages live at the peak: (bytes, the op that made it, or
        None for one held before the step), largest first. Says what a
        peak above the plan's max live held."""
        return sorted(((n, None if op is None else str(op)) for n, op in self._peak),
                      key=lambda e: (-e[0], e[1] or ""))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = func
        for x in tree_flatten(out)[0]:
            self.track(x)
        self._op = None
        self.measure()
        return out


def allocator_peak(fn: Callable[[], Any], resident: Iterable[torch.Tensor], device: str = "cpu") -> int:
    """Peak bytes held on `device` while `fn()` runs: the bytes of the
    storages of `resident` (tensors alive before and after, such as
    parameters and optimizer state) plus the highest running sum of the
    allocator's allocation and free events during the call. Every
    allocation counts, including those of compiled kernels and of memory
    that is not a tensor (on an eager step it agrees with
    :class:`StorageTracker` to within the few bytes of such buffers)."""
    kind = {"cpu": torch.autograd.DeviceType.CPU, "cuda": torch.autograd.DeviceType.CUDA}[device]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == kind]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    storages = {}
    for x in resident:
        if isinstance(x, torch.Tensor) and x.device.type == device:
            st = x.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values()) + peak


def _binder(args, kwargs, subst: bool) -> Callable:
    """A function ``(env, numbers) -> (args, kwargs)`` that puts the values
    of `env` in place of each :class:`Ref` of a recorded call's arguments
    (and, with `subst`, the optimizer markers' values in place of floats).

    Replaying a step binds once per op, so the arguments are walked once,
    here, into one Python expression that rebuilds only the lists, tuples
    and dicts on the way to a Ref (or marker) and reuses every other value
    as the recorded object, e.g. ``lambda env, nums, c: ((env[3], c[0]),
    c[1])`` (bound to its constants `c`): one frame per op, where a pytree
    map took dozens. Arguments in any other container (a named tuple) go
    through ``tree_map``."""
    consts: List[Any] = []

    def const(x) -> str:
        consts.append(x)
        return f"c[{len(consts) - 1}]"

    def reaches(x) -> bool:
        if isinstance(x, Ref) or (subst and isinstance(x, float)):
            return True
        if type(x) in (list, tuple):
            return any(reaches(y) for y in x)
        return type(x) is dict and any(reaches(y) for y in x.values())

    def expr(x) -> str:
        if isinstance(x, Ref):
            return f"env[{int(x.index)}]"
        if subst and isinstance(x, float):
            k = const(x)
            return f"nums.get({k}, {k})"
        if not reaches(x):
            return const(x)
        if type(x) is dict:
            return "{" + ", ".join(f"{const(key)}: {expr(y)}" for key, y in x.items()) + "}"
        inner = ", ".join(expr(y) for y in x)
        return f"[{inner}]" if type(x) is list else f"({inner},)"

    def walked(x) -> int:
        """Refs (and markers) that `expr` reaches."""
        if isinstance(x, Ref) or (subst and isinstance(x, float)):
            return 1
        if type(x) in (list, tuple):
            return sum(walked(y) for y in x)
        if type(x) is dict:
            return sum(walked(y) for y in x.values())
        return 0

    leaves = tree_flatten((args, kwargs))[0]
    if sum(isinstance(x, Ref) or (subst and isinstance(x, float)) for x in leaves) != walked((args, kwargs)):
        # A Ref inside a container `expr` does not open (a named tuple).
        def slow(env, nums):
            def bind(x):
                if isinstance(x, Ref):
                    return env[x.index]
                return nums.get(x, x) if subst and isinstance(x, float) else x
            return tree_map(bind, args), tree_map(bind, kwargs)
        return slow
    args_src = expr(tuple(args)) if reaches(tuple(args)) else const(args)
    kwargs_src = expr(dict(kwargs)) if reaches(dict(kwargs)) else const(kwargs)
    # Only indices, constant slots and brackets are spliced into the source.
    made = eval(f"lambda c: lambda env, nums: ({args_src}, {kwargs_src})", {"__builtins__": {}})(consts)
    # For the arena's generated calls (_generate): the two
    # expressions, over `env`, `nums` and the constants `c`.
    made.source = (args_src, kwargs_src, consts)
    return made


class Gate:
    """The updates of a step with a gradient scaler, which run only when no
    gradient of their optimizer overflowed: optimizer `j`'s update calls
    (`calls[j]`, call indices) are skipped when its flag tensor
    (`flags[j]`, a graph index) is set. Each flag is read once per step,
    at the first of its calls (every plan orders them after the flag's
    last check); :attr:`skipped` then says, per optimizer, what
    happened."""

    def __init__(self, flags: Sequence[int], calls: Sequence[frozenset]) -> None:
        self.flags = list(flags)
        self.calls = list(calls)
        self.skipped: List[Optional[bool]] = [None] * len(self.flags)

    def of_call(self) -> Dict[int, int]:
        """Call index -> the optimizer whose flag gates it."""
        return {k: j for j, ks in enumerate(self.calls) for k in ks}

    def reset(self) -> None:
        self.skipped = [None] * len(self.flags)

    def closed(self, env: Dict[int, torch.Tensor], j: int) -> bool:
        if self.skipped[j] is None:
            self.skipped[j] = bool(env[self.flags[j]].item() != 0)
        return self.skipped[j]


class Program:
    """The calls of a step in one order, with the tensors that die after
    each position.

    `takes` maps a call to the reuse the plan takes there, (output, input)
    graph tensor indices: the call runs as its ``out=`` overload writing
    into the input's tensor, whose last use it is, so the output needs no
    new bytes (docs/graph-format.md, reuse hints). A call whose overload
    refuses runs as recorded instead and is noted in :attr:`unreused`."""

    def __init__(self, calls: Sequence[Call], order: Sequence[int], keep: Sequence[int],
                 takes: Optional[Dict[int, Tuple[int, int]]] = None, gate: Optional[Gate] = None) -> None:
        self.calls = calls
        self.order = list(order)
        self.takes = dict(takes or {})
        self.unreused: set = set()
        self._held_plan: Optional[tuple] = None
        # Position of each gated call -> its optimizer (see Gate), and the gate.
        self.gate = gate
        of_call = gate.of_call() if gate is not None else {}
        self.gated = {pos: of_call[k] for pos, k in enumerate(self.order) if k in of_call}
        last: Dict[int, int] = {}
        for pos, k in enumerate(self.order):
            c = calls[k]
            for x in tree_flatten((c.args, c.kwargs))[0]:
                if isinstance(x, Ref):
                    last[x.index] = pos
            for _, i in c.outputs:
                last[i] = pos
            if pos in self.gated:
                flag = gate.flags[self.gated[pos]]
                last[flag] = max(last.get(flag, pos), pos)  # read there
        kept = set(keep)
        self.dies: List[List[int]] = [[] for _ in self.order]
        for i, pos in last.items():
            if i not in kept:
                self.dies[pos].append(i)

    def run(self, env: Dict[int, torch.Tensor], numbers: Dict[float, float],
            optimizer_calls: Sequence[bool]) -> None:
        """Runs every call in order on the values in `env`, substituting the
        optimizer's markers in the calls flagged in `optimizer_calls`."""
        gated, gate = self.gated, self.gate
        with torch.no_grad():
            for pos, (bind, k, func, outputs, only, dies) in enumerate(self.plan(optimizer_calls)):
                if pos in gated and gate.closed(env, gated[pos]):
                    for i in dies:
                        env.pop(i, None)
                    continue
                args, kwargs = bind(env, numbers)
                out = self._call_over(k, args, kwargs, env) if k in self.takes else None
                if out is None:
                    out = func(*args, **kwargs)
                args = kwargs = None
                if only is not None and isinstance(out, torch.Tensor):
                    env[only] = out
                elif outputs:
                    flat = tree_flatten(out)[0]
                    for p, i in outputs:
                        env[i] = flat[p]
                    flat = None
                out = None  # no reference may outlive the table's
                for i in dies:
                    env.pop(i, None)

    def plan(self, optimizer_calls: Sequence[bool]) -> List[tuple]:
        """Per position: the binding, the call, its outputs (and the one
        output when it is the whole result), the values dying there. Made
        once per `optimizer_calls` (held, not compared by id)."""
        held = self._held_plan
        if held is None or held[0] is not optimizer_calls:
            plan = []
            for pos, k in enumerate(self.order):
                c = self.calls[k]
                only = c.outputs[0][1] if len(c.outputs) == 1 and c.outputs[0][0] == 0 else None
                # Calls past the recorded ones (compiled regions) read no optimizer number.
                bind = _binder(c.args, c.kwargs, k < len(optimizer_calls) and bool(optimizer_calls[k]))
                plan.append((bind, k, getattr(c.func, "_op", c.func), c.outputs, only, self.dies[pos]))
            held = self._held_plan = (optimizer_calls, plan)
        return held[1]

    def _call_over(self, k: int, args, kwargs, env: Dict[int, torch.Tensor]):
        """Call `k` written into its reused input's tensor (see `takes`), or
        None when it has no ``out=`` overload or the overload refuses the
        arguments (aten checks them before writing); then it runs as
        recorded."""
        c = self.calls[k]
        _, i = self.takes[k]
        variant = out_variant(c.func) if k not in self.unreused else None
        if variant is None:
            self.unreused.add(k)
            return None
        fn, names = variant
        target = env[i]
        ptr, shape, stride = target.data_ptr(), tuple(target.shape), target.stride()
        try:
            fn(*args, **kwargs, **{names[0]: target})
        except (RuntimeError, TypeError):
            self.unreused.add(k)
            return None
        if (target.data_ptr(), tuple(target.shape), target.stride()) != (ptr, shape, stride):
            raise RuntimeError(f"{c.func}: its out= overload moved the reused output")
        return target


class _Seen(TorchDispatchMode):
    """The ops that reach the dispatcher's Python key inside a call."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _copy(x):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _writes_only_its_outputs(overload, args, kwargs, outs: Dict[str, torch.Tensor]) -> bool:
    """Whether the out= `overload` writes its results straight into the
    tensors `outs` it is given and does nothing else: called once on fresh
    tensors of their layouts, it must be the only op dispatched and leave
    each of them as and where it was. Two kinds fail:

    - aten's losses with a reduction (``mse_loss``, ``huber_loss``,
      ``binary_cross_entropy``...) resize `out` to the input's shape, use it
      as scratch and shrink it back; given a place in the arena, that
      writes over the neighbours' bytes (and may reallocate the arena);
    - a call that first makes a temporary: an argument with the conjugate
      or negative bit is materialised by PyTorch's fallback (``_conj``,
      ``clone``) before the kernel runs, bytes the arena does not count.

    Those run as recorded and are copied into place, counted as outside
    the arena. A probe is one extra call, on the first arena run only."""
    if not all(isinstance(t, torch.Tensor) for t in outs.values()):
        return False
    fresh = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for n, t in outs.items()}
    before = {n: (t.data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride()) for n, t in fresh.items()}
    seen = _Seen()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
            with seen:
                overload(*args, **kwargs, **fresh)
    except (RuntimeError, TypeError):
        return False
    return seen.ops == [overload] and all(
        (t.data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride()) == before[n]
        for n, t in fresh.items())


def _updates_as_recorded(func, args, kwargs, writes, probed_args, probed_kwargs) -> bool:
    """Whether an out= overload's probe (`probed_args`, `probed_kwargs`:
    copies of what the call updates, after the probe) updated the
    arguments as the recorded op `func` updates them, run here on copies
    too. The out= overloads PyTorch generates for ops that update
    arguments in place update copies of them instead (seen:
    ``_fused_moving_avg_obs_fq_helper.out``, quantization-aware
    training's observers, whose statistics then never moved in the
    arena); batch norm's own out= kernel updates its running statistics."""
    ref_args = [_copy(a) if i in writes else a for i, a in enumerate(args)]
    ref_kwargs = {n: _copy(v) if n in writes else v for n, v in kwargs.items()}
    func(*ref_args, **ref_kwargs)
    # `writes` names each written argument by position and by name.
    ref = [ref_args[i] for i in writes if isinstance(i, int) and i < len(args)]
    ref += [ref_kwargs[n] for n in writes if isinstance(n, str) and n in kwargs]
    probed = [probed_args[i] for i in writes if isinstance(i, int) and i < len(args)]
    probed += [probed_kwargs.get(n) for n in writes if isinstance(n, str) and n in kwargs]
    return all(isinstance(b, torch.Tensor) and torch.equal(a, b)
               for a, b in zip(tree_flatten(ref)[0], tree_flatten(probed)[0]) if isinstance(a, torch.Tensor))


# A factory's tensor options: its out= overload takes them from `out`.
TENSOR_OPTIONS = ("dtype", "layout", "device", "pin_memory")


def _embedding_dense_backward_into(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, *, out):
    """``embedding_dense_backward`` written into `out` itself: the rows
    of `grad_output` summed into `out`'s rows by index, the padding row
    left zero. aten's ``out=`` overload of it is generated: it computes
    the whole gradient in a tensor of its own and copies it, a
    vocabulary-sized allocation outside the arena (306.7 MiB on GPT-2 XL).

    On the CPU ``index_add_`` adds the rows in eager's order (bit for
    bit); on CUDA ``index_put_`` with accumulation sorts the indices and
    adds each row's contributions in a fixed order (deterministic, where
    ``index_add_`` would use atomics), which rounds differently from
    eager's segmented sums. Low-precision rows on CUDA:
    :func:`_low_precision_rows_into`."""
    if scale_grad_by_freq or out.dtype not in (torch.float32, torch.float64):
        if (not scale_grad_by_freq and out.device.type != "cpu"
                and indices.numel() * out.shape[-1] * 16 < out.numel() * out.element_size()):
            return _low_precision_rows_into(grad_output, indices, padding_idx, out)
        # Counts per index first, or many rows: eager's op.
        return torch.ops.aten.embedding_dense_backward.out(
            grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, out=out)
    rows = grad_output.reshape(-1, out.shape[-1])
    out.zero_()
    if out.device.type == "cpu":
        out.index_add_(0, indices.reshape(-1), rows)
    else:
        out.index_put_((indices.reshape(-1),), rows, accumulate=True)
    if padding_idx >= 0:
        out[padding_idx].zero_()  # eager skips the padding positions' rows
    return out


def _low_precision_rows_into(grad_output, indices, padding_idx, out):
    """Low-precision (bf16, f16) rows summed into `out` by index as CUDA's
    eager kernel sums them: each index's rows added in float32 and rounded
    once. Temporaries are as many rows as `indices` (sorted, each row's
    segment, float32 sums), not the vocabulary-sized float32 table a
    whole-table accumulation would make; every shape is fixed by the
    inputs (no device sync, so a CUDA graph can hold it). Duplicate
    indices write the same segment's sum. (On the CPU eager adds in the
    rows' own precision, so the CPU keeps eager's op.)"""
    flat = indices.reshape(-1)
    keys, perm = flat.sort(stable=True)
    seg = torch.zeros_like(keys)
    seg[1:] = (keys[1:] != keys[:-1]).cumsum(0)
    sums = torch.zeros(keys.numel(), out.shape[-1], dtype=torch.float32, device=out.device)
    sums.index_put_((seg,), grad_output.reshape(-1, out.shape[-1])[perm].float(), accumulate=True)
    out.zero_()
    out.index_put_((keys,), sums[seg].to(out.dtype))
    if padding_idx >= 0:
        out[padding_idx].zero_()
    return out


def _copy_into(self, *args, out, **kwargs):
    """``_to_copy``, ``clone``, ``alias_copy``: `self`'s values into `out`
    (which has the recorded dtype, layout and strides). Their generated
    ``out=`` overloads make the whole result elsewhere first."""
    return out.copy_(self)


def _view_copy_into(view):
    """A ``*_copy`` op (``t_copy``, ``expand_copy``...) as `view` of its
    input copied into `out`."""
    def into(*args, out, **kwargs):
        return out.copy_(view(*args, **kwargs))
    return into


def _fill_into(value):
    """``new_zeros``, ``zeros_like`` (0), ``new_ones``, ``ones_like`` (1):
    `out` filled in place."""
    def into(*args, out, **kwargs):
        return out.fill_(value)
    return into


def _new_full_into(self, size, fill_value, *, out, **kwargs):
    return out.fill_(fill_value)


def _full_like_into(self, fill_value, *, out, **kwargs):
    return out.fill_(fill_value)


# Ops whose generated out= overload computes the result elsewhere and
# copies it (a temporary as large as the result, outside the arena): op ->
# a function that writes into `out` itself, with the op's arguments
# (trusted: not probed by `_writes_only_its_outputs`). Also every view's
# ``*_copy`` op (placed_variant).
IN_PLACE_FORMS = {"aten::embedding_dense_backward": _embedding_dense_backward_into,
                  "aten::_to_copy": _copy_into, "aten::clone": _copy_into, "aten::alias_copy": _copy_into,
                  "aten::new_zeros": _fill_into(0), "aten::zeros_like": _fill_into(0),
                  "aten::new_ones": _fill_into(1), "aten::ones_like": _fill_into(1),
                  "aten::new_full": _new_full_into, "aten::full_like": _full_like_into}


def _view_of_copy_op(func):
    """The view op `func` (``aten::t_copy``...) copies, or None."""
    name = func._schema.name
    if func.namespace != "aten" or not name.endswith("_copy") or name in IN_PLACE_FORMS:
        return None
    packet = getattr(torch.ops.aten, name[len("aten::"):-len("_copy")], None)
    view = getattr(packet, func._schema.overload_name or "default", None) if packet is not None else None
    if (view is None or len(view._schema.returns) != 1 or str(view._schema.returns[0].type) != "Tensor"
            or view._schema.returns[0].alias_info is None or len(func._schema.returns) != 1):
        return None
    return view


@functools.lru_cache(maxsize=None)
def placed_variant(func):
    """How `func` writes into a given tensor: ``(overload, out names,
    dropped)``, or None. Its :data:`IN_PLACE_FORMS` function, else
    :func:`out_variant`'s overload, else, for a factory (``ones``,
    ``arange``, ``scalar_tensor``, ``_to_copy``...), the ``out=`` overload
    taking the same arguments but the tensor options `dropped`, which the
    caller leaves out: the place already has the recorded dtype, layout
    and device."""
    form = IN_PLACE_FORMS.get(func._schema.name)
    if form is not None and func._schema.overload_name in ("", "default"):
        return form, ("out",), ()
    view = _view_of_copy_op(func)
    if view is not None:
        return _view_copy_into(view), ("out",), ()
    found = out_variant(func)
    if found is not None:
        return found[0], found[1], ()
    if func.namespace != "aten":
        return None
    dropped = tuple(a.name for a in func._schema.arguments if a.name in TENSOR_OPTIONS and a.kwarg_only)
    found = out_variant(func, dropped) if dropped else None
    return None if found is None else (found[0], found[1], dropped)


# Ops whose result is memory with undefined contents: in the arena their
# output is their planned place, with no call.
UNINITIALISED = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                 "aten::new_empty_strided"}


def _keep_where_made(copied: List[tuple], kept: List[tuple], flat: Sequence[Any]) -> None:
    """Moves from `copied` to `kept` the results the real op made on
    another device than their place: a fake kernel may put a result on the
    step's device where the real one keeps it on the host (the dropout
    seed and offset of CUDA's fused attention, which its backward reads
    as host memory). Such a result stays where the op made it."""
    for entry in list(copied):
        p, i, t = entry
        x = flat[p]
        if isinstance(x, torch.Tensor) and x.device != t.device:
            copied.remove(entry)
            kept.append((p, i))


def _generate(way: Callable, step: tuple, gate: Optional[Gate] = None, j: Optional[int] = None) -> Callable:
    """A position's settled `way` (:meth:`Arena._settle`) as one generated
    function ``(env, nums) -> None``: the out= call written out with its
    arguments' expressions (the binder's) and its places as constants,
    or the way itself called on the bound arguments; then the values
    dying there dropped. A gated call (optimizer `j` of `gate`) first
    asks the gate and only drops them when it is closed. Only indices
    and constant slots are spliced into the source."""
    bind, _, _, _, _, dies = step
    spec = getattr(way, "spec", ("recorded",))
    source = getattr(bind, "source", None)
    consts: List[Any] = [] if source is None else list(source[2])

    def const(x) -> str:
        consts.append(x)
        return f"c[{len(consts) - 1}]"

    lines = []
    if j is not None:
        lines.append(f"if {const(gate)}.closed(env, {int(j)}):")
        lines += [f"    env.pop({int(i)}, None)" for i in dies]
        lines.append("    return")
    if source is None:  # a binder walking the arguments (one is a named tuple)
        lines.append(f"a, kw = {const(bind)}(env, nums)")
        args_src, kwargs_src = "a", "kw"
    else:
        args_src, kwargs_src = source[0], source[1]
    if spec[0] == "as_is":
        lines += [f"env[{int(i)}] = {const(t)}" for i, t in spec[1]]
    elif spec[0] == "into":
        _, fn, outs, into, dropped = spec
        if dropped:
            kwargs_src = f"{{n: v for n, v in {kwargs_src}.items() if n not in {const(set(dropped))}}}"
        lines.append(f"{const(fn)}(*{args_src}, **{kwargs_src}, **{const(outs)})")
        lines += [f"env[{int(i)}] = {const(t)}" for i, t in into]
    else:
        lines.append(f"{const(way)}({args_src}, {kwargs_src}, env)")
    lines += [f"env.pop({int(i)}, None)" for i in dies]
    src = "def f(env, nums):\n" + "".join(f"    {line}\n" for line in lines)
    scope: Dict[str, Any] = {"__builtins__": {}, "c": consts}
    exec(src, scope)
    return scope["f"]


class Arena:
    """One buffer of the planned size on the step's device; every tensor the
    plan places gets a view of it at its offset, with the recorded shape,
    strides and dtype.

    Ops that make new tensors run as their ``out=`` overload, writing into
    their planned places; ops that make uninitialised memory
    (``empty_like``...) are not called: their place is their result. An
    op without one (or whose outputs include a
    view) runs as recorded and its new outputs are copied into their places;
    those results are the only tensor bytes outside the arena (at most
    :attr:`outside_peak_bytes` at once, freed right after the copy), and
    :attr:`fallbacks` holds the ops that needed it.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._typed: Dict[torch.dtype, torch.Tensor] = {}
        self.fallbacks: set = set()
        self._expect: Dict[int, tuple] = {}
        # How each call runs (see run), by position, for the program and
        # places last run.
        self._ran_with: Optional[tuple] = None
        self._ways: List[Optional[Callable]] = []
        # Once every way is settled, one generated function per position.
        self._fast: Optional[List[Callable]] = None
        # The most bytes a fallback op's results held outside the arena.
        self.outside_peak_bytes = 0

    def view(self, offset: int, layout, own_storage: Optional[int] = None) -> torch.Tensor:
        """The tensor of `layout` at `offset`. With `own_storage` (a byte
        count), the tensor gets a storage of its own over those bytes of the
        arena instead of the arena's (made through DLPack, which keeps the
        arena alive): for parameters, buffers and optimizer state, so that
        ``torch.save`` of a state dict writes each tensor's bytes and not
        the whole arena's."""
        shape, stride, storage_offset, dtype, _ = layout
        size = torch.empty((), dtype=dtype, device="meta").element_size()
        if offset % size:
            raise ValueError(f"offset {offset} is not a multiple of the element size {size}")
        if own_storage is not None:
            window = from_dlpack(to_dlpack(self.buffer[offset:offset + own_storage]))
            return window.view(dtype).as_strided(shape, stride, storage_offset)
        typed = self._typed.get(dtype)
        if typed is None:
            n = self.buffer.numel() - self.buffer.numel() % size
            typed = self._typed[dtype] = self.buffer[:n].view(dtype)
        t = typed.as_strided(shape, stride, offset // size + storage_offset)
        self._expect[id(t)] = (tuple(shape), tuple(stride), t.data_ptr())
        return t

    def _intact(self, t: torch.Tensor) -> bool:
        return (tuple(t.shape), tuple(t.stride()), t.data_ptr()) == self._expect.get(id(t))

    def settled_for(self, prog: "Program", placed: Dict[int, torch.Tensor], optimizer_calls: Sequence[bool]) -> bool:
        """Whether every call of `prog` (with these places) has settled how
        it runs, so the next run calls only the generated functions."""
        ran = self._ran_with
        return (self._fast is not None and ran is not None and ran[0] is prog and ran[1] is placed
                and ran[2] is optimizer_calls)

    def run(self, prog: "Program", placed: Dict[int, torch.Tensor], env: Dict[int, torch.Tensor],
            numbers: Dict[float, float], optimizer_calls: Sequence[bool]) -> None:
        """Runs `prog` with every new tensor in `placed` made in place.

        How each call runs (its ``out=`` overload into its places, or as
        recorded with a copy) is settled the first time and kept for the
        same program and places: the per-op cost is then one binding and
        one call, as little Python as a replay can have."""
        ran = self._ran_with
        if ran is None or ran[0] is not prog or ran[1] is not placed or ran[2] is not optimizer_calls:
            # Held, not compared by id: a new program may reuse an old one's.
            self._ran_with = (prog, placed, optimizer_calls)
            self._ways = [None] * len(prog.order)
            self._fast = None
        ways = self._ways
        plan = prog.plan(optimizer_calls)
        with torch.no_grad():
            if self._fast is not None:
                self._run_fast(prog, plan, placed, env, numbers)
                return
            for pos, (bind, k, _, _, _, dies) in enumerate(plan):
                if pos in prog.gated and prog.gate.closed(env, prog.gated[pos]):
                    for i in dies:
                        env.pop(i, None)
                    continue
                args, kwargs = bind(env, numbers)
                way = ways[pos]
                if way is None or not way(args, kwargs, env):
                    ways[pos] = self._settle_or_explain(prog.calls[k], k, args, kwargs, placed, env)
                args = kwargs = None
                for i in dies:
                    env.pop(i, None)
        # Settled (every call, skipped updates included, ran once): from the
        # next run on, one generated function per call.
        if all(way is not None for way in ways):
            self._fast = [_generate(ways[pos], step, prog.gate, prog.gated.get(pos)) for pos, step in enumerate(plan)]

    def _run_fast(self, prog: "Program", plan: List[tuple], placed: Dict[int, torch.Tensor],
                  env: Dict[int, torch.Tensor], numbers: Dict[float, float]) -> None:
        """The settled replay: each position's generated function binds,
        calls and drops its dead values in one frame. A call that fails
        (an out= overload refusing what it took before) is settled again
        as recorded, and its function made anew."""
        fast = self._fast
        for pos, f in enumerate(fast):
            try:
                f(env, numbers)
            except (RuntimeError, TypeError):
                bind, k, _, _, _, dies = plan[pos]
                self.fallbacks.add(k)
                args, kwargs = bind(env, numbers)
                self._ways[pos] = self._settle_or_explain(prog.calls[k], k, args, kwargs, placed, env)
                for i in dies:
                    env.pop(i, None)
                fast[pos] = _generate(self._ways[pos], plan[pos], prog.gate, prog.gated.get(pos))

    def _settle_or_explain(self, c: Call, k: int, args, kwargs, placed: Dict[int, torch.Tensor],
                           env: Dict[int, torch.Tensor]) -> Callable:
        """:meth:`_settle`, with PyTorch's error on a tensor of the arena
        that a call tried to grow explained."""
        try:
            return self._settle(c, k, args, kwargs, placed, env)
        except RuntimeError as e:
            if "resize" not in str(e):
                raise
            raise UnsupportedStep(
                f"{c.func}: grows a tensor in place, where the arena holds it at the size it had at capture "
                f"(PyTorch: {e}). Quantization-aware training's observers grow their statistics on their "
                "first call: run one eager forward pass (under torch.no_grad()) before capture"
            ) from e

    def _settle(self, c: Call, k: int, args, kwargs, placed: Dict[int, torch.Tensor],
                env: Dict[int, torch.Tensor]) -> Callable:
        """Runs call `k` (number `c`) the first time and returns how it runs
        from then on: a function ``(args, kwargs, env) -> bool`` that is
        False when the call could not run that way (then it is settled
        again, as recorded)."""
        targets = [(p, i) for p, i in c.outputs if i in placed]
        schema = getattr(c.func, "_schema", None)  # None: a Python call (generator states)
        if schema is not None and schema.name in UNINITIALISED and len(targets) == len(c.outputs) == 1:
            # Its place is its value: nothing to run, nothing to copy.
            i, t = targets[0][1], placed[targets[0][1]]

            def placed_as_is(args, kwargs, env) -> bool:
                env[i] = t
                return True

            placed_as_is(args, kwargs, env)
            placed_as_is.spec = ("as_is", [(i, t)])
            return placed_as_is
        variant = None
        # A random call runs as recorded: a failed or moved out= call
        # followed by the recorded one would draw twice.
        if (targets and len(targets) == len(c.outputs) and k not in self.fallbacks and not c.random
                and schema is not None):
            variant = placed_variant(c.func)  # cached per op
            if variant is not None and [p for p, _ in targets] != list(range(len(targets))):
                variant = None
        if variant is not None:
            overload, names, dropped = variant
            fn = getattr(overload, "_op", overload)
            outs = {n: placed[i] for n, (_, i) in zip(names, targets)}
            into = [(i, placed[i]) for _, i in targets]
            # The probe updates copies of what the call updates in place
            # (batch norm's running statistics), not the step's tensors.
            probe_args = [_copy(a) if i in c.writes else a for i, a in enumerate(args)]
            probe_kwargs = {n: _copy(v) if n in c.writes else v for n, v in kwargs.items() if n not in dropped}
            if overload in IN_PLACE_FORMS.values():
                pass  # writes into its place by construction
            elif not _writes_only_its_outputs(overload, probe_args, probe_kwargs, outs):
                variant = None
            elif c.writes and not _updates_as_recorded(c.func, args, kwargs, c.writes, probe_args, probe_kwargs):
                variant = None
        if variant is not None:

            def into_place(args, kwargs, env) -> bool:
                if dropped:
                    kwargs = {n: v for n, v in kwargs.items() if n not in dropped}
                try:
                    fn(*args, **kwargs, **outs)
                except (RuntimeError, TypeError):
                    self.fallbacks.add(k)
                    return False
                for i, t in into:
                    env[i] = t
                return True

            # An out= kernel may restride or resize its output (leaving
            # the arena): then it runs as recorded.
            if into_place(args, kwargs, env) and all(self._intact(t) for _, t in into):
                into_place.spec = ("into", fn, outs, into, dropped)
                return into_place
            self.fallbacks.add(k)

        copied = [(p, i, placed[i]) for p, i in c.outputs if i in placed]
        kept = [(p, i) for p, i in c.outputs if i not in placed]
        if copied:
            self.fallbacks.add(k)
        # The overload's C++ callable itself: one Python frame less per op.
        func = getattr(c.func, "_op", c.func)
        only = kept[0][1] if len(c.outputs) == 1 and kept and kept[0][0] == 0 else None
        settled: List[bool] = []

        def as_recorded(args, kwargs, env) -> bool:
            out = func(*args, **kwargs)
            if only is not None and isinstance(out, torch.Tensor):
                env[only] = out  # one new tensor or view the plan does not place
                return True
            flat = tree_flatten(out)[0] if c.outputs else []
            if not settled:
                _keep_where_made(copied, kept, flat)
                settled.append(True)
            if copied:
                # New bytes only: a result may alias an argument (`lift_fresh`
                # returns its input, which may live in the arena).
                held = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0]
                        if isinstance(x, torch.Tensor)}
                held.add(self.buffer.untyped_storage().data_ptr())
                made = {flat[p].untyped_storage().data_ptr(): flat[p].untyped_storage().nbytes()
                        for p, _, _ in copied}
                new = sum(n for ptr, n in made.items() if ptr not in held)
                self.outside_peak_bytes = max(self.outside_peak_bytes, new)
                for p, i, t in copied:
                    t.copy_(flat[p])
                    env[i] = t
            for p, i in kept:
                env[i] = flat[p]
            return True

        as_recorded(args, kwargs, env)
        as_recorded.spec = ("recorded",)
        return as_recorded
