//! The scheduling problem the solver works on: ops, buffers, dependencies.
//!
//! This is memplan's graph reduced to what ordering needs, in compact
//! index form (CSR adjacency). Views are already resolved to the buffer that
//! owns the bytes, zero-sized tensors are gone (their ordering constraints are
//! edges), and in-place ordering rules are explicit edges. The solver never
//! sees names, shapes or roles, except the op class it needs for weight-update
//! placement.
//!
//! # Liveness
//! In a schedule, the op at step `i` reads its inputs and writes its outputs
//! during step `i`; both are live at `i`. A buffer is live on the closed step
//! interval `[birth, death]`:
//! - `birth` is its producer's step, or 0 when it has no producer (a step
//!   input);
//! - `death` is the last step of any user; `n - 1` if the buffer is
//!   persistent (it must survive the step); `birth` if it has no user.
//!
//! A reuse hint `(op, out, inp)` lets `out` take `inp`'s bytes when `op` is
//! `inp`'s last user in the schedule and `inp` is not persistent. The
//! conversion from memplan's graph only passes hints where `out` and `inp`
//! have the same size, so a taken hint merges the two into one buffer whose
//! life is the union of both: at step `i` only one of the two is counted.

use std::fmt;

/// Index of an op in a [`Problem`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpIdx(pub u32);

/// Index of a buffer (a tensor that owns bytes) in a [`Problem`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufIdx(pub u32);

impl OpIdx {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl BufIdx {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for OpIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}
impl fmt::Display for BufIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buf{}", self.0)
    }
}

/// What an op does in the training step; the solver treats optimizer ops
/// (weight updates) and collectives as movable work it may place.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum OpClass {
    Forward,
    Backward,
    Optimizer,
    Collective,
    #[default]
    Other,
}

/// A buffer: a tensor that owns bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buf {
    /// Bytes it occupies while live.
    pub size: u64,
    /// The op that writes it first; `None` for a step input (live from step 0).
    pub producer: Option<OpIdx>,
    /// Must survive the step: live until the last step.
    pub persistent: bool,
}

/// An op's permission to write output `out` into the bytes of input `inp`
/// when it is `inp`'s last user.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reuse {
    pub op: OpIdx,
    pub out: BufIdx,
    pub inp: BufIdx,
}

/// Why a [`ProblemBuilder`] refused its input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProblemError {
    #[error("{0} is out of range")]
    BadOp(OpIdx),
    #[error("{0} is out of range")]
    BadBuf(BufIdx),
    #[error("{op} both produces and uses {buf}")]
    SelfUse { op: OpIdx, buf: BufIdx },
    #[error("the dependencies have a cycle through {0}")]
    Cycle(OpIdx),
    #[error("reuse hint at {op}: {op} must produce {out} and use {inp}")]
    BadReuse { op: OpIdx, out: BufIdx, inp: BufIdx },
}

/// Compressed sparse rows: `items[start[i]..start[i+1]]` belong to row `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Csr {
    start: Vec<u32>,
    items: Vec<u32>,
}

impl Csr {
    fn from_pairs(rows: usize, pairs: &mut [(u32, u32)]) -> Csr {
        pairs.sort_unstable();
        let mut start = vec![0u32; rows + 1];
        let mut items = Vec::with_capacity(pairs.len());
        let mut last = None;
        for &(r, c) in pairs.iter() {
            if last == Some((r, c)) {
                continue;
            }
            last = Some((r, c));
            start[r as usize + 1] += 1;
            items.push(c);
        }
        for i in 0..rows {
            start[i + 1] += start[i];
        }
        Csr { start, items }
    }
    #[inline]
    fn row(&self, r: usize) -> &[u32] {
        &self.items[self.start[r] as usize..self.start[r + 1] as usize]
    }
}

/// The ordering problem: see the module docs for the liveness rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    classes: Vec<OpClass>,
    bufs: Vec<Buf>,
    succ: Csr,
    pred: Csr,
    outs: Csr,
    uses: Csr,
    users: Csr,
    reuses: Vec<Reuse>,
    reuse_by_op: Csr,
    topo: Vec<OpIdx>,
}

