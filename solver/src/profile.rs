//! An order with its live-bytes curve and the prefix/suffix summaries that
//! let a move of one op be scored without re-simulating the order.
//!
//! Moving op `v` from step `i` to the gap before step `g` changes the live
//! bytes only at the steps it jumps over, and there by an amount that
//! depends on `v`'s buffers alone: its outputs that outlive their step are
//! born earlier (moving up) or later (moving down); each input it reads is
//! freed where its last user now runs. At its new step `v` needs the bytes
//! live across that gap plus its own inputs and outputs minus what its reuse
//! hints save there. [`Profile::scan`] walks the gaps of `v`'s window
//! outwards from `i`, accumulating the changes, and reports for every gap
//! the new peak, the number of steps left at the old peak and the highest
//! point of the changed stretch, in `O(window · deg(v))` in all. Reuse hints
//! of *other* ops that a move makes legal or illegal are not scored (they
//! can only be off by one hint's bytes at one step); callers re-simulate an
//! accepted move exactly with [`Profile::apply`].

use crate::problem::{BufIdx, OpIdx, Problem};
use crate::simulate::{Evaluation, evaluate};

/// An order, its evaluation and summaries for scoring moves.
#[derive(Clone, Debug)]
pub struct Profile {
    pub order: Vec<OpIdx>,
    pub ev: Evaluation,
    /// `across[g]`: bytes live across the gap before step `g` (`g` in
    /// `0..=n`): born at a step before `g`, dying at `g` or later.
    across: Vec<u64>,
    /// `pre_max[g]`: highest point of steps `0..g`.
    pre_max: Vec<u64>,
    /// `suf_max[g]`: highest point of steps `g..n`.
    suf_max: Vec<u64>,
    /// `pre_cnt[g]`: steps in `0..g` at the peak.
    pre_cnt: Vec<u32>,
}

/// The score of putting an op in one gap.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GapScore {
    /// The gap (before step `gap` of the current order).
    pub gap: usize,
    /// Peak of the whole order after the move.
    pub peak: u64,
    /// Steps at the current peak after the move (meaningful when `peak`
    /// does not change).
    pub at_peak: u32,
    /// Highest step among those the move changes, the op's own included.
    pub local: u64,
}

impl Profile {
    pub fn new(p: &Problem, order: Vec<OpIdx>) -> Profile {
        let ev = evaluate(p, &order);
        let n = order.len();
        let mut diff = vec![0i128; n + 2];
        for b in p.buf_ids() {
            let s = p.size(b) as i128;
            if s == 0 {
                continue;
            }
            let (lo, hi) = gap_span(p, &ev, b, n);
            if lo <= hi {
                diff[lo] += s;
                diff[hi + 1] -= s;
            }
        }
        let mut across = Vec::with_capacity(n + 1);
        let mut acc = 0i128;
        for d in diff.iter().take(n + 1) {
            acc += d;
            across.push(acc as u64);
        }
        let mut pre_max = vec![0u64; n + 1];
        let mut pre_cnt = vec![0u32; n + 1];
        for i in 0..n {
            pre_max[i + 1] = pre_max[i].max(ev.curve[i]);
            pre_cnt[i + 1] = pre_cnt[i] + u32::from(ev.curve[i] == ev.peak);
        }
        let mut suf_max = vec![0u64; n + 1];
        for i in (0..n).rev() {
            suf_max[i] = suf_max[i + 1].max(ev.curve[i]);
        }
        Profile {
            order,
            ev,
            across,
            pre_max,
            suf_max,
            pre_cnt,
        }
    }

    pub fn peak(&self) -> u64 {
        self.ev.peak
    }
    /// Steps at the peak.
    pub fn at_peak(&self) -> u32 {
        *self.pre_cnt.last().unwrap_or(&0)
    }
    /// `(peak, steps at the peak)`: what local search lowers.
    pub fn key(&self) -> (u64, u32) {
        (self.peak(), self.at_peak())
    }
    /// Sum of the curve over all steps (byte-steps): how long bytes stay
    /// live, the tie-break among orders of equal [`Self::key`].
    pub fn area(&self) -> u128 {
        self.ev.curve.iter().map(|&c| c as u128).sum()
    }
    /// Bytes live across the gap before step `g`.
    pub fn across(&self, g: usize) -> u64 {
        self.across[g]
    }

    /// The gaps op `v` may move to: after its last predecessor, before its
    /// first successor (as gap indices of the current order).
    pub fn window(&self, p: &Problem, v: OpIdx) -> (usize, usize) {
        let lo = p
            .preds(v)
            .map(|u| self.ev.pos[u.index()] as usize + 1)
            .max()
            .unwrap_or(0);
        let hi = p
            .succs(v)
            .map(|u| self.ev.pos[u.index()] as usize)
            .min()
            .unwrap_or(self.order.len());
        (lo, hi)
    }

