"""memplan from Python: plan a training step's graph (the order its ops run
in and every tensor's offset in one arena) and check a plan.

Graphs and plans are the JSON documents of memplan's docs/graph-format.md
and docs/plan-format.md, given as dicts (as `json.load` returns them) or as
paths to files (`.json`, or `.json.gz`).

    import memplan
    plan = memplan.plan("step.json", time_limit=5)
    plan["arena_bytes"], plan["order"][:3], plan["stats"]["lower_bound_bytes"]
    memplan.check("step.json", plan)   # the independent checker's report

    # What to recompute so the step fits in 24 GiB:
    fitted = memplan.fit("step.json", budget=24 << 30)
    fitted["recomputed_ops"], fitted["added_flops"], fitted["plan"]["arena_bytes"]
    # How small it gets for at most 0.1% more FLOPs:
    memplan.fit("step.json", max_added=0.001, minimise="flops")["arena_bytes"]

    # The loss chain run on chunks of tokens where that lowers the arena:
    memplan.plan_split("step.json", split="auto")["split"]["chunks"]

    # A built-in step: one rank of Llama 3 8B under FSDP2, bf16 compute.
    memplan.plan(memplan.example("llama3-8b,world=8,mixed,checkpoint"))

    # The largest batch that fits, from the step captured at two batch sizes:
    memplan.max_batch("step-b2.json", "step-b3.json", budget=24 << 30)

Every error (a malformed graph, a plan that breaks a dependency or overlaps
two live tensors, a bad argument) raises `MemplanError`, whose message says
which document and which element is wrong.
"""

import json
import math
import os

from . import _memplan
from ._renamed import Renamed

__all__ = ["MemplanError", "plan", "check", "baselines", "fit", "fuse", "at_batch", "max_batch", "example", "__version__"]
__version__ = _memplan.__version__


