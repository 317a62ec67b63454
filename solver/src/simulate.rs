//! Evaluating an order: buffer lifetimes, taken reuses, live-bytes curve.
//!
//! [`evaluate`] applies the liveness rules of [`crate::problem`] to one order
//! and returns everything the allocator and the reports need. Reuse hints are
//! taken step by step: a hint `(op, out, inp)` can be taken when `op` is
//! `inp`'s last user and `inp` is not persistent, and at each step as many
//! hints as possible are taken with every buffer in at most one of them (a
//! maximum matching of the step's outputs to its inputs, in hint order).
//! Taking a hint never raises the curve, since the conversion passes only
//! equal-size hints.

use crate::problem::{BufIdx, OpIdx, Problem, Reuse};

/// The memory behaviour of one order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evaluation {
    /// Step of every op (`pos[op] = i` when `order[i] == op`).
    pub pos: Vec<u32>,
    /// First live step of every buffer.
    pub birth: Vec<u32>,
    /// Last live step of every buffer (inclusive).
    pub death: Vec<u32>,
    /// Reuse hints taken in this order.
    pub taken: Vec<Reuse>,
    /// Live bytes at each step.
    pub curve: Vec<u64>,
    /// Maximum of `curve`: the smallest arena any layout can reach for this
    /// order.
    pub peak: u64,
}

impl Evaluation {
    /// The step at which the curve first reaches its peak.
    pub fn peak_step(&self) -> usize {
        self.curve.iter().position(|&c| c == self.peak).unwrap_or(0)
    }
}

/// Steps of every op in `order`. `order` must be a permutation of the ops.
pub fn positions(p: &Problem, order: &[OpIdx]) -> Vec<u32> {
    let mut pos = vec![0u32; p.num_ops()];
    for (i, &op) in order.iter().enumerate() {
        pos[op.index()] = i as u32;
    }
    pos
}

/// Evaluates `order`, which must be a valid order of `p` (see
/// [`Problem::is_valid_order`]).
pub fn evaluate(p: &Problem, order: &[OpIdx]) -> Evaluation {
    let n = p.num_ops();
    let pos = positions(p, order);
    let last = n.saturating_sub(1) as u32;
    let mut birth = Vec::with_capacity(p.num_bufs());
    let mut death = Vec::with_capacity(p.num_bufs());
    for b in p.buf_ids() {
        let buf = p.buf(b);
        let born = buf.producer.map_or(0, |op| pos[op.index()]);
        let died = if buf.persistent {
            last
        } else {
            p.users(b)
                .map(|u| pos[u.index()])
                .max()
                .unwrap_or(born)
                .max(born)
        };
        birth.push(born);
        death.push(died);
    }
    let taken = take_reuses(p, order, &pos, &death);
    let steps = n.max(1);
    let mut delta = vec![0i128; steps + 1];
    for b in p.buf_ids() {
        let s = p.size(b) as i128;
        if s == 0 {
            continue;
        }
        delta[birth[b.index()] as usize] += s;
        delta[death[b.index()] as usize + 1] -= s;
    }
    for r in &taken {
        let i = pos[r.op.index()] as usize;
        let s = p.size(r.out).min(p.size(r.inp)) as i128;
        delta[i] -= s;
        delta[i + 1] += s;
    }
    let mut curve = Vec::with_capacity(steps);
    let mut acc = 0i128;
    for d in delta.iter().take(steps) {
        acc += d;
        curve.push(acc as u64);
    }
    let peak = curve.iter().copied().max().unwrap_or(0);
    Evaluation {
        pos,
        birth,
        death,
        taken,
        curve,
        peak,
    }
}

/// Peak live bytes of `order` (same as `evaluate(p, order).peak`).
pub fn peak(p: &Problem, order: &[OpIdx]) -> u64 {
    evaluate(p, order).peak
}

