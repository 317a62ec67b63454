"""memplan from Python: plan a training step's graph (the order its ops run
in and every tensor's offset in one arena) and check a plan.

Graphs and plans are the JSON documents of memplan's docs/graph-format.md
and docs/plan-format.md, given as dicts (as `json.load` returns them) or as
paths to files (`.json`, or `.json.gz`).

    import memplan
    plan = memplan.plan("step.json", time_limit=5)
    plan["arena_bytes"], plan["order"][:3], plan["stats"]["lower_bound_bytes"]
    memplan.check("step.json", plan)   # the independent checker's report

Every error (a malformed graph, a plan that breaks a dependency or overlaps
two live tensors, a bad argument) raises `MemplanError`, whose message says
which document and which element is wrong.
"""

import json
import os

from . import _memplan

__all__ = ["MemplanError", "plan", "check", "__version__"]
__version__ = _memplan.__version__


class MemplanError(ValueError):
    """A graph, a plan or an argument memplan cannot accept."""


def _text(doc, what):
    """The JSON text of `doc`: a dict, a JSON string, or a path."""
    if isinstance(doc, dict):
        return json.dumps(doc)
    if isinstance(doc, (str, os.PathLike)):
        path = os.fspath(doc)
        if isinstance(doc, str) and doc.lstrip().startswith("{"):
            return doc
        try:
            return _memplan.read_text(path)
        except ValueError as e:
            raise MemplanError(str(e)) from None
    raise TypeError(f"{what} must be a dict, a JSON string or a path, not {type(doc).__name__}")


def plan(graph, time_limit=10.0):
    """Plans `graph` within `time_limit` seconds.

    Returns the plan as a dict: `order` (op ids in the order to run them),
    `tensors` (each tensor's `id` and byte `offset` in the arena),
    `arena_bytes`, `reuse` (outputs placed in their input's bytes), and
    `stats` (among others `lower_bound_bytes`, the floor no order can beat,
    and `peak_bytes`). The plan has passed memplan's independent checker.
    """
    try:
        text = _memplan.plan_json(_text(graph, "graph"), float(time_limit))
    except ValueError as e:
        raise MemplanError(str(e)) from None
    return json.loads(text)


def check(graph, plan):
    """Checks `plan` against `graph` with memplan's independent checker
    (every op once, dependencies respected, co-live tensors never overlap
    unless a declared reuse allows it, everything inside the arena).

    Returns the report (`max_live_bytes`, `used_bytes`, `ops`,
    `tensors_placed`); raises `MemplanError` naming the first violation.
    """
    try:
        return json.loads(_memplan.check_json(_text(graph, "graph"), _text(plan, "plan")))
    except ValueError as e:
        raise MemplanError(str(e)) from None
