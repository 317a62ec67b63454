//! The allocator's entry point: heuristics, then exact search, per
//! independent region, in capacity or minimise mode.
//!
//! 1. [`Problem::check`], then reuse groups become units ([`Units`]).
//! 2. Regions: units split into partitions where no unit crosses a time
//!    cut. In a partition without pins, a unit live over the whole
//!    partition can go to the bottom without loss (cut its band out of any
//!    layout and the rest closes over it), so such units are stacked at
//!    the bottom and the rest, which often falls apart into smaller
//!    partitions, is solved on top of them, recursively. This is only done
//!    when the stacked sizes are multiples of every alignment in the
//!    partition, so the shift keeps everything aligned.
//! 3. Every leaf partition gets the best of the greedy heuristics.
//! 4. Leaves above the target (the capacity, or in minimise mode the
//!    floor) go to the exact search ([`crate::search`]): first at the
//!    target, then, when minimising, at capacities between the best proven
//!    bound and the best layout, bisecting; each attempt has a share of
//!    the time left. A failed attempt that ran to the end is a proof and
//!    raises the bound.
//!
//! The result always carries the best layout found and a proven lower
//! bound on the arena: the floor (max live bytes) or better.

use std::time::{Duration, Instant};

use crate::heuristics::{self, Heuristic};
use crate::params::SolverParams;
use crate::problem::{Problem, ProblemError, Solution};
use crate::search::{self, Decision, Restarts, SearchStats};
use crate::sweep::Sweep;
use crate::units::{self, Unit, Units, gcd, lcm};

/// What to solve for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The smallest arena: stop when the floor is reached (proven optimal)
    /// or the time runs out.
    Minimize,
    /// Whether everything fits in this many bytes (MiniMalloc's decision
    /// problem); stop at the first layout that fits.
    Capacity(u64),
}

/// How a solve ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The layout's height equals the proven lower bound.
    Optimal,
    /// Capacity mode: the layout fits the capacity. Minimise mode: the best
    /// layout found, above the lower bound.
    Feasible,
    /// Capacity mode: proven that no layout fits.
    Infeasible,
    /// Capacity mode: the time ran out before a layout that fits was found
    /// or the capacity was refuted.
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Optimal => "optimal",
            Status::Feasible => "feasible",
            Status::Infeasible => "infeasible",
            Status::Unknown => "unknown",
        }
    }
}

/// Counters for reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SolveStats {
    pub seconds: f64,
    /// Height of the best heuristic layout (all leaves together).
    pub heuristic_height: u64,
    /// The heuristic that won most leaves' bytes (the tallest leaf's).
    pub heuristic: String,
    /// Search nodes and runs.
    pub nodes: u64,
    pub runs: u64,
    /// Leaf partitions, and how many went to the exact search.
    pub leaves: usize,
    pub searched_leaves: usize,
    /// Units after merging reuse groups, and how many were stacked at the
    /// bottom of their partition.
    pub units: usize,
    pub peeled: usize,
    /// The time limit cut the solve short: a leaf kept fewer heuristics,
    /// the search stopped, or the whole-problem baseline was skipped. The
    /// layout is still valid; only the work spent on it was bounded.
    pub time_limit_hit: bool,
}

/// The result of a solve.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The best layout found (in capacity mode it may not fit when the
    /// status is not `Feasible`/`Optimal`).
    pub solution: Solution,
    pub status: Status,
    /// A proven lower bound on the arena of any layout.
    pub lower_bound: u64,
    /// The problem's max live bytes (the floor).
    pub max_live: u64,
    /// Which method produced the tallest part of the layout: a heuristic's
    /// name, `search` or `ilp`.
    pub source: String,
    pub stats: SolveStats,
}

impl Outcome {
    /// `(height - lower_bound) / lower_bound` (0 when both are 0).
    pub fn gap(&self) -> f64 {
        if self.lower_bound == 0 {
            return 0.0;
        }
        (self.solution.height as f64 - self.lower_bound as f64) / self.lower_bound as f64
    }
}

