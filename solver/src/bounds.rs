//! Lower bounds on the peak over every valid order.
//!
//! All three bounds have the form `max over ops v of L(v)`, where `L(v)` is
//! a number of bytes live at the step `v` runs in *every* valid order, under
//! the liveness rules of [`crate::problem`], whichever reuse hints the order
//! takes. Since the peak of an order is at least its live bytes at `v`'s
//! step, `max_v L(v)` is at most the peak of every order.
//!
//! # The bounds
//! - [`op_footprint`]: `v`'s inputs and outputs and the resident buffers.
//!   `O(n + m)`.
//! - [`simple_bound`] (the "simple" bound): every buffer whose producer is
//!   `v` or an ancestor of `v` and which is used by `v` or a descendant of
//!   `v` (or is persistent, or is an output of `v` nobody uses), every step
//!   input used by `v` or a descendant, and the resident buffers. It is at
//!   least [`op_footprint`] at every op. Exact, with bit-parallel
//!   reachability: buffers are taken 256 at a time, sorted by their
//!   producer's position in a topological order; one forward sweep marks
//!   the ops reached from each producer, one backward sweep the ops that
//!   reach a user, both only over the window of positions the 256 buffers
//!   span. `O((n + m) * B / 256)` word operations in the worst case, far
//!   less when lifetimes are short, plus one step per (op, buffer live at
//!   it) pair.
//! - [`min_cut_floor`] (the "floor"): at `v`, the least live bytes over
//!   every set `S` of ops that can run before `v`: `S` holds every
//!   ancestor of `v`, no descendant, and is closed under predecessors. This
//!   is a minimum s-t cut ([`CutSolver::cut_at`]). The maximum over `v` is
//!   found by branch and bound: `L(v)` lies between the simple bound and
//!   the live bytes at `v` in any known order, so ops whose known live bytes
//!   cannot beat the best floor so far need no cut. Afterwards, while the
//!   floor is below the best known order, [`crate::group_bound`] tries
//!   groups of ops with constrained cuts ([`CutSolver::cut_with`]).
//!
//! # Why the floor is a lower bound
//! Fix an order σ and an op `v`; let `S` be the ops before `v` in σ. `S`
//! holds every ancestor of `v` and no descendant, and it is closed under
//! predecessors, so it is one of the sets the cut minimises over. At `v`'s
//! step, a buffer `b` is live in σ exactly when (rules of
//! [`crate::problem`]):
//! - `b` is persistent and has no producer (resident): always;
//! - `b` is persistent with producer `p`: when `p ∈ S ∪ {v}` (live from its
//!   birth to the last step);
//! - `b` is transient with users `U`: when its birth is at or before `v`
//!   (`p ∈ S ∪ {v}`, or no producer: born at step 0) and some user runs at
//!   or after `v` (`U ⊄ S`);
//! - `b` is transient with a producer and no user: when `p = v`;
//! - `b` is transient with no producer and no user: only at step 0. The
//!   floor does not count these at `v` (a smaller number stays a lower
//!   bound); they are counted once, at the first step, in a separate term:
//!   the op at step 0 has no predecessor, so live bytes there are at least
//!   `min over sources v of L(v)` plus these buffers.
//!
//! A reuse hint `(v', out, inp)` taken by σ lowers the live bytes only at
//! `v'`'s step, by at most `min(size(out), size(inp))`, and σ takes at most
//! one hint per output and per input. So at `v`'s step the reuses σ takes
//! remove at most `savings(v)`: the smaller of (sum over distinct outputs
//! of `v`'s takeable hints of their largest weight) and (the same over
//! distinct inputs), where a hint is takeable unless its input is
//! persistent, larger outputs than inputs are involved, or another user of
//! the input is a descendant of `v` (then `v` is never its last user). The
//! live bytes of σ at `v` are therefore at least
//! `cost(S) - savings(v) ≥ mincut(v) - savings(v) = L(v)`.
//!
//! The cut: ancestors of `v` are fixed on the source side (in `S`),
//! descendants on the sink side; the network holds only the ops
//! incomparable with `v`. A dependency `a → b` between two of them becomes
//! an uncuttable arc `b → a` (if `b ∈ S` then `a ∈ S`). A buffer whose
//! liveness depends on free ops pays its size on an arc: producer to sink
//! (`p ∈ S`), source to user (`u ∉ S`), producer to user, or through an
//! auxiliary node with uncuttable arcs to each free user when there are
//! several (`p ∈ S` and some `u ∉ S`). The cost of every cut is exactly the
//! live bytes of its `S`, so the minimum cut is the minimum over `S`.
//! The simple bound counts the buffers the cut's fixed sides already make
//! live, so it is at most the floor at every op.
//!
//! # Where the ideas come from
//! The cut formulation of "bytes that must be live when `v` runs" is the
//! classic bound for memory-optimal scheduling of DAGs (the register
//! sufficiency / pebbling literature); its use as the floor for training
//! graphs and the branch and bound between the simple bound and known
//! orders follow this project's design notes.

