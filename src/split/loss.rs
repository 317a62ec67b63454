//! The loss chain: the LM head, cross-entropy and their backward, split
//! into chunks of rows (tokens).
//!
//! # The chain it splits
//! The loss chain of the built-in language models (`src/models/step.rs`,
//! `head_and_loss`), recognized by op type, operands and attributes (it
//! also matches the same ops in a graph read from JSON):
//!
//! | op | reads | writes | chunk `i` (rows `[r₀, r₁)`) |
//! |---|---|---|---|
//! | `matmul_nt` (LM head) | `y [R, C]`, `H [V, C]` | `logits [R, V]` | reads the rows of `y` (a view), all of `H` |
//! | `cross_entropy` | `logits`, `targets i32 [R]` | `loss f32 [1]` | partial loss over its rows, divided by all `R` rows (`divisor`) |
//! | `cross_entropy_backward` | `logits`, `targets` | `dlogits [R, V]` (in place of `logits`) | its rows, same `scale` |
//! | `matmul_nn` (backward data) | `dlogits`, `H` | `dy [R, C]` | its rows of `dy`, packed into `dy` at the end |
//! | `matmul_tn` (backward weight) | `dlogits`, `y` | `dH [V, C]` | chunk 0 writes `dH`, later chunks add to it (`accumulate`) |
//!
//! Optionally, a `cast` of the logits that the loss ops read instead (the
//! upcast to f32 of a low-precision step) and a `cast` of `dlogits` that
//! the products read instead (back to the compute dtype), each the only
//! user of its input: they are elementwise and are chunked with the rest.
//!
//! Joins: the partial losses are summed by `add` ops into the original
//! (persistent) `loss` tensor; `dH` is accumulated in place; the chunks of
//! `dy` are copied into `dy` by one `pack` op (rows are contiguous, so
//! chunk `i` sits at element `r₀·C`). The rows of `y` and of `targets` are
//! `view`s (no copies).
//!
//! # Why each split is exact
//! - `logits = y Hᵀ`: row `r` of the product depends only on row `r` of
//!   `y`. Each chunk computes the same dot products, in the same order.
//! - `cross_entropy_backward`: row-wise (softmax of the row minus the
//!   one-hot target, times a constant `scale` = 1/R that the chunks keep).
//!   Bit-identical per row.
//! - `dy = dlogits H` and the casts: row-wise (elementwise), bit-identical.
//! - `loss = (1/R) Σ_r ℓ_r`: the chunks compute `(1/R) Σ_{r∈chunk} ℓ_r`, and
//!   the sum of the chunks is the same sum grouped differently.
//! - `dH = dlogitsᵀ y = Σ_r dlogits_rᵀ y_r`: a sum over rows, grouped by
//!   chunk. With a low-precision `dH` (bf16), each chunk's addition rounds
//!   once more than the single product would.
//!
//! So the split step equals the original up to floating-point summation
//! order (and, for bf16 gradients, `k − 1` more roundings of `dH`).
//!
//! # What it refuses
//! A chain is split only if every link matches exactly: the logits and
//! their gradient are plain transient tensors (not views, not persistent,
//! no in-place updates) that no other op reads, the products take `y` and
//! `H` in the positions above (so that rows are the rows of `y`: a product
//! that contracts over rows, or a consumer that mixes rows, is not
//! separable), both backward products read the same `y` and `H` as the
//! forward one, and nothing between the chain's first and last op updates
//! `y`, `H` or `targets`. Anything else is left alone.
//!
//! Not split (yet): other pointwise ops between the logits and the loss
//! (a soft-capping, a temperature). MLP projections are split as row-wise
//! regions ([`super::rows`]).

use std::collections::HashMap;

use memplan_runtime::{Kernel, Matmul};

use super::{Piece, chunk_rows, elem_bytes, row_views};
use crate::error::Error;
use crate::graph::{Graph, GraphBuilder, Lifetime, OpId, OpSpec, Role, TensorId, TensorSpec};
use crate::vocab;