/// A leaf partition: units solved together on top of `base` bytes.
struct Leaf {
    units: Vec<usize>,
    base: u64,
    /// Local units (copies) and their best offsets, height and bound.
    local: Vec<Unit>,
    offsets: Vec<u64>,
    height: u64,
    lower: u64,
    source: String,
    /// Proven: no layout of this leaf is lower than `height`.
    done: bool,
}

/// What [`regions`] builds: the offsets of stacked units, and the leaves
/// left to solve with the base each sits on.
#[derive(Default)]
struct Regions {
    offsets: Vec<u64>,
    peeled: usize,
    /// The top of the highest stack.
    peak: u64,
    leaves: Vec<Vec<usize>>,
    bases: Vec<u64>,
}

/// Splits `idx` into leaves, stacking full-span units at the bottom.
fn regions(all: &[Unit], idx: Vec<usize>, base: u64, params: &SolverParams, out: &mut Regions) {
    if idx.is_empty() {
        return;
    }
    let local: Vec<Unit> = idx.iter().map(|&i| all[i]).collect();
    let parts: Vec<Vec<usize>> = if params.static_decomposition {
        Sweep::new(&local)
            .partitions
            .into_iter()
            .map(|p| p.units.into_iter().map(|k| idx[k]).collect())
            .collect()
    } else {
        vec![idx]
    };
    for part in parts {
        let pinned = part.iter().any(|&i| all[i].pin.is_some());
        if params.peel_full_span && !pinned && part.len() > 1 {
            let lo = part.iter().map(|&i| all[i].lower).min().unwrap_or(0);
            let hi = part.iter().map(|&i| all[i].upper).max().unwrap_or(0);
            let a = part.iter().fold(1u64, |a, &i| lcm(a, all[i].align));
            let (full, rest): (Vec<usize>, Vec<usize>) = part
                .iter()
                .partition(|&&i| all[i].lower == lo && all[i].upper == hi && all[i].size % a == 0);
            if !full.is_empty() {
                let mut top = base;
                for &i in &full {
                    out.offsets[i] = top;
                    top += all[i].size;
                }
                out.peak = out.peak.max(top);
                out.peeled += full.len();
                if params.static_decomposition {
                    regions(all, rest, top, params, out);
                } else if !rest.is_empty() {
                    out.leaves.push(rest);
                    out.bases.push(top);
                }
                continue;
            }
        }
        out.leaves.push(part);
        out.bases.push(base);
    }
}

/// Solves `problem` in `mode`.
pub fn solve(
    problem: &Problem,
    mode: Mode,
    params: &SolverParams,
) -> Result<Outcome, ProblemError> {
    let start = Instant::now();
    // A limit too far ahead for the clock is no deadline.
    let deadline = params.time_limit.and_then(|t| start.checked_add(t));
    problem.check()?;
    let u = Units::new(problem);
    let all = &u.units;
    let mut rg = Regions {
        offsets: vec![0u64; all.len()],
        ..Default::default()
    };
    regions(all, (0..all.len()).collect(), 0, params, &mut rg);
    let mut stats = SolveStats {
        units: all.len(),
        peeled: rg.peeled,
        ..Default::default()
    };
    let peak = rg.peak;
    let (mut leaves, cut) = heuristic_leaves(
        all,
        std::mem::take(&mut rg.leaves),
        &rg.bases,
        params,
        deadline,
    );
    stats.time_limit_hit = cut;
    stats.leaves = leaves.len();
    stats.heuristic_height = leaves
        .iter()
        .map(|l| l.base + l.height)
        .max()
        .unwrap_or(0)
        .max(peak);
    let mut search = LeafSearch {
        params,
        deadline,
        exact: u.exact,
        peak,
        stats: &mut stats,
    };
    let mut infeasible = false;
    if params.exact_search {
        match mode {
            Mode::Capacity(cap) => infeasible = search.decide(&mut leaves, cap),
            Mode::Minimize => search.minimise(&mut leaves),
        }
    }
    let mut offsets = rg.offsets;
    for l in &leaves {
        for (k, &i) in l.units.iter().enumerate() {
            offsets[i] = l.base + l.offsets[k];
        }
    }
    let max_live = problem.max_live();
    let mut solution = u.to_solution(problem, &offsets);
    let mut baseline_won = false;
    // Never worse than the plain baseline: greedy by size over the whole
    // problem, without partitions or peeling (one more O(u^2) pass, only
    // when the layout is above the floor, and only within the time limit:
    // past it, the pass is skipped or given up and the report says so).
    if solution.height > max_live && !all.is_empty() {
        match heuristics::greedy_by_size_until(problem, deadline) {
            Some(g) if g.height < solution.height => {
                solution = g;
                baseline_won = true;
            }
            Some(_) => {}
            None => stats.time_limit_hit = true,
        }
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        stats.time_limit_hit = true;
    }
    // Bounds: the floor, and every leaf's proven bound on its base.
    let mut lower_bound = max_live;
    if u.exact {
        lower_bound = lower_bound.max(peak).max(units::aligned_floor(all));
        for l in &leaves {
            lower_bound = lower_bound.max(l.base + l.lower);
        }
    }
    let tallest = leaves.iter().max_by_key(|l| l.base + l.height);
    stats.heuristic = tallest.map(|l| l.source.clone()).unwrap_or_default();
    let source = if baseline_won {
        "size/best (whole problem)".to_string()
    } else {
        stats.heuristic.clone()
    };
    let status = status(mode, solution.height, lower_bound, infeasible);
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(Outcome {
        solution,
        status,
        lower_bound,
        max_live,
        source,
        stats,
    })
}