class MemplanError(ValueError):
    """A graph, a plan or an argument memplan cannot accept.

    ``kind`` says which kind of error it is, without reading the message
    (the C ABI's ``MEMPLAN_E_*`` codes by name): ``"input"`` (a graph or
    plan document memplan cannot read), ``"invalid_argument"``,
    ``"invalid_plan"`` (the checker refuses the plan), ``"unsupported"`` (a
    valid graph or step that what was asked cannot take),
    ``"does_not_fit"`` (no plan within the budget), ``"io"``, ``"solver"``
    or ``"internal"`` (a bug: please report it)."""

    kind = "invalid_argument"

    def __init__(self, message, kind=None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


def _native_error(e):
    """A ValueError of the native half as a MemplanError of its kind."""
    return MemplanError(str(e), getattr(e, "kind", None))


def _text(doc, what):
    """The JSON text of `doc`: a dict, a JSON string, or a path."""
    if isinstance(doc, dict):
        try:
            return json.dumps(doc, allow_nan=False)
        except RecursionError:
            raise MemplanError(f"{what} is nested too deeply to be a JSON document", "input") from None
        except ValueError:
            where = _first_non_finite(doc, what)
            if where is None:
                # json.dumps' other ValueError: a dict or list inside itself.
                raise MemplanError(f"{what} contains itself (a circular reference): "
                                   "it cannot be written as JSON", "input") from None
            raise MemplanError(f"{where}: sizes, costs and attributes must be finite "
                               "numbers (JSON has no NaN or infinity)", "input") from None
    if isinstance(doc, (str, os.PathLike)):
        path = os.fspath(doc)
        if isinstance(doc, str) and doc.lstrip().startswith("{"):
            return doc
        try:
            return _memplan.read_text(path)
        except ValueError as e:
            raise _native_error(e) from None
    raise TypeError(f"{what} must be a dict, a JSON string or a path, not {type(doc).__name__}")


def _call(fn, *args):
    """`fn(*args)`'s JSON answer, its errors as MemplanError."""
    try:
        text = fn(*args)
    except ValueError as e:
        raise _native_error(e) from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise MemplanError(f"internal error: memplan wrote an answer that is not JSON ({e}); please report it",
                           "internal") from None


def plan(graph, time_limit=10.0):
    """Plans `graph` within `time_limit` seconds.

    Returns the plan as a dict: `order` (op ids in the order to run them),
    `tensors` (each tensor's `id` and byte `offset` in the arena),
    `arena_bytes`, `reuse` (outputs placed in their input's bytes), and
    `stats` (among others `lower_bound_bytes`, the floor no order can beat,
    and `max_live_bytes`, the peak of live bytes in this order; its
    `peak_bytes` is a deprecated copy of `arena_bytes`, kept for one
    release). The plan has passed memplan's independent checker.
    """
    return _call(_memplan.plan_json, _text(graph, "graph"), _seconds(time_limit))


def fuse(graph, order, *, limit=None, max_ops=None, exclude=()):
    """Regions of `order` (op ids, every op of `graph` once, a valid
    order) for a compiler to fuse, and the fused step's plan
    (docs/compiled.md): runs of ops that write nothing in place (no
    update, no random draw, no collective), none in `exclude` (op ids),
    at most `max_ops` each, chosen so that the fused program's live bytes
    stay within `limit` (by default the order's own max live).

    Returns ``regions`` (each ``name``, ``ops``, ``inputs``, ``outputs``
    by id and ``workspace_bytes``: room for the intermediates it drops),
    ``graph`` (the fused step: one op of type ``memplan.fused`` per
    region), its checked ``plan``, ``max_live_bytes`` (the fused plan's),
    ``unfused_max_live_bytes`` and ``fused_ops``.
    """
    opts = {"order": list(order), "exclude": list(exclude)}
    if limit is not None:
        opts["limit"] = int(limit)
    if max_ops is not None:
        opts["max_ops"] = int(max_ops)
    return _call(_memplan.fuse_json, _text(graph, "graph"), json.dumps(opts))


def plan_split(graph, split="auto", time_limit=10.0):
    """Plans `graph` as :func:`plan` does, with its loss chain (the LM
    head's product, the cross-entropy and their backward ops) run on
    chunks of its rows where that lowers the arena: the same math
    (docs/splitting.md). `split` is ``"auto"`` (2 to 32 chunks tried),
    ``"off"``, or a number of chunks.

    Returns ``{"graph", "plan", "split"}``: the graph that was planned
    (split or not), its plan (checked), and ``split`` with ``chunks`` (1:
    not split), ``chains``, ``tried`` (``[chunks, arena bytes]`` of each
    candidate), ``added_flops`` and ``step_flops``.
    """
    return _call(_memplan.plan_split_json, _text(graph, "graph"), _seconds(time_limit), _split(split))


def _split(split) -> str:
    """`split` as the core reads it: "auto", "off" or a number of chunks."""
    if isinstance(split, bool) or not isinstance(split, (str, int)):
        raise MemplanError(f"split must be 'auto', 'off' or a number of chunks, not {_shown(split)}",
                           "invalid_argument")
    return str(split)


def baselines(graph, device="cuda"):
    """What `graph` needs without memplan, simulated on the graph itself
    (the baselines of ``memplan compare``): PyTorch eager's order through
    a simulation of its caching allocator, with and without expandable
    segments and optimizer-in-backward, the order's max live bytes, and
    any peaks the graph records from other tools. A sharded step captured
    by ``memplan.torch`` runs FSDP2 eager's order, not the order capture
    recorded (docs/benchmarks.md), issuing its all-gathers as FSDP2 does
    on `device`: ``"cuda"`` one unit ahead in both passes, ``"cpu"`` one
    ahead in the backward only.

    Returns ``{"baselines": {name: {"footprint_bytes", "description"}},
    "best_eager": name}``, the last the eager configuration that needs the
    least (None if the graph has none). A baseline's footprint is the
    memory it holds at its worst: reserved bytes for the caching allocator,
    an arena for a layout, max live bytes for an order alone. Its old name,
    ``peak_bytes``, still reads for one release, with a
    ``DeprecationWarning``.
    """
    if device not in ("cuda", "cpu"):
        raise MemplanError(f"device {device!r}: the baselines model 'cuda' or 'cpu'")
    out = _call(_memplan.baselines_json, _text(graph, "graph"), device)
    return {"baselines": {b["name"]: Renamed({"footprint_bytes": b["footprint_bytes"],
                                              "description": b["description"]},
                                             {"peak_bytes": "footprint_bytes"})
                          for b in out["baselines"]},
            "best_eager": out["best_eager"]}


def check(graph, plan):
    """Checks `plan` against `graph` with memplan's independent checker
    (every op once, dependencies respected, co-live tensors never overlap
    unless a declared reuse allows it, everything inside the arena).

    Returns the report (`max_live_bytes`, `used_bytes`, `ops`,
    `tensors_placed`); raises `MemplanError` naming the first violation.
    """
    return _call(_memplan.check_json, _text(graph, "graph"), _text(plan, "plan"))


def _budget(budget, what="budget"):
    """Bytes: a non-negative int below 2**64, or a string as the CLI takes
    it (``"24GiB"``, ``"1.5 GB"``)."""
    if isinstance(budget, str):
        try:
            return _memplan.parse_bytes(budget)
        except ValueError as e:
            raise MemplanError(f"{what} {e}") from None
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise MemplanError(f"{what} must be a number of bytes (an int, or a string such as '24GiB'), "
                           f"not {budget!r}")
    if not 0 <= budget < 2 ** 64:
        raise MemplanError(f"{what} must be between 0 and 2**64 - 1 bytes, not {_shown(budget)}")
    return budget


def _shown(x):
    """`repr(x)` for a message; a huge int by its size (`str` refuses ints
    of more than 4300 digits, and a message need not hold them)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 128:
        return f"{'a negative' if x < 0 else 'an'} int of {x.bit_length()} bits"
    return repr(x)


def _seconds(time_limit, what="time_limit"):
    """A time limit as a float; memplan's core checks its range."""
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)):
        raise MemplanError(f"{what} must be a number of seconds, not {time_limit!r}")
    try:
        return float(time_limit)
    except OverflowError:
        # An int beyond any float: beyond the core's limit too.
        raise MemplanError(f"{what} must be at most 1e9 seconds (about 31 years), "
                           f"got {_shown(time_limit)}") from None


