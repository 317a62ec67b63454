//! Exact ordering by best-first search over scheduled sets (Serenity-style
//! dynamic programming with memory-bound pruning).
//!
//! A state is the set `S` of ops already run; it is closed under
//! predecessors, and the bytes live between two steps depend on `S` alone:
//! `L(S)` = buffers produced in `S` (or step inputs) that are persistent or
//! still have a user outside `S`. Running a ready op `v` next costs
//! `mem(S, v) = L(S) + outputs(v) - reuse(S, v)` at its step (its inputs are
//! already in `L(S)`), so the best peak to reach `S` is a bottleneck shortest
//! path over states, and every order reaching `S` is summarised by one value.
//!
//! The search pops states in increasing `f(S) = max(g(S), h(S))`, where
//! `g(S)` is the best peak found to reach `S` and `h(S)` a lower bound on the
//! rest of the order (persistent bytes already born + the largest
//! inputs-plus-outputs of an op still to run). `h` is admissible, so the
//! first complete state popped is optimal; states with `f` at or above the
//! incumbent (the best order known, e.g. from heuristics) are pruned, so
//! an empty queue proves the incumbent optimal. When the state budget runs
//! out, the smallest `f` left in the queue is a valid lower bound.
//!
//! Dominance (switch `dominance`): if a ready op fits under `f(S)` and does
//! not increase `L`, some optimal completion runs it next (moving it to the
//! front lowers or keeps every step in between), so it is the only child.
//! The argument needs each op to have at most one reuse hint; the rule is
//! off otherwise.
//!
//! Cost: `O(states · n · deg)`; states are bitsets of `W` words, `W ≤ 8`
//! (parts of up to 512 ops; the number of states, not `n`, is the limit).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::budget::Budget;
use crate::problem::{OpIdx, Problem};

/// Limits of one exact search.
#[derive(Clone, Debug)]
pub struct ExactLimits {
    /// States to create before giving up.
    pub max_states: usize,
    /// Use the dominance rule (see the module docs).
    pub dominance: bool,
}

impl Default for ExactLimits {
    fn default() -> Self {
        ExactLimits {
            max_states: 200_000,
            dominance: true,
        }
    }
}

/// What an exact search found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExactResult {
    /// A better order than the incumbent, if one was found.
    pub order: Option<Vec<OpIdx>>,
    /// Peak of `order`, or the incumbent's peak if none was found.
    pub peak: u64,
    /// A lower bound on the optimum (equal to `peak` when proven).
    pub lower_bound: u64,
    /// Whether `peak` is proven optimal.
    pub proven: bool,
    /// States created.
    pub states: usize,
}

/// Largest part [`solve`] accepts.
pub const MAX_OPS: usize = 512;

/// Finds an order of `p` with a smaller peak than `incumbent` (its peak,
/// `u64::MAX` for none), or proves there is none, within `limits`.
pub fn solve(p: &Problem, incumbent: u64, limits: &ExactLimits, budget: &Budget) -> ExactResult {
    let n = p.num_ops();
    match n {
        0 => ExactResult {
            order: Some(Vec::new()),
            peak: 0,
            lower_bound: 0,
            proven: true,
            states: 0,
        },
        1..=64 => Search::<1>::new(p, limits).run(incumbent, budget),
        65..=128 => Search::<2>::new(p, limits).run(incumbent, budget),
        129..=256 => Search::<4>::new(p, limits).run(incumbent, budget),
        257..=MAX_OPS => Search::<8>::new(p, limits).run(incumbent, budget),
        _ => ExactResult {
            order: None,
            peak: incumbent,
            lower_bound: 0,
            proven: false,
            states: 0,
        },
    }
}

type Bits<const W: usize> = [u64; W];