/// Reachability of a [`Problem`]'s ops ([`Problem::reach`]): op `v`'s
/// ancestors are the set bits of `anc[v * words..(v + 1) * words]`, its
/// descendants those of `desc` (an op is in neither of its own sets).
#[derive(Clone, Debug)]
pub struct Reach {
    /// `u64` words per op.
    pub words: usize,
    /// Ancestor bitsets, `words` per op.
    pub anc: Vec<u64>,
    /// Descendant bitsets, `words` per op.
    pub desc: Vec<u64>,
}

impl Problem {
    /// Number of ops.
    pub fn num_ops(&self) -> usize {
        self.classes.len()
    }
    /// Number of buffers.
    pub fn num_bufs(&self) -> usize {
        self.bufs.len()
    }
    /// All ops, in index order.
    pub fn ops(&self) -> impl ExactSizeIterator<Item = OpIdx> + Clone + use<> {
        (0..self.classes.len() as u32).map(OpIdx)
    }
    /// All buffers, in index order.
    pub fn buf_ids(&self) -> impl ExactSizeIterator<Item = BufIdx> + Clone + use<> {
        (0..self.bufs.len() as u32).map(BufIdx)
    }
    pub fn class(&self, op: OpIdx) -> OpClass {
        self.classes[op.index()]
    }
    pub fn buf(&self, b: BufIdx) -> &Buf {
        &self.bufs[b.index()]
    }
    pub fn bufs(&self) -> &[Buf] {
        &self.bufs
    }
    pub fn size(&self, b: BufIdx) -> u64 {
        self.bufs[b.index()].size
    }
    /// Ops that depend directly on `op`.
    pub fn succs(&self, op: OpIdx) -> impl ExactSizeIterator<Item = OpIdx> + '_ {
        self.succ.row(op.index()).iter().map(|&x| OpIdx(x))
    }
    /// Ops `op` depends on directly.
    pub fn preds(&self, op: OpIdx) -> impl ExactSizeIterator<Item = OpIdx> + '_ {
        self.pred.row(op.index()).iter().map(|&x| OpIdx(x))
    }
    pub fn num_succs(&self, op: OpIdx) -> usize {
        self.succ.row(op.index()).len()
    }
    pub fn num_preds(&self, op: OpIdx) -> usize {
        self.pred.row(op.index()).len()
    }
    /// Buffers `op` produces.
    pub fn outputs(&self, op: OpIdx) -> impl ExactSizeIterator<Item = BufIdx> + '_ {
        self.outs.row(op.index()).iter().map(|&x| BufIdx(x))
    }
    /// Buffers `op` reads or updates (not those it produces).
    pub fn uses(&self, op: OpIdx) -> impl ExactSizeIterator<Item = BufIdx> + '_ {
        self.uses.row(op.index()).iter().map(|&x| BufIdx(x))
    }
    /// Ops that read or update `b`.
    pub fn users(&self, b: BufIdx) -> impl ExactSizeIterator<Item = OpIdx> + '_ {
        self.users.row(b.index()).iter().map(|&x| OpIdx(x))
    }
    pub fn num_users(&self, b: BufIdx) -> usize {
        self.users.row(b.index()).len()
    }
    /// Every reuse hint.
    pub fn reuses(&self) -> &[Reuse] {
        &self.reuses
    }
    /// Reuse hints of one op.
    pub fn reuses_of(&self, op: OpIdx) -> impl ExactSizeIterator<Item = &Reuse> + '_ {
        self.reuse_by_op
            .row(op.index())
            .iter()
            .map(|&i| &self.reuses[i as usize])
    }
    /// Transitive ancestors and descendants of every op as bitsets:
    /// `O(n · m / 64)` time, `2 · n²/64` words.
    pub fn reach(&self) -> Reach {
        let n = self.num_ops();
        let words = n.div_ceil(64).max(1);
        let topo = self.topo_order();
        let mut anc = vec![0u64; n * words];
        for &v in topo {
            for u in self.preds(v) {
                let (a, b) = (u.index() * words, v.index() * words);
                for k in 0..words {
                    let x = anc[a + k];
                    anc[b + k] |= x;
                }
                anc[b + u.index() / 64] |= 1 << (u.index() % 64);
            }
        }
        let mut desc = vec![0u64; n * words];
        for &v in topo.iter().rev() {
            for q in self.succs(v) {
                let (a, b) = (q.index() * words, v.index() * words);
                for k in 0..words {
                    let x = desc[a + k];
                    desc[b + k] |= x;
                }
                desc[b + q.index() / 64] |= 1 << (q.index() % 64);
            }
        }
        Reach { words, anc, desc }
    }
    /// One topological order (smallest index first among ready ops).
    pub fn topo_order(&self) -> &[OpIdx] {
        &self.topo
    }
    /// Total bytes of all buffers.
    pub fn total_bytes(&self) -> u64 {
        self.bufs.iter().map(|b| b.size).sum()
    }
    /// Bytes of persistent buffers with no producer: live at every step.
    pub fn resident_bytes(&self) -> u64 {
        self.bufs
            .iter()
            .filter(|b| b.persistent && b.producer.is_none())
            .map(|b| b.size)
            .sum()
    }
    /// Whether `order` holds every op once and respects every dependency.
    pub fn is_valid_order(&self, order: &[OpIdx]) -> bool {
        if order.len() != self.num_ops() {
            return false;
        }
        let mut pos = vec![u32::MAX; self.num_ops()];
        for (i, &op) in order.iter().enumerate() {
            if op.index() >= self.num_ops() || pos[op.index()] != u32::MAX {
                return false;
            }
            pos[op.index()] = i as u32;
        }
        self.ops()
            .all(|v| self.preds(v).all(|u| pos[u.index()] < pos[v.index()]))
    }
}

