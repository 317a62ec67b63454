//! Row-wise regions: the ops around an expanding projection (a transformer
//! block's MLP, `[R, C] → [R, F]` with `F > C`) split into chunks of rows.
//!
//! At long sequence lengths a block's MLP holds several `[R, F]` tensors
//! at once (for a SwiGLU MLP in the backward of a checkpointed block: the
//! recomputed gate and up projections `[R, 2F]` and their activation
//! `[R, F]`, then the gradients of both), `R` = batch × tokens. Every op
//! in that region is row-wise except the weight gradients, which sum over
//! rows; so, as Mini-Sequence Transformer (MsT) runs the MLP, the region
//! can run on `k` slices of the rows in turn and hold `[R/k, F]` instead.
//!
//! # Which ops, and why each split is exact
//! A region grows from a seed, by these rules per op (its kernel):
//!
//! | op | operands | result | chunk of `n` rows |
//! |---|---|---|---|
//! | `matmul_nn`, `matmul_nt` (`m = R`) | `a` rows, `b` whole | rows | `m = n`: row `r` of `a b` is row `r` of `a` times `b` |
//! | `matmul_tn` (`k = R`; a weight gradient `aᵀ b`) | `a`, `b` rows | a sum over rows | `k = n`; chunk 0 writes the sum, the later chunks add to it (`accumulate`) |
//! | `swiglu` (`rows = R`), `swiglu_backward` | rows | rows | `rows = n` |
//! | `gelu`, `gelu_backward`, `relu`, `relu_backward`, `cast` (elements a multiple of `R`) | rows | rows | elementwise |
//!
//! The seed is a `matmul_nn` or `matmul_nt` whose output is wider than
//! its row operand (an up projection). The region then takes every reader
//! of a row tensor it makes that a rule covers (reading it only as rows),
//! and the producer of a row operand it reads when the rules cover that
//! producer and nothing outside the region reads what it makes. So it
//! stops at anything that mixes rows or has no rule: a norm, attention, a
//! residual `add` (kept out so the region does not run along the
//! residual stream), the loss (its own pass, [`super::loss`]).
//!
//! The tensors it touches are then
//! - **inner**: made and read only inside it, plain transient tensors:
//!   each chunk makes its own rows. This is what the split saves;
//! - **row inputs** from outside: each chunk reads a `view` of its rows
//!   (rows are contiguous: chunk `i` starts at element `r₀·width`);
//! - **row outputs** read outside: the chunks' rows are copied into the
//!   tensor by one `pack` op after the last chunk;
//! - **sums** (the weight gradients): made by chunk 0, added to by the
//!   rest (with a low-precision gradient, each addition rounds once more
//!   than the single product would);
//! - **whole** operands (the weights): read by every chunk.
//!
//! So the split region equals the original up to the summation order of
//! the weight gradients.
//!
//! # What it refuses
//! A region is split only if it has an inner tensor made by its seed,
//! every row tensor has `R` rows and a known shape, no op of it updates
//! anything, it reads no tensor it makes as a whole operand, its row
//! outputs and sums are not views and its sums are read by nothing in
//! it. Its chunks go where the last of its outside operands is ready (at
//! its first op if they all are): anything outside that reads what it
//! makes must come later, and nothing outside it may update or make what
//! it reads or makes between its first op and that place. A region of a
//! non-checkpointed step, whose forward half is far from its backward
//! half, fails this and is left alone; so does everything else that does
//! not match.

use std::collections::{HashMap, HashSet};

use memplan_runtime::{Kernel, Matmul};

use super::{Piece, chunk_rows, row_views};
use crate::graph::{Graph, GraphBuilder, Lifetime, OpId, OpSpec, TensorId, TensorSpec};
use crate::vocab;

/// How an op reads an operand, or makes its result, along the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Along {
    /// Row `r` of it belongs to row `r` of the region.
    Rows,
    /// All of it, in every chunk (a weight).
    Whole,
    /// A sum over the rows (a weight gradient).
    Sum,
}

