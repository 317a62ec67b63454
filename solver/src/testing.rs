//! Helpers the solver's unit tests share (test builds only): small
//! random problems, and the least peak over every order of one.

use proptest::prelude::*;

use crate::problem::{OpClass, OpIdx, Problem, ProblemBuilder};
use crate::simulate::evaluate;

/// The least peak over every order of a small problem (0 without ops).
pub(crate) fn best_peak(p: &Problem) -> u64 {
    all_orders(p)
        .iter()
        .map(|o| evaluate(p, o).peak)
        .min()
        .unwrap_or(0)
}

/// Every topological order of a small problem.
pub(crate) fn all_orders(p: &Problem) -> Vec<Vec<OpIdx>> {
    fn go(p: &Problem, indeg: &mut Vec<usize>, cur: &mut Vec<OpIdx>, out: &mut Vec<Vec<OpIdx>>) {
        if cur.len() == p.num_ops() {
            out.push(cur.clone());
            return;
        }
        for v in p.ops() {
            if indeg[v.index()] == 0 && !cur.contains(&v) {
                for s in p.succs(v) {
                    indeg[s.index()] -= 1;
                }
                cur.push(v);
                go(p, indeg, cur, out);
                cur.pop();
                for s in p.succs(v) {
                    indeg[s.index()] += 1;
                }
            }
        }
    }
    let mut indeg: Vec<usize> = p.ops().map(|v| p.num_preds(v)).collect();
    let mut out = Vec::new();
    go(p, &mut indeg, &mut Vec::new(), &mut out);
    out
}

/// A random small problem: ops in index order with random forward
/// edges, buffers with or without producer, persistent or not, random
/// later users, zero sizes, and reuse hints of equal size.
#[derive(Clone, Debug)]
pub(crate) struct Spec {
    pub(crate) n: usize,
    pub(crate) edges: Vec<(usize, usize)>,
    pub(crate) bufs: Vec<(Option<usize>, bool, u64, Vec<usize>)>,
    pub(crate) hints: Vec<(usize, usize, usize)>,
    pub(crate) chain: bool,
}

pub(crate) fn spec(max_ops: usize) -> impl Strategy<Value = Spec> {
    (
        0..=max_ops,
        proptest::collection::vec((0usize..64, 0usize..64), 0..10),
        proptest::collection::vec(
            (
                proptest::option::weighted(0.8, 0usize..64),
                proptest::bool::weighted(0.2),
                prop_oneof![Just(0u64), 1u64..50, Just(64u64)],
                proptest::collection::vec(0usize..64, 0..4),
            ),
            0..12,
        ),
        proptest::collection::vec((0usize..64, 0usize..64, 0usize..64), 0..6),
        proptest::bool::weighted(0.2),
    )
        .prop_map(|(n, edges, bufs, hints, chain)| Spec {
            n,
            edges,
            bufs,
            hints,
            chain,
        })
}

pub(crate) fn build(s: &Spec) -> Problem {
    let mut b = ProblemBuilder::new();
    let n = s.n;
    let ops: Vec<OpIdx> = (0..n).map(|_| b.add_op(OpClass::Other)).collect();
    if n == 0 {
        for &(_, pers, size, _) in &s.bufs {
            b.add_buf(size, None, pers);
        }
        return b.build().unwrap();
    }
    if s.chain {
        for i in 1..n {
            b.add_edge(ops[i - 1], ops[i]);
        }
    }
    for &(x, y) in &s.edges {
        let (x, y) = (x % n, y % n);
        if x < y {
            b.add_edge(ops[x], ops[y]);
        }
    }
    let mut produced: Vec<Vec<(usize, u64)>> = vec![Vec::new(); n];
    let mut used: Vec<Vec<(usize, u64)>> = vec![Vec::new(); n];
    for &(prod, pers, size, ref users) in &s.bufs {
        let prod = prod.map(|x| x % n);
        let buf = b.add_buf(size, prod.map(|x| ops[x]), pers);
        let mut us: Vec<usize> = users
            .iter()
            .map(|&u| u % n)
            .filter(|&u| prod.is_none_or(|p| u > p))
            .collect();
        us.sort_unstable();
        us.dedup();
        if let Some(pp) = prod {
            produced[pp].push((buf.index(), size));
        }
        for u in us {
            b.add_use(ops[u], buf);
            used[u].push((buf.index(), size));
        }
    }
    for &(o, i, j) in &s.hints {
        let o = o % n;
        if produced[o].is_empty() || used[o].is_empty() {
            continue;
        }
        let (out, so) = produced[o][i % produced[o].len()];
        let (inp, si) = used[o][j % used[o].len()];
        if so == si {
            b.add_reuse(
                ops[o],
                crate::problem::BufIdx(out as u32),
                crate::problem::BufIdx(inp as u32),
            );
        }
    }
    b.build().unwrap()
}