/// Builds a [`Problem`]; producer-to-user edges are added automatically.
#[derive(Default, Debug, Clone)]
pub struct ProblemBuilder {
    classes: Vec<OpClass>,
    bufs: Vec<Buf>,
    edges: Vec<(u32, u32)>,
    uses: Vec<(u32, u32)>,
    reuses: Vec<Reuse>,
}

impl ProblemBuilder {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn add_op(&mut self, class: OpClass) -> OpIdx {
        self.classes.push(class);
        OpIdx(self.classes.len() as u32 - 1)
    }
    pub fn add_buf(&mut self, size: u64, producer: Option<OpIdx>, persistent: bool) -> BufIdx {
        self.bufs.push(Buf {
            size,
            producer,
            persistent,
        });
        BufIdx(self.bufs.len() as u32 - 1)
    }
    /// `op` reads (or updates in place) `buf`.
    pub fn add_use(&mut self, op: OpIdx, buf: BufIdx) {
        self.uses.push((op.0, buf.0));
    }
    /// `after` must run after `before`.
    pub fn add_edge(&mut self, before: OpIdx, after: OpIdx) {
        if before != after {
            self.edges.push((before.0, after.0));
        }
    }
    pub fn add_reuse(&mut self, op: OpIdx, out: BufIdx, inp: BufIdx) {
        self.reuses.push(Reuse { op, out, inp });
    }

