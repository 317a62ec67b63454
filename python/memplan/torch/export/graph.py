"""Graph files: writing and reading memplan's JSON graph, gzip-compressed
when the path ends in ``.gz``, and checking one with memplan's own core.

The file format is ``memplan-graph`` version 1 (``src/io/json.rs``,
``docs/graph-format.md``). What a valid graph is, and what its program
order holds live, are decided in one place, the Rust core: :func:`check`
asks it (through :func:`memplan.baselines`, which loads the graph with every
check memplan applies and simulates the order it lists), so the exporter
and the planner never disagree.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from typing import Any, Dict

import memplan

FORMAT = "memplan-graph"
VERSION = 1


class GraphError(ValueError):
    """A graph file that is not one: the message names the file."""


def check(d: Dict[str, Any]) -> Dict[str, Any]:
    """Loads graph `d` in memplan's core, which raises
    :class:`memplan.MemplanError` naming the first element it rejects;
    returns the baselines of its listed order (``program-order``: its max
    live bytes)."""
    return memplan.baselines(d)["baselines"]


def program_order_max_live(d: Dict[str, Any]) -> int:
    """The max live bytes of `d`'s ops in the order listed (memplan's
    liveness rules: ``memplan compare``'s ``program-order``)."""
    return int(check(d)["program-order"]["footprint_bytes"])


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