/// How a solve ended, from the layout's height, the proven bound and
/// whether the search refuted the capacity.
fn status(mode: Mode, height: u64, lower_bound: u64, infeasible: bool) -> Status {
    let optimal_or_feasible = if height <= lower_bound {
        Status::Optimal
    } else {
        Status::Feasible
    };
    match mode {
        Mode::Minimize => optimal_or_feasible,
        Mode::Capacity(cap) if height <= cap => optimal_or_feasible,
        Mode::Capacity(cap) if infeasible || lower_bound > cap => Status::Infeasible,
        Mode::Capacity(_) => Status::Unknown,
    }
}

/// Every leaf with the best of the greedy heuristics' layouts; past
/// `deadline`, each leaf keeps the first heuristic's layout only (the flag
/// says whether that happened).
fn heuristic_leaves(
    all: &[Unit],
    leaves: Vec<Vec<usize>>,
    bases: &[u64],
    params: &SolverParams,
    deadline: Option<Instant>,
) -> (Vec<Leaf>, bool) {
    let mut cut = false;
    let hs: Vec<Heuristic> = if params.heuristics.is_empty() {
        vec![Heuristic::ALL[0]]
    } else {
        params.heuristics.clone()
    };
    let leaves = leaves
        .into_iter()
        .zip(bases)
        .map(|(idx, &base)| {
            let local: Vec<Unit> = idx.iter().map(|&i| all[i]).collect();
            let lower = units::aligned_floor(&local);
            let ((h, offs, height), c) = heuristics::best_of_until(&local, &hs, lower, deadline);
            cut |= c;
            Leaf {
                units: idx,
                base,
                local,
                offsets: offs,
                height,
                lower,
                source: h.name(),
                done: height <= lower,
            }
        })
        .collect();
    (leaves, cut)
}

/// The exact search over the leaves above the target, sharing the time.
struct LeafSearch<'a> {
    params: &'a SolverParams,
    deadline: Option<Instant>,
    /// Units are exact (no merged reuse groups): a refuted leaf refutes
    /// the whole problem.
    exact: bool,
    /// The top of the stacked units.
    peak: u64,
    stats: &'a mut SolveStats,
}