/// The rule for kernel `k` in a region of `rows` rows: how it reads each
/// input and makes its one output.
fn rule(k: &Kernel, rows: u64) -> Option<(Vec<Along>, Along)> {
    use Along::*;
    Some(match k {
        Kernel::MatmulNn(mm) | Kernel::MatmulNt(mm) if mm.m == rows => (vec![Rows, Whole], Rows),
        Kernel::MatmulTn(mm) if mm.k == rows => (vec![Rows, Rows], Sum),
        Kernel::SwiGlu { rows: r, .. } if *r == rows => (vec![Rows], Rows),
        Kernel::SwiGluBackward { rows: r, .. } if *r == rows => (vec![Rows, Rows], Rows),
        Kernel::Gelu { elements } | Kernel::Relu { elements } | Kernel::Cast { elements }
            if elements % rows == 0 =>
        {
            (vec![Rows], Rows)
        }
        Kernel::GeluBackward { elements } | Kernel::ReluBackward { elements }
            if elements % rows == 0 =>
        {
            (vec![Rows, Rows], Rows)
        }
        _ => return None,
    })
}

/// Kernel `k` on `n` of the region's `rows` rows.
fn chunk_kernel(k: &Kernel, rows: u64, n: u64) -> Kernel {
    let mut k = k.clone();
    match &mut k {
        Kernel::MatmulNn(mm) | Kernel::MatmulNt(mm) => mm.m = n,
        Kernel::MatmulTn(mm) | Kernel::MatmulTnAccumulate(mm) => mm.k = n,
        Kernel::SwiGlu { rows: r, .. } | Kernel::SwiGluBackward { rows: r, .. } => *r = n,
        Kernel::Gelu { elements }
        | Kernel::Relu { elements }
        | Kernel::Cast { elements }
        | Kernel::GeluBackward { elements }
        | Kernel::ReluBackward { elements } => *elements = *elements / rows * n,
        other => unreachable!("a row region has no {}", other.name()),
    }
    k
}

/// A row-wise region found in a graph (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// Its ops, in program order; the first of them is not always the seed.
    pub ops: Vec<OpId>,
    /// Rows `R`.
    pub rows: u64,
    /// Each op's kernel and rule, by position in `ops`.
    kernels: Vec<Kernel>,
    /// Tensors made and read only inside: chunked.
    pub inner: Vec<TensorId>,
    /// Row tensors from outside: read through views of their rows.
    pub inputs: Vec<TensorId>,
    /// Row tensors made inside and read outside: packed.
    pub outputs: Vec<TensorId>,
    /// Sums over the rows: made by chunk 0, accumulated by the rest.
    pub sums: Vec<TensorId>,
    /// Program position its chunks go before.
    position: usize,
}

/// The op's kernel and its rule in a region of `rows` rows, if it has
/// one and is an op a region can hold: one output, no updates.
fn ruled(g: &Graph, o: OpId, rows: u64) -> Option<(Kernel, Vec<Along>, Along)> {
    let op = g.op(o);
    if op.outputs.len() != 1 || !op.updates.is_empty() {
        return None;
    }
    let k = vocab::kernel(op).ok()?;
    let (ins, out) = rule(&k, rows)?;
    (ins.len() == op.inputs.len()).then_some((k, ins, out))
}

fn elements(g: &Graph, t: TensorId) -> Option<u64> {
    g.tensor(t).shape.as_ref().map(|s| s.iter().product())
}

/// Whether every operand position at which `o` reads `t` is a row one.
fn reads_as_rows(g: &Graph, o: OpId, t: TensorId, ins: &[Along]) -> bool {
    g.op(o)
        .inputs
        .iter()
        .zip(ins)
        .all(|(&x, &a)| x != t || a == Along::Rows)
}

