//! The planning pipeline: orders, then layouts, keep the best plan.
//!
//! 1. Lower the graph for the solver ([`crate::lower`]).
//! 2. Make candidate orders: the program order, the orders the graph
//!    carries, the plain list schedule, the program order with each update
//!    moved to right after its gradient (as eager runs the optimizer in the
//!    backward pass: [`crate::baselines::optimizer_in_backward_order`]) and
//!    the solver's order ([`memplan_solver::solve`]: partition, per-part
//!    heuristics, exact search and local improvement, within the time
//!    limit). A plan the limit cuts short is never above any of them.
//! 3. Evaluate each (live-bytes peak, reuses taken) and lay out the best
//!    few with the allocator.
//! 4. Keep the smallest arena. The program order without reuses, laid out by
//!    greedy-by-size (the baseline a user gets without memplan), is always a
//!    candidate, so the result is never worse than it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use memplan_solver as solver;

use crate::error::Error;
use crate::graph::Graph;
use crate::layout::{LAYOUT_BACKSTOP, layout_within};
use crate::lower::{self, Lowered};
use crate::plan::Plan;

/// How hard to plan.
#[derive(Clone, Debug)]
pub struct Options {
    /// Wall-clock budget for the whole solve.
    pub time_limit: Duration,
    /// How many of the best orders (by live-bytes peak) get a layout.
    pub layouts: usize,
    /// The ordering solver's switches and limits.
    pub solver: solver::SolverParams,
    /// Counters the solve updates as it goes (for a progress bar).
    pub progress: Option<Arc<solver::Progress>>,
    /// Split token-wise chains first ([`crate::split::plan`] reads it; a
    /// plain [`plan`] plans the graph as given).
    pub split: Split,
}

/// What `--split` asks for.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Split {
    /// Never split.
    #[default]
    Off,
    /// Try each of [`crate::split::AUTO_CHUNKS`]; keep the best if it lowers the peak.
    Auto,
    /// Split every separable chain into this many chunks (at least 2), if
    /// that lowers the peak.
    Chunks(u64),
}

impl std::str::FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "none" | "no" => Ok(Split::Off),
            "auto" => Ok(Split::Auto),
            n => match n.parse::<u64>() {
                Ok(k) if k >= 2 => Ok(Split::Chunks(k)),
                Ok(1) => Ok(Split::Off),
                _ => Err(format!(
                    "split takes auto, off or a number of chunks (2 or more), got {s:?}"
                )),
            },
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            time_limit: Duration::from_secs(10),
            layouts: 3,
            solver: solver::SolverParams::default(),
            progress: None,
            split: Split::Off,
        }
    }
}

/// The longest time limit a front end accepts, in seconds (10^9 s, about
/// 31.7 years): longer is a mistake, and far longer overflows a clock.
pub const MAX_TIME_LIMIT_SECONDS: f64 = 1e9;