impl LeafSearch<'_> {
    /// Capacity mode: makes every leaf fit `cap`, or proves one cannot
    /// (returns true). Passes over the leaves still undecided: each gets an
    /// equal share of the time left; time a leaf does not use goes to the
    /// next, and what is left after a pass to the leaves that ran out of
    /// their share.
    fn decide(&mut self, leaves: &mut [Leaf], cap: u64) -> bool {
        let mut pending: Vec<usize> = (0..leaves.len())
            .filter(|&k| leaves[k].base + leaves[k].height > cap)
            .collect();
        pending.sort_by_key(|&k| std::cmp::Reverse(leaves[k].local.len()));
        let mut first_pass = true;
        while !pending.is_empty() {
            if !first_pass && self.deadline.is_none_or(|d| Instant::now() >= d) {
                break;
            }
            let n = pending.len();
            let mut undecided = Vec::new();
            for (done, k) in pending.into_iter().enumerate() {
                let l = &mut leaves[k];
                let t = cap.saturating_sub(l.base);
                if self.exact && (self.peak > cap || l.lower > t) {
                    return true;
                }
                if first_pass {
                    self.stats.searched_leaves += 1;
                }
                match self.decide_leaf(l, t, share(self.deadline, n - done)) {
                    Decision::Fits(o) => {
                        l.height = units::height(&l.local, &o);
                        l.offsets = o;
                        l.source = "search".into();
                    }
                    Decision::Infeasible if self.exact => return true,
                    Decision::Infeasible => {}
                    Decision::Unknown => undecided.push(k),
                }
            }
            pending = undecided;
            first_pass = false;
        }
        false
    }

    fn decide_leaf(&mut self, l: &Leaf, capacity: u64, deadline: Option<Instant>) -> Decision {
        let mut st = SearchStats::default();
        let d = search::decide_with(
            &l.local,
            capacity,
            self.params,
            decision_restarts(self.params),
            deadline,
            nodes_left(self.params, self.stats.nodes),
            &mut st,
        );
        self.stats.nodes += st.nodes;
        self.stats.runs += st.runs;
        d
    }

    /// Minimise mode: brings the tallest leaves down toward the floor
    /// every leaf must reach (the tallest leaf's proven bound), tallest
    /// first, stopping within the tolerance.
    fn minimise(&mut self, leaves: &mut [Leaf]) {
        let goal = leaves
            .iter()
            .map(|l| l.base + l.lower)
            .max()
            .unwrap_or(0)
            .max(self.peak);
        // Close enough: within the tolerance of the floor.
        let good = goal.saturating_add((goal as f64 * self.params.tolerance.max(0.0)) as u64);
        let mut order: Vec<usize> = (0..leaves.len())
            .filter(|&k| leaves[k].base + leaves[k].height > good)
            .collect();
        order.sort_by_key(|&k| std::cmp::Reverse(leaves[k].base + leaves[k].height));
        let n = order.len();
        for (done, k) in order.into_iter().enumerate() {
            // Leaves only need to come down to the tallest other leaf's
            // proven bound, and never below their own.
            let dl = share(self.deadline, n - done);
            self.stats.searched_leaves += 1;
            let l = &mut leaves[k];
            let t = goal.saturating_sub(l.base).max(l.lower);
            let enough = good.saturating_sub(l.base).max(t);
            minimise_leaf(l, t, enough, self.params, dl, self.exact, self.stats);
        }
    }
}

/// A deadline that leaves equal shares to `parts` parts (this one
/// included).
fn share(deadline: Option<Instant>, parts: usize) -> Option<Instant> {
    let d = deadline?;
    let now = Instant::now();
    let left = d.saturating_duration_since(now);
    Some(now + left / parts.max(1) as u32)
}