#[inline]
fn has<const W: usize>(s: &Bits<W>, i: usize) -> bool {
    s[i >> 6] >> (i & 63) & 1 == 1
}
#[inline]
fn with<const W: usize>(mut s: Bits<W>, i: usize) -> Bits<W> {
    s[i >> 6] |= 1 << (i & 63);
    s
}
#[inline]
fn intersects<const W: usize>(a: &Bits<W>, b: &Bits<W>) -> bool {
    (0..W).any(|k| a[k] & b[k] != 0)
}
#[inline]
fn subset<const W: usize>(a: &Bits<W>, b: &Bits<W>) -> bool {
    (0..W).all(|k| a[k] & !b[k] == 0)
}

struct Input<const W: usize> {
    size: u64,
    persistent: bool,
    users: Bits<W>,
}

struct Hint<const W: usize> {
    out: u32,
    inp: u32,
    size: u64,
    inp_users: Bits<W>,
}

struct OpInfo<const W: usize> {
    preds: Bits<W>,
    /// Bytes of every output (all live at the op's step).
    out_step: u64,
    /// Bytes of outputs that stay live after the step.
    out_live: u64,
    /// Bytes of persistent outputs.
    out_persistent: u64,
    inputs: Vec<Input<W>>,
    hints: Vec<Hint<W>>,
}

struct Node<const W: usize> {
    set: Bits<W>,
    g: u64,
    /// Best lower bound known on the rest of the order from this state.
    h: u64,
    /// `h` is the strong bound (computed when the state is first popped).
    strong: bool,
    live: u64,
    live_persistent: u64,
    parent: u32,
    op: u32,
}

/// A buffer as the strong bound sees it.
struct BufInfo<const W: usize> {
    size: u64,
    producer: Option<usize>,
    persistent: bool,
    users: Bits<W>,
}

struct Search<'a, const W: usize> {
    n: usize,
    ops: Vec<OpInfo<W>>,
    /// Ops by decreasing `footprint`, for the cheap bound.
    by_footprint: Vec<(u64, usize)>,
    /// Buffers with bytes, for the strong bound.
    bufs: Vec<BufInfo<W>>,
    /// Per op: itself and its descendants.
    down: Vec<Bits<W>>,
    /// Per op: itself and its ancestors.
    up: Vec<Bits<W>>,
    /// Per op: bytes live at its step whatever happened before (see
    /// [`Search::strong_h`]).
    fixed: Vec<u64>,
    live0: u64,
    persistent0: u64,
    /// Bytes live at step 0 only (unused, non-persistent step inputs).
    extra0: u64,
    limits: &'a ExactLimits,
}

/// Per buffer: the ops that read it.
fn users_bits<const W: usize>(p: &Problem) -> Vec<Bits<W>> {
    let mut users: Vec<Bits<W>> = vec![[0; W]; p.num_bufs()];
    for b in p.buf_ids() {
        for u in p.users(b) {
            users[b.index()] = with(users[b.index()], u.index());
        }
    }
    users
}

/// The step inputs' bytes before the first op: (live, of which persistent,
/// and those live at step 0 only, unused and not persistent).
fn step_zero(p: &Problem) -> (u64, u64, u64) {
    let (mut live0, mut persistent0, mut extra0) = (0, 0, 0);
    for b in p.buf_ids() {
        let x = p.buf(b);
        if x.producer.is_some() {
            continue;
        }
        if x.persistent {
            persistent0 += x.size;
            live0 += x.size;
        } else if p.num_users(b) > 0 {
            live0 += x.size;
        } else {
            extra0 += x.size;
        }
    }
    (live0, persistent0, extra0)
}