/// A loss chain found in a graph (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossChain {
    /// `matmul_nt`, `cross_entropy`, `cross_entropy_backward`,
    /// `matmul_nn`, `matmul_tn`.
    pub ops: [OpId; 5],
    pub y: TensorId,
    pub head: TensorId,
    pub targets: TensorId,
    pub logits: TensorId,
    pub loss: TensorId,
    pub dlogits: TensorId,
    pub dy: TensorId,
    pub dhead: TensorId,
    pub rows: u64,
    pub width: u64,
    pub classes: u64,
    /// A `cast` of the logits that the loss reads instead (the upcast to
    /// f32 of a low-precision step): the op and its output.
    pub up: Option<(OpId, TensorId)>,
    /// A `cast` of the logits' gradient that the products read instead
    /// (back to the compute dtype): the op and its output.
    pub down: Option<(OpId, TensorId)>,
}

impl LossChain {
    /// Every op of the chain.
    pub fn all_ops(&self) -> Vec<OpId> {
        let mut v = self.ops.to_vec();
        v.extend(self.up.map(|c| c.0));
        v.extend(self.down.map(|c| c.0));
        v
    }
    /// Every tensor the chain makes and the split replaces.
    fn replaced(&self) -> Vec<TensorId> {
        let mut v = vec![self.logits, self.dlogits];
        v.extend(self.up.map(|c| c.1));
        v.extend(self.down.map(|c| c.1));
        v
    }
}

/// The `cast` that is the only user of `t` (a plain tensor of the same
/// element count), if there is one.
fn sole_cast(g: &Graph, t: TensorId) -> Option<(OpId, TensorId)> {
    let (&[o], &[r]) = (g.users_of_root(t), g.readers(t)) else {
        return None;
    };
    let op = g.op(o);
    if o != r
        || op.op_type != "cast"
        || op.inputs != [t]
        || op.outputs.len() != 1
        || !op.updates.is_empty()
    {
        return None;
    }
    let u = op.outputs[0];
    let elems = |t: TensorId| {
        g.tensor(t)
            .shape
            .as_ref()
            .map(|s| s.iter().product::<u64>())
    };
    (plain(g, u) && elems(u).is_some() && elems(u) == elems(t)).then_some((o, u))
}

/// The kernel op `o` runs, if it is one of the vocabulary's.
fn kernel_of(g: &Graph, o: OpId) -> Option<Kernel> {
    vocab::kernel(g.op(o)).ok()
}

/// Chunk `n` rows of a chain op's kernel `k` (the products' `m`, or `k`
/// for the head's gradient, which sums over rows; the losses' `rows`): the
/// same op on fewer rows. The loss keeps its `divisor` (all the rows) and
/// its gradient its `scale`, so each chunk's share is exact.
fn chunk_kernel(k: &Kernel, n: u64) -> Kernel {
    let mut k = k.clone();
    match &mut k {
        Kernel::MatmulNt(mm) | Kernel::MatmulNn(mm) => mm.m = n,
        Kernel::MatmulTn(mm) | Kernel::MatmulTnAccumulate(mm) => mm.k = n,
        Kernel::CrossEntropy { rows, .. } | Kernel::CrossEntropyBackward { rows, .. } => *rows = n,
        other => unreachable!("a loss chain has no {}", other.name()),
    }
    k
}

fn plain(g: &Graph, t: TensorId) -> bool {
    let x = g.tensor(t);
    x.view_of.is_none() && x.lifetime == Lifetime::Transient && !x.role.is_step_input()
}

/// The only op that reads `t` as an input, if that op is of type `ty`.
fn readers_of_type(g: &Graph, t: TensorId, ty: &str) -> Vec<OpId> {
    g.readers(t)
        .iter()
        .copied()
        .filter(|&o| g.op(o).op_type == ty)
        .collect()
}