def _first_non_finite(doc, path="graph"):
    """The path of the first NaN or infinite number in `doc`, or None.
    Each dict and list is visited once (a document may contain itself)."""
    stack = [(path, doc)]
    seen = set()
    while stack:
        where, x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return f"{where} is {x}"
        if isinstance(x, (dict, list, tuple)):
            if id(x) in seen:
                continue
            seen.add(id(x))
        if isinstance(x, dict):
            for k in x:
                if isinstance(k, float) and not math.isfinite(k):
                    return f"{where} has the key {k}"
            stack.extend((f"{where}.{k}", v) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(x))))
    return None


def _non_negative(x, not_a_number: str, out_of_range: str) -> float:
    """`x` as a finite float, 0 or more; else a MemplanError with the
    message for a non-number or for a value out of range (each followed by
    the value)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise MemplanError(f"{not_a_number}, not {x!r}")
    try:
        v = float(x)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v < 0:
        raise MemplanError(f"{out_of_range}, not {_shown(x)}")
    return v


def _share(max_added):
    return _non_negative(max_added, "max_added must be a number (0.001 for 0.1%)",
                         "max_added must be a share of the step's cost, 0 or more (0.001 for 0.1%)")


def _flops(n, what="already_added_flops"):
    """A FLOP count: a finite number, 0 or more."""
    return _non_negative(n, f"{what} must be a number of FLOPs", f"{what} must be a number of FLOPs, 0 or more")


def _objective(minimise):
    if not isinstance(minimise, str):
        raise MemplanError(f"minimise must be 'time' or 'flops', not {_shown(minimise)}")
    return minimise


def fit(graph, budget=None, time_limit=60.0, minimise="time", *, max_added=None, split="off",
        already_added_flops=0.0, offload=None, max_slowdown=None):
    """The cheapest recomputation that fits `graph` into `budget` bytes.

    memplan chooses forward ops to run again in the backward pass, then
    orders and lays out the step so its arena is at most `budget`,
    minimising the added estimated time (``minimise="time"``) or the added
    FLOPs (``"flops"``). Returns a dict: `graph` (the step with the
    recomputed ops added, as a graph document), `plan` (its checked plan),
    `recomputed_ops`, `added_flops`, `added_seconds_estimate`,
    `arena_bytes`, `no_recompute_arena_bytes`, `optimal` (proven cheapest).
    A budget no plan reaches raises `MemplanError` stating the bound.

    With `max_added` instead of a budget it answers the other question:
    the smallest arena it finds whose recomputation adds at most that
    share of the step's cost (``max_added=0.001``: 0.1% more estimated
    time, or FLOPs with ``minimise="flops"``), as ``torch.compile``'s
    partitioner recomputes cheap ops without being given a budget. The
    report then has ``max_added_share``, and ``share_floor_bytes``: no
    recomputation within the share, in any order, needs less (docs/fit.md);
    `optimal` says no affordable choice peaks lower.

    With `split` (``"auto"`` or a number of chunks) it may also split the
    loss chain (:func:`plan_split`): with a budget where that is the
    cheaper way into it, with `max_added` where that gives the smaller
    arena, the split's FLOPs counted in the share. The report then has
    ``split`` (``chunks`` 1: not split), its `graph` is the split step's
    when split, and its ``added_flops`` are the split's and the
    recomputation's.

    With `max_added` and `already_added_flops`, `graph` is a step made
    from another that it already adds that many FLOPs to (a split made
    outside this function, as ``memplan.torch`` splits a captured step):
    `max_added` is then a share of that other step's cost, and those
    FLOPs count against it. Raises `MemplanError` (kind ``does_not_fit``)
    when they alone exceed it.

    With `offload` (``True``, or a dict of ``device``, ``link_gbps``,
    ``host_memory``), host memory is a lever too (docs/offload.md): memplan
    chooses which tensors leave the device and when they come back,
    together with recomputation, for the least modeled time within
    `budget`, or, with `max_slowdown` (``0.05``: 5%) instead of a budget,
    the smallest arena whose modeled time is at most that share above the
    step's. Returns `graph` (the step with its copy ops and host tensors),
    `plan` (checked), `arena_bytes`, and the figures under ``offload``
    (``host_bytes``, ``modeled_seconds``, ``compute_seconds``,
    ``modeled_seconds_without_offload``, ``lower_bound_bytes``, ...).
    """
    if offload or max_slowdown is not None:
        return _fit_offload(graph, budget, time_limit, offload, max_slowdown, max_added, split, minimise)
    if (budget is None) == (max_added is None):
        raise TypeError("give either budget (bytes) or max_added (a share of the step's cost)")
    if _split(split) != "off":
        return _call(_memplan.fit_split_json, _text(graph, "graph"),
                     None if budget is None else _budget(budget),
                     None if max_added is None else _share(max_added), _seconds(time_limit),
                     _objective(minimise), _split(split))
    if already_added_flops and max_added is None:
        raise TypeError("already_added_flops goes with max_added")
    if max_added is not None:
        return _call(_memplan.fit_within_json, _text(graph, "graph"), _share(max_added),
                     _seconds(time_limit), _objective(minimise), _flops(already_added_flops))
    return _call(_memplan.fit_json, _text(graph, "graph"), _budget(budget), _seconds(time_limit),
                 _objective(minimise))


def _fit_offload(graph, budget, time_limit, offload, max_slowdown, max_added, split, minimise):
    """:func:`fit` with ``offload``: the options document the core reads."""
    if not offload:
        raise TypeError("max_slowdown goes with offload=True")
    if max_added is not None or _split(split) != "off" or minimise != "time":
        raise TypeError("offload chooses recomputation itself by modeled time: "
                        "give budget or max_slowdown, not max_added, split or minimise")
    if (budget is None) == (max_slowdown is None):
        raise TypeError("with offload, give either budget (bytes) or max_slowdown (a share of the step's time)")
    extra = {} if offload is True else dict(offload)
    unknown = set(extra) - {"device", "link_gbps", "host_memory"}
    if unknown:
        raise TypeError(f"offload options: unknown {sorted(unknown)}; known: device, link_gbps, host_memory")
    if "host_memory" in extra:
        extra["host_memory"] = _budget(extra["host_memory"], "host_memory")
    if "link_gbps" in extra:
        gbps = _non_negative(extra["link_gbps"], "link_gbps must be a number of GB/s",
                             "link_gbps must be a positive number of GB/s")
        if gbps == 0:
            raise MemplanError("link_gbps must be a positive number of GB/s, not 0", "invalid_argument")
        extra["link_gbps"] = gbps
    opts = {"time_limit": _seconds(time_limit), **extra}
    if budget is not None:
        opts["budget"] = _budget(budget)
    else:
        opts["max_slowdown"] = _non_negative(max_slowdown, "max_slowdown must be a number (0.05 for 5%)",
                                             "max_slowdown must be a share, 0 or more (0.05 for 5%)")
    return _call(_memplan.fit_offload_json, _text(graph, "graph"), json.dumps(opts))


def example(spec):
    """A built-in example step as a graph dict, written as for
    ``memplan bench``: ``"NAME[,batch=N,seq=N,layers=N,dtype=T,clip=X,world=N,
    prefetch=N,noreshard,flat,reduce=bf16,checkpoint,fused,mixed]"``.
    E.g. ``memplan.example("llama3-8b,world=8,mixed,checkpoint")`` is one
    rank's step of Llama 3 8B under FSDP2 (per-parameter shards) with mixed
    precision and activation checkpointing; ``flat`` shards FSDP1-style.
    """
    if not isinstance(spec, str):
        raise MemplanError(f"spec must be a string such as 'gpt2-tiny,batch=2', not {_shown(spec)}")
    return _call(_memplan.example_json, spec)


def _count(n, what):
    """A batch size: a non-negative int below 2**64."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise MemplanError(f"{what} must be a whole number, not {n!r}")
    if not 0 <= n < 2 ** 64:
        raise MemplanError(f"{what} must be between 0 and 2**64 - 1, not {_shown(n)}")
    return n


