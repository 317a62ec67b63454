//! Greedy orders with several priority rules, built forward (from the
//! first step) or in reverse (from the last step).
//!
//! Forward: the ready ops are those whose predecessors have all run. The
//! live bytes between steps are known; running `v` next costs
//! `step(v) = live + outputs(v) - reuse(v)` at its step, allocates the
//! outputs that outlive the step and frees the inputs it is the last user
//! of.
//!
//! Reverse: the order is built from the end; the "ready" ops are those whose
//! successors are all placed. Going backwards, an op's outputs stop being
//! live before it (they are "freed") and its inputs that no later op reads
//! start being live (they are "allocated"). A schedule built this way is
//! scored with exactly the same liveness rules; the two directions simply
//! see different greedy choices (XLA's CPU order, for instance, computes
//! backward-only values early; a reverse greedy never does).
//!
//! Rules ([`Rule`]):
//! - `NetFree`: most bytes freed minus allocated, then most freed (XLA's
//!   list scheduler);
//! - `Fit`: among ops whose step stays under the peak so far, the one with
//!   the best net effect; if none fits, the one with the smallest step
//!   (LESCEA);
//! - `SmallStep`: the smallest step, then the best net effect.
//!
//! Ties go to the smallest op index, so every order is deterministic.
//! `O(n · r + m)` for `r` the largest ready set: the ready set is scanned at
//! each step, which keeps the rules simple and exact.

use crate::budget::Budget;
use crate::problem::{OpIdx, Problem};

/// A priority rule for the greedy orders.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Rule {
    NetFree,
    Fit,
    SmallStep,
}

impl Rule {
    pub const ALL: [Rule; 3] = [Rule::NetFree, Rule::Fit, Rule::SmallStep];
    pub fn name(self) -> &'static str {
        match self {
            Rule::NetFree => "net-free",
            Rule::Fit => "fit",
            Rule::SmallStep => "small-step",
        }
    }
}

/// Which way the order is built.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Forward,
    Reverse,
}

/// Picks the best candidate by `rule`. Each candidate is
/// `(op, step, freed, allocated)`.
fn pick(rule: Rule, peak: u64, cands: &[(u32, u64, u64, u64)]) -> usize {
    let net = |c: &(u32, u64, u64, u64)| c.2 as i128 - c.3 as i128;
    let mut best = 0;
    for i in 1..cands.len() {
        let (a, b) = (&cands[i], &cands[best]);
        let better = match rule {
            Rule::NetFree => (net(a), a.2, std::cmp::Reverse(a.0))
                .cmp(&(net(b), b.2, std::cmp::Reverse(b.0)))
                .is_gt(),
            Rule::Fit => {
                let (fa, fb) = (a.1 <= peak, b.1 <= peak);
                if fa != fb {
                    fa
                } else if fa {
                    (net(a), std::cmp::Reverse(a.0))
                        .cmp(&(net(b), std::cmp::Reverse(b.0)))
                        .is_gt()
                } else {
                    (a.1, std::cmp::Reverse(net(a)), a.0) < (b.1, std::cmp::Reverse(net(b)), b.0)
                }
            }
            Rule::SmallStep => {
                (a.1, std::cmp::Reverse(net(a)), a.0) < (b.1, std::cmp::Reverse(net(b)), b.0)
            }
        };
        if better {
            best = i;
        }
    }
    best
}

/// A greedy order of `p` built in direction `dir` with `rule`.
pub fn greedy(p: &Problem, rule: Rule, dir: Direction) -> Vec<OpIdx> {
    greedy_within(p, rule, dir, &Budget::unlimited()).expect("no deadline")
}

/// [`greedy`], given up (`None`) once `budget` expires: on a part of tens
/// of thousands of ops with a wide ready set one order takes seconds.
pub fn greedy_within(
    p: &Problem,
    rule: Rule,
    dir: Direction,
    budget: &Budget,
) -> Option<Vec<OpIdx>> {
    match dir {
        Direction::Forward => forward(p, rule, budget),
        Direction::Reverse => reverse(p, rule, budget),
    }
}