/// What the search needs to know of op `v`.
fn op_info<const W: usize>(p: &Problem, v: OpIdx, users: &[Bits<W>]) -> OpInfo<W> {
    let mut preds = [0; W];
    for u in p.preds(v) {
        preds = with(preds, u.index());
    }
    let (mut out_step, mut out_live, mut out_persistent) = (0, 0, 0);
    for o in p.outputs(v) {
        let x = p.buf(o);
        out_step += x.size;
        if x.persistent {
            out_persistent += x.size;
            out_live += x.size;
        } else if p.num_users(o) > 0 {
            out_live += x.size;
        }
    }
    let inputs = p
        .uses(v)
        .filter(|&b| p.size(b) > 0)
        .map(|b| Input {
            size: p.size(b),
            persistent: p.buf(b).persistent,
            users: users[b.index()],
        })
        .collect();
    let hints: Vec<Hint<W>> = p
        .reuses_of(v)
        .filter(|r| !p.buf(r.inp).persistent && r.out != r.inp && p.size(r.out) <= p.size(r.inp))
        .map(|r| Hint {
            out: r.out.0,
            inp: r.inp.0,
            size: p.size(r.out).min(p.size(r.inp)),
            inp_users: users[r.inp.index()],
        })
        .collect();
    OpInfo {
        preds,
        out_step,
        out_live,
        out_persistent,
        inputs,
        hints,
    }
}

impl<const W: usize> OpInfo<W> {
    /// The most bytes its reuse hints can save.
    fn max_reuse(&self) -> u64 {
        self.hints.iter().map(|h| h.size).sum()
    }
}

/// Ops by the bytes they touch (outputs and transient inputs, less what
/// reuse saves), largest first.
fn by_footprint<const W: usize>(ops: &[OpInfo<W>]) -> Vec<(u64, usize)> {
    let mut v: Vec<(u64, usize)> = ops
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let ins: u64 = o
                .inputs
                .iter()
                .filter(|x| !x.persistent)
                .map(|x| x.size)
                .sum();
            ((o.out_step + ins).saturating_sub(o.max_reuse()), i)
        })
        .collect();
    v.sort_by(|a, b| b.cmp(a));
    v
}

/// Per op: itself with its ancestors, and itself with its descendants.
fn closures<const W: usize>(p: &Problem) -> (Vec<Bits<W>>, Vec<Bits<W>>) {
    let n = p.num_ops();
    let mut up: Vec<Bits<W>> = vec![[0; W]; n];
    let mut down: Vec<Bits<W>> = vec![[0; W]; n];
    for &v in p.topo_order() {
        let mut m = with([0; W], v.index());
        for u in p.preds(v) {
            for k in 0..W {
                m[k] |= up[u.index()][k];
            }
        }
        up[v.index()] = m;
    }
    for &v in p.topo_order().iter().rev() {
        let mut m = with([0; W], v.index());
        for s in p.succs(v) {
            for k in 0..W {
                m[k] |= down[s.index()][k];
            }
        }
        down[v.index()] = m;
    }
    (up, down)
}

impl<'a, const W: usize> Search<'a, W> {
    fn new(p: &Problem, limits: &'a ExactLimits) -> Self {
        let n = p.num_ops();
        let users = users_bits::<W>(p);
        let (live0, persistent0, extra0) = step_zero(p);
        let ops: Vec<OpInfo<W>> = p.ops().map(|v| op_info(p, v, &users)).collect();
        let bufs: Vec<BufInfo<W>> = p
            .buf_ids()
            .filter(|&b| p.size(b) > 0)
            .map(|b| BufInfo {
                size: p.size(b),
                producer: p.buf(b).producer.map(|q| q.index()),
                persistent: p.buf(b).persistent,
                users: users[b.index()],
            })
            .collect();
        let (up, down) = closures::<W>(p);
        let fixed: Vec<u64> = (0..n)
            .map(|v| {
                let sum: u64 = bufs
                    .iter()
                    .filter(|b| {
                        b.producer.is_none_or(|q| has(&up[v], q))
                            && (b.persistent
                                || b.producer == Some(v)
                                || intersects(&b.users, &down[v]))
                    })
                    .map(|b| b.size)
                    .sum();
                sum.saturating_sub(ops[v].max_reuse())
            })
            .collect();
        Search {
            n,
            by_footprint: by_footprint(&ops),
            ops,
            bufs,
            down,
            up,
            fixed,
            live0,
            persistent0,
            extra0,
            limits,
        }
    }