/// The region grown from `seed` (an up projection), if it can be split;
/// `taken` holds ops already in a region or chain.
fn region_at(g: &Graph, seed: OpId, taken: &HashSet<OpId>, pos: &[usize]) -> Option<Region> {
    let (Kernel::MatmulNn(Matmul { m: rows, k, n }) | Kernel::MatmulNt(Matmul { m: rows, k, n })) =
        vocab::kernel(g.op(seed)).ok()?
    else {
        return None;
    };
    if rows < 2 || n <= k || taken.contains(&seed) {
        return None;
    }
    ruled(g, seed, rows)?;
    let mut set: HashSet<OpId> = HashSet::from([seed]);
    loop {
        let mut grew = false;
        let members: Vec<OpId> = set.iter().copied().collect();
        for o in members {
            let (_, ins, out) = ruled(g, o, rows)?;
            let op = g.op(o);
            // Readers of the row tensor it makes.
            if out == Along::Rows {
                for &r in g.readers(op.outputs[0]) {
                    if set.contains(&r) || taken.contains(&r) {
                        continue;
                    }
                    if let Some((_, rins, _)) = ruled(g, r, rows)
                        && reads_as_rows(g, r, op.outputs[0], &rins)
                    {
                        set.insert(r);
                        grew = true;
                    }
                }
            }
            // Producers of its row operands read only inside.
            for (&t, &a) in op.inputs.iter().zip(&ins) {
                let Some(p) = g.tensor(t).producer else {
                    continue;
                };
                if a != Along::Rows || set.contains(&p) || taken.contains(&p) {
                    continue;
                }
                if let Some((_, _, Along::Rows)) = ruled(g, p, rows)
                    && g.readers(t).iter().all(|r| set.contains(r))
                {
                    set.insert(p);
                    grew = true;
                }
            }
        }
        if !grew {
            break;
        }
    }
    classify(g, seed, set, rows, pos)
}

/// The region of `set`'s ops, its tensors sorted by what the split does
/// with them, if every condition of "What it refuses" holds.
fn classify(g: &Graph, seed: OpId, set: HashSet<OpId>, rows: u64, pos: &[usize]) -> Option<Region> {
    let mut ops: Vec<OpId> = set.iter().copied().collect();
    ops.sort_by_key(|o| pos[o.index()]);
    let mut kernels = Vec::new();
    let (mut inner, mut inputs, mut outputs, mut sums, mut whole) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let made: HashSet<TensorId> = ops.iter().map(|&o| g.op(o).outputs[0]).collect();
    let row_shape = |t: TensorId| {
        let x = g.tensor(t);
        elements(g, t).is_some_and(|e| e > 0 && e % rows == 0) && x.size % rows == 0
    };
    for &o in &ops {
        let (k, ins, out) = ruled(g, o, rows)?;
        kernels.push(k);
        let op = g.op(o);
        for (&t, &a) in op.inputs.iter().zip(&ins) {
            match a {
                _ if made.contains(&t) && a != Along::Rows => return None,
                Along::Rows if made.contains(&t) => {}
                Along::Rows => {
                    if !row_shape(t) || g.tensor(t).view_of.is_some() {
                        return None;
                    }
                    if !inputs.contains(&t) {
                        inputs.push(t);
                    }
                }
                _ => whole.push(t),
            }
        }
        let t = op.outputs[0];
        let x = g.tensor(t);
        if x.view_of.is_some() || x.role.is_step_input() {
            return None;
        }
        let outside = g.users_of_root(t).iter().any(|u| !set.contains(u));
        match out {
            Along::Sum if g.readers(t).iter().any(|r| set.contains(r)) => return None,
            Along::Sum => sums.push(t),
            _ if !row_shape(t) => return None,
            _ if outside || x.lifetime != Lifetime::Transient => outputs.push(t),
            _ => inner.push(t),
        }
    }
    if !inner.contains(&g.op(seed).outputs[0]) {
        return None;
    }
    let position = placed(g, &ops, &inputs, &whole, &made, pos)?;
    Some(Region {
        ops,
        rows,
        kernels,
        inner,
        inputs,
        outputs,
        sums,
        position,
    })
}

