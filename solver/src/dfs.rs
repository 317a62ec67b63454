//! Depth-first post-orders, as XLA's DFS and post-order schedulers make them.
//!
//! A post-order DFS from the sinks emits an op right after everything it
//! depends on, so values are produced close to their first use. The
//! [`DfsVariant::Weighted`] variant visits an op's operands in decreasing
//! order of (cumulative extra users, cumulative bytes) — the operand subtrees
//! that feed many users and hold many bytes run first, so what they produce
//! is consumed soon — and starts from the sinks in the same order; the
//! [`DfsVariant::Plain`] variant visits in index order. Cumulative figures are
//! sums over predecessors (shared ancestors counted more than once, as XLA
//! does), saturating. `O(n log n + m log m)`; iterative, so deep graphs do
//! not overflow the stack.

use crate::problem::{OpIdx, Problem};

/// Which post-order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DfsVariant {
    Weighted,
    Plain,
}

impl DfsVariant {
    pub fn name(self) -> &'static str {
        match self {
            DfsVariant::Weighted => "dfs-weighted",
            DfsVariant::Plain => "post-order",
        }
    }
}

/// A post-order DFS order of `p`.
pub fn dfs_order(p: &Problem, variant: DfsVariant) -> Vec<OpIdx> {
    let n = p.num_ops();
    let mut extra = vec![0u64; n];
    let mut bytes = vec![0u64; n];
    if variant == DfsVariant::Weighted {
        for &v in p.topo_order() {
            let own_bytes: u64 = p.outputs(v).map(|b| p.size(b)).sum();
            let own_extra = (p.num_succs(v) as u64).saturating_sub(1);
            let (mut e, mut b) = (own_extra, own_bytes);
            for u in p.preds(v) {
                e = e.saturating_add(extra[u.index()]);
                b = b.saturating_add(bytes[u.index()]);
            }
            extra[v.index()] = e;
            bytes[v.index()] = b;
        }
    }
    let key = |v: OpIdx| {
        (
            std::cmp::Reverse(extra[v.index()]),
            std::cmp::Reverse(bytes[v.index()]),
            v,
        )
    };
    let mut sinks: Vec<OpIdx> = p.ops().filter(|&v| p.num_succs(v) == 0).collect();
    sinks.sort_by_key(|&v| key(v));
    let mut done = vec![false; n];
    let mut order = Vec::with_capacity(n);
    // Stack of (op, its operands in visit order, next operand index).
    let mut stack: Vec<(OpIdx, Vec<OpIdx>, usize)> = Vec::new();
    let operands = |v: OpIdx| {
        let mut ps: Vec<OpIdx> = p.preds(v).collect();
        ps.sort_by_key(|&u| key(u));
        ps
    };
    for s in sinks {
        if done[s.index()] {
            continue;
        }
        done[s.index()] = true;
        stack.push((s, operands(s), 0));
        while let Some(top) = stack.last_mut() {
            if top.2 < top.1.len() {
                let u = top.1[top.2];
                top.2 += 1;
                if !done[u.index()] {
                    done[u.index()] = true;
                    let ops = operands(u);
                    stack.push((u, ops, 0));
                }
            } else {
                order.push(top.0);
                stack.pop();
            }
        }
    }
    debug_assert_eq!(order.len(), n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::random_problem;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn post_orders_are_valid(seed in any::<u64>(), n in 0usize..60) {
            let p = random_problem(seed, n, 0.15);
            for v in [DfsVariant::Weighted, DfsVariant::Plain] {
                prop_assert!(p.is_valid_order(&dfs_order(&p, v)));
            }
        }
    }
}
