//! A lower bound on one part's peak, valid for every order of the part.
//!
//! When op `v` runs, these are live whatever the order: `v`'s inputs and
//! outputs (less the bytes its reuse hints could save), and every buffer
//! produced by an ancestor of `v` (or a step input of the part) that a
//! descendant of `v` reads or that must outlive the part. The bound is the
//! largest such sum over the part's ops; the part's constant (bytes live
//! across it) is added by the caller. This is the foundation's "simple"
//! bound taken inside one part, where the crossing bytes are exact; it is
//! what lets a part stop as soon as a heuristic meets it.
//!
//! Cost: ancestor and descendant sets as bitsets (`O(n·m/64)` words of
//! work, `O(n²/64)` memory) plus one pass over each buffer's forced-live
//! set; for parts above [`DETAILED_MAX_OPS`] ops only the op's own inputs
//! and outputs and the part's persistent inputs are counted (`O(n + m)`).

use crate::problem::{BufIdx, Problem};

/// Largest part for which ancestor/descendant sets are built.
pub const DETAILED_MAX_OPS: usize = 12_000;

/// Lower bound on the peak of every order of `p` (without the part's
/// constant).
pub fn part_bound(p: &Problem) -> u64 {
    let n = p.num_ops();
    let resident: u64 = p
        .buf_ids()
        .filter(|&b| p.buf(b).persistent && p.buf(b).producer.is_none())
        .map(|b| p.size(b))
        .sum();
    let is_resident = |b: BufIdx| p.buf(b).persistent && p.buf(b).producer.is_none();
    // Own footprint of every op, hints subtracted.
    let own: Vec<u64> = p
        .ops()
        .map(|v| {
            let saved: u64 = p
                .reuses_of(v)
                .filter(|r| !p.buf(r.inp).persistent)
                .map(|r| p.size(r.out).min(p.size(r.inp)))
                .sum();
            let s: u64 = p
                .uses(v)
                .chain(p.outputs(v))
                .filter(|&b| !is_resident(b))
                .map(|b| p.size(b))
                .sum();
            s.saturating_sub(saved)
        })
        .collect();
    if n == 0 {
        return resident;
    }
    if n > DETAILED_MAX_OPS {
        return resident + own.iter().copied().max().unwrap_or(0);
    }
    let crate::problem::Reach {
        words: w,
        anc,
        desc,
    } = p.reach();
    // extra[v]: bytes forced live at v that are not v's own inputs/outputs.
    let mut extra = vec![0u64; n];
    let mut mask = vec![0u64; w];
    for b in p.buf_ids() {
        let s = p.size(b);
        if s == 0 || is_resident(b) {
            continue;
        }
        let x = p.buf(b);
        // Ops after the producer (all ops for a step input).
        mask.iter_mut().for_each(|m| *m = !0);
        if let Some(q) = x.producer {
            mask.copy_from_slice(&desc[q.index() * w..(q.index() + 1) * w]);
        }
        if !x.persistent {
            // ... and before some user.
            let mut before = vec![0u64; w];
            for u in p.users(b) {
                for (k, bk) in before.iter_mut().enumerate() {
                    *bk |= anc[u.index() * w + k];
                }
            }
            for (m, bk) in mask.iter_mut().zip(&before) {
                *m &= bk;
            }
        }
        // Its users count it in their own footprint.
        for u in p.users(b) {
            mask[u.index() / 64] &= !(1 << (u.index() % 64));
        }
        for (k, &m) in mask.iter().enumerate() {
            let mut bits = m;
            while bits != 0 {
                let t = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let v = k * 64 + t;
                if v < n {
                    extra[v] += s;
                }
            }
        }
    }
    resident + (0..n).map(|v| own[v] + extra[v]).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{brute_force_peak, random_problem};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn is_a_lower_bound(seed in any::<u64>(), n in 1usize..=9) {
            let p = random_problem(seed, n, 0.3);
            let Some(best) = brute_force_peak(&p, 200_000) else { return Ok(()); };
            prop_assert!(part_bound(&p) <= best);
        }
    }

    /// A saved activation crossing a chain is counted at every op between
    /// its producer and its user.
    #[test]
    fn counts_buffers_crossing_an_op() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let m = b.add_op(OpClass::Forward);
        let z = b.add_op(OpClass::Forward);
        let saved = b.add_buf(100, Some(a), false);
        let t1 = b.add_buf(5, Some(a), false);
        let t2 = b.add_buf(7, Some(m), false);
        b.add_use(m, t1);
        b.add_use(z, t2);
        b.add_use(z, saved);
        let p = b.build().unwrap();
        // At m: saved (100) + t1 (5) + t2 (7).
        assert_eq!(part_bound(&p), 112);
        assert_eq!(crate::random::brute_force_peak(&p, 10), Some(112));
    }
}