use std::time::Instant;

use crate::cut::{CutSolver, reuse_savings};
use crate::group_bound::{GroupFloor, GroupParams, group_floor};
use crate::problem::{OpIdx, Problem};

/// The largest bytes any single op needs live while it runs, plus resident
/// bytes; valid for every order. Outputs that one of the op's reuse hints
/// may place in an input's bytes are not counted.
pub fn op_footprint(p: &Problem) -> u64 {
    let resident = p.resident_bytes();
    let is_resident = |b: crate::problem::BufIdx| {
        let x = p.buf(b);
        x.persistent && x.producer.is_none()
    };
    let mut best = resident;
    let mut may_reuse = vec![false; p.num_bufs()];
    for v in p.ops() {
        for r in p.reuses_of(v) {
            may_reuse[r.out.index()] = true;
        }
        let uses: u64 = p
            .uses(v)
            .filter(|&b| !is_resident(b))
            .map(|b| p.size(b))
            .sum();
        let outs: u64 = p
            .outputs(v)
            .filter(|&b| !may_reuse[b.index()])
            .map(|b| p.size(b))
            .sum();
        best = best.max(resident + uses + outs);
        for r in p.reuses_of(v) {
            may_reuse[r.out.index()] = false;
        }
    }
    best
}

/// The simple bound at every op; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimpleBound {
    /// The bound: `max(per_op)`, or the first-step term when larger.
    pub bytes: u64,
    /// Bytes live at each op's step in every order (indexed by op).
    pub per_op: Vec<u64>,
    /// The op where `per_op` is largest (`None` without ops).
    pub at: Option<OpIdx>,
}

/// Words per bit lane: buffers handled together in one sweep.
const LANE_WORDS: usize = 4;
const LANE_BITS: usize = 64 * LANE_WORDS;
type Lane = [u64; LANE_WORDS];

/// Buffers whose liveness at `v` needs reachability, for the sweeps.
struct Span {
    size: u64,
    /// Topological position of the producer (0 for a step input).
    lo: u32,
    /// Last position it may be live at: its last user's, or the end.
    hi: u32,
    /// The producer's position, if it has one.
    prod: Option<u32>,
    /// Persistent: live to the end once born.
    persistent: bool,
    buf: u32,
}

/// Bytes of transient step inputs nobody uses: live at step 0 only.
fn unused_step_inputs(p: &Problem) -> u64 {
    p.buf_ids()
        .filter(|&b| {
            let x = p.buf(b);
            x.producer.is_none() && !x.persistent && p.num_users(b) == 0
        })
        .map(|b| p.size(b))
        .sum()
}