/// Steps between looks at the budget's clock.
const CLOCK_EVERY: usize = 64;

/// Adds `v` to `ready`, kept sorted by index (so ties scan stably).
fn push_sorted(ready: &mut Vec<OpIdx>, v: OpIdx) {
    let at = ready.partition_point(|&x| x < v);
    ready.insert(at, v);
}

fn forward(p: &Problem, rule: Rule, budget: &Budget) -> Option<Vec<OpIdx>> {
    let n = p.num_ops();
    let mut remaining: Vec<u32> = p.buf_ids().map(|b| p.num_users(b) as u32).collect();
    let mut indeg: Vec<u32> = p.ops().map(|v| p.num_preds(v) as u32).collect();
    let mut ready: Vec<OpIdx> = p.ops().filter(|v| indeg[v.index()] == 0).collect();
    let mut live: u64 = p
        .buf_ids()
        .filter(|&b| {
            let x = p.buf(b);
            x.producer.is_none() && (x.persistent || p.num_users(b) > 0)
        })
        .map(|b| p.size(b))
        .sum();
    let mut peak = live;
    let mut order = Vec::with_capacity(n);
    let mut cands = Vec::new();
    while !ready.is_empty() {
        if order.len() % CLOCK_EVERY == CLOCK_EVERY - 1 && budget.expired() {
            return None;
        }
        cands.clear();
        for &v in &ready {
            let mut freed = 0;
            for b in p.uses(v) {
                if remaining[b.index()] == 1 && !p.buf(b).persistent {
                    freed += p.size(b);
                }
            }
            let mut out_step = 0;
            let mut alloc = 0;
            for b in p.outputs(v) {
                out_step += p.size(b);
                if p.buf(b).persistent || p.num_users(b) > 0 {
                    alloc += p.size(b);
                }
            }
            let reuse = reuse_now(p, v, |b| remaining[b.index()] == 1);
            cands.push((v.0, live + out_step - reuse, freed + reuse, alloc));
        }
        let k = pick(rule, peak, &cands);
        let (op, step, _, _) = cands[k];
        let v = OpIdx(op);
        // `ready` stays sorted by index (ties scan stably): remove and
        // insert in place rather than sort it at every step.
        ready.remove(ready.binary_search(&v).expect("picked a ready op"));
        peak = peak.max(step);
        order.push(v);
        for b in p.uses(v) {
            remaining[b.index()] -= 1;
            if remaining[b.index()] == 0 && !p.buf(b).persistent {
                live -= p.size(b);
            }
        }
        for b in p.outputs(v) {
            if p.buf(b).persistent || p.num_users(b) > 0 {
                live += p.size(b);
            }
        }
        for s in p.succs(v) {
            indeg[s.index()] -= 1;
            if indeg[s.index()] == 0 {
                push_sorted(&mut ready, s);
            }
        }
    }
    Some(order)
}

/// Bytes the reuse hints of `v` save at its step, taken greedily as the
/// simulator does; `last(b)`: `v` is `b`'s last user.
fn reuse_now(p: &Problem, v: OpIdx, last: impl Fn(crate::BufIdx) -> bool) -> u64 {
    let mut saved = 0;
    let mut busy: Vec<crate::BufIdx> = Vec::new();
    for r in p.reuses_of(v) {
        if !p.buf(r.inp).persistent
            && r.out != r.inp
            && p.size(r.out) <= p.size(r.inp)
            && last(r.inp)
            && !busy.contains(&r.inp)
            && !busy.contains(&r.out)
        {
            busy.push(r.inp);
            busy.push(r.out);
            saved += p.size(r.out);
        }
    }
    saved
}