/// Where the chunks of the region's `ops` can go: before the program
/// position where the last outside operand is ready (or the first op's),
/// if nothing outside reads what they make before it and nothing outside
/// writes what they read or make between their first op and there.
fn placed(
    g: &Graph,
    ops: &[OpId],
    inputs: &[TensorId],
    whole: &[TensorId],
    made: &HashSet<TensorId>,
    pos: &[usize],
) -> Option<usize> {
    let inside: HashSet<OpId> = ops.iter().copied().collect();
    let first = pos[ops[0].index()];
    let last = pos[ops[ops.len() - 1].index()];
    let mut at = first;
    for &t in inputs.iter().chain(whole) {
        for p in [g.tensor(t).producer, g.tensor(g.root(t)).producer]
            .into_iter()
            .flatten()
        {
            at = at.max(pos[p.index()] + 1);
        }
    }
    for &o in ops {
        for &a in &g.op(o).after {
            if !inside.contains(&a) {
                at = at.max(pos[a.index()] + 1);
            }
        }
    }
    let order = g.program_order();
    if at > order.len() {
        return None;
    }
    // Each root the region reads, and the program positions of its ops
    // that read it.
    let mut read: HashMap<TensorId, Vec<usize>> = HashMap::new();
    for &o in ops {
        for &t in &g.op(o).inputs {
            if !made.contains(&t) {
                read.entry(g.root(t)).or_default().push(pos[o.index()]);
            }
        }
    }
    // An outside write at `q` to a root the region reads keeps its
    // meaning if every op of the region reading it stays on its side: all
    // after `q` when the chunks go after it, all before `q` otherwise.
    let moved_across = |q: usize, t: &TensorId| {
        read.get(&g.root(*t)).is_some_and(|readers| {
            if q < at {
                readers.iter().any(|&r| r < q)
            } else {
                readers.iter().any(|&r| r > q)
            }
        })
    };
    let end = at.max(last);
    for (q, &o) in order.iter().enumerate().take(end + 1).skip(first) {
        if inside.contains(&o) {
            continue;
        }
        let op = g.op(o);
        let touches = |t: &TensorId| made.contains(&g.root(*t)) || made.contains(t);
        // Outside ops in the stretch may not write what the region reads
        // across its move; those before its place may not use what it
        // makes or wait for it.
        if op
            .outputs
            .iter()
            .chain(&op.updates)
            .any(|t| moved_across(q, t))
            || (q < at
                && (op.inputs.iter().chain(&op.updates).any(touches)
                    || op.after.iter().any(|a| inside.contains(a))))
        {
            return None;
        }
    }
    Some(at)
}

/// Every row-wise region of `g` that can be split, outside the ops of
/// `taken` (the loss chains), disjoint, in program order of their seeds.
pub fn find_regions(g: &Graph, taken: &HashSet<OpId>) -> Vec<Region> {
    let mut pos = vec![0; g.num_ops()];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }
    let mut taken = taken.clone();
    let mut out = Vec::new();
    for &o in g.program_order() {
        if let Some(r) = region_at(g, o, &taken, &pos) {
            taken.extend(r.ops.iter().copied());
            out.push(r);
        }
    }
    out
}

impl Region {
    /// FLOPs the split adds: the `k − 1` additions into each sum.
    pub fn added_flops(&self, g: &Graph, k: u64) -> f64 {
        let sum: u64 = self.sums.iter().filter_map(|&t| elements(g, t)).sum();
        ((k - 1) * sum) as f64
    }

    /// Row width of row tensor `t`.
    fn width(&self, g: &Graph, t: TensorId) -> u64 {
        elements(g, t).unwrap_or(0) / self.rows
    }

    /// Chunk `i` (`n` rows) of row tensor `t`: a transient tensor like it.
    fn chunk_of(&self, g: &Graph, b: &mut GraphBuilder, t: TensorId, i: usize, n: u64) -> TensorId {
        let x = g.tensor(t);
        let w = self.width(g, t);
        let mut s = TensorSpec::new(format!("{}.chunk{i}", x.name), x.size / self.rows * n)
            .role(x.role)
            .align(x.align)
            .lifetime(Lifetime::Transient)
            .shape(vec![n, w]);
        s.dtype = x.dtype.clone();
        b.add_tensor(s)
    }
}