/// The simple bound, exact; see the module docs for what it counts.
pub fn simple_bound(p: &Problem) -> SimpleBound {
    let n = p.num_ops();
    let resident = p.resident_bytes();
    let unused = unused_step_inputs(p);
    if n == 0 {
        return SimpleBound {
            bytes: resident + unused,
            per_op: Vec::new(),
            at: None,
        };
    }
    let topo = p.topo_order();
    let mut rank = vec![0u32; n];
    for (i, &o) in topo.iter().enumerate() {
        rank[o.index()] = i as u32;
    }
    // Bytes at each topological position.
    let mut at_rank = vec![0u64; n];
    let spans = spans(p, &rank, &mut at_rank);
    let mut lanes = Lanes::default();
    for chunk in spans.chunks(LANE_BITS) {
        lanes.add_chunk(p, topo, &rank, chunk, &mut at_rank);
    }
    let mut per_op = vec![0u64; n];
    for v in p.ops() {
        // Only direct successors are surely later without reachability.
        let succs: Vec<OpIdx> = p.succs(v).collect();
        let save = reuse_savings(p, v, |u| succs.contains(&u));
        per_op[v.index()] = (at_rank[rank[v.index()] as usize] + resident).saturating_sub(save);
    }
    let (at, mut bytes) = per_op
        .iter()
        .enumerate()
        .max_by_key(|&(i, &b)| (b, std::cmp::Reverse(i)))
        .map(|(i, &b)| (Some(OpIdx(i as u32)), b))
        .unwrap_or((None, 0));
    if unused > 0 {
        bytes = bytes.max(first_step_term(p, &per_op, unused));
    }
    SimpleBound { bytes, per_op, at }
}

/// The buffers whose liveness depends on the order, as spans of
/// topological positions (sorted); buffers live at their producer's step
/// only are added to `at_rank` directly.
fn spans(p: &Problem, rank: &[u32], at_rank: &mut [u64]) -> Vec<Span> {
    let n = p.num_ops();
    let mut spans: Vec<Span> = Vec::new();
    for b in p.buf_ids() {
        let x = p.buf(b);
        let size = x.size;
        if size == 0 {
            continue;
        }
        let last_user = p.users(b).map(|u| rank[u.index()]).max();
        let prod = x.producer.map(|o| rank[o.index()]);
        match (prod, x.persistent, last_user) {
            (None, true, _) | (None, false, None) => {} // resident / first-step term
            (Some(r), false, None) => at_rank[r as usize] += size,
            (prod, persistent, last) => spans.push(Span {
                size,
                lo: prod.unwrap_or(0),
                hi: if persistent {
                    n as u32 - 1
                } else {
                    last.unwrap_or(0)
                },
                prod,
                persistent,
                buf: b.0,
            }),
        }
    }
    spans.sort_unstable_by_key(|s| (s.lo, s.hi));
    spans
}

/// Per-position bit lanes of up to [`LANE_BITS`] spans, reused across
/// chunks.
#[derive(Default)]
struct Lanes {
    fwd: Vec<Lane>,
    bwd: Vec<Lane>,
}