    pub fn build(self) -> Result<Problem, ProblemError> {
        let n = self.classes.len();
        let nb = self.bufs.len();
        let mut edges = self.edges;
        let mut outs_pairs = Vec::new();
        for (i, b) in self.bufs.iter().enumerate() {
            if let Some(p) = b.producer {
                if p.index() >= n {
                    return Err(ProblemError::BadOp(p));
                }
                outs_pairs.push((p.0, i as u32));
            }
        }
        for &(a, b) in &edges {
            for x in [a, b] {
                if x as usize >= n {
                    return Err(ProblemError::BadOp(OpIdx(x)));
                }
            }
        }
        let mut use_pairs = Vec::with_capacity(self.uses.len());
        let mut user_pairs = Vec::with_capacity(self.uses.len());
        for &(op, b) in &self.uses {
            if op as usize >= n {
                return Err(ProblemError::BadOp(OpIdx(op)));
            }
            if b as usize >= nb {
                return Err(ProblemError::BadBuf(BufIdx(b)));
            }
            match self.bufs[b as usize].producer {
                Some(p) if p.0 == op => {
                    return Err(ProblemError::SelfUse {
                        op: OpIdx(op),
                        buf: BufIdx(b),
                    });
                }
                Some(p) => edges.push((p.0, op)),
                None => {}
            }
            use_pairs.push((op, b));
            user_pairs.push((b, op));
        }
        let succ = Csr::from_pairs(n, &mut edges);
        let mut rev: Vec<(u32, u32)> = edges.iter().map(|&(a, b)| (b, a)).collect();
        let pred = Csr::from_pairs(n, &mut rev);
        let outs = Csr::from_pairs(n, &mut outs_pairs);
        let uses = Csr::from_pairs(n, &mut use_pairs);
        let users = Csr::from_pairs(nb, &mut user_pairs);

        let mut reuses = self.reuses;
        reuses.sort_by_key(|r| (r.op, r.out, r.inp));
        reuses.dedup();
        for r in &reuses {
            let ok = r.op.index() < n
                && r.out.index() < nb
                && r.inp.index() < nb
                && self.bufs[r.out.index()].producer == Some(r.op)
                && uses.row(r.op.index()).contains(&r.inp.0);
            if !ok {
                return Err(ProblemError::BadReuse {
                    op: r.op,
                    out: r.out,
                    inp: r.inp,
                });
            }
        }
        let mut rb: Vec<(u32, u32)> = reuses
            .iter()
            .enumerate()
            .map(|(i, r)| (r.op.0, i as u32))
            .collect();
        let reuse_by_op = Csr::from_pairs(n, &mut rb);

        // Kahn's algorithm, smallest index first, for a deterministic order.
        let mut indeg: Vec<u32> = (0..n).map(|v| pred.row(v).len() as u32).collect();
        let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<u32>> = (0..n as u32)
            .filter(|&v| indeg[v as usize] == 0)
            .map(std::cmp::Reverse)
            .collect();
        let mut topo = Vec::with_capacity(n);
        while let Some(std::cmp::Reverse(v)) = ready.pop() {
            topo.push(OpIdx(v));
            for &s in succ.row(v as usize) {
                indeg[s as usize] -= 1;
                if indeg[s as usize] == 0 {
                    ready.push(std::cmp::Reverse(s));
                }
            }
        }
        if topo.len() != n {
            let stuck = (0..n).find(|&v| indeg[v] > 0).unwrap_or(0);
            return Err(ProblemError::Cycle(OpIdx(stuck as u32)));
        }
        Ok(Problem {
            classes: self.classes,
            bufs: self.bufs,
            succ,
            pred,
            outs,
            uses,
            users,
            reuses,
            reuse_by_op,
            topo,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_edges_from_uses_and_rejects_cycles() {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let x = b.add_buf(8, Some(a), false);
        b.add_use(c, x);
        let p = b.clone().build().unwrap();
        assert_eq!(p.succs(a).collect::<Vec<_>>(), vec![c]);
        assert_eq!(p.preds(c).collect::<Vec<_>>(), vec![a]);
        assert_eq!(p.topo_order(), &[a, c]);
        b.add_edge(c, a);
        assert!(matches!(b.build(), Err(ProblemError::Cycle(_))));
    }

    #[test]
    fn rejects_bad_reuse() {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let x = b.add_buf(8, Some(a), false);
        let y = b.add_buf(8, Some(c), false);
        b.add_reuse(a, y, x);
        assert!(matches!(b.build(), Err(ProblemError::BadReuse { .. })));
    }
}