/// Whether `g`'s ops at program positions strictly between `from` and
/// `to` (inclusive of the chain's own ops, which update nothing) update the
/// bytes of any root in `roots`.
fn updated_between(g: &Graph, chain: &[OpId], roots: &[TensorId]) -> bool {
    let pos: HashMap<OpId, usize> = g
        .program_order()
        .iter()
        .enumerate()
        .map(|(i, &o)| (o, i))
        .collect();
    let lo = chain.iter().map(|o| pos[o]).min().unwrap_or(0);
    let hi = chain.iter().map(|o| pos[o]).max().unwrap_or(0);
    g.program_order()[lo..=hi]
        .iter()
        .any(|&o| g.op(o).updates.iter().any(|&t| roots.contains(&g.root(t))))
}

/// The loss chain starting at `head_op` (a `matmul_nt`), if every link
/// matches (see "What it refuses").
fn chain_at(g: &Graph, a: OpId) -> Option<LossChain> {
    let op = g.op(a);
    if op.op_type != "matmul_nt"
        || op.inputs.len() != 2
        || op.outputs.len() != 1
        || !op.updates.is_empty()
    {
        return None;
    }
    let Some(Kernel::MatmulNt(Matmul {
        m: rows,
        k: width,
        n: classes,
    })) = kernel_of(g, a)
    else {
        return None;
    };
    let (y, head, logits) = (op.inputs[0], op.inputs[1], op.outputs[0]);
    if rows < 2 || !plain(g, logits) {
        return None;
    }
    let up = sole_cast(g, logits);
    let ce_in = up.map_or(logits, |c| c.1);
    if g.users_of_root(ce_in).len() != 2 {
        return None;
    }
    let (b, cb, targets, loss, dlogits) = loss_ops(g, ce_in, rows, classes)?;
    if !plain(g, dlogits) {
        return None;
    }
    let down = sole_cast(g, dlogits);
    let mm_in = down.map_or(dlogits, |c| c.1);
    if g.users_of_root(mm_in).len() != 2 {
        return None;
    }
    let (d, e, dy, dhead) = products(g, mm_in, head, y, [rows, width, classes])?;
    // Rows are contiguous: the byte sizes must be rows × row.
    let elems = |t: TensorId| {
        g.tensor(t)
            .shape
            .as_ref()
            .map(|s| s.iter().product::<u64>())
    };
    if elems(y) != Some(rows * width)
        || elems(logits) != Some(rows * classes)
        || elems(dlogits) != Some(rows * classes)
        || elems(dy) != Some(rows * width)
        || elems(targets) != Some(rows)
        || g.tensor(dy).view_of.is_some()
        || g.tensor(dhead).view_of.is_some()
    {
        return None;
    }
    let ops = [a, b, cb, d, e];
    let roots = [g.root(y), g.root(head), g.root(targets)];
    let mut every = ops.to_vec();
    every.extend(up.map(|c| c.0));
    every.extend(down.map(|c| c.0));
    if updated_between(g, &every, &roots) {
        return None;
    }
    Some(LossChain {
        ops,
        y,
        head,
        targets,
        logits,
        loss,
        dlogits,
        dy,
        dhead,
        rows,
        width,
        classes,
        up,
        down,
    })
}

/// The chain's loss and its backward: the one `cross_entropy` and the one
/// `cross_entropy_backward` reading `ce_in` (the logits, or their upcast)
/// and the same targets, over `rows` rows of `classes`, the mean over all
/// rows, the loss one f32. Returns the two ops, the targets, the loss and
/// the logits' gradient.
fn loss_ops(
    g: &Graph,
    ce_in: TensorId,
    rows: u64,
    classes: u64,
) -> Option<(OpId, OpId, TensorId, TensorId, TensorId)> {
    let ce = readers_of_type(g, ce_in, "cross_entropy");
    let ceb = readers_of_type(g, ce_in, "cross_entropy_backward");
    let (&[b], &[cb]) = (ce.as_slice(), ceb.as_slice()) else {
        return None;
    };
    let (bo, cbo) = (g.op(b), g.op(cb));
    if bo.inputs.len() != 2
        || bo.inputs[0] != ce_in
        || bo.outputs.len() != 1
        || cbo.inputs != bo.inputs
        || cbo.outputs.len() != 1
        || !bo.updates.is_empty()
        || !cbo.updates.is_empty()
    {
        return None;
    }
    let targets = bo.inputs[1];
    let (loss, dlogits) = (bo.outputs[0], cbo.outputs[0]);
    // The mean over all rows, and its gradient, over the chain's sizes.
    let Some(Kernel::CrossEntropy {
        rows: r,
        classes: v,
        divisor,
    }) = kernel_of(g, b)
    else {
        return None;
    };
    if (r, v, divisor) != (rows, classes, rows) {
        return None;
    }
    let Some(Kernel::CrossEntropyBackward {
        rows: r,
        classes: v,
        ..
    }) = kernel_of(g, cb)
    else {
        return None;
    };
    if (r, v) != (rows, classes) {
        return None;
    }
    let loss_t = g.tensor(loss);
    if loss_t.view_of.is_some() || loss_t.dtype.as_deref() != Some("f32") || loss_t.size != 4 {
        return None;
    }
    Some((b, cb, targets, loss, dlogits))
}

