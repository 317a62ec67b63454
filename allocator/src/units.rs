//! The planners' view of a [`Problem`]: every reuse group becomes one
//! rectangle ("unit") in time × bytes, and empty buffers drop out.
//!
//! A group's rectangle spans the union of its members' lifetimes at the
//! size of its largest member, at the lcm of their alignments, at their
//! common pin if any. When all members of a group have the same size and
//! their lifetimes chain without a hole (the usual in-place op), the
//! rectangle is exactly the group's footprint; otherwise it is a safe
//! over-approximation, and [`Units::exact`] says so (then a proof that a
//! capacity is infeasible for the units is not a proof for the problem).

use crate::problem::{Problem, Solution};

/// A rectangle to place: `size` bytes over `[lower, upper)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unit {
    pub lower: u64,
    pub upper: u64,
    pub size: u64,
    /// Offsets must be multiples of this (≥ 1).
    pub align: u64,
    pub pin: Option<u64>,
}

impl Unit {
    #[inline]
    pub fn overlaps(&self, o: &Unit) -> bool {
        self.lower < o.upper && o.lower < self.upper
    }
    /// `size * duration`, saturating (persistent units are "infinite").
    pub fn area(&self) -> u128 {
        self.size as u128 * (self.upper - self.lower) as u128
    }
}

/// The units of a problem and the way back to its buffers.
#[derive(Clone, Debug)]
pub struct Units {
    pub units: Vec<Unit>,
    /// The unit of every buffer (`None` for empty buffers, placed at 0 or
    /// their pin).
    pub unit_of: Vec<Option<usize>>,
    /// Whether every unit is exactly its group's footprint.
    pub exact: bool,
}

pub(crate) fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return a.max(b);
    }
    (a / gcd(a, b)).saturating_mul(b)
}

impl Units {
    /// Merges reuse groups (reuses out of range are ignored here; see
    /// [`Problem::check`]).
    pub fn new(problem: &Problem) -> Units {
        let bufs = &problem.buffers;
        let n = bufs.len();
        let root = crate::problem::groups(problem);
        let mut unit_of = vec![None; n];
        let mut root_unit = vec![usize::MAX; n];
        let mut units: Vec<Unit> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (i, b) in bufs.iter().enumerate() {
            if b.is_empty() {
                continue;
            }
            let r = root[i];
            if root_unit[r] == usize::MAX {
                root_unit[r] = units.len();
                units.push(Unit {
                    lower: b.lower,
                    upper: b.upper,
                    size: b.size,
                    align: b.align.max(1),
                    pin: b.pinned,
                });
                members.push(vec![i]);
            } else {
                let u = &mut units[root_unit[r]];
                u.lower = u.lower.min(b.lower);
                u.upper = u.upper.max(b.upper);
                u.size = u.size.max(b.size);
                u.align = lcm(u.align, b.align.max(1));
                u.pin = u.pin.or(b.pinned);
                members[root_unit[r]].push(i);
            }
            unit_of[i] = Some(root_unit[r]);
        }
        // Empty buffers in a group still follow the group's pin.
        for (i, b) in bufs.iter().enumerate() {
            if b.is_empty() {
                let r = root[i];
                if root_unit[r] != usize::MAX {
                    unit_of[i] = Some(root_unit[r]);
                }
            }
        }
        let exact = members.iter().zip(&units).all(|(m, u)| {
            if m.len() == 1 {
                return true;
            }
            if m.iter().any(|&i| bufs[i].size != u.size) {
                return false;
            }
            // Lifetimes must cover the union without a hole.
            let mut iv: Vec<(u64, u64)> =
                m.iter().map(|&i| (bufs[i].lower, bufs[i].upper)).collect();
            iv.sort_unstable();
            let mut reach = iv[0].1;
            for &(lo, hi) in &iv[1..] {
                if lo > reach {
                    return false;
                }
                reach = reach.max(hi);
            }
            true
        });
        Units {
            units,
            unit_of,
            exact,
        }
    }

    /// The buffers' layout from the units' offsets.
    pub fn to_solution(&self, problem: &Problem, offsets: &[u64]) -> Solution {
        let mut out = vec![0u64; problem.buffers.len()];
        let mut height = 0;
        for (i, b) in problem.buffers.iter().enumerate() {
            out[i] = match self.unit_of[i] {
                Some(u) => offsets[u],
                None => b.pinned.unwrap_or(0),
            };
            if !b.is_empty() {
                height = height.max(out[i] + b.size);
            }
        }
        Solution {
            offsets: out,
            height,
        }
    }

    /// The most bytes of units live at one time.
    pub fn max_live(&self) -> u64 {
        max_live(&self.units)
    }
}

/// The most bytes live at one time among `units`.
pub fn max_live(units: &[Unit]) -> u64 {
    let mut ev: Vec<(u64, i128)> = Vec::with_capacity(units.len() * 2);
    for u in units {
        ev.push((u.lower, u.size as i128));
        ev.push((u.upper, -(u.size as i128)));
    }
    ev.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut cur, mut best) = (0i128, 0i128);
    for (_, d) in ev {
        cur += d;
        best = best.max(cur);
    }
    best as u64
}

