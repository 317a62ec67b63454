"""memplan's JSON graph, written and read without torch.

This module knows the file format (``memplan-graph`` version 1, see
``src/io/json.rs`` and ``docs/graph-format.md``) and nothing about PyTorch, so
it is tested everywhere. :class:`GraphBuilder` collects tensors and ops in
program order and writes them, gzip-compressed when the path ends in ``.gz``.

:func:`check` validates a graph the way memplan's ``GraphBuilder`` does for
the rules an exporter can break (unknown or duplicate ids, two producers, an
op reading its own output, a read tensor with no source), and
:func:`program_order_live` computes the max live bytes of the listed order
with memplan's liveness rules (a root lives from its producer, or step 0, to
its last use; persistent roots to the end; views own no bytes), so the CLI
can print a summary and the tests can check lifetimes without Rust.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

FORMAT = "memplan-graph"
VERSION = 1

ROLES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "temporary",
    "input",
    "output",
    "communication",
)
STEP_INPUT_ROLES = ("parameter", "optimizer_state", "input")
KINDS = ("forward", "backward", "optimizer", "collective", "other")
LIFETIMES = ("transient", "persistent")


class GraphError(ValueError):
    """A graph that memplan would reject; the message names the element."""


class GraphBuilder:
    """Tensors and ops of one training step, in program order.

    Tensors and ops are plain dicts in the file's own shape, so a caller may
    amend a tensor (its role, its lifetime) after adding it, until
    :meth:`to_dict` or :meth:`write`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: List[Dict[str, Any]] = []
        self.ops: List[Dict[str, Any]] = []
        self.reference_peaks: Dict[str, int] = {}
        self.metadata: Dict[str, Any] = {}

    def add_tensor(
        self,
        id: str,
        size: int,
        role: str = "activation",
        lifetime: str = "transient",
        view_of: Optional[int] = None,
        dtype: Optional[str] = None,
        shape: Optional[Iterable[int]] = None,
        align: int = 1,
    ) -> int:
        """Adds a tensor and returns its index (used by :meth:`add_op`)."""
        if role not in ROLES:
            raise GraphError(f"tensor {id!r}: unknown role {role!r}")
        if lifetime not in LIFETIMES:
            raise GraphError(f"tensor {id!r}: unknown lifetime {lifetime!r}")
        if size < 0 or align < 1:
            raise GraphError(f"tensor {id!r}: size {size} / align {align} out of range")
        t: Dict[str, Any] = {"id": id, "size": int(size)}
        if align != 1:
            t["align"] = int(align)
        t["role"] = role
        t["lifetime"] = lifetime
        if view_of is not None:
            t["view_of"] = view_of
        if dtype is not None:
            t["dtype"] = dtype
        if shape is not None:
            t["shape"] = [int(d) for d in shape]
        self.tensors.append(t)
        return len(self.tensors) - 1

    def add_op(
        self,
        id: str,
        kind: str,
        type: str,
        inputs: Iterable[int] = (),
        outputs: Iterable[int] = (),
        updates: Iterable[int] = (),
        reuse: Iterable[Tuple[int, int]] = (),
        attrs: Optional[Dict[str, Any]] = None,
        flops: Optional[float] = None,
    ) -> int:
        """Adds an op (tensors by index) and returns its index. ``reuse``
        lists ``(output, input)`` pairs: the output may take the input's
        bytes if this op is the input's last use. ``flops``: the
        floating-point operations it performs, when known."""
        if kind not in KINDS:
            raise GraphError(f"op {id!r}: unknown kind {kind!r}")
        o: Dict[str, Any] = {"id": id, "kind": kind, "type": type}
        for field, ts in (("inputs", inputs), ("outputs", outputs), ("updates", updates)):
            ts = list(ts)
            if ts:
                o[field] = ts
        reuse = [(int(a), int(b)) for a, b in reuse]
        if reuse:
            o["reuse"] = reuse
        if attrs:
            o["attrs"] = dict(attrs)
        if flops is not None:
            if not flops >= 0:
                raise GraphError(f"op {id!r}: flops must be a number >= 0, got {flops!r}")
            o["flops"] = flops
        self.ops.append(o)
        return len(self.ops) - 1

    def to_dict(self) -> Dict[str, Any]:
        """The file form: references by index become references by id."""
        tid = [t["id"] for t in self.tensors]
        tensors = []
        for t in self.tensors:
            t = dict(t)
            if "view_of" in t:
                t["view_of"] = tid[t["view_of"]]
            tensors.append(t)
        ops = []
        for o in self.ops:
            o = dict(o)
            for field in ("inputs", "outputs", "updates"):
                if field in o:
                    o[field] = [tid[i] for i in o[field]]
            if "reuse" in o:
                o["reuse"] = [{"output": tid[a], "input": tid[b]} for a, b in o["reuse"]]
            ops.append(o)
        d: Dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "tensors": tensors,
            "ops": ops,
        }
        if self.reference_peaks:
            d["reference_peaks"] = {k: int(v) for k, v in sorted(self.reference_peaks.items())}
        if self.metadata:
            d["metadata"] = self.metadata
        return d

    def write(self, path: str) -> Dict[str, Any]:
        """Checks the graph and writes it; returns the file form."""
        d = self.to_dict()
        check(d)
        write(d, path)
        return d


