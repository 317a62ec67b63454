//! The layout as a mixed-integer program (good_lp + HiGHS), for small
//! partitions.
//!
//! Variables: each free unit's offset `x_i = align_i * k_i` with `k_i` a
//! non-negative integer; one binary `z_ij` per pair of free units live at
//! the same time (which one is below); the height `H`. Constraints, with
//! `M` the height of a known layout:
//!
//! ```text
//! x_i + s_i <= x_j + M (1 - z_ij)        x_j + s_j <= x_i + M z_ij
//! x_i + s_i <= H                          x_i + s_i <= p or p + s_p <= x_i
//! ```
//!
//! (the last pair for a pinned unit at `p`, through one more binary).
//! Minimise `H`, starting from the known layout. The big-M relaxation is
//! weak, so this only pays on a few dozen units; `benches/allocator.rs`
//! and `memplan alloc --report` compare it with the search.

use std::time::Instant;

use good_lp::{
    Expression, ResolutionError, Solution as _, SolutionStatus, SolverModel, Variable,
    WithInitialSolution, constraint, highs, variable, variables,
};

use crate::units::Unit;

/// What the ILP found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IlpResult {
    /// Offsets indexed like the units, and their height.
    pub offsets: Vec<u64>,
    pub height: u64,
    /// HiGHS proved the height optimal.
    pub optimal: bool,
}

/// Minimises the height of `units` starting from a layout `start` of height
/// `ub`, never going below `lb`. `None` when HiGHS fails or returns
/// nothing better than `start`'s validity would allow.
pub fn minimise(
    units: &[Unit],
    start: &[u64],
    ub: u64,
    lb: u64,
    deadline: Option<Instant>,
) -> Option<IlpResult> {
    let n = units.len();
    let big = ub as f64;
    let mut vars = variables!();
    let mut x: Vec<Option<Variable>> = Vec::with_capacity(n);
    let mut init: Vec<(Variable, f64)> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        if u.pin.is_some() {
            x.push(None);
            continue;
        }
        let hi = (ub.saturating_sub(u.size) / u.align) as f64;
        let k = vars.add(variable().integer().min(0.0).max(hi));
        init.push((k, (start[i] / u.align) as f64));
        x.push(Some(k));
    }
    let h = vars.add(variable().min(lb as f64).max(big));
    init.push((h, ub as f64));
    let off = |i: usize, x: &[Option<Variable>]| -> Expression {
        match x[i] {
            Some(k) => units[i].align as f64 * k,
            None => Expression::from(units[i].pin.unwrap_or(0) as f64),
        }
    };
    let mut cons = Vec::new();
    for i in 0..n {
        if x[i].is_some() {
            cons.push(constraint!(off(i, &x) + units[i].size as f64 <= h));
        }
    }
    for i in 0..n {
        for j in 0..i {
            if !units[i].overlaps(&units[j]) || (x[i].is_none() && x[j].is_none()) {
                continue;
            }
            let z = vars.add(variable().binary());
            let below = start[i] + units[i].size <= start[j];
            init.push((z, if below { 1.0 } else { 0.0 }));
            // z = 1: i below j; z = 0: j below i.
            cons.push(constraint!(
                off(i, &x) + units[i].size as f64 <= off(j, &x) + big * (1.0 - z)
            ));
            cons.push(constraint!(
                off(j, &x) + units[j].size as f64 <= off(i, &x) + big * z
            ));
        }
    }
    let mut model = vars.minimise(h).using(highs);
    for c in cons {
        model = model.with(c);
    }
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(Instant::now()).as_secs_f64();
        model = model.set_time_limit(left.max(0.001));
    }
    model = model.set_threads(1).with_initial_solution(init);
    let sol = match model.solve() {
        Ok(s) => s,
        Err(ResolutionError::Infeasible) | Err(_) => return None,
    };
    let optimal = matches!(sol.status(), SolutionStatus::Optimal);
    let offsets: Vec<u64> = units
        .iter()
        .enumerate()
        .map(|(i, u)| match (u.pin, x[i]) {
            (Some(p), _) => p,
            (None, Some(k)) => sol.value(k).round().max(0.0) as u64 * u.align,
            (None, None) => 0,
        })
        .collect();
    let height = crate::units::height(units, &offsets);
    // Trust but verify: rounding must leave a valid layout.
    for i in 0..n {
        for j in 0..i {
            if units[i].overlaps(&units[j]) {
                let (a, b) = (offsets[i], offsets[j]);
                if a + units[i].size > b && b + units[j].size > a {
                    return None;
                }
            }
        }
    }
    Some(IlpResult {
        offsets,
        height,
        optimal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(lower: u64, upper: u64, size: u64) -> Unit {
        Unit {
            lower,
            upper,
            size,
            align: 1,
            pin: None,
        }
    }

    #[test]
    fn closes_a_greedy_gap() {
        // Greedy by size puts the two 2-byte units side by side at 0 and
        // leaves a hole; the optimum is the floor, 4.
        let us = vec![u(0, 2, 2), u(0, 4, 1), u(2, 6, 2), u(4, 6, 1), u(0, 6, 1)];
        let start = vec![0, 2, 3, 2, 5];
        let r = minimise(&us, &start, 6, 4, None).expect("solved");
        assert!(r.optimal);
        assert_eq!(r.height, crate::units::max_live(&us));
    }
}