/// The head's two backward products reading `mm_in` (the logits'
/// gradient, or its downcast): `matmul_nn` with the head (the gradient of
/// `y`) and `matmul_tn` with `y` (the head's gradient, not accumulated),
/// of the chain's `[rows, width, classes]`. Returns the two ops and their
/// outputs.
fn products(
    g: &Graph,
    mm_in: TensorId,
    head: TensorId,
    y: TensorId,
    [rows, width, classes]: [u64; 3],
) -> Option<(OpId, OpId, TensorId, TensorId)> {
    let nn = readers_of_type(g, mm_in, "matmul_nn");
    let tn = readers_of_type(g, mm_in, "matmul_tn");
    let (&[d], &[e]) = (nn.as_slice(), tn.as_slice()) else {
        return None;
    };
    let (dop, eop) = (g.op(d), g.op(e));
    if dop.inputs != [mm_in, head]
        || eop.inputs != [mm_in, y]
        || dop.outputs.len() != 1
        || eop.outputs.len() != 1
        || !dop.updates.is_empty()
        || !eop.updates.is_empty()
    {
        return None;
    }
    let (dy, dhead) = (dop.outputs[0], eop.outputs[0]);
    // The head's gradient is made here, not accumulated into.
    let (Some(Kernel::MatmulNn(dmm)), Some(Kernel::MatmulTn(emm))) =
        (kernel_of(g, d), kernel_of(g, e))
    else {
        return None;
    };
    let mm = |m, k, n| Matmul { m, k, n };
    if dmm != mm(rows, classes, width) || emm != mm(classes, rows, width) {
        return None;
    }
    Some((d, e, dy, dhead))
}

/// Every loss chain of `g` that can be split (disjoint, in program order).
pub fn find_chains(g: &Graph) -> Vec<LossChain> {
    g.program_order()
        .iter()
        .filter_map(|&o| chain_at(g, o))
        .collect()
}

/// `g` with each chain of `chains` split into `k` chunks (`2 ≤ k ≤ rows`).
/// The chunks' ops take the place of the chain's first op in the program
/// order, chunk by chunk; the rest of the graph is unchanged.
pub fn split_chains(g: &Graph, chains: &[LossChain], k: u64) -> Result<Graph, Error> {
    super::Splits {
        chains: chains.to_vec(),
        regions: Vec::new(),
    }
    .apply(g, k)
}

impl Piece for LossChain {
    fn replaced_ops(&self) -> Vec<OpId> {
        self.all_ops()
    }

    fn replaced_tensors(&self) -> Vec<TensorId> {
        self.replaced()
    }

    fn position(&self, pos: &[usize]) -> usize {
        self.all_ops()
            .iter()
            .map(|o| pos[o.index()])
            .min()
            .expect("a chain has ops")
    }

    fn emit(
        &self,
        g: &Graph,
        b: &mut GraphBuilder,
        k: u64,
        tm: &dyn Fn(TensorId) -> TensorId,
        _om: &dyn Fn(OpId) -> Vec<OpId>,
    ) -> Vec<OpId> {
        emit_chunks(g, b, self, k, tm)
    }
}