/// A lower bound on the height of every layout of `units` that counts
/// alignment: at least [`max_live`], often more.
///
/// When every unit's alignment and pin is a multiple of some `a > 1`,
/// every offset is a multiple of `a`. Then a unit with another unit above
/// it in the same time step keeps its size rounded up to `a` to itself
/// (the next one cannot start in the rounding), and only the topmost unit
/// of a time step may end unrounded. So at each time step the height is at
/// least the sum of the live units' rounded sizes minus the largest
/// rounding among them. With 64-byte alignment and many small tensors
/// (scalars of a few bytes) this is well above the plain max live.
pub fn aligned_floor(units: &[Unit]) -> u64 {
    let a = units.iter().fold(0u64, |g, u| gcd(g, u.align.max(1)));
    if a <= 1 || units.iter().any(|u| u.pin.is_some_and(|p| p % a != 0)) {
        return max_live(units);
    }
    let mut ev: Vec<(u64, bool, u64, u64)> = Vec::with_capacity(units.len() * 2);
    for u in units.iter().filter(|u| u.upper > u.lower && u.size > 0) {
        let r = u.size.next_multiple_of(a);
        // Ends sort before starts at the same time (`false < true`).
        ev.push((u.lower, true, r, r - u.size));
        ev.push((u.upper, false, r, r - u.size));
    }
    ev.sort_unstable();
    let mut sum: u128 = 0;
    let mut waste: std::collections::BTreeMap<u64, usize> = Default::default();
    let mut best: u128 = 0;
    for (k, &(t, start, r, w)) in ev.iter().enumerate() {
        if start {
            sum += r as u128;
            *waste.entry(w).or_default() += 1;
        } else {
            sum -= r as u128;
            if let Some(c) = waste.get_mut(&w) {
                *c -= 1;
                if *c == 0 {
                    waste.remove(&w);
                }
            }
        }
        // Evaluate once every event at this time is in.
        if ev.get(k + 1).is_none_or(|n| n.0 != t) {
            let top = waste.keys().next_back().copied().unwrap_or(0) as u128;
            best = best.max(sum.saturating_sub(top));
        }
    }
    // At least max live: at every step the roundings sum to at least the
    // largest one.
    best as u64
}

pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Height of a layout of units.
pub fn height(units: &[Unit], offsets: &[u64]) -> u64 {
    units
        .iter()
        .zip(offsets)
        .map(|(u, &o)| o + u.size)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Buffer, Reuse, validate};

    #[test]
    fn a_reuse_chain_is_one_exact_unit() {
        let mut p = Problem::new(vec![
            Buffer::new("a", 0, 2, 4),
            Buffer::new("b", 1, 3, 4).aligned(2),
            Buffer::new("c", 2, 5, 4),
            Buffer::new("empty", 3, 3, 4),
        ]);
        p.reuses = vec![
            Reuse {
                output: 1,
                input: 0,
            },
            Reuse {
                output: 2,
                input: 1,
            },
        ];
        let u = Units::new(&p);
        assert_eq!(u.units.len(), 1);
        assert_eq!(
            u.units[0],
            Unit {
                lower: 0,
                upper: 5,
                size: 4,
                align: 2,
                pin: None
            }
        );
        assert!(u.exact);
        assert_eq!(u.unit_of, vec![Some(0), Some(0), Some(0), None]);
        let s = u.to_solution(&p, &[6]);
        assert_eq!(s.offsets, vec![6, 6, 6, 0]);
        validate(&p, &s, None).unwrap();
    }

    #[test]
    fn a_group_of_mixed_sizes_is_not_exact() {
        let mut p = Problem::new(vec![Buffer::new("a", 0, 2, 8), Buffer::new("b", 1, 3, 4)]);
        p.reuses.push(Reuse {
            output: 1,
            input: 0,
        });
        let u = Units::new(&p);
        assert_eq!(u.units[0].size, 8);
        assert!(!u.exact);
    }

    #[test]
    fn aligned_floor_counts_the_rounding_of_all_but_the_top_unit() {
        let u = |lower, upper, size, align| Unit {
            lower,
            upper,
            size,
            align,
            pin: None,
        };
        // Three 4-byte scalars and a 100-byte tensor, all live at once,
        // 64-byte aligned: three of them take 64 bytes each below the top.
        let us = [
            u(0, 2, 4, 64),
            u(0, 2, 4, 64),
            u(0, 2, 4, 64),
            u(0, 2, 100, 64),
        ];
        assert_eq!(max_live(&us), 112);
        // Rounded: 64 * 3 + 128 = 320, minus the largest rounding (60).
        assert_eq!(aligned_floor(&us), 260);
        // Without alignment it is max live.
        let plain: Vec<Unit> = us.iter().map(|x| Unit { align: 1, ..*x }).collect();
        assert_eq!(aligned_floor(&plain), 112);
        // A pin off the common alignment turns the rounding argument off.
        let mut pinned = us;
        pinned[0].pin = Some(4);
        assert_eq!(aligned_floor(&pinned), 112);
    }
}
