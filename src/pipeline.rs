//! The planning pipeline: orders, then layouts, keep the best plan.
//!
//! 1. Lower the graph for the solver ([`crate::lower`]).
//! 2. Make candidate orders: the program order and the solver's orders.
//! 3. Evaluate each (live-bytes peak, reuses taken) and lay out the best
//!    few with the allocator.
//! 4. Keep the smallest arena. The program order without reuses, laid out by
//!    greedy-by-size (the baseline a user gets without memplan), is always a
//!    candidate, so the result is never worse than it.

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
}

impl Default for Options {
    fn default() -> Self {
        Options {
            time_limit: Duration::from_secs(10),
            layouts: 3,
        }
    }
}

/// An order with where it came from.
struct Candidate {
    source: &'static str,
    order: Vec<solver::OpIdx>,
    eval: solver::Evaluation,
}

/// Plans `g`: returns the smallest-arena plan found.
pub fn plan(g: &Graph, opts: &Options) -> Result<Plan, Error> {
    let start = Instant::now();
    let low = lower::lower(g, true);
    let p = &low.problem;

    let mut orders: Vec<(&'static str, Vec<solver::OpIdx>)> =
        vec![("program-order", Lowered::from_op_ids(g.program_order()))];
    orders.push(("list-schedule", solver::list_schedule(p)));
    for (_, order) in &g.extra_orders {
        orders.push(("given-order", Lowered::from_op_ids(order)));
    }

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

    let mut best: Option<Plan> = None;
    let keep = |best: &mut Option<Plan>, plan: Plan| {
        if best.as_ref().is_none_or(|b| {
            (plan.arena_bytes, plan.stats.max_live_bytes) < (b.arena_bytes, b.stats.max_live_bytes)
        }) {
            *best = Some(plan);
        }
    };
    for c in cands.iter().take(opts.layouts.max(1)) {
        let plan = layout(g, &low, &c.order, &c.eval, c.source);
        keep(&mut best, plan);
    }
    // The baseline: program order, no reuse, greedy by size.
    keep(&mut best, crate::baselines::program_order_greedy(g));

    let mut plan = best.expect("at least one candidate");
    let bound_start = Instant::now();
    let (bound, kind, simple) =
        lower_bound(p, &cands, start + opts.time_limit.mul_f64(BOUND_SHARE));
    plan.stats.simple_bound_bytes = simple.min(plan.stats.max_live_bytes);
    plan.stats.bound_seconds = bound_start.elapsed().as_secs_f64();
    debug_assert!(
        bound <= plan.stats.max_live_bytes,
        "lower bound {bound} ({kind}) above the max live {} of a valid order",
        plan.stats.max_live_bytes
    );
    plan.stats.lower_bound_bytes = bound.min(plan.stats.max_live_bytes);
    plan.stats.lower_bound_kind = kind.into();
    plan.stats.solve_seconds = start.elapsed().as_secs_f64();
    Ok(plan)
}

/// Share of the time budget the min-cut floor may use (from the start of
/// the solve).
const BOUND_SHARE: f64 = 0.25;

/// The min-cut floor if it finishes by `deadline`, else the best bound the
/// search reached (`min-cut-partial`) or the simple bound; with the simple
/// bound itself.
fn lower_bound(
    p: &solver::Problem,
    cands: &[Candidate],
    deadline: Instant,
) -> (u64, &'static str, u64) {
    let orders: Vec<&[solver::OpIdx]> = cands.iter().map(|c| c.order.as_slice()).collect();
    let floor = solver::bounds::min_cut_floor(p, &orders, Some(deadline), &Default::default());
    if floor.finished {
        (floor.bytes, "min-cut", floor.simple)
    } else if floor.bytes > floor.simple {
        (floor.bytes, "min-cut-partial", floor.simple)
    } else {
        (floor.simple, "simple", floor.simple)
    }
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
    // The allocator's share of the budget: its heuristics reach max live on
    // almost every step graph at once; the exact search only runs (anytime,
    // within this limit) when they miss it.
    let params = alloc::SolverParams {
        time_limit: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let (sol, layout_source) = match alloc::solve(&lp.problem, alloc::Mode::Minimize, &params) {
        Ok(out) => (out.solution, out.source),
        Err(_) => (alloc::greedy_by_size(&lp.problem), "size/best".into()),
    };
    lower::assemble(
        g,
        low,
        order,
        ev,
        &lp,
        &sol,
        PlanStats {
            order_source: source.to_string(),
            layout_source,
            ..Default::default()
        },
    )
}