def _batches(batches):
    if batches is None:
        return 0, 0
    if not isinstance(batches, (tuple, list)) or len(batches) != 2:
        raise MemplanError(f"batches must be the two captures' batch sizes (b1, b2), not {batches!r}")
    return _count(batches[0], "batches[0]"), _count(batches[1], "batches[1]")


def at_batch(graph1, graph2, batch, batches=None):
    """The step at `batch`, from the same step captured at two batch sizes.

    Sizes, shapes, FLOPs and numeric attributes are extrapolated along the
    line through the two captures (docs/fit.md, "Largest batch"). The batch
    sizes of the two captures are `batches` (b1, b2), or what each graph's
    metadata records as ``"batch"``. Capture at two sizes above 1: PyTorch
    can trace batch 1 differently (squeezed dimensions).
    """
    b1, b2 = _batches(batches)
    return _call(_memplan.graph_at_batch_json, _text(graph1, "graph1"), b1,
                 _text(graph2, "graph2"), b2, _count(batch, "batch"))


def max_batch(graph1, graph2, budget, batches=None, probe_time=5.0):
    """The largest batch whose step fits `budget` bytes, three ways: PyTorch
    eager in its best configuration (the least of the caching allocator
    simulated over the eager order with and without expandable segments and
    with the optimizer in the backward, as ``memplan compare`` simulates
    them), memplan's plan without recomputation, and memplan with
    recomputation.

    `graph1` and `graph2` are the step captured at two batch sizes (see
    :func:`at_batch`). Returns ``{"eager", "eager_configuration",
    "eager_default", "planned", "fitted", "budget_bytes", "cap"}``:
    ``eager_configuration`` names the configuration that fits at ``eager``,
    ``eager_default`` is the default allocator's answer; an answer equal to
    `cap` means "at least".
    Each trial fit gets `probe_time` seconds.
    """
    b1, b2 = _batches(batches)
    return _call(_memplan.max_batch_json, _text(graph1, "graph1"), b1, _text(graph2, "graph2"),
                 b2, _budget(budget), _seconds(probe_time, "probe_time"))
