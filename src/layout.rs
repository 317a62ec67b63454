//! One evaluated order laid out in the arena: the allocator's settings for
//! a step graph ([`layout_params`]) and the plan assembled from its offsets
//! ([`layout`]).
//!
//! Below the pipeline ([`crate::pipeline`], which lays out its best
//! candidates) and the baselines ([`crate::baselines`], which lay out the
//! orders a graph carries and estimate XLA's): both use it, it uses
//! neither.

use std::time::Duration;

use memplan_allocator as alloc;
use memplan_solver as solver;

use crate::graph::Graph;
use crate::lower::{self, Lowered};
use crate::plan::{Plan, PlanStats};

/// Lays out one evaluated order with the allocator and assembles the plan.
pub fn layout(
    g: &Graph,
    low: &Lowered,
    order: &[solver::OpIdx],
    ev: &solver::Evaluation,
    source: &str,
) -> Plan {
    layout_within(g, low, order, ev, source, Duration::from_secs(1)).0
}

/// Largest layout problem the pipeline runs the exact search on.
const LAYOUT_EXACT_MAX_BUFFERS: usize = 4_000;

/// A layout within this fraction of max live ends the layout search: on
/// the HLO and PyTorch steps the heuristics land a few hundred bytes above
/// max live (alignment), and closing that took most of a second per
/// candidate on 1,500-2,000-buffer graphs for a millionth of the arena.
const LAYOUT_TOLERANCE: f64 = 1e-5;

/// Wall-clock backstop of one candidate's layout (normally far from
/// reached: the node budget stops the search first).
pub const LAYOUT_BACKSTOP: Duration = Duration::from_secs(30);

/// Search nodes the allocator may spend on one candidate's layout of `n`
/// buffers. A node's cost grows faster than linearly with the problem
/// (more sections, deeper stacks), so the budget falls with `n²`: 100,000
/// nodes up to about 3,000 buffers, about 12,000 at 9,000. Measured, that
/// keeps a layout near a second or less on one core of a 2-core machine
/// (the per-parameter FSDP2 Llama 3 8B step, 3,026 buffers, needs about
/// 100,000 to reach max live).
fn layout_node_budget(n: usize) -> u64 {
    let n = n.max(1) as u64;
    (1_000_000_000_000 / n.saturating_mul(n)).clamp(1_000, 100_000)
}

/// The allocator's settings for a step graph's layout of `buffers`
/// buffers, with `limit` as a wall-clock backstop.
///
/// The allocator's heuristics reach max live on almost every step graph
/// at once; the exact search only runs when they miss it. It stops on a
/// node budget, so plans (and the recorded peaks of fixtures/peaks.json)
/// do not depend on the machine's speed or load; `limit` is only a
/// backstop for pathological cases.
pub fn layout_params(buffers: usize, limit: Duration) -> alloc::SolverParams {
    alloc::SolverParams {
        time_limit: Some(limit),
        node_budget: Some(layout_node_budget(buffers)),
        // Past a few thousand buffers each exact decision's set-up costs
        // more than the last fraction of a percent it can win: heuristics
        // only (they reach max live within 0.001% on such step graphs).
        exact_search: buffers <= LAYOUT_EXACT_MAX_BUFFERS,
        tolerance: LAYOUT_TOLERANCE,
        ..Default::default()
    }
}

/// [`layout`] with the allocator's time limit given; the flag says whether
/// the allocator stopped at it.
pub(crate) fn layout_within(
    g: &Graph,
    low: &Lowered,
    order: &[solver::OpIdx],
    ev: &solver::Evaluation,
    source: &str,
    limit: Duration,
) -> (Plan, bool) {
    let lp = lower::layout_problem(g, low, ev);
    let params = layout_params(lp.problem.buffers.len(), limit);
    let (sol, layout_source, hit) = match alloc::solve(&lp.problem, alloc::Mode::Minimize, &params)
    {
        Ok(out) => (out.solution, out.source, out.stats.time_limit_hit),
        Err(_) => (
            alloc::greedy_by_size(&lp.problem),
            "size/best".into(),
            false,
        ),
    };
    let plan = lower::assemble(
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
    );
    (plan, hit)
}