/// Brings a leaf's height down toward `goal` (its own floor or better)
/// with capacity attempts, stopping once it is at most `enough` (`goal`
/// plus the tolerance). First the goal itself, with a tenth of the
/// time (step graphs and perfect packings end here, proven optimal). Then
/// a descent from the best layout: try `best - step`; a layout that fits
/// becomes the best (often lower than asked), a proof that nothing fits
/// raises the lower bound, and an attempt that runs out of its slice (a
/// eighth of the time left) halves the step. Descent attempts use
/// [`Restarts::Randomized`]. Capacities are multiples of
/// the gcd of the leaf's sizes, alignments above 1 and pins, since every height
/// is. Raises `lower` on proofs when the units are exact.
fn minimise_leaf(
    l: &mut Leaf,
    goal: u64,
    enough: u64,
    params: &SolverParams,
    deadline: Option<Instant>,
    exact: bool,
    stats: &mut SolveStats,
) {
    #[cfg(feature = "ilp")]
    if params.ilp_max_units >= l.local.len() && l.height > l.lower {
        if let Some(r) = crate::ilp::minimise(&l.local, &l.offsets, l.height, l.lower, deadline) {
            if r.height < l.height {
                l.height = r.height;
                l.offsets = r.offsets;
                l.source = "ilp".into();
            }
            if r.optimal && exact {
                l.lower = l.lower.max(r.height.min(l.height));
            }
        }
    }
    let g = l
        .local
        .iter()
        // An alignment of 1 rounds nothing, so it does not count.
        .flat_map(|u| {
            [
                u.size,
                if u.align > 1 { u.align } else { 0 },
                u.pin.unwrap_or(0),
            ]
        })
        .fold(0, gcd)
        .max(1);
    if exact {
        l.lower = l.lower.next_multiple_of(g);
    }
    let mut lo = l.lower;
    let mut first = true;
    let mut step: Option<u64> = None;
    let mut attempts = 0u64;
    while lo < l.height {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let gap = l.height - lo;
        let s = if first {
            gap
        } else {
            step.unwrap_or(gap.div_ceil(2)).clamp(1, gap)
        };
        // Heights come in multiples of `g`, so the goal rounds down: a
        // layout within the goal is within its multiple below (rounding up
        // could ask for no less than the height the leaf already has).
        let cap = if first {
            (goal / g * g).max(lo)
        } else {
            ((l.height - s) / g * g).max(lo)
        };
        if cap >= l.height {
            break;
        }
        let dl = deadline.map(|d| {
            let now = Instant::now();
            let left = d.saturating_duration_since(now);
            now + if first { left / 10 } else { left / 8 }.max(Duration::from_millis(1))
        });
        let was_first = std::mem::replace(&mut first, false);
        let budget = nodes_left(params, stats.nodes);
        if budget == 0 {
            break;
        }
        let mut st = SearchStats::default();
        // The first attempt (at the goal) mixes the preorders as they are
        // with shuffled ones, as capacity mode does; the descent only
        // shuffles, with a new seed each time, so a capacity tried again
        // searches new trees.
        let restarts = if !params.random_restarts || was_first {
            decision_restarts(params)
        } else {
            attempts += 1;
            Restarts::Randomized {
                seed: params.seed ^ attempts,
            }
        };
        let d = search::decide_with(&l.local, cap, params, restarts, dl, budget, &mut st);
        if params.node_budget.is_some() && st.nodes == 0 {
            // Nothing was searched: with a budget, trying again cannot help.
            break;
        }
        stats.nodes += st.nodes;
        stats.runs += st.runs;
        match d {
            Decision::Fits(o) => {
                l.height = units::height(&l.local, &o);
                l.offsets = o;
                l.source = "search".into();
            }
            Decision::Infeasible => {
                if !exact {
                    break;
                }
                lo = (cap + 1).next_multiple_of(g);
                l.lower = l.lower.max(lo);
            }
            Decision::Unknown => {
                if !was_first {
                    step = Some((s / 2).max(g));
                }
            }
        }
        if l.height <= enough {
            break;
        }
    }
    l.done = l.height <= l.lower;
}

/// The restarts of a capacity decision: fixed and shuffled preorders in
/// turn ([`Restarts::Mixed`]), or only the fixed ones when shuffling is
/// off.
fn decision_restarts(params: &SolverParams) -> Restarts {
    if params.random_restarts {
        Restarts::Mixed { seed: params.seed }
    } else {
        Restarts::Doubling
    }
}

/// Nodes the next exact decision may use: an eighth of the solve's budget,
/// at most what is left of it (`u64::MAX` without a budget).
fn nodes_left(params: &SolverParams, spent: u64) -> u64 {
    params
        .node_budget
        .map_or(u64::MAX, |b| b.saturating_sub(spent).min((b / 8).max(1)))
}
