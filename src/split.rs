//! Splitting ("fission"): rewrite a chain of ops that is independent along
//! its rows into `k` chunks, joined by the reductions the chunks need.
//!
//! Order, layout and recomputation cannot make one tensor smaller; in a
//! language model's step the largest tensors are often the logits
//! `[B·T, V]` and their gradient. Nothing in the loss region mixes rows
//! (tokens) except two sums: the loss itself and the LM head's weight
//! gradient. So the region can run on `k` slices of the rows in turn, each
//! holding `[B·T/k, V]` instead of `[B·T, V]`, with the same math.
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
//! (a soft-capping, a temperature), pointwise chains elsewhere, MLP
//! projections.
//!
//! # Choosing `k`
//! [`plan_split`] plans the graph as it is and split into each `k` of
//! [`AUTO_CHUNKS`] (or the `k` asked for; `auto` stops once doubling `k`
//! no longer lowers the arena), sharing the time limit among them, and
//! keeps the split graph only if its planned arena is smaller: without a
//! gain the graph is left as it was. Splitting recomputes nothing; it adds the `k − 1` partial-loss
//! additions and the `(k − 1)·V·C` additions of the accumulation
//! ([`added_flops`]).

use std::collections::HashMap;

use memplan_runtime::{Kernel, Matmul};
use serde_json::json;

use crate::error::Error;
use crate::graph::{
    Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec,
};
use crate::pipeline::{self, Options};
use crate::plan::Plan;
use crate::vocab;

// What `--split` asks for lives with the pipeline's options (so the
// pipeline does not depend on this pass, which plans through it).
pub use crate::pipeline::Split;

/// The chunk counts `auto` tries.
pub const AUTO_CHUNKS: [u64; 5] = [2, 4, 8, 16, 32];

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

/// Rows `[r₀, r₁)` of each of `k` chunks of `rows` (sizes differ by at most
/// one, larger first).
pub fn chunk_rows(rows: u64, k: u64) -> Vec<(u64, u64)> {
    let (q, r) = (rows / k, rows % k);
    let mut out = Vec::with_capacity(k as usize);
    let mut lo = 0;
    for i in 0..k {
        let n = q + u64::from(i < r);
        out.push((lo, lo + n));
        lo += n;
    }
    out
}

fn elem_bytes(x: &TensorSpec, elements: u64) -> u64 {
    x.size / elements.max(1)
}