impl Piece for Region {
    fn replaced_ops(&self) -> Vec<OpId> {
        self.ops.clone()
    }

    fn replaced_tensors(&self) -> Vec<TensorId> {
        self.inner.clone()
    }

    fn position(&self, _pos: &[usize]) -> usize {
        self.position
    }

    fn emit(
        &self,
        g: &Graph,
        b: &mut GraphBuilder,
        k: u64,
        tm: &dyn Fn(TensorId) -> TensorId,
        om: &dyn Fn(OpId) -> Vec<OpId>,
    ) -> Vec<OpId> {
        let parts = chunk_rows(self.rows, k);
        let mut ops = Vec::new();
        // Views of the rows of each row input.
        let mut views: HashMap<TensorId, Vec<TensorId>> = HashMap::new();
        for &t in &self.inputs {
            let (op, v) = row_views(g, b, t, tm(t), &parts, self.width(g, t));
            ops.push(op);
            views.insert(t, v);
        }
        let outside_after: Vec<OpId> = self
            .ops
            .iter()
            .flat_map(|&o| g.op(o).after.iter().copied())
            .filter(|a| !self.ops.contains(a))
            .flat_map(om)
            .collect();
        let mut packed: HashMap<TensorId, Vec<TensorId>> = HashMap::new();
        for (i, &(lo, hi)) in parts.iter().enumerate() {
            let n = hi - lo;
            let mut chunk: HashMap<TensorId, TensorId> = HashMap::new();
            for (j, &o) in self.ops.iter().enumerate() {
                let op = g.op(o);
                let (ins, out) = rule(&self.kernels[j], self.rows).expect("a region op has a rule");
                let mut kern = chunk_kernel(&self.kernels[j], self.rows, n);
                let inputs: Vec<TensorId> = op
                    .inputs
                    .iter()
                    .zip(&ins)
                    .map(|(&t, &a)| match a {
                        Along::Rows => chunk.get(&t).copied().unwrap_or_else(|| views[&t][i]),
                        _ => tm(t),
                    })
                    .collect();
                let t = op.outputs[0];
                let mut s =
                    OpSpec::new(format!("{}.chunk{i}", op.name), op.kind, op.op_type.clone())
                        .inputs(inputs)
                        .after(outside_after.clone());
                s.stream = op.stream;
                s.attrs = op.attrs.clone();
                let share = n as f64 / self.rows as f64;
                s.cost = op.cost.map(|c| c * share);
                s.flops = op.flops.map(|f| f * share);
                if out == Along::Sum {
                    if i == 0 {
                        s = s.outputs([tm(t)]);
                    } else {
                        let Kernel::MatmulTn(mm) = kern else {
                            unreachable!("a sum is a matmul_tn's")
                        };
                        kern = Kernel::MatmulTnAccumulate(mm);
                        s = s.updates([tm(t)]);
                        let add = (mm.m * mm.n) as f64;
                        s.flops = Some(s.flops.unwrap_or(2.0 * (mm.m * mm.k * mm.n) as f64) + add);
                    }
                } else {
                    let c = self.chunk_of(g, b, t, i, n);
                    chunk.insert(t, c);
                    if self.outputs.contains(&t) {
                        packed.entry(t).or_default().push(c);
                    }
                    s = s.outputs([c]);
                }
                vocab::write(&kern, &mut s.attrs);
                ops.push(b.add_op(s));
            }
        }
        for &t in &self.outputs {
            let w = self.width(g, t);
            let maker = g.op(g
                .tensor(t)
                .producer
                .expect("a region output is made inside"));
            let pack = Kernel::Pack {
                offsets: parts.iter().map(|&(lo, _)| lo * w).collect(),
                elements: self.rows * w,
            };
            ops.push(
                b.add_op(
                    vocab::spec(format!("{}.pack", maker.name), maker.kind, &pack)
                        .inputs(packed.remove(&t).unwrap_or_default())
                        .outputs([tm(t)])
                        .flops(0.0)
                        .stream(maker.stream),
                ),
            );
        }
        ops
    }
}