/// Adds chain `c`'s `k` chunks to `b`; returns the ops added: the views
/// of the rows, then per chunk its forward ([`Chunks::forward`]), the sum
/// of the partial losses ([`Chunks::sum`]) and its backward
/// ([`Chunks::backward`]), then the pack of the input's gradient.
fn emit_chunks(
    g: &Graph,
    b: &mut GraphBuilder,
    c: &LossChain,
    k: u64,
    tm: &dyn Fn(TensorId) -> TensorId,
) -> Vec<OpId> {
    let mut ch = Chunks::new(g, c, k, tm);
    let (vy, y_parts) = ch.view(b, c.y, c.width);
    let (vt, t_parts) = ch.view(b, c.targets, 1);
    ch.ops.extend([vy, vt]);
    let mut sum: Option<TensorId> = None;
    let mut dy_parts = Vec::new();
    for i in 0..ch.parts.len() {
        let (ce_in, part) = ch.forward(b, i, y_parts[i], t_parts[i]);
        sum = Some(match sum {
            Some(prev) => ch.sum(b, i, prev, part),
            None => part,
        });
        dy_parts.push(ch.backward(b, i, ce_in, y_parts[i], t_parts[i]));
    }
    let d = g.op(c.ops[3]);
    let pack = Kernel::Pack {
        offsets: ch.parts.iter().map(|&(lo, _)| lo * c.width).collect(),
        elements: c.rows * c.width,
    };
    ch.ops.push(
        b.add_op(
            vocab::spec(format!("{}.pack", d.name), d.kind, &pack)
                .inputs(dy_parts)
                .outputs([tm(c.dy)])
                .flops(0.0)
                .stream(d.stream),
        ),
    );
    ch.ops
}

/// What the chunks of one chain are made from: the chain, its tensors'
/// specs, the rows of each chunk, and the ops added so far.
struct Chunks<'a> {
    g: &'a Graph,
    c: &'a LossChain,
    tm: &'a dyn Fn(TensorId) -> TensorId,
    /// `[lo, hi)` rows of each chunk.
    parts: Vec<(u64, u64)>,
    ops: Vec<OpId>,
}

impl<'a> Chunks<'a> {
    fn new(g: &'a Graph, c: &'a LossChain, k: u64, tm: &'a dyn Fn(TensorId) -> TensorId) -> Self {
        Chunks {
            g,
            c,
            tm,
            parts: chunk_rows(c.rows, k),
            ops: Vec::new(),
        }
    }

    fn spec(&self, t: TensorId) -> TensorSpec {
        TensorSpec::from(self.g.tensor(t))
    }

    /// Bytes per element of tensor `t`, which holds `elements`.
    fn elem(&self, t: TensorId, elements: u64) -> u64 {
        elem_bytes(&self.spec(t), elements)
    }

    /// `x` (a cost or FLOPs of the whole chain's op) for `n` of its rows.
    fn scaled(&self, x: Option<f64>, n: u64) -> Option<f64> {
        x.map(|v| v * n as f64 / self.c.rows as f64)
    }

    /// Views of the chunks' rows of `base` (`row` elements a row).
    fn view(&self, b: &mut GraphBuilder, base: TensorId, row: u64) -> (OpId, Vec<TensorId>) {
        row_views(self.g, b, base, (self.tm)(base), &self.parts, row)
    }

    /// Chunk `i` of tensor `t`: a transient tensor of `shape` like `t`.
    fn like(&self, b: &mut GraphBuilder, t: TensorId, i: usize, shape: Vec<u64>) -> TensorId {
        let spec = self.spec(t);
        let elements: u64 = shape.iter().product();
        let total: u64 = self.c.rows * shape[1..].iter().product::<u64>();
        let mut s = TensorSpec::new(
            format!("{}.chunk{i}", spec.name),
            elements * self.elem(t, total),
        )
        .role(spec.role)
        .align(spec.align)
        .lifetime(Lifetime::Transient);
        s.dtype = spec.dtype.clone();
        s.shape = Some(shape);
        b.add_tensor(s)
    }