    fn dominance(&self) -> bool {
        self.limits.dominance && self.ops.iter().all(|o| o.hints.len() <= 1)
    }

    /// Bytes at the step of `v` run after `set`.
    fn step_mem(&self, node: &Node<W>, v: usize) -> u64 {
        let o = &self.ops[v];
        let after = with(node.set, v);
        let mut reuse = 0;
        if !o.hints.is_empty() {
            // Greedy in hint order, as the simulator takes them.
            let mut busy: Vec<u32> = Vec::new();
            for h in &o.hints {
                // Inputs and outputs share `busy`: outputs are tagged with
                // the top bit, in the check as in the push, so an output
                // takes at most one input's bytes (as in the simulator).
                let out_tag = h.out | 1 << 31;
                if subset(&h.inp_users, &after)
                    && !busy.contains(&h.inp)
                    && !busy.contains(&out_tag)
                {
                    busy.push(h.inp);
                    busy.push(out_tag);
                    reuse += h.size;
                }
            }
        }
        let extra = if node.set == [0; W] { self.extra0 } else { 0 };
        node.live + o.out_step + extra - reuse
    }

    fn child(&self, node: &Node<W>, v: usize) -> (u64, u64) {
        let o = &self.ops[v];
        let after = with(node.set, v);
        let freed: u64 = o
            .inputs
            .iter()
            .filter(|x| !x.persistent && subset(&x.users, &after))
            .map(|x| x.size)
            .sum();
        (
            node.live + o.out_live - freed,
            node.live_persistent + o.out_persistent,
        )
    }

    fn h(&self, set: &Bits<W>, live_persistent: u64) -> u64 {
        let rest = self
            .by_footprint
            .iter()
            .find(|(_, i)| !has(set, *i))
            .map_or(0, |x| x.0);
        live_persistent + rest
    }

    /// The strong bound: for every op `v` still to run, the bytes that must
    /// be live at its step — buffers born before it (already, or by one of
    /// its ancestors) that are persistent or read by `v` or a descendant,
    /// plus `v`'s outputs, less what its hints could save. `fixed[v]` holds
    /// the part that does not depend on the state (step inputs and buffers
    /// of `v`'s ancestors); buffers already produced by other ops are added
    /// here.
    fn strong_h(&self, set: &Bits<W>) -> u64 {
        let live: Vec<&BufInfo<W>> = self
            .bufs
            .iter()
            .filter(|b| {
                b.producer.is_some_and(|q| has(set, q)) && (b.persistent || !subset(&b.users, set))
            })
            .collect();
        let mut best = 0;
        for v in 0..self.n {
            if has(set, v) || self.fixed[v] + live.iter().map(|b| b.size).sum::<u64>() <= best {
                continue;
            }
            let extra: u64 = live
                .iter()
                .filter(|b| {
                    !has(&self.up[v], b.producer.unwrap_or(0))
                        && (b.persistent || intersects(&b.users, &self.down[v]))
                })
                .map(|b| b.size)
                .sum();
            best = best.max(self.fixed[v] + extra);
        }
        best
    }