fn reverse(p: &Problem, rule: Rule, budget: &Budget) -> Option<Vec<OpIdx>> {
    let n = p.num_ops();
    // placed_users[b]: users of b already placed (they run after the front).
    let mut placed_users: Vec<u32> = vec![0; p.num_bufs()];
    let mut outdeg: Vec<u32> = p.ops().map(|v| p.num_succs(v) as u32).collect();
    let mut ready: Vec<OpIdx> = p.ops().filter(|v| outdeg[v.index()] == 0).collect();
    // Open buffers: live across the gap just before the placed suffix.
    let open = |b: crate::BufIdx, placed_users: &[u32]| -> bool {
        p.buf(b).persistent || placed_users[b.index()] > 0
    };
    let mut live: u64 = p
        .buf_ids()
        .filter(|&b| p.buf(b).persistent)
        .map(|b| p.size(b))
        .sum();
    let mut peak = live;
    let mut order = Vec::with_capacity(n);
    let mut cands = Vec::new();
    while !ready.is_empty() {
        if order.len() % CLOCK_EVERY == CLOCK_EVERY - 1 && budget.expired() {
            return None;
        }
        cands.clear();
        for &v in &ready {
            // Inputs nobody after v reads start being live here.
            let mut newly = 0;
            for b in p.uses(v) {
                if !open(b, &placed_users) {
                    newly += p.size(b);
                }
            }
            let mut closing = 0;
            let mut dead_out = 0;
            for b in p.outputs(v) {
                if open(b, &placed_users) {
                    closing += p.size(b);
                } else {
                    dead_out += p.size(b);
                }
            }
            let reuse = reuse_now(p, v, |b| placed_users[b.index()] == 0);
            let step = live + newly + dead_out - reuse;
            cands.push((v.0, step, closing, newly));
        }
        let k = pick(rule, peak, &cands);
        let (op, step, closing, newly) = cands[k];
        let v = OpIdx(op);
        // `ready` stays sorted by index (ties scan stably): remove and
        // insert in place rather than sort it at every step.
        ready.remove(ready.binary_search(&v).expect("picked a ready op"));
        peak = peak.max(step);
        order.push(v);
        live = live + newly - closing;
        for b in p.uses(v) {
            placed_users[b.index()] += 1;
        }
        for u in p.preds(v) {
            outdeg[u.index()] -= 1;
            if outdeg[u.index()] == 0 {
                push_sorted(&mut ready, u);
            }
        }
    }
    order.reverse();
    Some(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::random_problem;
    use crate::simulate::evaluate;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_rule_and_direction_gives_a_valid_order(seed in any::<u64>(), n in 0usize..40) {
            let p = random_problem(seed, n, 0.2);
            for rule in Rule::ALL {
                for dir in [Direction::Forward, Direction::Reverse] {
                    let o = greedy(&p, rule, dir);
                    prop_assert!(p.is_valid_order(&o), "{rule:?} {dir:?}");
                    let _ = evaluate(&p, &o);
                }
            }
        }
    }

    /// Reverse greedy on a fan-out: one producer, several consumers that
    /// each allocate a big temporary and return a small result.
    #[test]
    fn reverse_greedy_runs_big_consumers_one_at_a_time() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let src = b.add_op(OpClass::Forward);
        let x = b.add_buf(1, Some(src), false);
        let end = b.add_op(OpClass::Forward);
        for _ in 0..3 {
            let big = b.add_op(OpClass::Forward);
            b.add_use(big, x);
            let t = b.add_buf(100, Some(big), false);
            let small = b.add_op(OpClass::Forward);
            b.add_use(small, t);
            let r = b.add_buf(1, Some(small), false);
            b.add_use(end, r);
        }
        let p = b.build().unwrap();
        for dir in [Direction::Forward, Direction::Reverse] {
            let o = greedy(&p, Rule::NetFree, dir);
            assert!(evaluate(&p, &o).peak <= 103, "{dir:?}");
        }
    }
}
