//! Memory-independent parts: key points and the segments between them.
//!
//! A *key point* is an op comparable with every other op: each other op is
//! either its ancestor or its descendant. Every valid order runs exactly the
//! key point's ancestors before it, so its step is the same in all orders,
//! and the ops strictly between two consecutive key points (a *segment*)
//! always run as one contiguous block. A buffer's liveness inside a segment
//! then depends only on the order of that segment: it is born inside (at a
//! step the segment's order decides), dies inside (likewise), or spans the
//! whole segment (a constant). So the minimum peak over all orders is the
//! maximum over parts of (bytes live across the whole part + the part's own
//! minimum peak), and ordering each part on its own is exact.
//!
//! [`key_points`] finds them in `O(n + m)` with one topological order `π`:
//! `π(p)` is a key point iff it is the only sink of the prefix `π(0..=p)` and
//! the only source of the suffix `π(p..)`. (Every other op of the prefix
//! then has a path inside the prefix to `π(p)`, and symmetrically for the
//! suffix.) An op `u` at position `i` whose first successor is at `f(u)` is a
//! sink of the prefixes ending in `[i, f(u))`; a difference array counts the
//! sinks of every prefix, and the sources of every suffix likewise.
//!
//! [`partition`] cuts the ops into [`Part`]s in execution order (each key
//! point alone, each segment as one part) and computes every part's
//! constant; [`Partition::extract`] turns one part into a stand-alone
//! [`Problem`] (a [`SubProblem`]) that every ordering algorithm of this crate
//! accepts unchanged.

use crate::problem::{BufIdx, OpIdx, Problem, ProblemBuilder};

/// Key points of `p`, in topological order. `O(n + m)`.
pub fn key_points(p: &Problem) -> Vec<OpIdx> {
    let n = p.num_ops();
    let topo = p.topo_order();
    let mut pos = vec![0usize; n];
    for (i, &v) in topo.iter().enumerate() {
        pos[v.index()] = i;
    }
    // sinks[i]: sinks of the prefix topo[0..=i]; sources[i]: sources of the
    // suffix topo[i..].
    let mut sinks = vec![0i64; n + 1];
    let mut sources = vec![0i64; n + 1];
    for (i, &v) in topo.iter().enumerate() {
        let first_succ = p.succs(v).map(|s| pos[s.index()]).min().unwrap_or(n);
        sinks[i] += 1;
        sinks[first_succ] -= 1;
        let last_pred = p.preds(v).map(|s| pos[s.index()] + 1).max().unwrap_or(0);
        sources[last_pred] += 1;
        sources[i + 1] -= 1;
    }
    let mut out = Vec::new();
    let (mut a, mut b) = (0i64, 0i64);
    for (i, &v) in topo.iter().enumerate() {
        a += sinks[i];
        b += sources[i];
        if a == 1 && b == 1 {
            out.push(v);
        }
    }
    out
}

/// What a part is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PartKind {
    /// A single key point: its step is fixed in every order.
    KeyPoint,
    /// The ops strictly between two consecutive key points (or before the
    /// first, or after the last).
    Segment,
}

/// A set of ops that runs as one contiguous block in every order the solver
/// considers, with the bytes that stay live across all of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub kind: PartKind,
    /// The part's ops in one valid order (the problem's topological order).
    pub ops: Vec<OpIdx>,
    /// Bytes of buffers live at every step of the part whatever its order
    /// (born before it and dying after it, or persistent).
    pub base: u64,
}

/// The parts of a problem in execution order.
#[derive(Clone, Debug)]
pub struct Partition {
    pub parts: Vec<Part>,
    /// The part each op belongs to.
    pub part_of: Vec<u32>,
}

/// One part as a stand-alone problem.
///
/// Ops of the part become ops `0..n` of `problem` (`ops[i]` is the original
/// op of local op `i`). Buffers produced before the part and dying in it
/// have no producer; buffers produced in it that must outlive it are
/// persistent; buffers live across the whole part are left out and counted
/// in `base`. The live bytes of the original problem at the step of a local
/// op are exactly `base` plus the local problem's live bytes there, for
/// every order of the part.
#[derive(Clone, Debug)]
pub struct SubProblem {
    pub problem: Problem,
    /// Original op of each local op.
    pub ops: Vec<OpIdx>,
    /// Original buffer of each local buffer.
    pub bufs: Vec<BufIdx>,
    /// Bytes live across the whole part.
    pub base: u64,
}

impl SubProblem {
    /// Maps a local order back to original op ids.
    pub fn to_global(&self, order: &[OpIdx]) -> Vec<OpIdx> {
        order.iter().map(|o| self.ops[o.index()]).collect()
    }
}

const BEFORE: i64 = -1;