/// A time limit given in seconds, checked by the one rule every front end
/// uses (the CLI's `--time-limit`, the C ABI, the Python package): a
/// finite number above 0 and at most [`MAX_TIME_LIMIT_SECONDS`]. `what`
/// names the argument in the error, which prints the number compactly
/// (`1e300`, not 301 digits).
pub fn time_limit(seconds: f64, what: &str) -> Result<Duration, Error> {
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(Error::InvalidArgument(format!(
            "{what} must be a positive number of seconds, got {}",
            compact_number(seconds)
        )));
    }
    if seconds > MAX_TIME_LIMIT_SECONDS {
        return Err(Error::InvalidArgument(format!(
            "{what} must be at most 1e9 seconds (about 31 years), got {}",
            compact_number(seconds)
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// `x` as a short decimal: exponent notation beyond 10^15 and below 10^-6.
pub fn compact_number(x: f64) -> String {
    let a = x.abs();
    if x.is_finite() && a != 0.0 && !(1e-6..1e15).contains(&a) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Share of the time limit the ordering solver may use; the min-cut floor
/// gets [`BOUND_SHARE`]. Layouts are bounded by a work budget instead
/// ([`crate::layout::layout_params`]), so plans are deterministic.
const ORDER_SHARE: f64 = 0.65;

/// The time the work after the ordering keeps, as a multiple of the
/// lowering's: on gpt2-tiny at 2,500 layers (100,000 ops, 200,000
/// buffers; a lowering of 0.14 to 0.2 s on the 2-core development
/// machine) the candidates' evaluation and the first layout's fixed part
/// take about 0.6 s, and the ordering solver ends 0.1 to 0.25 s past its
/// budget (the heuristic under way, then improvement and combination).
const AFTER_ORDER: f64 = 6.0;

/// The time a layout takes after its allocator stops, as a multiple of the
/// lowering's (measured: 0.2 to 0.3 s at 200,000 buffers, where the
/// lowering takes 0.14 to 0.2 s).
const LAYOUT_TAIL: f64 = 1.5;

/// What a solve did, for `memplan plan --report`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `(phase, seconds)` of the pipeline: lowering, ordering, layout.
    pub phases: Vec<(String, f64)>,
    /// The ordering solver's report (per-part sizes, bounds, gaps).
    pub solver: solver::SolveReport,
    /// Every candidate order: `(source, max live bytes, arena bytes if it
    /// was laid out)`.
    pub candidates: Vec<(String, u64, Option<u64>)>,
}

/// An order with where it came from.
struct Candidate {
    source: &'static str,
    order: Vec<solver::OpIdx>,
    eval: solver::Evaluation,
}

/// Plans `g`: returns the smallest-arena plan found.
pub fn plan(g: &Graph, opts: &Options) -> Result<Plan, Error> {
    plan_with_report(g, opts).map(|(plan, _)| plan)
}

/// [`plan`], with a report of where the time went and how close each part
/// came to its bound.
pub fn plan_with_report(g: &Graph, opts: &Options) -> Result<(Plan, Report), Error> {
    plan_by(g, opts, Instant::now().checked_add(opts.time_limit))
}

/// [`plan_with_report`] with the time limit as a `deadline` (`None`: far
/// beyond the clock). Every phase keeps to it: the ordering solver stops
/// its heuristics and searches at its share (less on graphs so large that
/// the work after it needs more: [`AFTER_ORDER`]), the allocator stops a
/// layout's tail ([`LAYOUT_TAIL`]) before the deadline and the first
/// candidate's layout then finishes at once (a large leaf keeps the
/// runtime allocator's layout it started from, or the first greedy fit
/// with what it has not placed stacked on top, the lower), later
/// candidates and the program-order baseline are skipped or given up, and
/// the bound reports what it reached. A plan cut short says so in
/// [`crate::plan::PlanStats::time_limit_hit`]; it is valid like any other.
pub fn plan_by(
    g: &Graph,
    opts: &Options,
    deadline: Option<Instant>,
) -> Result<(Plan, Report), Error> {
    let start = Instant::now();
    let mut report = Report::default();
    let mut lap = Instant::now();
    let low = lower::lower(g, true);
    let lowering = lap.elapsed();
    report
        .phases
        .push(("lowering".into(), lowering.as_secs_f64()));
    lap = Instant::now();
    let cands = candidates(g, &low.problem, opts, deadline, lowering, &mut report);
    report
        .phases
        .push(("ordering".into(), lap.elapsed().as_secs_f64()));
    lap = Instant::now();
    let (mut plan, cut) = best_layout(g, &low, &cands, opts, deadline, lowering, &mut report);
    bound_plan(
        &mut plan,
        &low.problem,
        &cands,
        opts,
        deadline,
        &report,
        cut,
    );
    plan.stats.solve_seconds = start.elapsed().as_secs_f64();
    report
        .phases
        .push(("layout".into(), lap.elapsed().as_secs_f64()));
    Ok((plan, report))
}

/// What is left of the limit at `deadline` (None without one).
fn left(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The orders to lay out, lowest max live first: program order, the list
/// schedule, the graph's given orders and the solver's, each evaluated.
/// The solver's budget is its share of what is left, less what the work
/// after the ordering needs.
fn candidates(
    g: &Graph,
    p: &solver::Problem,
    opts: &Options,
    deadline: Option<Instant>,
    lowering: Duration,
    report: &mut Report,
) -> Vec<Candidate> {
    let mut orders: Vec<(&'static str, Vec<solver::OpIdx>)> =
        vec![("program-order", Lowered::from_op_ids(g.program_order()))];
    orders.push(("list-schedule", solver::list_schedule(p)));
    // Each update right after its gradient is complete, as an eager user
    // with the optimizer in the backward pass runs it, so that a plan cut
    // short by its limit is never above that configuration's order (on a
    // large checkpointed step the solver may stop before its update
    // placement). A candidate like the list schedule, not a seed of the
    // solver: as a seed it displaced orders the solver improves further.
    // (A step without updates gets its program order back: no candidate.)
    let oib = crate::baselines::optimizer_in_backward_order(g);
    if oib != g.program_order() {
        orders.push(("optimizer-in-backward", Lowered::from_op_ids(&oib)));
    }
    // A captured FSDP2 step: FSDP2 eager's own order (its gathers issued
    // as gloo does, at most one unit ahead in the backward), so that no
    // plan is above the order the user's eager step runs in (seen on
    // torchtitan's 70B shape with full AC at 64 ranks, where the solver's
    // orders held more than eager's: docs/estimate.md).
    if let Some(eager) =
        crate::baselines::fsdp_eager::eager_order(g, crate::baselines::fsdp_eager::Prefetch::CPU)
    {
        orders.push(("fsdp2-eager", Lowered::from_op_ids(&eager)));
    }
    for (_, order) in &g.extra_orders {
        orders.push(("given-order", Lowered::from_op_ids(order)));
    }
    let given: Vec<(String, Vec<solver::OpIdx>)> = orders
        .iter()
        .filter(|(s, _)| {
            !matches!(
                *s,
                "list-schedule" | "optimizer-in-backward" | "fsdp2-eager"
            )
        })
        .map(|(s, o)| (s.to_string(), o.clone()))
        .collect();
    // The work after the ordering (evaluating the candidates, the first
    // layout, the bound) cannot stop early and grows with the graph like
    // the lowering did: it keeps AFTER_ORDER times the lowering's time,
    // where that is more than the share left to it.
    let budget = match left(deadline) {
        Some(l) => {
            let after = lowering.mul_f64(AFTER_ORDER).min(l.mul_f64(0.5));
            solver::Budget::new(l.mul_f64(ORDER_SHARE).min(l.saturating_sub(after)))
        }
        None => solver::Budget::unlimited(),
    };
    let sol = solver::solve(p, &given, &opts.solver, &budget, opts.progress.as_deref());
    orders.push(("memplan-solver", sol.order));
    report.solver = sol.report;
    let mut cands: Vec<Candidate> = orders
        .into_iter()
        .map(|(source, order)| {
            debug_assert!(p.is_valid_order(&order), "{source} gave an invalid order");
            let eval = solver::evaluate(p, &order);
            Candidate {
                source,
                order,
                eval,
            }
        })
        .collect();
    cands.sort_by_key(|c| c.eval.peak);
    cands
}

/// Lays out the best `opts.layouts` candidates and the program-order
/// baseline within the deadline; returns the plan with the smallest arena
/// and whether the clock cut any of that short.
fn best_layout(
    g: &Graph,
    low: &Lowered,
    cands: &[Candidate],
    opts: &Options,
    deadline: Option<Instant>,
    lowering: Duration,
    report: &mut Report,
) -> (Plan, bool) {
    let mut best: Option<Plan> = None;
    let keep = |best: &mut Option<Plan>, plan: Plan| {
        if best.as_ref().is_none_or(|b| {
            (plan.arena_bytes, plan.stats.max_live_bytes) < (b.arena_bytes, b.stats.max_live_bytes)
        }) {
            *best = Some(plan);
        }
    };
    // Layouts are bounded by work, not time (see `crate::layout`), so
    // that a plan does not depend on the machine's load; the time limit
    // here is only a backstop for pathological inputs.
    // Past the deadline only the best candidate is laid out, with at least
    // LAYOUT_SHARE of the limit (the allocator finishes a layout at once
    // when even that runs out).
    let mut cut = report.solver.time_limit_hit;
    // What a layout does after its allocator stops (the solution read
    // back, the plan assembled, the allocator's structures freed) takes
    // about 1.5 times the lowering: the allocator stops that much early.
    let layout_tail = lowering.mul_f64(LAYOUT_TAIL);
    let floor_limit = opts.time_limit.mul_f64(LAYOUT_SHARE);
    for (i, c) in cands.iter().enumerate() {
        // Later candidates only while their allocator has time left.
        let skip = i > 0 && left(deadline).is_some_and(|l| l <= layout_tail);
        cut |= skip && i < opts.layouts.max(1);
        let arena = if i < opts.layouts.max(1) && !skip {
            let layout_limit = left(deadline).map_or(LAYOUT_BACKSTOP, |l| {
                l.saturating_sub(layout_tail)
                    .max(if i == 0 { floor_limit } else { Duration::ZERO })
                    .min(LAYOUT_BACKSTOP)
            });
            let (plan, hit) = layout_within(g, low, &c.order, &c.eval, c.source, layout_limit);
            cut |= hit;
            let a = plan.arena_bytes;
            keep(&mut best, plan);
            Some(a)
        } else {
            None
        };
        report
            .candidates
            .push((c.source.to_string(), c.eval.peak, arena));
    }
    // The baseline: program order, no reuse, greedy by size, within the
    // deadline (given up there: its layout is quadratic in the worst case),
    // and skipped where less is left than a layout's tail (its own lowering
    // and evaluation cost about that before the layout starts).
    match left(deadline) {
        Some(l) if l <= layout_tail => cut = true,
        _ => match crate::baselines::program_order_greedy_until(g, deadline) {
            Some(b) => keep(&mut best, b),
            None => cut = true,
        },
    }
    (best.expect("at least one candidate"), cut)
}

/// Sets `plan`'s lower bound (the floor over every order, or the solver's
/// part bounds where stronger or where the clock has run out) and whether
/// the time limit cut the plan short (`cut`, or the deadline now past).
fn bound_plan(
    plan: &mut Plan,
    p: &solver::Problem,
    cands: &[Candidate],
    opts: &Options,
    deadline: Option<Instant>,
    report: &Report,
    mut cut: bool,
) {
    let past = || deadline.is_some_and(|d| Instant::now() >= d);
    let bound_start = Instant::now();
    // The bound's share, within the deadline (the simple bound, linear,
    // is always computed).
    let mut bound_deadline = bound_start + opts.time_limit.mul_f64(BOUND_SHARE);
    if let Some(d) = deadline {
        bound_deadline = bound_deadline.min(d);
    }
    // Past the deadline even the simple bound is skipped (it grows faster
    // than linearly: a second at 40,000 ops); the solver's part bounds,
    // already computed, stand in for both.
    let (mut bound, mut kind, simple) = if past() {
        cut = true;
        let b = report.solver.lower_bound;
        (b, "part-bound", b)
    } else {
        lower_bound(p, cands, bound_deadline)
    };
    // The solver's part bounds hold for every order too (checked against
    // every order of small problems in the solver's tests and in
    // tests/properties.rs); where an exact search or the ILP proved a part's
    // optimum they beat the floor, which minimises each op's live bytes over
    // a different order. Keep the stronger.
    if report.solver.lower_bound > bound {
        bound = report.solver.lower_bound;
        kind = "part-bound";
    }
    plan.stats.simple_bound_bytes = simple.min(plan.stats.max_live_bytes);
    plan.stats.bound_seconds = bound_start.elapsed().as_secs_f64();
    debug_assert!(
        bound <= plan.stats.max_live_bytes,
        "lower bound {bound} ({kind}) above the max live {} of a valid order",
        plan.stats.max_live_bytes
    );
    plan.stats.lower_bound_bytes = bound.min(plan.stats.max_live_bytes);
    plan.stats.lower_bound_kind = kind.into();
    plan.stats.time_limit_hit = cut || past();
}

/// Share of the time limit the first candidate's layout always has, even
/// when the ordering used up its own.
const LAYOUT_SHARE: f64 = 0.1;

/// Share of the time budget the min-cut floor may use (from the end of the
/// ordering phase).
const BOUND_SHARE: f64 = 0.15;

/// The min-cut floor if it finishes by `deadline` (`min-cut-groups` where
/// its group search raised it), else the best bound the search reached
/// (`min-cut-partial`) or the simple bound; with the simple bound itself.
fn lower_bound(
    p: &solver::Problem,
    cands: &[Candidate],
    deadline: Instant,
) -> (u64, &'static str, u64) {
    let orders: Vec<&[solver::OpIdx]> = cands.iter().map(|c| c.order.as_slice()).collect();
    let floor = solver::bounds::min_cut_floor(p, &orders, Some(deadline), &Default::default());
    if floor.finished && !floor.groups.group.is_empty() {
        (floor.bytes, "min-cut-groups", floor.simple)
    } else if floor.finished {
        (floor.bytes, "min-cut", floor.simple)
    } else if floor.bytes > floor.simple {
        (floor.bytes, "min-cut-partial", floor.simple)
    } else {
        (floor.simple, "simple", floor.simple)
    }
}