impl Lanes {
    /// Adds to `at_rank` the bytes of the spans of `chunk` that are surely
    /// live at each position: reachable from their producer (or born
    /// before the step) and reaching a user (or persistent).
    fn add_chunk(
        &mut self,
        p: &Problem,
        topo: &[OpIdx],
        rank: &[u32],
        chunk: &[Span],
        at_rank: &mut [u64],
    ) {
        let lo = chunk.iter().map(|s| s.lo).min().unwrap_or(0) as usize;
        let hi = chunk.iter().map(|s| s.hi).max().unwrap_or(0) as usize;
        let len = hi - lo + 1;
        let (fwd, bwd) = (&mut self.fwd, &mut self.bwd);
        fwd.clear();
        fwd.resize(len, [0; LANE_WORDS]);
        bwd.clear();
        bwd.resize(len, [0; LANE_WORDS]);
        // Bits that hold everywhere: born before the step (step inputs),
        // alive to the end (persistent).
        let mut fwd_all: Lane = [0; LANE_WORDS];
        let mut bwd_all: Lane = [0; LANE_WORDS];
        for (j, s) in chunk.iter().enumerate() {
            let (w, bit) = (j / 64, 1u64 << (j % 64));
            match s.prod {
                Some(r) => fwd[r as usize - lo][w] |= bit,
                None => fwd_all[w] |= bit,
            }
            if s.persistent {
                bwd_all[w] |= bit;
            } else {
                for u in p.users(crate::problem::BufIdx(s.buf)) {
                    bwd[rank[u.index()] as usize - lo][w] |= bit;
                }
            }
        }
        // Forward: a bit reaches every op reachable from its producer.
        // Paths from a producer at position ≥ lo to an op at position ≤ hi
        // stay inside the window.
        for r in lo..=hi {
            let v = topo[r];
            let mut acc = fwd[r - lo];
            for q in p.preds(v) {
                let rq = rank[q.index()] as usize;
                if rq >= lo {
                    let f = &fwd[rq - lo];
                    for w in 0..LANE_WORDS {
                        acc[w] |= f[w];
                    }
                }
            }
            fwd[r - lo] = acc;
        }
        // Backward: a bit reaches every op from which a user is reachable.
        for r in (lo..=hi).rev() {
            let v = topo[r];
            let mut acc = bwd[r - lo];
            for s in p.succs(v) {
                let rs = rank[s.index()] as usize;
                if rs <= hi {
                    let g = &bwd[rs - lo];
                    for w in 0..LANE_WORDS {
                        acc[w] |= g[w];
                    }
                }
            }
            bwd[r - lo] = acc;
        }
        for r in lo..=hi {
            let mut sum = 0u64;
            for w in 0..LANE_WORDS {
                let mut m = (fwd[r - lo][w] | fwd_all[w]) & (bwd[r - lo][w] | bwd_all[w]);
                while m != 0 {
                    let j = w * 64 + m.trailing_zeros() as usize;
                    sum += chunk[j].size;
                    m &= m - 1;
                }
            }
            at_rank[r] += sum;
        }
    }
}

/// Live bytes at step 0 in any order: the op there is a source, so at
/// least the smallest per-op bound among sources, plus the transient step
/// inputs nobody uses (live only at step 0).
fn first_step_term(p: &Problem, per_op: &[u64], unused: u64) -> u64 {
    p.ops()
        .filter(|&v| p.num_preds(v) == 0)
        .map(|v| per_op[v.index()])
        .min()
        .unwrap_or(0)
        + unused
}

/// Switches of the floor's search; every technique on by default.
#[derive(Clone, Debug)]
pub struct FloorParams {
    /// Skip ops whose live bytes in a known order cannot beat the best
    /// floor so far (branch and bound); off: solve a cut at every op.
    pub prune_by_orders: bool,
    /// Solve ops in decreasing order of their known live bytes, so the best
    /// floor rises early and prunes more.
    pub best_first: bool,
    /// Add the list scheduler's order to the known orders.
    pub list_schedule_order: bool,
    /// After the per-op cuts, search groups of ops for a stronger bound
    /// ([`crate::group_bound`]) while the floor is below the best known
    /// order; `None`: per-op cuts only.
    pub groups: Option<GroupParams>,
}

impl Default for FloorParams {
    fn default() -> Self {
        FloorParams {
            prune_by_orders: true,
            best_first: true,
            list_schedule_order: true,
            groups: Some(GroupParams::default()),
        }
    }
}

/// The min-cut floor, or as much of it as the deadline allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Floor {
    /// A lower bound on the peak of every order: the largest cut solved,
    /// the simple bound, and the first-step term. When `finished`, it is
    /// the min-cut floor itself.
    pub bytes: u64,
    /// Whether every op was solved or pruned before the deadline.
    pub finished: bool,
    /// The op whose cut gave `bytes` (`None` when no cut beat the simple
    /// bound).
    pub at: Option<OpIdx>,
    /// The simple bound ([`simple_bound`]).
    pub simple: u64,
    /// The smallest peak among the known orders: the optimum lies in
    /// `[bytes, upper]`.
    pub upper: u64,
    /// Cuts solved.
    pub cuts: usize,
    /// Ops skipped because a known order showed their cut cannot matter.
    pub pruned: usize,
    /// The group search's result (its `bytes` is at most `bytes`); the
    /// default when it did not run.
    pub groups: GroupFloor,
}