    fn run(self, incumbent: u64, budget: &Budget) -> ExactResult {
        let mut full = [0u64; W];
        for i in 0..self.n {
            full = with(full, i);
        }
        let dominance = self.dominance();
        let h0 = self.h(&[0; W], self.persistent0);
        let root = Node {
            set: [0; W],
            g: 0,
            h: h0,
            strong: false,
            live: self.live0,
            live_persistent: self.persistent0,
            parent: u32::MAX,
            op: u32::MAX,
        };
        let mut fr = Frontier::new(root, incumbent);
        while let Some(Reverse((f, id))) = fr.heap.pop() {
            let node = &fr.nodes[id as usize];
            if fr.closed[id as usize] || node.g.max(node.h) != f {
                continue;
            }
            if !node.strong && node.set != full && !self.strengthen(&mut fr, id, f, incumbent) {
                continue;
            }
            let node = &fr.nodes[id as usize];
            if node.set == full {
                let g = node.g;
                return ExactResult {
                    order: Some(fr.order_to(id)),
                    peak: g,
                    lower_bound: g,
                    proven: true,
                    states: fr.nodes.len(),
                };
            }
            if fr.nodes.len() >= self.limits.max_states || budget.expired() {
                fr.heap.push(Reverse((f, id)));
                // The smallest f still open bounds the optimum from below.
                return ExactResult {
                    order: None,
                    peak: incumbent,
                    lower_bound: fr.open_bound(incumbent),
                    proven: false,
                    states: fr.nodes.len(),
                };
            }
            fr.closed[id as usize] = true;
            let g_here = node.g;
            for (v, m, live, lp) in self.children(&fr.nodes[id as usize], f, dominance) {
                let cset = with(fr.nodes[id as usize].set, v);
                let child = Node {
                    set: cset,
                    g: g_here.max(m),
                    h: 0,
                    strong: false,
                    live,
                    live_persistent: lp,
                    parent: id,
                    op: v as u32,
                };
                fr.offer(child, incumbent, |set| self.h(set, lp));
            }
        }
        // Every state below the incumbent was expanded: nothing beats it.
        ExactResult {
            order: None,
            peak: incumbent,
            lower_bound: incumbent,
            proven: incumbent != u64::MAX,
            states: fr.nodes.len(),
        }
    }

    /// Raises state `id`'s `h` to the strong bound when it is first popped
    /// (with `f`). Returns whether to expand it now; otherwise it is closed
    /// (no better than the incumbent) or back in the queue with its new `f`.
    fn strengthen(&self, fr: &mut Frontier<W>, id: u32, f: u64, incumbent: u64) -> bool {
        let hs = self.strong_h(&fr.nodes[id as usize].set);
        let node = &mut fr.nodes[id as usize];
        node.strong = true;
        node.h = node.h.max(hs);
        let f2 = node.g.max(node.h);
        if f2 >= incumbent {
            fr.closed[id as usize] = true;
            return false;
        }
        if f2 > f {
            fr.heap.push(Reverse((f2, id)));
            return false;
        }
        true
    }

    /// The ready ops of `node` as (op, step memory, live, live persistent)
    /// after it. With dominance, a ready op that raises neither the peak
    /// above `f` nor the live bytes is the only child: running it first
    /// loses nothing.
    fn children(&self, node: &Node<W>, f: u64, dominance: bool) -> Vec<(usize, u64, u64, u64)> {
        let mut children = Vec::new();
        for v in
            (0..self.n).filter(|&v| !has(&node.set, v) && subset(&self.ops[v].preds, &node.set))
        {
            let m = self.step_mem(node, v);
            let (live, lp) = self.child(node, v);
            if dominance && m <= f && live <= node.live {
                return vec![(v, m, live, lp)];
            }
            children.push((v, m, live, lp));
        }
        children
    }
}

/// The A* search's states: every state made so far by id, the index of
/// each by its set of ops run, the queue by `f = max(g, h)`, and which are
/// closed.
struct Frontier<const W: usize> {
    nodes: Vec<Node<W>>,
    index: HashMap<Bits<W>, u32>,
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    closed: Vec<bool>,
}

impl<const W: usize> Frontier<W> {
    fn new(root: Node<W>, incumbent: u64) -> Self {
        let f = root.g.max(root.h);
        let mut fr = Frontier {
            index: HashMap::from([(root.set, 0)]),
            nodes: vec![root],
            heap: BinaryHeap::new(),
            closed: vec![false],
        };
        if f < incumbent {
            fr.heap.push(Reverse((f, 0)));
        }
        fr
    }

