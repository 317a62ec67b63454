//! Random problems and orders for tests and benchmarks (deterministic for a
//! seed: SplitMix64, the workspace's one generator).
//!
//! [`random_problem`] makes a DAG with the features the solver must handle:
//! multi-user buffers, zero-sized buffers, step inputs (persistent or not),
//! persistent outputs, explicit ordering edges, reuse hints between
//! equal-sized buffers, and optimizer-class sinks.

use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

use crate::problem::{BufIdx, OpClass, OpIdx, Problem, ProblemBuilder};

/// SplitMix64 (`rand_xoshiro`'s): small, fast, good enough for test data.
#[derive(Clone, Debug)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// A random problem with `n` ops; `density` is the chance that a buffer of
/// op `i` is read by a later op `j`.
pub fn random_problem(seed: u64, n: usize, density: f64) -> Problem {
    let mut r = Rng::new(seed);
    let mut b = ProblemBuilder::new();
    let ops: Vec<OpIdx> = (0..n)
        .map(|_| {
            b.add_op(if r.chance(0.1) {
                OpClass::Optimizer
            } else {
                OpClass::Forward
            })
        })
        .collect();
    let sizes = [0u64, 1, 2, 3, 5, 8, 13, 21];
    let mut produced: Vec<(BufIdx, usize, u64)> = Vec::new();
    // Step inputs.
    for _ in 0..r.below(3) {
        let persistent = r.chance(0.5);
        let s = sizes[r.below(sizes.len() as u64) as usize];
        let x = b.add_buf(s, None, persistent);
        if n > 0 {
            for _ in 0..1 + r.below(2) {
                b.add_use(ops[r.below(n as u64) as usize], x);
            }
        }
    }
    for i in 0..n {
        let outs = if r.chance(0.15) { 2 } else { 1 };
        for _ in 0..outs {
            let s = sizes[r.below(sizes.len() as u64) as usize];
            let persistent = r.chance(0.08);
            let x = b.add_buf(s, Some(ops[i]), persistent);
            produced.push((x, i, s));
            for &o in &ops[i + 1..n] {
                if r.chance(density) {
                    b.add_use(o, x);
                }
            }
        }
        if i > 0 && r.chance(0.1) {
            let a = r.below(i as u64) as usize;
            b.add_edge(ops[a], ops[i]);
        }
    }
    // Reuse hints: an op's output may take an equal-sized input's bytes.
    let problem = b.clone().build().expect("random problems are acyclic");
    for v in problem.ops() {
        let ins: Vec<BufIdx> = problem.uses(v).collect();
        for o in problem.outputs(v) {
            for &i in &ins {
                if problem.size(i) == problem.size(o) && problem.size(o) > 0 && r.chance(0.5) {
                    b.add_reuse(v, o, i);
                }
            }
        }
    }
    b.build().expect("random problems are valid")
}

/// A uniformly chosen ready op at each step: a random valid order.
pub fn random_order(p: &Problem, seed: u64) -> Vec<OpIdx> {
    let mut r = Rng::new(seed);
    let mut indeg: Vec<u32> = p.ops().map(|v| p.num_preds(v) as u32).collect();
    let mut ready: Vec<OpIdx> = p.ops().filter(|v| indeg[v.index()] == 0).collect();
    let mut order = Vec::with_capacity(p.num_ops());
    while !ready.is_empty() {
        let k = r.below(ready.len() as u64) as usize;
        let v = ready.swap_remove(k);
        order.push(v);
        for s in p.succs(v) {
            indeg[s.index()] -= 1;
            if indeg[s.index()] == 0 {
                ready.push(s);
            }
        }
    }
    order
}

/// Every valid order of `p`, or `None` if there are more than `limit`.
pub fn all_orders(p: &Problem, limit: usize) -> Option<Vec<Vec<OpIdx>>> {
    fn rec(
        p: &Problem,
        indeg: &mut [u32],
        cur: &mut Vec<OpIdx>,
        out: &mut Vec<Vec<OpIdx>>,
        limit: usize,
    ) -> bool {
        if cur.len() == p.num_ops() {
            out.push(cur.clone());
            return out.len() <= limit;
        }
        for v in p.ops() {
            if indeg[v.index()] != 0 || cur.contains(&v) {
                continue;
            }
            cur.push(v);
            for s in p.succs(v) {
                indeg[s.index()] -= 1;
            }
            let ok = rec(p, indeg, cur, out, limit);
            for s in p.succs(v) {
                indeg[s.index()] += 1;
            }
            cur.pop();
            if !ok {
                return false;
            }
        }
        true
    }
    let mut indeg: Vec<u32> = p.ops().map(|v| p.num_preds(v) as u32).collect();
    let mut out = Vec::new();
    if rec(p, &mut indeg, &mut Vec::new(), &mut out, limit) {
        Some(out)
    } else {
        None
    }
}

/// The smallest peak over every valid order, by enumeration (`None` if
/// there are more than `limit` orders).
pub fn brute_force_peak(p: &Problem, limit: usize) -> Option<u64> {
    let orders = all_orders(p, limit)?;
    orders
        .iter()
        .map(|o| crate::simulate::evaluate(p, o).peak)
        .min()
        .or(Some(0))
}

#[cfg(test)]
mod tests {
    /// The same streams as the hand-written SplitMix64 this replaced, so
    /// every random problem (and the tests' expectations on them) is
    /// unchanged.
    #[test]
    fn streams_are_unchanged() {
        let mut r = super::Rng::new(0);
        assert_eq!(r.next_u64(), 7960286522194355700);
        assert_eq!(r.next_u64(), 487617019471545679);
    }
}