def write(d: Dict[str, Any], path: str) -> None:
    """Writes a graph dict as JSON, gzip-compressed when `path` ends in
    ``.gz`` (with a zero timestamp, so equal graphs give equal files)."""
    text = json.dumps(d, separators=(",", ":"), sort_keys=False).encode()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
            f.write(text)
        data = buf.getvalue()
    else:
        data = text
    with open(path, "wb") as f:
        f.write(data)


def load(path: str) -> Dict[str, Any]:
    """Reads a graph file, plain or gzip-compressed."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        d = json.loads(data)
    except ValueError as e:
        raise GraphError(f"{path}: not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise GraphError(f"{path}: not a {FORMAT} file")
    if d.get("version") != VERSION:
        raise GraphError(f"{path}: unsupported version {d.get('version')!r}")
    return d


def _roots(d: Dict[str, Any]) -> Dict[str, str]:
    by_id = {t["id"]: t for t in d["tensors"]}
    root = {}
    for t in d["tensors"]:
        cur, seen = t, 0
        while "view_of" in cur:
            cur = by_id[cur["view_of"]]
            seen += 1
            if seen > len(by_id):
                raise GraphError(f"tensor {t['id']!r}: view_of forms a cycle")
        root[t["id"]] = cur["id"]
    return root


def check(d: Dict[str, Any]) -> None:
    """Raises :class:`GraphError` on what memplan would reject."""
    tensors = {}
    for t in d["tensors"]:
        if t["id"] in tensors:
            raise GraphError(f"tensor {t['id']!r} is defined twice")
        tensors[t["id"]] = t
    for t in d["tensors"]:
        if "view_of" in t and t["view_of"] not in tensors:
            raise GraphError(f"tensor {t['id']!r} is a view of unknown {t['view_of']!r}")
    root = _roots(d)
    producer: Dict[str, str] = {}
    op_ids = set()
    for o in d["ops"]:
        if o["id"] in op_ids:
            raise GraphError(f"op {o['id']!r} is defined twice")
        op_ids.add(o["id"])
        for field in ("inputs", "outputs", "updates"):
            for x in o.get(field, []):
                if x not in tensors:
                    raise GraphError(f"op {o['id']!r}: {field} names unknown tensor {x!r}")
        outs = set(o.get("outputs", []))
        for x in o.get("outputs", []):
            if x in producer:
                raise GraphError(
                    f"tensor {x!r} is produced by {producer[x]!r} and {o['id']!r}"
                )
            producer[x] = o["id"]
        for field in ("inputs", "updates"):
            for x in o.get(field, []):
                if x in outs:
                    raise GraphError(f"op {o['id']!r} {field[:-1]}s its own output {x!r}")
        for r in o.get("reuse", []):
            out, inp = r["output"], r["input"]
            bad = f"op {o['id']!r}: reuse {out!r} <- {inp!r}:"
            if out not in outs or inp not in o.get("inputs", []):
                raise GraphError(f"{bad} not an output and an input of this op")
            if "view_of" in tensors[out]:
                raise GraphError(f"{bad} the output is a view")
            if tensors[out]["size"] > tensors[root[inp]]["size"]:
                raise GraphError(f"{bad} the output is larger than the input")

    def has_source(x: str) -> bool:
        while True:
            t = tensors[x]
            if x in producer or t.get("role") in STEP_INPUT_ROLES or t.get("lifetime") == "persistent":
                return True
            if "view_of" not in t:
                return False
            x = t["view_of"]

    seen_producer: set = set()
    for o in d["ops"]:
        for x in o.get("inputs", []) + o.get("updates", []):
            if not has_source(x):
                raise GraphError(
                    f"op {o['id']!r} reads {x!r} ({tensors[x].get('role', 'activation')}), "
                    "which nothing produces"
                )
            if x in producer and producer[x] not in seen_producer:
                raise GraphError(f"op {o['id']!r} reads {x!r} before its producer runs")
        seen_producer.add(o["id"])


def program_order_live(d: Dict[str, Any]) -> Dict[str, Any]:
    """Liveness of the listed order, memplan's rules, no reuse.

    Returns ``max_live`` (bytes), ``peak_step`` (op index), ``birth`` and
    ``death`` (op index per root id that occupies memory).
    """
    n = len(d["ops"])
    root = _roots(d)
    tensors = {t["id"]: t for t in d["tensors"]}
    birth: Dict[str, int] = {}
    death: Dict[str, int] = {}
    for i, o in enumerate(d["ops"]):
        for x in o.get("outputs", []):
            r = root[x]
            if r == x:
                birth[x] = i
            death[r] = max(death.get(r, i), i)
        for x in o.get("inputs", []) + o.get("updates", []):
            r = root[x]
            death[r] = max(death.get(r, i), i)
    delta = [0] * (n + 1)
    b_out: Dict[str, int] = {}
    d_out: Dict[str, int] = {}
    for tid, t in tensors.items():
        if "view_of" in t or t["size"] == 0:
            continue
        b = birth.get(tid, 0)
        e = n - 1 if t.get("lifetime") == "persistent" else death.get(tid, b)
        e = max(e, b)
        b_out[tid], d_out[tid] = b, e
        delta[b] += t["size"]
        delta[e + 1] -= t["size"]
    live, best, at = 0, 0, 0
    for i in range(max(n, 1)):
        live += delta[i]
        if live > best:
            best, at = live, i
    return {"max_live": best, "peak_step": at, "birth": b_out, "death": d_out}
