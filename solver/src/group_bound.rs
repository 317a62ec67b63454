//! Group floors: a lower bound from which op of a group runs first (or
//! last), stronger than the min-cut floor where the floor's best sets at
//! different ops contradict each other.
//!
//! # Why the floor can be loose
//! The floor ([`crate::bounds::min_cut_floor`]) is `max over v` of the least
//! live bytes at `v` over every set of ops that can run before `v`. Each op
//! picks its own best set, and the sets of two ops may need opposite orders.
//! A training step shows it: every layer's weight gradient is a large
//! buffer, made from two saved activations. At any one weight-gradient op
//! the floor runs all the *other* layers' backward first, so their
//! activations are gone and their gradients already consumed; but in a real
//! order one of these ops runs first, and at that moment every other
//! layer still holds its activations. On an 8-layer MLP step (XLA dump,
//! 64 MiB weight gradients, 4 MiB activations) the floor sits 3% below the
//! best order for that reason alone.
//!
//! # The bound
//! Take any group `G` of ops. In every valid order some `g ∈ G` runs first;
//! the ops before it hold no other member of `G` and, being closed under
//! predecessors, no descendant of one. So the live bytes at `g`'s step are
//! at least the cut at `g` over the sets that exclude `G \ {g}` and their
//! descendants ([`CutSolver::cut_with`]), and the peak of every order is at
//! least `min over g ∈ G` of that cut. The same holds for the op of `G`
//! that runs **last**, whose preceding set holds all of `G \ {g}` and
//! their ancestors. A member that cannot be first (last) at all, because
//! another member precedes (follows) it, drops out of the minimum. One-op
//! groups give the floor itself, so the bound is never weaker; the max
//! over several groups is a bound too.
//!
//! # Choosing groups
//! Groups that help are made of ops that each add a lot of memory where
//! they run, or that each free a lot: the ops with the largest transient
//! outputs, resp. the largest transient inputs. Both rankings are tried
//! with both ends: the first of the big allocators (the MLP above), the
//! last of the big freers, and the mixed pairs; the last of a set of
//! weight-gradient ops, for one, is where either the buffers their updates
//! share are live or every other gradient still waits (a constant
//! broadcast to a weight's shape that every layer's update reads, in
//! unfused XLA modules). The search peels: starting from the `k` largest
//! ops of a ranking, it computes every
//! member's constrained cut, records the minimum when it beats the best
//! bound so far, and drops every member whose cut is not above that best
//! bound: its cut can only fall as the group shrinks, so no later group
//! holding it could beat the bound. It stops when the group is empty, or
//! at the cut budget or deadline. With `k` members that is at most
//! `k (k + 1) / 2` cuts per group, each a max-flow over the ops
//! incomparable with the member.

use std::time::Instant;

use crate::cut::CutSolver;
use crate::problem::{OpIdx, Problem};

/// Which end of its group an op is assumed to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The member runs before every other member.
    First,
    /// The member runs after every other member.
    Last,
}

/// Limits of the group search (both measured in work, not time, so the
/// bound does not depend on the machine unless the deadline stops it).
#[derive(Clone, Debug)]
pub struct GroupParams {
    /// Members of each starting group (one per end and ranking).
    pub members: usize,
    /// Cuts the whole search may solve (all four groups together).
    pub max_cuts: usize,
}

impl Default for GroupParams {
    fn default() -> Self {
        GroupParams {
            members: 24,
            max_cuts: 600,
        }
    }
}

/// The best group bound found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupFloor {
    /// A lower bound on the peak of every order; equal to the `above`
    /// argument of [`group_floor`] when no group beat it.
    pub bytes: u64,
    /// The group that gave `bytes` (empty when none beat `above`) and the
    /// end its members were assumed to hold.
    pub group: Vec<OpIdx>,
    pub end: Option<End>,
    /// Cuts solved.
    pub cuts: usize,
    /// Whether the search ran to its end for every group (neither the cut
    /// budget nor the deadline stopped it).
    pub finished: bool,
}

/// The rankings of candidates: transient bytes an op adds when it runs
/// (`First`: its outputs, less what its reuse hints may save) or may free
/// (`Last`: its inputs).
fn weight(p: &Problem, v: OpIdx, by: End) -> u64 {
    let transient = |b| !p.buf(b).persistent;
    match by {
        End::First => {
            let out: u64 = p
                .outputs(v)
                .filter(|&b| transient(b))
                .map(|b| p.size(b))
                .sum();
            let saved: u64 = p
                .reuses_of(v)
                .filter(|r| transient(r.inp))
                .map(|r| p.size(r.out).min(p.size(r.inp)))
                .sum();
            out.saturating_sub(saved)
        }
        End::Last => p
            .uses(v)
            .filter(|&b| transient(b) && p.buf(b).producer.is_some())
            .map(|b| p.size(b))
            .sum(),
    }
}

