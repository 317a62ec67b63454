"""Splitting the loss chain of a captured step (``capture(..., split=...)``).

memplan's splitting pass (``src/split/loss.rs``, docs/splitting.md) rewrites the
loss chain of a graph in memplan's own op vocabulary, which its executors
run. A captured step's graph names aten ops instead, and only PyTorch can
run them, so this module is the same transform over aten calls: it finds
the chain that starts at the LM head's product, and rewrites the graph and
its program into `k` chunks of rows (tokens), each call running on row
slices of its operands. The rules are the Rust pass's (one row of each
result depends only on the same row of its operands; the two sums over
rows are joined), written per aten op:

| op | chunk `i` (rows `[r0, r1)`) |
|---|---|
| ``mm(y, H)`` (the seed: ``y [R, C]``, output ``[R, V]``, ``V > C``) | ``mm(y[r0:r1], H)`` |
| ``view``, ``_unsafe_view``, ``reshape``, ``alias``, ``detach`` keeping the last dimension | nothing: the chunk is the same tensor |
| ``_to_copy``; any op tagged ``pointwise`` whose other operands are scalars or chunks (a soft-capping's ``div``, ``tanh``, ``mul``, and their backward ops) | on the chunk |
| ``_log_softmax``, ``_softmax`` over the last dimension, and their backward ops | on the chunk, over its dimension 1 |
| ``nll_loss_forward(p, target, None, mean or sum, ignore)`` | ``reduction=sum`` on the chunk's rows of ``target``; joins: the total weight is counted once, before the chunks, from ``target`` (``target != ignore``), the loss is the sum of the chunks' (divided by that count for ``mean``) |
| ``nll_loss_backward(g, p, target, None, r, ignore, total_weight)`` | on the chunk, with the whole step's total weight |
| ``t`` of a chunk, then ``mm(t(d), y)`` (the head's weight gradient) | chunk 0 ``mm``, later chunks ``addmm_`` into it |
| ``mm(d, W)`` of a chunk, output narrower than ``V`` (the gradient of ``y``) | ``mm(d, W)``; the chunks are joined by one ``cat`` |

The backward pass's seed, ``ones_like(loss)``, reads the loss for its shape
and dtype only; it reads chunk 0's partial loss instead, so a chunk's
backward need not wait for every chunk's forward (else the logits of all
chunks would be alive at once and nothing would be gained).

Two control edges (``after``) keep each chunk together where nothing in
the data does: a chunk's ``nll_loss_backward`` runs after its
``nll_loss_forward`` (whose partial loss nothing reads until the join, so
a planner could leave it to the end, holding the chunk's
log-probabilities), and its accumulation into the head's gradient after
its product for the gradient of ``y`` (so the head's weight, which that
product reads, is not held past the gradient's completion: under FSDP2
that is a gathered weight).

What does not match is left as it was: a reader of a chunked tensor that
no rule covers (anything that might mix rows: a reduction, an operand
that is not a scalar and could broadcast along the rows), a weighted loss, a loss
without reduction, an in-place write to a chunked tensor. The chunked
tensors of the original keep their place in the tensor list with zero
bytes (every other tensor keeps its index: the step's bound tensors, loss
and norm are indices), and the new tensors are appended.

Why it is exact is docs/splitting.md's argument: every row-wise op
computes the same rows; the loss and the weight gradient are the same
sums grouped by chunk (so the split step equals the unsplit one up to
floating-point summation order, and one more rounding of a bf16 weight
gradient per chunk); the total weight is an integer count either way.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from ._calls import Call, Ref
from ._tensors import Layout, dtype_itemsize

aten = torch.ops.aten

# The counts `auto` tries, as the Rust pass's `AUTO_CHUNKS`.
AUTO_CHUNKS = (2, 4, 8, 16, 32)

_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default",
          "aten.detach.default"}
_SOFTMAX = {"aten._log_softmax.default", "aten._softmax.default"}
_SOFTMAX_BACKWARD = {"aten._log_softmax_backward_data.default", "aten._softmax_backward_data.default"}

ROWS, TROWS = "rows", "trows"


class NotSplit(Exception):
    """Why a chain is left as it was."""


def chunk_rows(rows: int, k: int) -> List[Tuple[int, int]]:
    """`k` slices of `rows` whose sizes differ by at most one (as the Rust
    pass's ``chunk_rows``)."""
    base, extra = divmod(rows, k)
    out, r = [], 0
    for i in range(k):
        n = base + (1 if i < extra else 0)
        out.append((r, r + n))
        r += n
    return out


class _Graph:
    """Indices over a captured graph document and its calls."""

    def __init__(self, graph: Dict[str, Any], calls: Sequence[Call], layouts: Sequence[Layout]) -> None:
        self.graph, self.calls, self.layouts = graph, calls, layouts
        self.tensors = graph["tensors"]
        self.ops = graph["ops"]
        self.index = {t["id"]: i for i, t in enumerate(self.tensors)}
        self.index_of_op = {op["id"]: k for k, op in enumerate(self.ops)}
        self.producer: Dict[int, int] = {}
        for k, op in enumerate(self.ops):
            for tid in op.get("outputs", []):
                self.producer[self.index[tid]] = k

    def root(self, i: int) -> int:
        while "view_of" in self.tensors[i]:
            i = self.index[self.tensors[i]["view_of"]]
        return i

    def shape(self, i: int) -> List[int]:
        return list(self.tensors[i].get("shape") or self.layouts[i].shape)


def _width(shape: Sequence[int]) -> int:
    return int(shape[-1]) if shape else 1


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _Chain:
    """One loss chain: which tensors are chunked, and what each op does."""

    def __init__(self, g: _Graph, seed: int) -> None:
        self.g = g
        self.seed = seed
        a, h = g.calls[seed].args[:2]
        out = g.calls[seed].outputs[0][1]
        self.rows, self.width = g.shape(out)
        self.state: Dict[int, str] = {out: ROWS}  # tensor -> ROWS / TROWS
        self.alias: Dict[int, int] = {}  # a view tensor -> the tensor whose chunks it shares
        self.narrowed: set = {a.index}  # tensors read by rows, made outside the chain
        self.ops: Dict[int, str] = {seed: "rows"}  # op -> what it becomes
        self.joins: Dict[int, str] = {}  # tensor made by a join -> how
        self.nll: Optional[int] = None
        self._follow()
        mine = {g.ops[o]["id"] for o in self.ops}
        for op in g.ops:
            if mine.intersection(op.get("after", ())):
                raise NotSplit(f"{op['id']} must run after an op of the chain (a control edge)")

    def _base(self, i: int) -> int:
        while i in self.alias:
            i = self.alias[i]
        return i

    def _follow(self) -> None:
        g = self.g
        for k in range(self.seed + 1, len(g.ops)):
            op = g.ops[k]
            ins = [g.index[t] for t in op.get("inputs", [])]
            ups = [g.root(g.index[t]) for t in op.get("updates", [])]
            if any(g.root(i) in self.state or i in self.state for i in ups):
                raise NotSplit(f"{op['id']} writes a chunked tensor in place")
            chunked = [i for i in ins if i in self.state]
            if not chunked:
                continue
            self.ops[k] = self._rule(k, op, chunked)

    def _rule(self, k: int, op: Dict[str, Any], chunked: List[int]) -> str:
        g, ty, c = self.g, op["type"], self.g.calls[k]
        outs = [i for _, i in c.outputs]
        args = c.args
        why = f"{op['id']} ({ty})"
        if ty in _VIEWS:
            x = args[0].index
            y = outs[0]
            if self.state[x] != ROWS or _width(g.shape(y)) != self.width or \
                    _numel(g.shape(y)) != self.rows * self.width:
                raise NotSplit(f"{why} reshapes the chunked rows")
            self.state[y] = ROWS
            self.alias[y] = x
            return "alias"
        if ty == "aten._to_copy.default":
            if c.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
                raise NotSplit(f"{why} changes the memory format")
            self.state[outs[0]] = ROWS
            return "rows"
        if ty in _SOFTMAX or ty in _SOFTMAX_BACKWARD:
            dim_pos = 1 if ty in _SOFTMAX else 2
            x = args[0].index
            nd = len(g.shape(x))
            if args[dim_pos] % nd != nd - 1 or any(self.state.get(i) != ROWS for i in chunked):
                raise NotSplit(f"{why} is not over the last dimension")
            self.state[outs[0]] = ROWS
            return "rows"
        if ty == "aten.nll_loss_forward.default":
            p, target, weight, reduction = args[0], args[1], args[2], args[3]
            if weight is not None or reduction not in (1, 2) or self.nll is not None:
                raise NotSplit(f"{why}: a weighted or unreduced loss")
            if p.index not in chunked or not isinstance(target, Ref) or g.shape(target.index) != [self.rows]:
                raise NotSplit(f"{why}: its target is not one per row")
            self.narrowed.add(target.index)
            self.nll = k
            self.joins[outs[0]] = "loss"
            self.joins[outs[1]] = "total_weight"
            return "nll"
        if ty == "aten.nll_loss_backward.default":
            p, target, weight, reduction = args[1], args[2], args[3], args[4]
            if self.nll is None or weight is not None or not isinstance(target, Ref) or \
                    target.index not in self.narrowed or args[0].index in self.state or \
                    args[6].index in self.state:
                raise NotSplit(f"{why} does not match the chain's loss")
            self.state[outs[0]] = ROWS
            return "rows"
        if ty == "aten.t.default":
            if self.state[args[0].index] != ROWS:
                raise NotSplit(f"{why} transposes a transposed chunk")
            self.state[outs[0]] = TROWS
            return "t"
        if ty == "aten.mm.default":
            a, b = args[0].index, args[1].index
            if self.state.get(a) == ROWS and b not in self.state:
                if g.shape(a)[0] != self.rows:
                    raise NotSplit(f"{why} reads a chunk of other rows")
                if _width(g.shape(outs[0])) == self.width:
                    self.state[outs[0]] = ROWS
                    return "rows"
                if g.shape(outs[0]) != [self.rows, _width(g.shape(outs[0]))]:
                    raise NotSplit(f"{why}'s result is not one row per row")
                self.joins[outs[0]] = "cat"
                return "exit"
            if self.state.get(a) == TROWS and b not in self.state and g.shape(b)[:1] == [self.rows] and \
                    len(g.shape(b)) == 2:
                self.narrowed.add(b)
                self.joins[outs[0]] = "sum"
                return "reduce"
            raise NotSplit(f"{why} mixes rows")
        if self._pointwise(c, chunked, outs):
            self.state[outs[0]] = ROWS
            return "rows"
        raise NotSplit(f"{why} reads a chunked tensor and has no rule")

    def _pointwise(self, c: Call, chunked: List[int], outs: List[int]) -> bool:
        """An elementwise op (PyTorch's ``pointwise`` tag: a soft-capping's
        ``div``, ``tanh``, ``mul``; ``tanh_backward``) whose tensor operands
        are chunks of the same rows or scalars (0-d), making one tensor of
        the chunks' shape: row ``r`` of it reads row ``r`` of each operand."""
        func = c.func
        if not isinstance(func, torch._ops.OpOverload) or torch.Tag.pointwise not in func.tags:
            return False
        if len(outs) != 1 or any(self.state.get(i) != ROWS for i in chunked):
            return False
        g = self.g
        if any(isinstance(x, Ref) and x.index in self.state for x in tree_flatten(c.kwargs)[0]):
            return False  # (a chunk is passed by position only, below)
        for x in tree_flatten((c.args, c.kwargs))[0]:
            if isinstance(x, Ref) and x.index not in self.state and g.shape(x.index) != []:
                return False  # an operand that is not a scalar could broadcast along the rows
        shape = g.shape(outs[0])
        return _width(shape) == self.width and _numel(shape) == self.rows * self.width


def find_seeds(graph: Dict[str, Any], calls: Sequence[Call], layouts: Sequence[Layout]) -> List[int]:
    """The ops a chain may start at: forward, not already split, an
    ``mm(y [R, C], H [C, V])`` with V > C, largest first."""
    g = _Graph(graph, calls, layouts)
    found = []
    for k, op in enumerate(g.ops):
        if op["type"] != "aten.mm.default" or op.get("kind") != "forward" or \
                "split_of" in op.get("attrs", {}):
            continue
        out = g.calls[k].outputs[0][1] if g.calls[k].outputs else None
        if out is None:
            continue
        a, h = g.shape(g.calls[k].args[0].index), g.shape(out)
        if len(a) == 2 and len(h) == 2 and h[1] > a[1] and h[0] > 1:
            found.append((-h[0] * h[1], k))
    return [k for _, k in sorted(found)]


def find_chains(graph: Dict[str, Any], calls: Sequence[Call], layouts: Sequence[Layout]) -> List[Dict[str, Any]]:
    """Each chain that would split: its seed op, rows and width; and each
    candidate that would not, with why (for reports and tests)."""
    g = _Graph(graph, calls, layouts)
    out = []
    for k in find_seeds(graph, calls, layouts):
        try:
            c = _Chain(g, k)
            if c.nll is None:
                raise NotSplit(f"{g.ops[k]['id']}: no loss over its rows")
            out.append({"seed": g.ops[k]["id"], "rows": c.rows, "width": c.width, "ops": len(c.ops)})
        except NotSplit as e:
            out.append({"seed": g.ops[k]["id"], "refused": str(e)})
    return out


class _Builder:
    """The split graph: new tensors and ops, and their calls and layouts."""

    def __init__(self, g: _Graph) -> None:
        self.g = g
        self.tensors = [dict(t) for t in g.tensors]
        self.layouts = list(g.layouts)
        # (priority, place, op, call): the priority schedules, the place
        # (the recorded position of the op it stands for) orders writes.
        self.new_ops: List[Tuple[tuple, tuple, Dict[str, Any], Call]] = []

    def tensor(self, like: int, id: str, shape: Sequence[int], *, dtype: Optional[str] = None,
               view_of: Optional[int] = None, offset: int = 0, stride: Optional[Sequence[int]] = None,
               torch_dtype: Optional[torch.dtype] = None) -> int:
        base = self.g.tensors[like]
        lay = self.g.layouts[like]
        dtype = dtype or base["dtype"]
        t: Dict[str, Any] = {"id": id, "role": base["role"] if view_of is None else self.tensors[view_of]["role"],
                             "lifetime": "transient", "dtype": dtype, "shape": [int(d) for d in shape]}
        if "align" in base:
            t["align"] = base["align"]
        if stride is None:
            stride, acc = [], 1
            for d in reversed(shape):
                stride.insert(0, acc)
                acc *= int(d)
        if view_of is not None:
            t["size"] = 0
            t["view_of"] = self.tensors[view_of]["id"]
        else:
            t["size"] = _numel(shape) * dtype_itemsize(dtype, torch_dtype or lay.dtype)
        self.tensors.append(t)
        self.layouts.append(Layout(tuple(int(d) for d in shape), tuple(stride), offset,
                                   torch_dtype or lay.dtype, lay.device))
        return len(self.tensors) - 1

    def op(self, priority: tuple, id: str, kind: str, type: str, call: Call, *, inputs=(), outputs=(),
           updates=(), flops: Optional[int] = None, reuse=None, split=None, place: Optional[tuple] = None,
           after: Sequence[str] = ()) -> None:
        op: Dict[str, Any] = {"id": id, "kind": kind, "type": type}
        if flops is not None:
            op["flops"] = int(flops)
        ids = lambda xs: [self.tensors[i]["id"] for i in dict.fromkeys(xs)]  # noqa: E731
        ins = [i for i in dict.fromkeys(inputs) if i not in updates and i not in outputs]
        for field, xs in (("inputs", ins), ("outputs", outputs), ("updates", updates)):
            if xs:
                op[field] = ids(xs)
        if reuse is not None:
            op["reuse"] = [{"output": self.tensors[reuse[0]]["id"], "input": self.tensors[reuse[1]]["id"]}]
        if after:
            op["after"] = list(after)
        if split is not None:
            op["attrs"] = {"split_of": split["of"], "chunk": split["chunk"], "rows": split["rows"]}
        if place is None:
            place = (self.g.index_of_op[split["of"]], split["chunk"], 0) if split else priority[:3]
        self.new_ops.append((priority, place, op, call))


def split_step(graph: Dict[str, Any], calls: List[Call], layouts: List[Layout], k: int):
    """`graph`, its calls and layouts with every separable loss chain split
    into `k` chunks; returns ``(graph, calls, layouts, chains)``, `chains`
    the chains split (empty: the inputs unchanged)."""
    done: List[Dict[str, Any]] = []
    while True:
        g = _Graph(graph, calls, layouts)
        chain = None
        for seed in find_seeds(graph, calls, layouts):
            try:
                c = _Chain(g, seed)
                if c.nll is not None:
                    chain = c
                    break
            except NotSplit:
                continue
        if chain is None:
            return graph, calls, layouts, done
        graph, calls, layouts, added = _split_chain(g, chain, k, f"s{len(done)}")
        done.append({"seed": g.ops[chain.seed]["id"], "rows": chain.rows, "width": chain.width, "chunks": k,
                     "added_flops": added})


def _split_chain(g: _Graph, ch: _Chain, k: int, tag: str):
    """Chain `ch` of `g` in `k` chunks of rows: the total weight counted
    once from the targets, each chunk's ops (:class:`_Chunks`), then the
    joins (the loss, the tensors read past the chain). Returns what
    :func:`_assemble` does, and the added FLOPs."""
    b = _Builder(g)
    nll_call = g.calls[ch.nll]
    target, ignore, reduction = nll_call.args[1].index, nll_call.args[4], nll_call.args[3]
    loss_t, weight_t = nll_call.outputs[0][1], nll_call.outputs[1][1]
    nll_kind = g.ops[ch.nll]["kind"]
    p_dtype = g.layouts[loss_t].dtype

    # The total weight, counted once from the targets (weight None: the
    # number of rows whose target is not `ignore`).
    mask = b.tensor(target, f"{tag}.counted", [ch.rows], dtype="bool", torch_dtype=torch.bool)
    b.op((ch.seed, -1, 0, 0), f"{tag}.count", nll_kind, "aten.ne.Scalar",
         Call(aten.ne.Scalar, (Ref(target), ignore), {}, [(0, mask)]), inputs=[target], outputs=[mask])
    b.op((ch.seed, -1, 1, 0), f"{tag}.total_weight", nll_kind, "aten.sum.default",
         Call(aten.sum.default, (Ref(mask),), {"dtype": p_dtype}, [(0, weight_t)]), inputs=[mask],
         outputs=[weight_t])

    chunks = _Chunks(g, ch, b, tag, loss_t, weight_t)
    for c, (r0, r1) in enumerate(chunk_rows(ch.rows, k)):
        chunks.emit(c, r0, r1)
    partial = chunks.partial

    # Joins: the loss, and the chunks of each tensor read past the chain.
    last = k
    acc = partial[0]
    for c in range(1, k):
        final = c == k - 1 and reduction == 2
        out = loss_t if final else b.tensor(loss_t, f"{g.tensors[loss_t]['id']}.{tag}sum{c}", g.shape(loss_t))
        b.op((ch.seed, last, 0, c), f"{tag}.loss.add{c}", nll_kind, "aten.add.Tensor",
             Call(aten.add.Tensor, (Ref(acc), Ref(partial[c])), {}, [(0, out)]), inputs=[acc, partial[c]],
             outputs=[out])
        acc = out
    if reduction == 1:
        b.op((ch.seed, last, 1, 0), f"{tag}.loss.mean", nll_kind, "aten.div.Tensor",
             Call(aten.div.Tensor, (Ref(acc), Ref(weight_t)), {}, [(0, loss_t)]), inputs=[acc, weight_t],
             outputs=[loss_t])
    for j, (y, parts) in enumerate(chunks.exits.items()):
        kind = g.ops[g.producer[y]]["kind"]
        b.op((ch.seed, last, 2, j), f"{tag}.join.{g.tensors[y]['id']}", kind, "aten.cat.default",
             Call(aten.cat.default, ([Ref(p) for p in parts], 0), {}, [(0, y)]), inputs=parts, outputs=[y])

    # The chunked tensors of the original hold no bytes now.
    for i, st in ch.state.items():
        if i in ch.joins:
            continue
        t = b.tensors[i]
        t["size"] = 0
        t.pop("view_of", None)

    # Added work: the later chunks' accumulations into the weight gradient,
    # the partial losses' additions, and counting the targets.
    added = chunks.added + (k - 1) + ch.rows
    return _assemble(g, ch, b, partial[0], loss_t) + (added,)


class _Chunks:
    """Emits each chunk's copy of a chain's ops into builder `b`
    (:meth:`emit`), keeping what the joins need: each chunk's partial loss
    (`partial`), the chunks of each tensor read past the chain (`exits`)
    and the FLOPs the accumulations add (`added`)."""

    def __init__(self, g: _Graph, ch: _Chain, b: "_Builder", tag: str, loss_t: int, weight_t: int) -> None:
        self.g, self.ch, self.b, self.tag = g, ch, b, tag
        self.loss_t, self.weight_t = loss_t, weight_t
        self.added = 0
        self.partial: List[int] = []  # each chunk's partial loss
        self.exits: Dict[int, List[int]] = {}  # a tensor joined by `cat` -> its chunks

    def emit(self, c: int, r0: int, r1: int) -> None:
        """Chunk `c`, rows `[r0, r1)`: every op of the chain on its rows."""
        g, ch = self.g, self.ch
        self.c, self.r0, self.n = c, r0, r1 - r0
        self.mine: Dict[int, int] = {}
        # A chunk's backward waits for its loss (a control edge): nothing
        # else reads the partial loss until the join, and a loss left for
        # later would hold the chunk's log-probabilities until then.
        self.nll_fwd: List[str] = []
        # The chunk's products for the gradient of `y`: its accumulation
        # into the head's gradient waits for them (control edges), so the
        # head's weight is not held past its gradient's completion.
        self.exit_ids = [f"{g.ops[o]['id']}.{self.tag}c{c}" for o in sorted(ch.ops) if ch.ops[o] == "exit"]
        for o in sorted(ch.ops):
            what = ch.ops[o]
            if what == "alias":
                continue
            if what == "t":
                self._transpose(o)
            else:
                self._op(o, what)

    def _split_attr(self, o: int) -> Dict[str, Any]:
        return {"of": self.g.ops[o]["id"], "chunk": self.c, "rows": [self.r0, self.r0 + self.n]}

    def _name(self, x: int) -> str:
        """The chunk's name for tensor or op id `x`."""
        return f"{x}.{self.tag}c{self.c}"

    def _narrowed(self, x: int) -> int:
        """The chunk's rows of `x`: a view, made by a slice on first use."""
        g, b, mine = self.g, self.b, self.mine
        if x in mine:
            return mine[x]
        shape = g.shape(x)
        lay = g.layouts[x]
        v = b.tensor(x, self._name(g.tensors[x]["id"]), [self.n] + shape[1:], view_of=x,
                     offset=lay.offset + self.r0 * (lay.stride[0] if lay.stride else 0), stride=lay.stride)
        b.op((self.ch.seed, self.c, -1, len(mine)), f"{self.tag}.c{self.c}.rows.{g.tensors[x]['id']}",
             g.ops[self.ch.seed]["kind"], "aten.slice.Tensor",
             Call(aten.slice.Tensor, (Ref(x), 0, self.r0, self.r0 + self.n), {}, [(0, v)]),
             inputs=[x], outputs=[v])
        mine[x] = v
        return v

    def _chunk(self, x: int) -> int:
        """The chunk's own copy of chain tensor `x` (or of its base)."""
        return self.mine[self.ch._base(x)] if self.ch._base(x) in self.mine else self.mine[x]

    def _transpose(self, o: int) -> None:
        """A transpose of a chunk's tensor: a view of the chunk's copy."""
        g, b = self.g, self.b
        op, call = g.ops[o], g.calls[o]
        x, y = call.args[0].index, call.outputs[0][1]
        shp = list(b.layouts[self._chunk(x)].shape)
        self.mine[y] = b.tensor(y, self._name(g.tensors[y]["id"]), [shp[1], shp[0]], view_of=self._chunk(x),
                                stride=[1, shp[1]])
        b.op((self.ch.seed, self.c, o, 0), self._name(op["id"]), op["kind"], op["type"],
             Call(aten.t.default, (Ref(self._chunk(x)),), {}, [(0, self.mine[y])]), inputs=[self._chunk(x)],
             outputs=[self.mine[y]], split=self._split_attr(o))

    def _arguments(self, o: int, what: str):
        """Op `o`'s arguments on the chunk: its chain tensors as the
        chunk's copies, the rows it reads whole as the chunk's rows, and
        the softmax's dimension as 1. Returns the arguments and the graph
        tensors read."""
        g, ch = self.g, self.ch
        op, call = g.ops[o], g.calls[o]
        new_args = list(call.args)
        ins: List[int] = []
        for pos, a in enumerate(call.args):
            if not isinstance(a, Ref):
                continue
            i = a.index
            if i in ch.state:
                new_args[pos] = Ref(self._chunk(i))
            elif i in ch.narrowed and (what in ("rows", "exit") and pos == 0 and o == ch.seed or
                                       what == "nll" and pos == 1 or
                                       what == "rows" and op["type"] == "aten.nll_loss_backward.default"
                                       and pos == 2 or what == "reduce" and pos == 1):
                new_args[pos] = Ref(self._narrowed(i))
            ins.append(new_args[pos].index)
        if op["type"] in _SOFTMAX:
            new_args[1] = 1
        elif op["type"] in _SOFTMAX_BACKWARD:
            new_args[2] = 1
        return new_args, ins

    def _op(self, o: int, what: str) -> None:
        """Op `o` of the chain on the chunk's rows, by its part in the
        chain: a row-wise op, the loss, a product leaving the chain, or the
        head's gradient (made by the first chunk, accumulated by the rest)."""
        g, b, ch, c, n = self.g, self.b, self.ch, self.c, self.n
        op, call = g.ops[o], g.calls[o]
        prio = (ch.seed, c, o, 0)
        y = call.outputs[0][1] if call.outputs else None
        new_args, ins = self._arguments(o, what)
        flops = op.get("flops")
        chunk_flops = None if flops is None else flops * n // ch.rows
        name, split = self._name(op["id"]), self._split_attr(o)
        if what == "rows":
            self.mine[y] = b.tensor(y, self._name(g.tensors[y]["id"]), [n, ch.width])
            reuse = None
            for r in op.get("reuse", []):
                ri, ro = g.index[r["input"]], g.index[r["output"]]
                if ro == y and ch._base(ri) in self.mine:
                    reuse = (self.mine[y], self._chunk(ri))
            b.op(prio, name, op["kind"], op["type"],
                 Call(call.func, tuple(new_args), call.kwargs, [(call.outputs[0][0], self.mine[y])]),
                 inputs=ins, outputs=[self.mine[y]], flops=chunk_flops, reuse=reuse, split=split,
                 after=self.nll_fwd if op["type"] == "aten.nll_loss_backward.default" else ())
        elif what == "nll":
            new_args[3] = 2  # sum: the chunks' sums are joined below
            loss_t, weight_t = self.loss_t, self.weight_t
            s = b.tensor(loss_t, self._name(g.tensors[loss_t]["id"]), g.shape(loss_t))
            w = b.tensor(weight_t, self._name(g.tensors[weight_t]["id"]), g.shape(weight_t))
            self.partial.append(s)
            self.nll_fwd.append(name)
            b.op(prio, name, op["kind"], op["type"], Call(call.func, tuple(new_args), call.kwargs, [(0, s), (1, w)]),
                 inputs=ins, outputs=[s, w], flops=chunk_flops, split=split)
        elif what == "exit":
            part = b.tensor(y, self._name(g.tensors[y]["id"]), [n, _width(g.shape(y))])
            self.exits.setdefault(y, []).append(part)
            b.op(prio, name, op["kind"], op["type"], Call(call.func, tuple(new_args), call.kwargs, [(0, part)]),
                 inputs=ins, outputs=[part], flops=chunk_flops, split=split)
        elif what == "reduce" and c == 0:
            b.op(prio, name, op["kind"], op["type"], Call(call.func, tuple(new_args), call.kwargs, [(0, y)]),
                 inputs=ins, outputs=[y], flops=chunk_flops, split=split, after=self.exit_ids)
        elif what == "reduce":
            self.added += _numel(g.shape(y))
            b.op(prio, name, op["kind"], "aten.addmm_.default",
                 Call(aten.addmm_.default, (Ref(y),) + tuple(new_args), {}, [], writes=frozenset({0, "self"})),
                 inputs=ins, updates=[y], flops=(chunk_flops or 0) + _numel(g.shape(y)), split=split,
                 after=self.exit_ids)


def _depends_on(g: _Graph, start: int, upto: int, sources: set) -> set:
    """The tensors made by ops before `upto` from `sources` (by data)."""
    reached = set(sources)
    for k in range(start, upto):
        op = g.ops[k]
        if any(g.index[t] in reached for t in op.get("inputs", [])):
            reached.update(g.index[t] for t in op.get("outputs", []))
    return reached


def _assemble(g: _Graph, ch: _Chain, b: _Builder, first_partial: int, loss_t: int):
    """The new graph's ops in one valid order: the kept ops, the chain's
    chunks in place of its ops, and the joins; the order of every write
    to a tensor kept as recorded."""
    items: List[Tuple[tuple, tuple, Dict[str, Any], Call]] = []
    for o, op in enumerate(g.ops):
        if o in ch.ops:
            continue
        call = g.calls[o]
        if op["type"] == "aten.ones_like.default" and o > ch.nll:
            # The backward pass's seed reads the loss for its shape only.
            x = call.args[0].index
            lay, mine = g.layouts[x], b.layouts[first_partial]
            if x in _depends_on(g, ch.nll, o, {loss_t}) and \
                    (lay.shape, lay.dtype, lay.device) == (mine.shape, mine.dtype, mine.device):
                op = dict(op, inputs=[b.tensors[first_partial]["id"] if t == g.tensors[x]["id"] else t
                                      for t in op.get("inputs", [])])
                call = Call(call.func, (Ref(first_partial),) + tuple(call.args[1:]), call.kwargs, call.outputs,
                            call.random, call.writes)
        items.append(((o, 0, 0, 0), (o, 0, 0), op, call))
    items.extend(b.new_ops)

    index = {t["id"]: i for i, t in enumerate(b.tensors)}

    def root(i: int) -> int:
        while "view_of" in b.tensors[i]:
            i = index[b.tensors[i]["view_of"]]
        return i

    producer: Dict[int, int] = {}
    for n, (_, _, op, _) in enumerate(items):
        for t in op.get("outputs", []):
            producer[index[t]] = n
    deps: List[set] = [set() for _ in items]
    named = {op["id"]: n for n, (_, _, op, _) in enumerate(items)}
    # Data: each op after what makes its operands (and its control edges).
    for n, (_, _, op, _) in enumerate(items):
        deps[n].update(named[a] for a in op.get("after", []))
        for t in op.get("inputs", []) + op.get("updates", []):
            p = producer.get(index[t])
            if p is not None and p != n:
                deps[n].add(p)
    # Writes: per root, the ops touching it in their recorded places; each
    # write waits for what came before it, and what comes after waits for it.
    touching: Dict[int, List[Tuple[tuple, int, bool]]] = {}
    for n, (_, place, op, _) in enumerate(items):
        for t in op.get("inputs", []) + op.get("outputs", []):
            touching.setdefault(root(index[t]), []).append((place, n, False))
        for t in op.get("updates", []):
            touching.setdefault(root(index[t]), []).append((place, n, True))
    for r, seq in touching.items():
        if not any(w for _, _, w in seq):
            continue
        seq.sort()
        since: List[int] = []
        last_write: Optional[int] = None
        for _, n, w in seq:
            if w:
                deps[n].update(m for m in since if m != n)
                if last_write is not None and last_write != n:
                    deps[n].add(last_write)
                since, last_write = [], n
            else:
                if last_write is not None and last_write != n:
                    deps[n].add(last_write)
                since.append(n)
    # Priorities: a kept op needed by a chunk runs just before it.
    prio = [p for p, _, _, _ in items]
    users: List[List[int]] = [[] for _ in items]
    for n, ds in enumerate(deps):
        for d in ds:
            users[d].append(n)
    for n in sorted(range(len(items)), key=lambda n: prio[n], reverse=True):
        for u in users[n]:
            if prio[u][:3] + (prio[u][3] - 1,) < prio[n]:
                prio[n] = prio[u][:3] + (prio[u][3] - 1,)
    waiting = [len(ds) for ds in deps]
    ready = [(prio[n], n) for n in range(len(items)) if waiting[n] == 0]
    heapq.heapify(ready)
    order: List[int] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (prio[u], u))
    if len(order) != len(items):
        raise NotSplit("the split graph has a cycle")
    graph = dict(g.graph, tensors=b.tensors, ops=[items[n][2] for n in order])
    calls = [items[n][3] for n in order]
    return graph, calls, b.layouts