    /// Scores every gap of `v`'s window within `[lo, hi]` (clipped to the
    /// window). The gap `pos(v)` (no move) is always included.
    pub fn scan(&self, p: &Problem, v: OpIdx, lo: usize, hi: usize) -> Vec<GapScore> {
        let n = self.order.len();
        let (wlo, whi) = self.window(p, v);
        let (lo, hi) = (lo.max(wlo), hi.min(whi));
        let i = self.ev.pos[v.index()] as usize;
        let peak = self.ev.peak;
        let curve = &self.ev.curve;
        let m = self.moving(p, v);
        let own_step = |g: usize| m.step_bytes(p, self.across[g], g);
        let in_delta = |q: usize| m.freed_before(q);
        let out_ext = m.out_ext;
        let count_peak = |a: usize, b: usize| -> u32 {
            // Steps at the peak in [a, b).
            if a >= b {
                0
            } else {
                self.pre_cnt[b] - self.pre_cnt[a]
            }
        };
        let mut out = Vec::new();
        out.push(GapScore {
            gap: i,
            peak,
            at_peak: self.at_peak(),
            local: curve[i],
        });
        // Moving up: gaps g < i, changed steps [g, i).
        let mut range_max = 0u64;
        let mut range_cnt = 0u32;
        let mut g = i;
        while g > lo {
            g -= 1;
            let q = g;
            let val = (curve[q] as i128 + out_ext as i128 - in_delta(q)) as u64;
            range_max = range_max.max(val);
            range_cnt += u32::from(val >= peak);
            let me = own_step(g);
            let outside = self.pre_max[g].max(self.suf_max[i + 1]);
            let cnt = count_peak(0, g) + count_peak(i + 1, n) + range_cnt + u32::from(me >= peak);
            out.push(GapScore {
                gap: g,
                peak: outside.max(range_max).max(me),
                at_peak: cnt,
                local: range_max.max(me),
            });
        }
        // Moving down: gaps g > i + 1, changed steps (i, g).
        let mut range_max = 0u64;
        let mut range_cnt = 0u32;
        let mut g = i + 1;
        while g < hi {
            g += 1;
            let q = g - 1;
            let val = (curve[q] as i128 - out_ext as i128 + in_delta(q)) as u64;
            range_max = range_max.max(val);
            range_cnt += u32::from(val >= peak);
            let me = own_step(g);
            let outside = self.pre_max[i].max(self.suf_max[g]);
            let cnt = count_peak(0, i) + count_peak(g, n) + range_cnt + u32::from(me >= peak);
            out.push(GapScore {
                gap: g,
                peak: outside.max(range_max).max(me),
                at_peak: cnt,
                local: range_max.max(me),
            });
        }
        out
    }

    /// What moving `v` changes, gathered once per [`Self::scan`].
    fn moving(&self, p: &Problem, v: OpIdx) -> Moved {
        let n = self.order.len();
        let mut m = Moved::default();
        for b in p.outputs(v) {
            let s = p.size(b);
            m.out_step += s;
            if s == 0 {
                continue;
            }
            if p.buf(b).persistent || p.num_users(b) > 0 {
                m.out_ext += s;
            }
            let (a, z) = gap_span(p, &self.ev, b, n);
            m.own.push((b, a, z));
        }
        for b in p.uses(v) {
            let s = p.size(b);
            if s == 0 {
                continue;
            }
            m.in_all += s;
            let (a, z) = gap_span(p, &self.ev, b, n);
            m.own.push((b, a, z));
            if !p.buf(b).persistent {
                m.ins.push((s, self.dminus(p, b, v)));
            }
        }
        m.hints = p
            .reuses_of(v)
            .filter(|r| {
                !p.buf(r.inp).persistent && r.out != r.inp && p.size(r.out) <= p.size(r.inp)
            })
            .map(|r| (self.dminus(p, r.inp, v), p.size(r.out), r.inp, r.out))
            .collect();
        m
    }

    /// Last step of a user of `b` other than `v`, or of its producer;
    /// -1 when neither exists.
    fn dminus(&self, p: &Problem, b: BufIdx, v: OpIdx) -> i64 {
        let pos = &self.ev.pos;
        let born = p.buf(b).producer.map_or(-1, |o| pos[o.index()] as i64);
        p.users(b)
            .filter(|&u| u != v)
            .map(|u| pos[u.index()] as i64)
            .max()
            .unwrap_or(-1)
            .max(born)
    }