    /// Adds `child` (its `h` from `h(set)` when its set is new), or lowers
    /// the `g` of the state with its set and reopens it; nothing when its
    /// `f` is not below the incumbent.
    fn offer(&mut self, child: Node<W>, incumbent: u64, h: impl FnOnce(&Bits<W>) -> u64) {
        match self.index.get(&child.set) {
            Some(&cid) => {
                let c = &mut self.nodes[cid as usize];
                let fc = child.g.max(c.h);
                if child.g < c.g && fc < incumbent {
                    c.g = child.g;
                    c.parent = child.parent;
                    c.op = child.op;
                    self.closed[cid as usize] = false;
                    self.heap.push(Reverse((fc, cid)));
                }
            }
            None => {
                let hc = h(&child.set);
                let fc = child.g.max(hc);
                if fc >= incumbent {
                    return;
                }
                let cid = self.nodes.len() as u32;
                self.index.insert(child.set, cid);
                self.nodes.push(Node { h: hc, ..child });
                self.closed.push(false);
                self.heap.push(Reverse((fc, cid)));
            }
        }
    }

    /// The ops run on the way to state `id`, in order.
    fn order_to(&self, id: u32) -> Vec<OpIdx> {
        let mut order = Vec::new();
        let mut cur = id;
        while self.nodes[cur as usize].parent != u32::MAX {
            order.push(OpIdx(self.nodes[cur as usize].op));
            cur = self.nodes[cur as usize].parent;
        }
        order.reverse();
        order
    }

    /// The smallest `f` of a state still open (at most the incumbent).
    fn open_bound(&self, incumbent: u64) -> u64 {
        self.heap
            .iter()
            .filter(|Reverse((f, id))| {
                let node = &self.nodes[*id as usize];
                !self.closed[*id as usize] && node.g.max(node.h) == *f
            })
            .map(|Reverse((f, _))| *f)
            .min()
            .unwrap_or(incumbent)
            .min(incumbent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{brute_force_peak, random_problem};
    use crate::simulate::evaluate;
    use proptest::prelude::*;

    #[test]
    fn proves_the_incumbent_when_nothing_is_better() {
        let p = random_problem(7, 8, 0.3);
        let best = brute_force_peak(&p, 1_000_000).unwrap();
        let r = solve(&p, best, &ExactLimits::default(), &Budget::unlimited());
        assert!(r.proven);
        assert_eq!(r.order, None);
        assert_eq!(r.peak, best);
    }

    /// Regression: two hints of one op share an output; the simulator
    /// takes one, and so must the search's step accounting (it took both,
    /// reporting a peak below the order's real one).
    #[test]
    fn one_output_takes_one_inputs_bytes() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let x = b.add_buf(5, Some(a), false);
        let y = b.add_buf(5, Some(a), false);
        let z = b.add_buf(5, Some(c), false);
        // A scratch output makes c's step the peak.
        b.add_buf(3, Some(c), false);
        b.add_use(c, x);
        b.add_use(c, y);
        b.add_reuse(c, z, x);
        b.add_reuse(c, z, y);
        let p = b.build().unwrap();
        let limits = ExactLimits {
            dominance: false,
            ..ExactLimits::default()
        };
        let r = solve(&p, u64::MAX, &limits, &Budget::unlimited());
        let order = r.order.unwrap();
        // At c: x + y + z + scratch, less one reuse (a's step holds 10).
        assert_eq!(evaluate(&p, &order).peak, 13);
        assert_eq!(r.peak, 13);
        assert_eq!(r.lower_bound, 13);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// The exact search finds the brute-force optimum on random DAGs of
        /// up to 12 ops, with and without the dominance rule.
        #[test]
        fn matches_brute_force(seed in any::<u64>(), n in 1usize..=12, dominance in any::<bool>()) {
            let p = random_problem(seed, n, 0.3);
            let Some(best) = brute_force_peak(&p, 300_000) else { return Ok(()); };
            let limits = ExactLimits { dominance, ..ExactLimits::default() };
            let r = solve(&p, u64::MAX, &limits, &Budget::unlimited());
            prop_assert!(r.proven);
            let order = r.order.unwrap();
            prop_assert!(p.is_valid_order(&order));
            prop_assert_eq!(evaluate(&p, &order).peak, best);
            prop_assert_eq!(r.peak, best);
        }
    }
}