/// The part index where buffer `b` is born (`-1`: before every part) and
/// dies (`i64::MAX`: survives the step), given the part of every op.
fn span(p: &Problem, part_of: &[u32], b: BufIdx) -> (i64, i64) {
    let buf = p.buf(b);
    let born = buf.producer.map_or(BEFORE, |o| part_of[o.index()] as i64);
    if buf.persistent {
        return (born, i64::MAX);
    }
    let died = p.users(b).map(|u| part_of[u.index()] as i64).max();
    match died {
        Some(d) => (born, d.max(born)),
        // An unused step input is live at step 0 only: it belongs to the
        // first part.
        None if born == BEFORE => (0, 0),
        None => (born, born),
    }
}

/// Cuts `p` at its key points (or, with `split: false`, keeps the whole
/// problem as one part). `O(n + m)`.
pub fn partition(p: &Problem, split: bool) -> Partition {
    let n = p.num_ops();
    let topo = p.topo_order();
    let mut parts: Vec<Part> = Vec::new();
    if split {
        let keys = key_points(p);
        let mut is_key = vec![false; n];
        for k in &keys {
            is_key[k.index()] = true;
        }
        let mut cur: Vec<OpIdx> = Vec::new();
        for &v in topo {
            if is_key[v.index()] {
                if !cur.is_empty() {
                    parts.push(Part {
                        kind: PartKind::Segment,
                        ops: std::mem::take(&mut cur),
                        base: 0,
                    });
                }
                parts.push(Part {
                    kind: PartKind::KeyPoint,
                    ops: vec![v],
                    base: 0,
                });
            } else {
                cur.push(v);
            }
        }
        if !cur.is_empty() {
            parts.push(Part {
                kind: PartKind::Segment,
                ops: cur,
                base: 0,
            });
        }
    } else if n > 0 {
        parts.push(Part {
            kind: PartKind::Segment,
            ops: topo.to_vec(),
            base: 0,
        });
    }
    let mut part_of = vec![0u32; n];
    for (j, part) in parts.iter().enumerate() {
        for &v in &part.ops {
            part_of[v.index()] = j as u32;
        }
    }
    // base[j] = bytes of buffers born in a part before j and dying after j.
    let k = parts.len();
    let mut diff = vec![0i128; k + 1];
    for b in p.buf_ids() {
        let s = p.size(b) as i128;
        if s == 0 {
            continue;
        }
        let (born, died) = span(p, &part_of, b);
        let lo = (born + 1).max(0) as usize;
        let hi = if died == i64::MAX {
            k
        } else {
            (died.max(0) as usize).min(k)
        };
        if lo < hi {
            diff[lo] += s;
            diff[hi] -= s;
        }
    }
    let mut acc = 0i128;
    for (j, part) in parts.iter_mut().enumerate() {
        acc += diff[j];
        part.base = acc as u64;
    }
    Partition { parts, part_of }
}

impl Partition {
    /// Part `j` of `p` as a stand-alone problem. `O(size of the part and of
    /// the buffers it touches, with their users)`.
    pub fn extract(&self, p: &Problem, j: usize) -> SubProblem {
        // An unused, non-persistent step input is live at step 0 only: the
        // first part carries it.
        let orphans: Vec<BufIdx> = if j == 0 {
            p.buf_ids()
                .filter(|&b| {
                    let x = p.buf(b);
                    x.producer.is_none() && !x.persistent && p.num_users(b) == 0 && x.size > 0
                })
                .collect()
        } else {
            Vec::new()
        };
        extract_with(p, &self.parts[j].ops, self.parts[j].base, &orphans, |o| {
            self.part_of[o.index()] as i64 - j as i64
        })
    }

    /// Concatenates one order per part (global op ids) into a whole order.
    pub fn concat(&self, orders: &[Vec<OpIdx>]) -> Vec<OpIdx> {
        orders.iter().flatten().copied().collect()
    }
}