/// The `k` ops of largest [`weight`] by ranking `by` (ties by index), none
/// of weight 0.
fn candidates(p: &Problem, by: End, k: usize) -> Vec<OpIdx> {
    let mut c: Vec<(u64, OpIdx)> = p
        .ops()
        .map(|v| (weight(p, v, by), v))
        .filter(|&(w, _)| w > 0)
        .collect();
    c.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    c.truncate(k);
    let mut ops: Vec<OpIdx> = c.into_iter().map(|x| x.1).collect();
    ops.sort_unstable();
    ops
}

/// The constrained cut of `g` as the `end` member of `group`.
fn member_cut(cs: &mut CutSolver<'_>, group: &[OpIdx], g: OpIdx, end: End) -> Option<u64> {
    let others: Vec<OpIdx> = group.iter().copied().filter(|&o| o != g).collect();
    let cut = match end {
        End::First => cs.cut_with(g, &[], &others),
        End::Last => cs.cut_with(g, &others, &[]),
    };
    cut.map(|c| c.bytes)
}

/// A lower bound on the peak of every order of `p` from groups of ops (see
/// the module docs), at least `above` (a bound the caller already has,
/// such as the min-cut floor). `upper` is the best known peak: the search
/// stops once it reaches it.
pub fn group_floor(
    p: &Problem,
    above: u64,
    upper: u64,
    params: &GroupParams,
    deadline: Option<Instant>,
) -> GroupFloor {
    let mut out = GroupFloor {
        bytes: above,
        finished: true,
        ..Default::default()
    };
    let mut cs = CutSolver::new(p);
    let rankings = [
        (End::First, End::First),
        (End::Last, End::Last),
        (End::First, End::Last),
        (End::Last, End::First),
    ];
    for (end, by) in rankings {
        let mut group = candidates(p, by, params.members);
        while group.len() > 1 && out.bytes < upper {
            if out.cuts + group.len() > params.max_cuts
                || deadline.is_some_and(|d| Instant::now() >= d)
            {
                out.finished = false;
                return out;
            }
            let cuts: Vec<Option<u64>> = group
                .iter()
                .map(|&g| member_cut(&mut cs, &group, g, end))
                .collect();
            out.cuts += group.len();
            // Some member can hold the end in every order, so the minimum
            // is over at least one cut.
            let least = cuts.iter().flatten().copied().min().unwrap_or(0);
            if least > out.bytes {
                out.bytes = least;
                out.group = group.clone();
                out.end = Some(end);
            }
            let keep: Vec<OpIdx> = group
                .iter()
                .zip(&cuts)
                .filter(|&(_, c)| c.is_none_or(|c| c > out.bytes))
                .map(|(&g, _)| g)
                .collect();
            if keep.len() == group.len() {
                // Cannot happen: the least member's cut is at most the
                // best bound now.
                break;
            }
            group = keep;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{best_peak, build, spec};
    use proptest::prelude::*;

    /// A cut budget too small for one round stops the search with the
    /// caller's bound, marked unfinished.
    #[test]
    fn the_cut_budget_stops_the_search() {
        let s = crate::testing::Spec {
            n: 4,
            edges: vec![],
            bufs: vec![
                (Some(0), false, 10, vec![3]),
                (Some(1), false, 20, vec![3]),
                (Some(2), false, 5, vec![3]),
            ],
            hints: vec![],
            chain: false,
        };
        let p = build(&s);
        let params = GroupParams {
            members: 24,
            max_cuts: 1,
        };
        let g = group_floor(&p, 7, u64::MAX, &params, None);
        assert_eq!((g.bytes, g.cuts, g.finished), (7, 0, false));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// For every group and either end, the least member cut is at most
        /// the peak of every order; and the search's result is too.
        #[test]
        fn every_group_bounds_every_order(s in spec(7), pick in proptest::collection::vec(any::<bool>(), 7)) {
            let p = build(&s);
            let best = best_peak(&p);
            let group: Vec<OpIdx> = p.ops().filter(|o| pick[o.index()]).collect();
            let mut cs = CutSolver::new(&p);
            for end in [End::First, End::Last] {
                if group.is_empty() {
                    continue;
                }
                let cuts: Vec<Option<u64>> = group.iter().map(|&g| member_cut(&mut cs, &group, g, end)).collect();
                let least = cuts.iter().flatten().min();
                prop_assert!(least.is_some(), "no member can hold the {:?} end", end);
                prop_assert!(*least.unwrap() <= best, "{:?} group {:?}: {} > {}", end, group, least.unwrap(), best);
            }
            let g = group_floor(&p, 0, u64::MAX, &GroupParams::default(), None);
            prop_assert!(g.bytes <= best);
        }
    }
}