    /// Chunk `i`'s copy of the chain's op `o` (its kind, stream and
    /// attributes) on its `n` rows ([`chunk_kernel`]), its cost and FLOPs
    /// scaled to them.
    fn copy_op(&self, o: usize, i: usize, n: u64) -> OpSpec {
        let op = self.g.op(self.c.ops[o]);
        let k = kernel_of(self.g, self.c.ops[o]).expect("a chain op is a kernel");
        let mut s = OpSpec::new(format!("{}.chunk{i}", op.name), op.kind, op.op_type.clone());
        s.stream = op.stream;
        s.attrs = op.attrs.clone();
        vocab::write(&chunk_kernel(&k, n), &mut s.attrs);
        s.cost = self.scaled(op.cost, n);
        s.flops = self.scaled(op.flops, n);
        s
    }

    /// A one-element f32 partial loss or running sum.
    fn scalar(&self, b: &mut GraphBuilder, name: String) -> TensorId {
        let loss = self.spec(self.c.loss);
        b.add_tensor(
            TensorSpec::new(name, 4)
                .role(Role::Activation)
                .align(loss.align)
                .dtype("f32")
                .shape(vec![1]),
        )
    }

    /// Chunk `i`'s forward: its logits (the head's product on its rows of
    /// `y`), their upcast if the chain has one, and its partial loss
    /// (divided by all the rows). Returns what the loss read and the
    /// partial loss.
    fn forward(
        &mut self,
        b: &mut GraphBuilder,
        i: usize,
        y: TensorId,
        targets: TensorId,
    ) -> (TensorId, TensorId) {
        let (c, g) = (self.c, self.g);
        let (lo, hi) = self.parts[i];
        let n = hi - lo;
        let logits = self.like(b, c.logits, i, vec![n, c.classes]);
        let s = self
            .copy_op(0, i, n)
            .inputs([y, (self.tm)(c.head)])
            .outputs([logits]);
        self.ops.push(b.add_op(s));

        let part = self.scalar(b, format!("{}.chunk{i}", self.spec(c.loss).name));
        // The upcast, if the chain has one: the loss reads its output.
        let ce_in = match c.up {
            None => logits,
            Some((cast, out)) => {
                cast_chunk(b, g, cast, out, logits, i, n * c.classes, &mut self.ops)
            }
        };
        let s = self
            .copy_op(1, i, n)
            .inputs([ce_in, targets])
            .outputs([part]);
        self.ops.push(b.add_op(s));
        (ce_in, part)
    }

    /// Adds chunk `i`'s partial loss to the running sum `prev`; the last
    /// sum is the chain's loss. Returns the new sum.
    fn sum(&mut self, b: &mut GraphBuilder, i: usize, prev: TensorId, part: TensorId) -> TensorId {
        let c = self.c;
        let ce = self.g.op(c.ops[1]);
        let out = if i + 1 == self.parts.len() {
            (self.tm)(c.loss)
        } else {
            self.scalar(b, format!("{}.sum{i}", self.spec(c.loss).name))
        };
        self.ops.push(
            b.add_op(
                vocab::spec(
                    format!("{}.sum{i}", ce.name),
                    ce.kind,
                    &Kernel::Add { elements: 1 },
                )
                .inputs([prev, part])
                .outputs([out])
                .stream(ce.stream),
            ),
        );
        out
    }