/// Extracts the ops `ops` (in a valid order) as a stand-alone problem.
/// `side(o)` tells where an op runs relative to them: negative before, 0
/// inside, positive after. The caller guarantees that `ops` run as one
/// contiguous block and that `base` is the bytes live across all of it.
/// `extra` are buffers no op of the part touches that must still be counted
/// (an unused step input, live at step 0 only, in the first part).
pub fn extract_with(
    p: &Problem,
    ops: &[OpIdx],
    base: u64,
    extra: &[BufIdx],
    side: impl Fn(OpIdx) -> i64,
) -> SubProblem {
    let mut local = std::collections::HashMap::with_capacity(ops.len());
    let mut b = ProblemBuilder::new();
    for (i, &o) in ops.iter().enumerate() {
        b.add_op(p.class(o));
        local.insert(o, OpIdx(i as u32));
    }
    let mut buf_local: std::collections::HashMap<BufIdx, BufIdx> = Default::default();
    let mut bufs = Vec::new();
    // Touched buffers: outputs and uses of the part's ops.
    let mut touched: Vec<BufIdx> = Vec::new();
    for &o in ops {
        touched.extend(p.outputs(o));
        touched.extend(p.uses(o));
    }
    touched.extend_from_slice(extra);
    touched.sort_unstable();
    touched.dedup();
    for &x in &touched {
        let buf = p.buf(x);
        let produced_here = buf.producer.is_some_and(|o| side(o) == 0);
        let used_after = p.users(x).any(|u| side(u) > 0);
        let outlives = buf.persistent || used_after;
        if !produced_here && outlives {
            // Live across the whole part: already in `base`.
            continue;
        }
        let lb = b.add_buf(
            buf.size,
            if produced_here {
                buf.producer.map(|o| local[&o])
            } else {
                None
            },
            outlives,
        );
        buf_local.insert(x, lb);
        bufs.push(x);
        for u in p.users(x) {
            if let Some(&lu) = local.get(&u) {
                b.add_use(lu, lb);
            }
        }
    }
    for &o in ops {
        for s in p.succs(o) {
            if let Some(&ls) = local.get(&s) {
                b.add_edge(local[&o], ls);
            }
        }
        for r in p.reuses_of(o) {
            if let (Some(&lo), Some(&li)) = (buf_local.get(&r.out), buf_local.get(&r.inp)) {
                b.add_reuse(local[&o], lo, li);
            }
        }
    }
    let problem = b
        .build()
        .expect("a part of a valid problem is a valid problem");
    SubProblem {
        problem,
        ops: ops.to_vec(),
        bufs,
        base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::OpClass;
    use crate::random::random_problem;
    use crate::simulate::evaluate;
    use proptest::prelude::*;

    /// The definition: `v` is a key point iff every other op is an ancestor
    /// or a descendant of `v`.
    fn brute_key_points(p: &Problem) -> Vec<OpIdx> {
        let n = p.num_ops();
        let reach = |start: OpIdx, fwd: bool| {
            let mut seen = vec![false; n];
            let mut stack = vec![start];
            while let Some(v) = stack.pop() {
                let next: Vec<OpIdx> = if fwd {
                    p.succs(v).collect()
                } else {
                    p.preds(v).collect()
                };
                for s in next {
                    if !seen[s.index()] {
                        seen[s.index()] = true;
                        stack.push(s);
                    }
                }
            }
            seen
        };
        let mut keys: Vec<OpIdx> = p
            .ops()
            .filter(|&v| {
                let d = reach(v, true);
                let a = reach(v, false);
                p.ops().all(|u| u == v || d[u.index()] || a[u.index()])
            })
            .collect();
        let pos = crate::simulate::positions(p, p.topo_order());
        keys.sort_by_key(|k| pos[k.index()]);
        keys
    }

    #[test]
    fn chain_ops_are_all_key_points_and_a_diamond_middle_is_not() {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let l = b.add_op(OpClass::Forward);
        let r = b.add_op(OpClass::Forward);
        let j = b.add_op(OpClass::Forward);
        b.add_edge(a, l);
        b.add_edge(a, r);
        b.add_edge(l, j);
        b.add_edge(r, j);
        let p = b.build().unwrap();
        assert_eq!(key_points(&p), vec![a, j]);
        let part = partition(&p, true);
        assert_eq!(part.parts.len(), 3);
        assert_eq!(part.parts[1].ops, vec![l, r]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn key_points_match_the_definition(seed in any::<u64>(), n in 1usize..14) {
            let p = random_problem(seed, n, 0.3);
            prop_assert_eq!(key_points(&p), brute_key_points(&p));
        }

        /// Live bytes of the whole order at a part's step = part base + the
        /// part's own live bytes, for a random order of every part.
        #[test]
        fn parts_add_up_to_the_whole(seed in any::<u64>(), n in 1usize..16) {
            let p = random_problem(seed, n, 0.25);
            let part = partition(&p, true);
            let mut orders = Vec::new();
            let mut locals = Vec::new();
            for j in 0..part.parts.len() {
                let sub = part.extract(&p, j);
                let lo = crate::random::random_order(&sub.problem, seed ^ j as u64);
                orders.push(sub.to_global(&lo));
                locals.push((sub, lo));
            }
            let whole = part.concat(&orders);
            prop_assert!(p.is_valid_order(&whole));
            let ev = evaluate(&p, &whole);
            let mut step = 0;
            for (sub, lo) in &locals {
                let e = evaluate(&sub.problem, lo);
                for &c in &e.curve {
                    prop_assert_eq!(ev.curve[step], sub.base + c, "step {}", step);
                    step += 1;
                }
            }
        }
    }
}