/// `g` with each chain of `chains` split into `k` chunks (`2 ≤ k ≤ rows`).
/// The chunks' ops take the place of the chain's first op in the program
/// order, chunk by chunk; the rest of the graph is unchanged.
pub fn split_chains(g: &Graph, chains: &[LossChain], k: u64) -> Result<Graph, Error> {
    if k < 2 {
        return Err(Error::InvalidArgument(format!(
            "split into {k} chunks: need at least 2"
        )));
    }
    for c in chains {
        if k > c.rows {
            return Err(Error::InvalidArgument(format!(
                "split into {k} chunks: the chain at {:?} has only {} rows",
                g.op(c.ops[0]).name,
                c.rows
            )));
        }
    }
    let mut dropped_ops = vec![false; g.num_ops()];
    let mut dropped_tensors = vec![false; g.num_tensors()];
    let mut first: HashMap<OpId, &LossChain> = HashMap::new();
    for c in chains {
        let all = c.all_ops();
        for &o in &all {
            dropped_ops[o.index()] = true;
        }
        for t in c.replaced() {
            dropped_tensors[t.index()] = true;
        }
        let lead = *g
            .program_order()
            .iter()
            .find(|o| all.contains(o))
            .expect("a chain's ops are in the graph");
        first.insert(lead, c);
    }
    let mut b = GraphBuilder::new(g.name.clone());
    let mut tmap: Vec<Option<TensorId>> = vec![None; g.num_tensors()];
    // Bases before views: tensors in id order, views of dropped tensors
    // cannot exist (the chain's tensors are plain).
    for t in g.tensor_ids() {
        if dropped_tensors[t.index()] {
            continue;
        }
        let mut spec = TensorSpec::from(g.tensor(t));
        spec.view_of = spec
            .view_of
            .map(|v| tmap[v.index()].expect("a view's base is kept"));
        tmap[t.index()] = Some(b.add_tensor(spec));
    }
    let tm = |t: TensorId| tmap[t.index()].expect("kept tensor");
    let mut omap: Vec<Vec<OpId>> = vec![Vec::new(); g.num_ops()];
    for &o in g.program_order() {
        if let Some(c) = first.get(&o) {
            let new = emit_chunks(g, &mut b, c, k, &tm);
            for old in c.all_ops() {
                omap[old.index()] = new.clone();
            }
            continue;
        }
        if dropped_ops[o.index()] {
            continue;
        }
        let op = g.op(o);
        let mut spec = OpSpec::from(op);
        spec.inputs = op.inputs.iter().map(|&t| tm(t)).collect();
        spec.outputs = op.outputs.iter().map(|&t| tm(t)).collect();
        spec.updates = op.updates.iter().map(|&t| tm(t)).collect();
        spec.reuse = op.reuse.iter().map(|&(x, y)| (tm(x), tm(y))).collect();
        spec.after = op
            .after
            .iter()
            .flat_map(|a| omap[a.index()].iter().copied())
            .collect();
        if op.after.iter().any(|a| omap[a.index()].is_empty()) {
            return Err(Error::Unsupported(format!(
                "op {:?} runs after an op that comes later in program order",
                op.name
            )));
        }
        omap[o.index()] = vec![b.add_op(spec)];
    }
    let mut out = b.build()?;
    out.reference_peaks = g.reference_peaks.clone();
    out.metadata = g.metadata.clone();
    out.metadata.insert(
        "split".into(),
        json!({ "chunks": k, "chains": chains.len() }),
    );
    Ok(out)
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

    /// Views of the chunks' rows of `base` (`row` elements a row), made
    /// by one `view` op.
    fn view(&self, b: &mut GraphBuilder, base: TensorId, row: u64) -> (OpId, Vec<TensorId>) {
        let spec = self.spec(base);
        let ebytes = self.elem(base, self.c.rows * row);
        let mut out = Vec::new();
        let mut offsets = Vec::new();
        for (i, &(lo, hi)) in self.parts.iter().enumerate() {
            let mut s =
                TensorSpec::new(format!("{}.chunk{i}", spec.name), (hi - lo) * row * ebytes)
                    .role(spec.role)
                    .align(spec.align)
                    .view_of((self.tm)(base));
            s.dtype = spec.dtype.clone();
            s.shape = Some(if row == 1 {
                vec![hi - lo]
            } else {
                vec![hi - lo, row]
            });
            out.push(b.add_tensor(s));
            offsets.push(lo * row);
        }
        let op = b.add_op(
            OpSpec::new(format!("{}.chunks", spec.name), OpKind::Other, "view")
                .inputs([(self.tm)(base)])
                .outputs(out.clone())
                .attr("offsets", offsets),
        );
        (op, out)
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

/// `g` with every separable chain split into `k` chunks (`--split-chunks`);
/// an error if it has none, or `k` is not between 2 and a chain's rows.
pub fn split_graph(g: &Graph, k: u64) -> Result<Graph, Error> {
    let chains = find_chains(g);
    if chains.is_empty() {
        return Err(Error::Unsupported(format!(
            "{}: no separable loss chain to split (docs/splitting.md)",
            g.name
        )));
    }
    split_chains(g, &chains, k)
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

/// What [`plan_split`] chose.
#[derive(Clone, Debug)]
pub struct SplitReport {
    /// Chunks of the kept graph (1: not split).
    pub chunks: u64,
    /// Chains split.
    pub chains: usize,
    /// `(k, arena bytes)` of every candidate planned (`k = 1`: unsplit).
    pub tried: Vec<(u64, u64)>,
    /// FLOPs the split adds (0 when not split).
    pub added_flops: f64,
    /// FLOPs of the unsplit step (the cost model's, [`crate::cost`]).
    pub step_flops: f64,
}

/// Plans `g` and, as `split` asks, its splits; returns the graph with the
/// smallest planned arena (the unsplit one unless a split is strictly
/// smaller), its plan and what was tried. Each candidate gets
/// `opts.time_limit` divided by the number of candidates.
pub fn plan_split(
    g: &Graph,
    opts: &Options,
    split: Split,
) -> Result<(Graph, Plan, SplitReport), Error> {
    let (g, p, (), rep) = plan_split_with(g, split, |g, n| {
        let mut o = opts.clone();
        o.time_limit = opts.time_limit / n;
        Ok::<_, Error>((pipeline::plan(g, &o)?, ()))
    })?;
    // Every plan leaves through the independent checker.
    crate::checker::check(&g, &p)
        .map_err(|e| Error::Internal(format!("the split plan is invalid: {e}")))?;
    Ok((g, p, rep))
}

/// [`plan_split`] with `opts.split`: the graph that was planned (split or
/// not), its plan, and what was tried.
pub fn plan(g: &Graph, opts: &Options) -> Result<(Graph, Plan, SplitReport), Error> {
    plan_split(g, opts, opts.split)
}

/// [`plan_split`] with any planner: `plan(graph, n)` plans one candidate of
/// `n` (to share a time budget) and returns its plan and whatever else it
/// reports, kept for the chosen graph.
pub fn plan_split_with<R, E: From<Error>>(
    g: &Graph,
    split: Split,
    mut plan: impl FnMut(&Graph, u32) -> Result<(Plan, R), E>,
) -> Result<(Graph, Plan, R, SplitReport), E> {
    let chains = find_chains(g);
    let min_rows = chains.iter().map(|c| c.rows).min().unwrap_or(0);
    let ks: Vec<u64> = match split {
        _ if chains.is_empty() => Vec::new(),
        Split::Off => Vec::new(),
        Split::Auto => AUTO_CHUNKS
            .iter()
            .copied()
            .filter(|&k| k <= min_rows)
            .collect(),
        Split::Chunks(k) => vec![k.min(min_rows)],
    };
    let n = 1 + ks.len() as u32;
    let step_flops: f64 = g.op_ids().map(|o| crate::cost::op_flops(g, o)).sum();
    let (base, r) = plan(g, n)?;
    let mut tried = vec![(1, base.arena_bytes)];
    let mut best: Option<(Graph, Plan, R, u64)> = None;
    for &k in &ks {
        // `auto` stops once more chunks no longer lower the arena.
        if split == Split::Auto
            && let [.., (_, a), (_, b)] = tried[..]
            && tried.len() > 2
            && b >= a
        {
            break;
        }
        let sg = split_chains(g, &chains, k)?;
        let (p, r) = plan(&sg, n)?;
        tried.push((k, p.arena_bytes));
        let cur = best.as_ref().map_or(base.arena_bytes, |b| b.1.arena_bytes);
        if p.arena_bytes < cur {
            best = Some((sg, p, r, k));
        }
    }
    Ok(match best {
        Some((sg, p, r, k)) => (
            sg,
            p,
            r,
            SplitReport {
                chunks: k,
                chains: chains.len(),
                tried,
                added_flops: added_flops(&chains, k),
                step_flops,
            },
        ),
        None => (
            g.clone(),
            base,
            r,
            SplitReport {
                chunks: 1,
                chains: 0,
                tried,
                added_flops: 0.0,
                step_flops,
            },
        ),
    })
}

/// A fit ([`crate::fit::fit`]) that may split as well as recompute.
#[derive(Clone, Debug)]
pub struct SplitFit {
    /// The fitted step: split (if that was cheaper) and with its
    /// recomputation. Its `added` includes the split's FLOPs (and their
    /// time at the step's FLOP rate).
    pub fitted: crate::fit::Fitted,
    /// The split chosen (`chunks` 1: not split).
    pub split: SplitReport,
}

/// Fits `g` into `opts.budget`, splitting as `split` asks where that is the
/// cheaper way in: the split with the smallest planned arena (if any is
/// smaller than the unsplit step's) and the unsplit step are each fitted
/// with half the time, and the one that fits with the least added cost
/// (recomputation plus the split's additions, in `opts.objective`'s unit)
/// is kept; ties go to the unsplit step.
pub fn fit_split(
    g: &Graph,
    opts: &crate::fit::FitOptions,
    split: Split,
) -> Result<SplitFit, Error> {
    use crate::fit::fit;
    let p = Probe::new(g, opts, split)?;
    if p.rep.chunks == 1 {
        return Ok(SplitFit {
            fitted: fit(g, opts)?,
            split: p.rep,
        });
    }
    let half = p.halves(opts);
    let plain = fit(g, &half);
    let split_fit = fit(&p.graph, &half).map(|f| {
        let added = split_cost(p.rep.added_flops, &f.step);
        with_split_added(f, &added)
    });
    let cost = |f: &crate::fit::Fitted| opts.objective.of(&f.added);
    p.choose(plain, split_fit, |a, b| cost(b) < cost(a))
}

/// The smallest arena found whose added cost is at most `max_added` times
/// the step's ([`crate::fit::fit_within`]), splitting as `split` asks where
/// that lowers it. The split's own additions count against the share (the
/// unsplit step's cost, in `opts.objective`'s unit): the split with the
/// smallest planned arena (if any is smaller than the unsplit step's) is
/// fitted with what the split leaves of it, the unsplit step with all of
/// it, each with half the time, and the smaller arena is kept (ties go to
/// the unsplit step). A split whose additions alone exceed the share is
/// not fitted.
pub fn fit_within_split(
    g: &Graph,
    max_added: f64,
    opts: &crate::fit::FitOptions,
    split: Split,
) -> Result<SplitFit, Error> {
    use crate::fit::fit_within;
    crate::fit::check_share(max_added)?;
    let p = Probe::new(g, opts, split)?;
    let step = opts.cost_model.checked_total(g)?;
    let split_added = split_cost(p.rep.added_flops, &step);
    let left = max_added * opts.objective.of(&step) - opts.objective.of(&split_added);
    if p.rep.chunks == 1 || left < 0.0 {
        return Ok(SplitFit {
            fitted: fit_within(g, max_added, opts)?,
            split: p.unsplit(),
        });
    }
    let half = p.halves(opts);
    let plain = fit_within(g, max_added, &half);
    let split_step = opts.objective.of(&opts.cost_model.checked_total(&p.graph)?);
    let share = if split_step > 0.0 {
        left / split_step
    } else {
        0.0
    };
    let split_fit = fit_within(&p.graph, share, &half).map(|f| {
        let mut f = with_split_added(f, &split_added);
        f.max_added = Some(max_added);
        f
    });
    p.choose(plain, split_fit, |a, b| {
        b.plan.arena_bytes < a.plan.arena_bytes
    })
}

/// What both fits that may split start from: the split step `plan_split`
/// keeps under the fit's probe time, and when that probe started.
struct Probe {
    graph: Graph,
    rep: SplitReport,
    start: std::time::Instant,
}

impl Probe {
    fn new(g: &Graph, opts: &crate::fit::FitOptions, split: Split) -> Result<Probe, Error> {
        let probe = Options {
            time_limit: opts.probe_time,
            layouts: 1,
            ..Options::default()
        };
        let start = std::time::Instant::now();
        let (graph, _, rep) = plan_split(g, &probe, split)?;
        Ok(Probe { graph, rep, start })
    }

    /// `opts` with half of what is left of its time limit since the probe
    /// started, for each of the two fits.
    fn halves(&self, opts: &crate::fit::FitOptions) -> crate::fit::FitOptions {
        crate::fit::FitOptions {
            time_limit: opts.time_limit.saturating_sub(self.start.elapsed()) / 2,
            ..opts.clone()
        }
    }

    /// The report of the step left unsplit.
    fn unsplit(&self) -> SplitReport {
        SplitReport {
            chunks: 1,
            chains: 0,
            added_flops: 0.0,
            ..self.rep.clone()
        }
    }

    /// The split fit where `split_better(plain, split)` (or where only it
    /// succeeded), else the unsplit one; when both fail, the split's error.
    fn choose(
        self,
        plain: Result<crate::fit::Fitted, Error>,
        split_fit: Result<crate::fit::Fitted, Error>,
        split_better: impl Fn(&crate::fit::Fitted, &crate::fit::Fitted) -> bool,
    ) -> Result<SplitFit, Error> {
        let unsplit = self.unsplit();
        Ok(match (plain, split_fit) {
            (Ok(a), Ok(b)) if split_better(&a, &b) => SplitFit {
                fitted: b,
                split: self.rep,
            },
            (Ok(a), _) => SplitFit {
                fitted: a,
                split: unsplit,
            },
            (Err(_), Ok(b)) => SplitFit {
                fitted: b,
                split: self.rep,
            },
            (Err(_), Err(e)) => return Err(e),
        })
    }
}

/// `flops` the split adds, and their time at the rate of `step` (its
/// seconds per FLOP).
fn split_cost(flops: f64, step: &crate::cost::OpCost) -> crate::cost::OpCost {
    let rate = if step.flops > 0.0 {
        step.seconds / step.flops
    } else {
        0.0
    };
    crate::cost::OpCost {
        flops,
        seconds: flops * rate,
        bytes: 0,
    }
}

/// `f` with the split's `added` cost counted in its own.
fn with_split_added(mut f: crate::fit::Fitted, added: &crate::cost::OpCost) -> crate::fit::Fitted {
    f.added.flops += added.flops;
    f.added.seconds += added.seconds;
    f
}