    /// Chunk `i`'s backward: the logits' gradient (in the loss input's
    /// bytes where the chain's op may reuse them), its downcast if the
    /// chain has one, the gradient of its rows of `y`, and its share of the
    /// head's gradient (made by the first chunk, accumulated by the rest).
    /// Returns the rows' gradient.
    fn backward(
        &mut self,
        b: &mut GraphBuilder,
        i: usize,
        ce_in: TensorId,
        y: TensorId,
        targets: TensorId,
    ) -> TensorId {
        let (c, g) = (self.c, self.g);
        let ceb = g.op(c.ops[2]);
        let (lo, hi) = self.parts[i];
        let n = hi - lo;
        let (classes, width) = (c.classes, c.width);
        let dlogits = self.like(b, c.dlogits, i, vec![n, classes]);
        let mut s = self
            .copy_op(2, i, n)
            .inputs([ce_in, targets])
            .outputs([dlogits]);
        let ce_in_orig = c.up.map_or(c.logits, |u| u.1);
        if ceb.reuse.contains(&(c.dlogits, ce_in_orig))
            && self.elem(c.dlogits, c.rows * classes) <= b.tensor_spec(ce_in).size / (n * classes)
        {
            s = s.reuse(dlogits, ce_in);
        }
        self.ops.push(b.add_op(s));

        let dy = self.like(b, c.dy, i, vec![n, width]);
        // The downcast, if the chain has one: the products read its output.
        let mm_in = match c.down {
            None => dlogits,
            Some((cast, out)) => {
                cast_chunk(b, g, cast, out, dlogits, i, n * classes, &mut self.ops)
            }
        };
        let s = self
            .copy_op(3, i, n)
            .inputs([mm_in, (self.tm)(c.head)])
            .outputs([dy]);
        self.ops.push(b.add_op(s));

        let mut s = self.copy_op(4, i, n).inputs([mm_in, y]);
        s = if i == 0 {
            s.outputs([(self.tm)(c.dhead)])
        } else {
            // The later chunks add their share to the first's.
            let mm = Matmul {
                m: classes,
                k: n,
                n: width,
            };
            vocab::write(&Kernel::MatmulTnAccumulate(mm), &mut s.attrs);
            s.updates([(self.tm)(c.dhead)])
        };
        // 2·V·n·C for the product, V·C for adding it to the sum.
        let product = 2.0 * (classes * n * width) as f64;
        s.flops = Some(
            s.flops.unwrap_or(product)
                + if i == 0 {
                    0.0
                } else {
                    (classes * width) as f64
                },
        );
        self.ops.push(b.add_op(s));
        dy
    }
}

/// Chunk `i` (`elements` elements) of the chain's `cast` op `cast` (whose
/// output is `out`), reading `from`; adds the op to `ops` and returns its
/// output.
#[allow(clippy::too_many_arguments)]
fn cast_chunk(
    b: &mut GraphBuilder,
    g: &Graph,
    cast: OpId,
    out: TensorId,
    from: TensorId,
    i: usize,
    elements: u64,
    ops: &mut Vec<OpId>,
) -> TensorId {
    let (op, spec) = (g.op(cast), TensorSpec::from(g.tensor(out)));
    let total: u64 = spec.shape.as_ref().map_or(1, |s| s.iter().product());
    let mut t = TensorSpec::new(
        format!("{}.chunk{i}", spec.name),
        elements * (spec.size / total.max(1)),
    )
    .role(spec.role)
    .align(spec.align)
    .shape(vec![elements]);
    t.dtype = spec.dtype.clone();
    if let Some(s) = &spec.shape
        && let Some(&last) = s.last()
        && last > 0
        && elements % last == 0
    {
        t.shape = Some(vec![elements / last, last]);
    }
    let t = b.add_tensor(t);
    let mut s = OpSpec::new(format!("{}.chunk{i}", op.name), op.kind, op.op_type.clone())
        .inputs([from])
        .outputs([t]);
    s.stream = op.stream;
    s.attrs = op.attrs.clone();
    vocab::write(&Kernel::Cast { elements }, &mut s.attrs);
    s.cost = op.cost.map(|c| c * elements as f64 / total.max(1) as f64);
    s.flops = op.flops.map(|f| f * elements as f64 / total.max(1) as f64);
    for &(o, inp) in &op.reuse {
        if o == out
            && inp == g.op(cast).inputs[0]
            && b.tensor_spec(t).size <= b.tensor_spec(from).size
        {
            s = s.reuse(t, from);
        }
    }
    ops.push(b.add_op(s));
    t
}

/// FLOPs the split adds: `Σ_k` over chains of `(k − 1)` loss additions and
/// `(k − 1)·V·C` gradient additions.
pub fn added_flops(chains: &[LossChain], k: u64) -> f64 {
    chains
        .iter()
        .map(|c| ((k - 1) * (1 + c.classes * c.width)) as f64)
        .sum()
}
