//! The planning pipeline: orders, then layouts, keep the best plan.
//!
//! 1. Lower the graph for the solver ([`crate::lower`]).
//! 2. Make candidate orders: the program order, the orders the graph
//!    carries, the plain list schedule and the solver's order
//!    ([`memplan_solver::solve`]: partition, per-part heuristics, exact
//!    search and local improvement, within the time limit).
//! 3. Evaluate each (live-bytes peak, reuses taken) and lay out the best
//!    few with the allocator.
//! 4. Keep the smallest arena. The program order without reuses, laid out by
//!    greedy-by-size (the baseline a user gets without memplan), is always a
//!    candidate, so the result is never worse than it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use memplan_allocator as alloc;
use memplan_solver as solver;

use crate::error::Error;
use crate::graph::Graph;
use crate::lower::{self, Lowered};
use crate::plan::{Plan, PlanStats};

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
}

impl Default for Options {
    fn default() -> Self {
        Options {
            time_limit: Duration::from_secs(10),
            layouts: 3,
            solver: solver::SolverParams::default(),
            progress: None,
        }
    }
}

/// Share of the time limit the ordering solver may use; the rest is kept
/// for layouts.
const ORDER_SHARE: f64 = 0.8;

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
    let start = Instant::now();
    let mut report = Report::default();
    let mut lap = Instant::now();
    let low = lower::lower(g, true);
    let p = &low.problem;
    report
        .phases
        .push(("lowering".into(), lap.elapsed().as_secs_f64()));
    lap = Instant::now();

    let mut orders: Vec<(&'static str, Vec<solver::OpIdx>)> =
        vec![("program-order", Lowered::from_op_ids(g.program_order()))];
    orders.push(("list-schedule", solver::list_schedule(p)));
    for (_, order) in &g.extra_orders {
        orders.push(("given-order", Lowered::from_op_ids(order)));
    }
    let given: Vec<(String, Vec<solver::OpIdx>)> = orders
        .iter()
        .filter(|(s, _)| *s != "list-schedule")
        .map(|(s, o)| (s.to_string(), o.clone()))
        .collect();
    let budget = solver::Budget::new(opts.time_limit.mul_f64(ORDER_SHARE));
    let sol = solver::solve(p, &given, &opts.solver, &budget, opts.progress.as_deref());
    orders.push(("memplan-solver", sol.order));
    report.solver = sol.report;
    report
        .phases
        .push(("ordering".into(), lap.elapsed().as_secs_f64()));
    lap = Instant::now();

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

    let simple = solver::bounds::op_footprint(p);
    let (bound, bound_kind) = if report.solver.lower_bound > simple {
        (report.solver.lower_bound, "part-bound")
    } else {
        (simple, "op-footprint")
    };
    let mut best: Option<Plan> = None;
    let keep = |best: &mut Option<Plan>, plan: Plan| {
        if best.as_ref().is_none_or(|b| {
            (plan.arena_bytes, plan.stats.max_live_bytes) < (b.arena_bytes, b.stats.max_live_bytes)
        }) {
            *best = Some(plan);
        }
    };
    for (i, c) in cands.iter().enumerate() {
        let arena = if i < opts.layouts.max(1) {
            let plan = layout(g, &low, &c.order, &c.eval, c.source);
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
    // The baseline: program order, no reuse, greedy by size.
    keep(&mut best, crate::baselines::program_order_greedy(g));

    let mut plan = best.expect("at least one candidate");
    plan.stats.lower_bound_bytes = bound.min(plan.stats.max_live_bytes);
    plan.stats.lower_bound_kind = bound_kind.into();
    plan.stats.solve_seconds = start.elapsed().as_secs_f64();
    report
        .phases
        .push(("layout".into(), lap.elapsed().as_secs_f64()));
    Ok((plan, report))
}

/// Lays out one evaluated order with the allocator and assembles the plan.
pub fn layout(
    g: &Graph,
    low: &Lowered,
    order: &[solver::OpIdx],
    ev: &solver::Evaluation,
    source: &str,
) -> Plan {
    let lp = lower::layout_problem(g, low, ev);
    let sol = alloc::greedy_by_size(&lp.problem);
    lower::assemble(
        g,
        low,
        order,
        ev,
        &lp,
        &sol,
        PlanStats {
            order_source: source.to_string(),
            layout_source: "greedy-by-size".into(),
            ..Default::default()
        },
    )
}