/// The min-cut floor: `max over v` of [`CutSolver::cut_at`], by branch and
/// bound. `orders` are valid orders whose live bytes bound each op's cut
/// from above (the solver's candidates; invalid ones are ignored); the
/// problem's own topological order is always used. Stops at `deadline`
/// with `finished: false` and the best bound found so far.
pub fn min_cut_floor(
    p: &Problem,
    orders: &[&[OpIdx]],
    deadline: Option<Instant>,
    params: &FloorParams,
) -> Floor {
    let n = p.num_ops();
    let simple = simple_bound(p);
    // Upper bound of every op's cut: its live bytes in each known order.
    let mut ub = vec![u64::MAX; n];
    let mut upper = u64::MAX;
    let mut known: Vec<Vec<OpIdx>> = vec![p.topo_order().to_vec()];
    if params.list_schedule_order {
        known.push(crate::list_schedule::list_schedule(p));
    }
    known.extend(
        orders
            .iter()
            .filter(|o| p.is_valid_order(o))
            .map(|o| o.to_vec()),
    );
    for order in &known {
        let ev = crate::simulate::evaluate(p, order);
        upper = upper.min(ev.peak);
        for v in p.ops() {
            let live = ev.curve[ev.pos[v.index()] as usize];
            ub[v.index()] = ub[v.index()].min(live);
        }
    }
    let mut best = simple.bytes;
    let mut at = None;
    let mut todo: Vec<OpIdx> = p.ops().collect();
    if params.best_first {
        todo.sort_by_key(|v| std::cmp::Reverse(ub[v.index()]));
    }
    let mut solver = CutSolver::new(p);
    let mut per_op_cut = simple.per_op.clone();
    let mut solved = vec![false; n];
    let (mut cuts, mut pruned) = (0, 0);
    let mut finished = true;
    for (i, &v) in todo.iter().enumerate() {
        if params.prune_by_orders && ub[v.index()] <= best {
            if params.best_first {
                // Every later op's upper bound is no larger.
                pruned += todo.len() - i;
                break;
            }
            pruned += 1;
            continue;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            finished = false;
            break;
        }
        let c = solver.cut_at(v).bytes;
        cuts += 1;
        debug_assert!(
            c >= simple.per_op[v.index()],
            "cut below the simple bound at {v}"
        );
        debug_assert!(
            c <= ub[v.index()],
            "cut above a valid order's live bytes at {v}"
        );
        per_op_cut[v.index()] = c;
        solved[v.index()] = true;
        if c > best {
            best = c;
            at = Some(v);
        }
    }
    // Step 0 holds a source op and the unused step inputs. The term needs
    // the cut at every source, pruned ones included (their simple bound
    // would give a smaller, still valid, term), unless even the known
    // orders' live bytes there cannot beat the best floor.
    let unused = unused_step_inputs(p);
    if unused > 0 && n > 0 {
        let sources: Vec<OpIdx> = p.ops().filter(|&v| p.num_preds(v) == 0).collect();
        let reach = sources
            .iter()
            .map(|v| ub[v.index()])
            .min()
            .unwrap_or(0)
            .saturating_add(unused);
        if !params.prune_by_orders || reach > best {
            for &v in &sources {
                if solved[v.index()] {
                    continue;
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    finished = false;
                    break;
                }
                per_op_cut[v.index()] = solver.cut_at(v).bytes;
                solved[v.index()] = true;
                cuts += 1;
            }
        }
        best = best.max(first_step_term(p, &per_op_cut, unused));
    }
    let mut groups = GroupFloor::default();
    if let Some(gp) = &params.groups
        && n > 1
        && best < upper
        && deadline.is_none_or(|d| Instant::now() < d)
    {
        groups = group_floor(p, best, upper, gp, deadline);
        best = best.max(groups.bytes);
    }
    Floor {
        bytes: best,
        finished,
        at,
        simple: simple.bytes,
        upper: if n == 0 { best } else { upper },
        cuts,
        pruned,
        groups,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group_bound::{End, GroupParams, group_floor};
    use crate::problem::{OpClass, ProblemBuilder};
    use crate::simulate::evaluate;
    use crate::testing::{Spec, all_orders, best_peak, build, spec};
    use proptest::prelude::*;

    /// The group floor (`crate::group_bound`) on the MLP case of its
    /// module docs in miniature: three layers, each
    /// with a saved activation `a` (4) that its weight-gradient op `w`
    /// turns into a gradient `g` (16) consumed by an update `u`; the
    /// backward runs top-down through `d`. At each `w` alone the floor
    /// runs the other layers' gradient work first (20 = its own activation
    /// and gradient), but whichever `w` runs first meets the other two
    /// activations: 28 in every order.
    #[test]
    fn first_weight_gradient_meets_every_other_activation() {
        let mut b = ProblemBuilder::new();
        let loss = b.add_op(OpClass::Forward);
        let mut prev = loss;
        let mut ws = Vec::new();
        for _ in 0..3 {
            let w = b.add_op(OpClass::Backward);
            let u = b.add_op(OpClass::Optimizer);
            let d = b.add_op(OpClass::Backward);
            let a = b.add_buf(4, Some(loss), false);
            b.add_use(w, a);
            let g = b.add_buf(16, Some(w), false);
            b.add_use(u, g);
            b.add_edge(prev, d);
            b.add_edge(d, w);
            prev = d;
            ws.push(w);
        }
        let p = b.build().unwrap();
        let per_op = min_cut_floor(
            &p,
            &[],
            None,
            &FloorParams {
                groups: None,
                ..Default::default()
            },
        );
        assert_eq!(per_op.bytes, 20);
        let best = best_peak(&p);
        assert_eq!(best, 28);
        let g = group_floor(&p, per_op.bytes, best, &GroupParams::default(), None);
        assert_eq!(g.bytes, 28);
        assert_eq!(g.end, Some(End::First));
        assert_eq!(g.group, ws);
        assert!(g.finished);
    }

    #[test]
    fn counts_inputs_outputs_and_residents() {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let w = b.add_buf(5, None, true);
        let x = b.add_buf(10, Some(a), false);
        let y = b.add_buf(7, Some(c), false);
        b.add_use(a, w);
        b.add_use(c, x);
        let _ = y;
        let p = b.build().unwrap();
        assert_eq!(op_footprint(&p), 5 + 10 + 7);
        assert_eq!(simple_bound(&p).bytes, 5 + 10 + 7);
        assert_eq!(
            min_cut_floor(&p, &[], None, &FloorParams::default()).bytes,
            22
        );
    }

    /// Two branches, each a big buffer reduced to a small one, joined at
    /// the end. Running one branch after the other peaks at 102 (the second
    /// branch's big buffer with both small ones). The simple bound sees only
    /// one op's own buffers (101); so does the per-op floor: at the second
    /// branch's reduce, the set before it may hold none of the first
    /// branch. The group floor closes the gap: of the two reduces, one runs
    /// last, when the other branch's small buffer is live.
    #[test]
    fn two_branches() {
        let mut b = ProblemBuilder::new();
        let a: Vec<_> = (0..2).map(|_| b.add_op(OpClass::Forward)).collect();
        let m: Vec<_> = (0..2).map(|_| b.add_op(OpClass::Forward)).collect();
        let end = b.add_op(OpClass::Forward);
        for i in 0..2 {
            let big = b.add_buf(100, Some(a[i]), false);
            b.add_use(m[i], big);
            let small = b.add_buf(1, Some(m[i]), false);
            b.add_use(end, small);
        }
        let p = b.build().unwrap();
        assert_eq!(simple_bound(&p).bytes, 101);
        let per_op = FloorParams {
            groups: None,
            ..Default::default()
        };
        let f = min_cut_floor(&p, &[], None, &per_op);
        assert_eq!(f.bytes, 101);
        assert_eq!(f.upper, 102);
        assert!(f.finished);
        let g = min_cut_floor(&p, &[], None, &FloorParams::default());
        assert_eq!(g.bytes, 102);
        assert!(g.groups.finished);
    }

    /// A step where the floor sees what the simple bound cannot. Main
    /// line: src -> f -> y (100) -> h -> y2 (1) -> g. Side line: src -> x
    /// (30) -> s -> t (40) -> g. The side op s is incomparable with f and
    /// h: before them it leaves t (40) live, after them x (30) stays live.
    /// The simple bound at h sees only y and y2 (101); the cut at h finds
    /// 131, which the order src f h s g reaches.
    #[test]
    fn floor_beats_simple_bound() {
        let mut b = ProblemBuilder::new();
        let src = b.add_op(OpClass::Forward);
        let f = b.add_op(OpClass::Forward);
        let h = b.add_op(OpClass::Forward);
        let s = b.add_op(OpClass::Forward);
        let g = b.add_op(OpClass::Forward);
        let x = b.add_buf(30, Some(src), false);
        let y = b.add_buf(100, Some(f), false);
        let y2 = b.add_buf(1, Some(h), false);
        let t = b.add_buf(40, Some(s), false);
        let z = b.add_buf(1, Some(g), false);
        let _ = z;
        b.add_edge(src, f);
        b.add_use(s, x);
        b.add_use(h, y);
        b.add_use(g, y2);
        b.add_use(g, t);
        let p = b.build().unwrap();
        let simple = simple_bound(&p);
        assert_eq!(simple.bytes, 101);
        assert_eq!(simple.per_op[h.index()], 101);
        let mut cs = CutSolver::new(&p);
        assert_eq!(cs.cut_at(f).bytes, 130);
        assert_eq!(cs.cut_at(h).bytes, 131);
        let fl = min_cut_floor(&p, &[], None, &FloorParams::default());
        assert_eq!((fl.bytes, fl.at), (131, Some(h)));
        assert_eq!(best_peak(&p), 131);
    }

    /// The definition of the cut at `v`, by enumerating every set of ops
    /// that can run before it (no reuse savings).
    fn brute_cut(p: &Problem, v: OpIdx) -> u64 {
        brute_cut_with(p, v, &[], &[]).unwrap()
    }

    /// The definition of [`CutSolver::cut_with`]: the sets that can run
    /// before `v` holding `before` and none of `after` (`None`: no such
    /// set).
    fn brute_cut_with(p: &Problem, v: OpIdx, before: &[OpIdx], after: &[OpIdx]) -> Option<u64> {
        let n = p.num_ops();
        let mut best = u64::MAX;
        for mask in 0u32..(1 << n) {
            let in_s = |o: OpIdx| mask >> o.index() & 1 == 1;
            if in_s(v)
                || !before.iter().all(|&o| in_s(o))
                || after.iter().any(|&o| in_s(o) || o == v)
            {
                continue;
            }
            // Closed under predecessors, and v's predecessors inside.
            let closed = p
                .ops()
                .all(|o| !(in_s(o) || o == v) || p.preds(o).all(&in_s));
            // No descendant of v inside: a set closed under predecessors
            // holding a descendant would hold v.
            if !closed {
                continue;
            }
            let before_or_v = |o: OpIdx| in_s(o) || o == v;
            let mut live = 0u64;
            for b in p.buf_ids() {
                let x = p.buf(b);
                let born = x.producer.is_none_or(before_or_v);
                let counted = if !born {
                    false
                } else if x.persistent {
                    true
                } else if p.num_users(b) == 0 {
                    x.producer == Some(v)
                } else {
                    p.users(b).any(|u| !in_s(u))
                };
                if counted {
                    live += x.size;
                }
            }
            best = best.min(live);
        }
        (best != u64::MAX).then_some(best)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// op footprint ≤ simple ≤ floor ≤ the best order's peak, and at every
        /// op each per-op bound is at most the live bytes there in every
        /// order.
        #[test]
        fn bounds_are_valid(s in spec(7)) {
            let p = build(&s);
            let orders = all_orders(&p);
            let evals: Vec<_> = orders.iter().map(|o| evaluate(&p, o)).collect();
            let best = evals.iter().map(|e| e.peak).min().unwrap_or(0);
            let simple = simple_bound(&p);
            let fl = min_cut_floor(&p, &[], None, &FloorParams { groups: None, ..Default::default() });
            let all = min_cut_floor(&p, &[], None, &FloorParams {
                prune_by_orders: false, best_first: false, list_schedule_order: false,
                groups: None,
            });
            let with_groups = min_cut_floor(&p, &[], None, &FloorParams::default());
            prop_assert!(op_footprint(&p) <= simple.bytes);
            prop_assert!(simple.bytes <= fl.bytes);
            prop_assert!(fl.bytes <= best, "floor {} > best order {}", fl.bytes, best);
            prop_assert_eq!(fl.bytes, all.bytes, "pruning changed the floor");
            prop_assert!(fl.bytes <= with_groups.bytes);
            prop_assert!(with_groups.bytes <= best, "group floor {} > best order {}", with_groups.bytes, best);
            prop_assert!(fl.finished);
            prop_assert!(fl.upper >= best);
            let mut cs = CutSolver::new(&p);
            for v in p.ops() {
                let least = evals.iter().map(|e| e.curve[e.pos[v.index()] as usize]).min().unwrap();
                let c = cs.cut_at(v).bytes;
                prop_assert!(simple.per_op[v.index()] <= c);
                prop_assert!(c <= least, "cut at {} is {} > {}", v, c, least);
            }
        }

        /// Without reuse hints, the cut at every op is exactly the minimum
        /// over the sets that can run before it.
        #[test]
        fn cut_matches_its_definition(mut s in spec(8)) {
            s.hints.clear();
            let p = build(&s);
            let mut cs = CutSolver::new(&p);
            for v in p.ops() {
                prop_assert_eq!(cs.cut_at(v).bytes, brute_cut(&p, v), "at {}", v);
            }
        }

        /// With ops forced before and after `v`, the cut is the minimum over
        /// the sets that honour both, and `None` exactly when there is none.
        #[test]
        fn cut_with_matches_its_definition(mut s in spec(8), pick in proptest::collection::vec(0u8..3, 8)) {
            s.hints.clear();
            let p = build(&s);
            let mut cs = CutSolver::new(&p);
            for v in p.ops() {
                let (mut before, mut after) = (Vec::new(), Vec::new());
                for o in p.ops().filter(|&o| o != v) {
                    match pick[o.index()] {
                        1 => before.push(o),
                        2 => after.push(o),
                        _ => {}
                    }
                }
                let got = cs.cut_with(v, &before, &after).map(|c| c.bytes);
                prop_assert_eq!(got, brute_cut_with(&p, v, &before, &after), "at {}", v);
            }
        }

        /// When the ops form a chain there is one order, and the floor is its
        /// peak exactly (reuse included).
        #[test]
        fn floor_is_exact_on_chains(mut s in spec(9)) {
            s.chain = true;
            let p = build(&s);
            let order = p.topo_order().to_vec();
            let peak = evaluate(&p, &order).peak;
            let fl = min_cut_floor(&p, &[], None, &FloorParams::default());
            prop_assert_eq!(fl.bytes, peak);
        }
    }

    /// A deadline in the past stops before any cut and says so.
    #[test]
    fn deadline_stops_the_search() {
        let s = Spec {
            n: 4,
            edges: vec![(0, 1), (1, 2), (0, 3)],
            bufs: vec![
                (Some(0), false, 10, vec![1, 3]),
                (Some(1), false, 20, vec![2]),
                (Some(3), false, 5, vec![2]),
            ],
            hints: vec![],
            chain: false,
        };
        let p = build(&s);
        let past = Instant::now();
        let fl = min_cut_floor(
            &p,
            &[],
            Some(past),
            &FloorParams {
                prune_by_orders: false,
                ..Default::default()
            },
        );
        assert!(!fl.finished);
        assert_eq!(fl.cuts, 0);
        assert_eq!(fl.bytes, simple_bound(&p).bytes);
    }
}
