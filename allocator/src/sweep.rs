//! Cuts time into sections and the units into independent partitions.
//!
//! The distinct endpoints `t_0 < t_1 < ... < t_m` of all lifetimes cut time
//! into sections `[t_k, t_(k+1))`; inside one section the set of live units
//! does not change, so a unit covers a contiguous run of sections (its
//! *span*). Where no unit crosses the boundary between two sections, what
//! lies left and right of it never conflicts: those are separate
//! partitions, laid out independently in the same bytes (the arena is the
//! tallest of them). Cost: `O(u log u)`.

use crate::units::Unit;

/// An independent part of the problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Indices of its units, in increasing order of `lower`.
    pub units: Vec<usize>,
}

/// The sections and partitions of a set of units.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// Section `k` covers `[times[k], times[k + 1])`.
    pub times: Vec<u64>,
    /// The sections each unit covers: `[first, last + 1)`.
    pub span: Vec<(u32, u32)>,
    pub partitions: Vec<Partition>,
}

impl Sweep {
    /// Sweeps `units` (every unit must have `lower < upper`).
    pub fn new(units: &[Unit]) -> Sweep {
        let mut times: Vec<u64> = units.iter().flat_map(|u| [u.lower, u.upper]).collect();
        times.sort_unstable();
        times.dedup();
        let at = |t: u64| times.binary_search(&t).expect("an endpoint") as u32;
        let span: Vec<(u32, u32)> = units.iter().map(|u| (at(u.lower), at(u.upper))).collect();
        let mut idx: Vec<usize> = (0..units.len()).collect();
        idx.sort_by_key(|&i| (units[i].lower, i));
        let mut partitions: Vec<Partition> = Vec::new();
        let mut reach = 0u64;
        for i in idx {
            let u = &units[i];
            match partitions.last_mut() {
                Some(p) if u.lower < reach => p.units.push(i),
                _ => partitions.push(Partition { units: vec![i] }),
            }
            reach = if partitions.last().is_some_and(|p| p.units.len() == 1) {
                u.upper
            } else {
                reach.max(u.upper)
            };
        }
        Sweep {
            times,
            span,
            partitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(lower: u64, upper: u64) -> Unit {
        Unit {
            lower,
            upper,
            size: 1,
            align: 1,
            pin: None,
        }
    }

    #[test]
    fn touching_lifetimes_are_independent() {
        let s = Sweep::new(&[u(0, 2), u(2, 4), u(3, 6), u(1, 2), u(6, 7)]);
        assert_eq!(s.times, vec![0, 1, 2, 3, 4, 6, 7]);
        assert_eq!(s.span[2], (3, 5));
        let parts: Vec<Vec<usize>> = s.partitions.iter().map(|p| p.units.clone()).collect();
        assert_eq!(parts, vec![vec![0, 3], vec![1, 2], vec![4]]);
    }
}