    /// The order with `v` moved to gap `gap`.
    pub fn moved(&self, v: OpIdx, gap: usize) -> Vec<OpIdx> {
        let i = self.ev.pos[v.index()] as usize;
        let mut order = self.order.clone();
        order.remove(i);
        let at = if gap > i { gap - 1 } else { gap };
        order.insert(at, v);
        order
    }

    /// Moves `v` to `gap` and re-simulates.
    pub fn apply(&mut self, p: &Problem, v: OpIdx, gap: usize) {
        let order = self.moved(v, gap);
        *self = Profile::new(p, order);
    }
}

/// Gaps `[lo, hi]` across which buffer `b` is live: born at a step before
/// the gap, dying at the step after it or later (persistent: to the end).
/// `lo > hi` when there are none.
fn gap_span(p: &Problem, ev: &Evaluation, b: BufIdx, n: usize) -> (usize, usize) {
    let x = p.buf(b);
    let lo = match x.producer {
        None => 0,
        Some(_) => ev.birth[b.index()] as usize + 1,
    };
    let hi = if x.persistent {
        n
    } else if x.producer.is_none() && p.num_users(b) == 0 {
        return (1, 0);
    } else {
        ev.death[b.index()] as usize
    };
    (lo, hi)
}

/// The buffers of an op being moved ([`Profile::scan`]): what its step
/// holds, and what leaves the steps it moves across.
#[derive(Default)]
struct Moved {
    /// Bytes of its outputs that outlive its step (used later, or persistent).
    out_ext: u64,
    /// Bytes of all its outputs.
    out_step: u64,
    /// Bytes of all its inputs.
    in_all: u64,
    /// Its buffers with the gaps they span: (buffer, first gap, last gap).
    own: Vec<(BufIdx, usize, usize)>,
    /// Non-persistent inputs: (size, last step of another user or of the
    /// producer; -1 for none).
    ins: Vec<(u64, i64)>,
    /// Its reuse hints: (the input's other-users bound, output size,
    /// input, output).
    hints: Vec<(i64, u64, BufIdx, BufIdx)>,
}

impl Moved {
    /// Bytes live at the op's step when it runs in gap `g`, `across` being
    /// the bytes live across that gap today.
    fn step_bytes(&self, p: &Problem, across: u64, g: usize) -> u64 {
        let mine: u64 = self
            .own
            .iter()
            .filter(|&&(_, a, z)| a <= g && g <= z)
            .map(|&(b, _, _)| p.size(b))
            .sum();
        let mut saved = 0;
        let mut busy: Vec<BufIdx> = Vec::new();
        for &(dm, s, inp, out) in &self.hints {
            if dm < g as i64 && !busy.contains(&inp) && !busy.contains(&out) {
                busy.push(inp);
                busy.push(out);
                saved += s;
            }
        }
        across - mine + self.out_step + self.in_all - saved
    }

    /// Bytes of the inputs whose other uses all end before step `q`: they
    /// die with the op, wherever it moves past `q`.
    fn freed_before(&self, q: usize) -> i128 {
        self.ins
            .iter()
            .filter(|&&(_, dm)| dm < q as i64)
            .map(|&(s, _)| s as i128)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{random_order, random_problem};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// Without reuse hints the scores are exact: they match a full
        /// re-simulation of every move.
        #[test]
        fn scores_match_simulation(seed in any::<u64>(), n in 1usize..25) {
            let p = strip_hints(&random_problem(seed, n, 0.25));
            let prof = Profile::new(&p, random_order(&p, seed));
            for v in p.ops() {
                for s in prof.scan(&p, v, 0, n) {
                    let o = prof.moved(v, s.gap);
                    prop_assert!(p.is_valid_order(&o));
                    let e = evaluate(&p, &o);
                    prop_assert_eq!(s.peak, e.peak, "op {} gap {}", v, s.gap);
                    if e.peak == prof.peak() {
                        let cnt = e.curve.iter().filter(|&&c| c == e.peak).count() as u32;
                        prop_assert_eq!(s.at_peak, cnt);
                    }
                }
            }
        }
    }

    fn strip_hints(p: &Problem) -> Problem {
        let mut b = crate::problem::ProblemBuilder::new();
        for v in p.ops() {
            b.add_op(p.class(v));
        }
        for x in p.buf_ids() {
            let buf = p.buf(x);
            b.add_buf(buf.size, buf.producer, buf.persistent);
            for u in p.users(x) {
                b.add_use(u, x);
            }
        }
        for v in p.ops() {
            for s in p.succs(v) {
                b.add_edge(v, s);
            }
        }
        b.build().unwrap()
    }
}