fn take_reuses(p: &Problem, order: &[OpIdx], pos: &[u32], death: &[u32]) -> Vec<Reuse> {
    let mut taken = Vec::new();
    if p.reuses().is_empty() {
        return taken;
    }
    for &op in order {
        let legal: Vec<Reuse> = p
            .reuses_of(op)
            .filter(|r| reuse_legal(p, r, pos, death))
            .copied()
            .collect();
        // owner: each matched input with the hint (index into `legal`) taking it.
        let mut owner: Vec<(BufIdx, usize)> = Vec::new();
        let mut tried: Vec<BufIdx> = Vec::new();
        for r in &legal {
            if !tried.contains(&r.out) {
                tried.push(r.out);
                augment(&legal, r.out, &mut owner, &mut Vec::new());
            }
        }
        let mut mine: Vec<usize> = owner.into_iter().map(|(_, k)| k).collect();
        mine.sort_unstable();
        taken.extend(mine.into_iter().map(|k| legal[k]));
    }
    taken
}

/// Kuhn's augmenting path from output `out` over one op's legal hints, so
/// that each input and output takes part in at most one taken hint and as
/// many hints as possible are taken (taking hints greedily can spend the
/// one input two outputs could use and block the second).
fn augment(
    legal: &[Reuse],
    out: BufIdx,
    owner: &mut Vec<(BufIdx, usize)>,
    seen: &mut Vec<BufIdx>,
) -> bool {
    for (k, r) in legal.iter().enumerate().filter(|(_, r)| r.out == out) {
        if seen.contains(&r.inp) {
            continue;
        }
        seen.push(r.inp);
        let at = owner.iter().position(|&(inp, _)| inp == r.inp);
        let free = match at {
            None => true,
            Some(i) => augment(legal, legal[owner[i].1].out, owner, seen),
        };
        if free {
            match owner.iter_mut().find(|(inp, _)| *inp == r.inp) {
                Some(slot) => slot.1 = k,
                None => owner.push((r.inp, k)),
            }
            return true;
        }
    }
    false
}

/// Whether a hint can be taken given the steps and deaths of an order.
pub fn reuse_legal(p: &Problem, r: &Reuse, pos: &[u32], death: &[u32]) -> bool {
    let inp = p.buf(r.inp);
    !inp.persistent
        && death[r.inp.index()] == pos[r.op.index()]
        && p.size(r.out) <= p.size(r.inp)
        && r.out != r.inp
}

/// Buffers grouped by taken reuses: each group shares one slot of memory.
/// Returns, for every buffer, the index of its group's first buffer.
pub fn reuse_groups(p: &Problem, taken: &[Reuse]) -> Vec<BufIdx> {
    let mut root: Vec<BufIdx> = p.buf_ids().collect();
    // `taken` is in schedule order, so an input's root is final before its
    // output joins it.
    for r in taken {
        root[r.out.index()] = root[r.inp.index()];
    }
    root
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{OpClass, ProblemBuilder};

    /// a -> x(10) -> b -> y(10) -> c, with a persistent w(5) read by a.
    fn chain() -> (Problem, [OpIdx; 3]) {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let bb = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let w = b.add_buf(5, None, true);
        let x = b.add_buf(10, Some(a), false);
        let y = b.add_buf(10, Some(bb), false);
        b.add_use(a, w);
        b.add_use(bb, x);
        b.add_use(c, y);
        b.add_reuse(bb, y, x);
        (b.build().unwrap(), [a, bb, c])
    }

    #[test]
    fn curve_counts_inclusive_intervals_and_reuse() {
        let (p, [a, b, c]) = chain();
        let e = evaluate(&p, &[a, b, c]);
        assert_eq!(e.taken.len(), 1);
        // step0: w+x; step1: w+x (y shares x); step2: w+y
        assert_eq!(e.curve, vec![15, 15, 15]);
        assert_eq!(e.peak, 15);
        let groups = reuse_groups(&p, &e.taken);
        assert_eq!(groups[2], groups[1]);
    }

    #[test]
    fn empty_problem_has_zero_peak() {
        let p = ProblemBuilder::new().build().unwrap();
        let e = evaluate(&p, &[]);
        assert_eq!(e.peak, 0);
    }
}
