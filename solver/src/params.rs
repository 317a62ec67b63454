//! Every search technique of the solver as a named switch, with its limits.
//!
//! Defaults turn everything on; switching one off is an ablation (see the
//! `ablation` example of the `memplan` crate). Limits are work counts, not
//! times, so a solve that finishes inside its time budget is deterministic.

use std::time::Duration;

/// The solver's switches and limits.
#[derive(Clone, Debug, PartialEq)]
pub struct SolverParams {
    /// Cut the problem at key points; each part is ordered on its own (exact).
    pub key_points: bool,
    /// Solve parts in parallel threads (rayon).
    pub parallel: bool,
    /// Only improve parts whose peak could be the step's peak (above the best global bound).
    pub focus_peak_parts: bool,
    /// Stop improving a part as soon as its peak meets its lower bound.
    pub bound_stop: bool,
    /// Forward greedy orders, one per priority rule (net-free, fit, small-step).
    pub forward_greedy: bool,
    /// Reverse greedy orders (built from the last step), one per rule.
    pub reverse_greedy: bool,
    /// Depth-first post-orders (XLA's weighted DFS and the plain post-order).
    pub dfs: bool,
    /// The sink/hoist pass on every heuristic order.
    pub sink_hoist: bool,
    /// A last pass on each part's final order sinking allocators to their
    /// first consumer wherever the peak does not rise ([`crate::local::tidy`]).
    pub tidy: bool,
    /// Hoist net-freeing ops together with their private producers
    /// ([`crate::local::chain_hoist`]) before the other local improvements.
    pub chain_hoist: bool,
    /// Weight-update and collective placement into valleys of the curve.
    pub update_placement: bool,
    /// Sinking small descendant-closed blocks past the peak
    /// ([`crate::local::tail_sink`]).
    pub tail_sink: bool,
    /// Peak-driven reinsertion local search with incremental scoring.
    pub reinsertion: bool,
    /// Exact re-ordering of windows around the peak in large parts.
    pub window_exact: bool,
    /// Exact best-first search over scheduled sets on small parts.
    pub exact_search: bool,
    /// Dominance rule in the exact search (run net-freeing ops that fit first).
    pub dominance: bool,
    /// HiGHS time-indexed ILP on small parts the exact search leaves open.
    pub ilp: bool,

    /// Largest part given to the exact search.
    pub exact_max_ops: usize,
    /// States the exact search may create per part.
    pub exact_max_states: usize,
    /// Largest part given to the ILP.
    pub ilp_max_ops: usize,
    /// HiGHS time limit per part (the solve's deadline still applies).
    pub ilp_time_limit: Duration,
    /// Ops per window of the window search.
    pub window_ops: usize,
    /// States the exact search may create per window.
    pub window_states: usize,
    /// Windows tried per part.
    pub max_windows: usize,
    /// Accepted moves of the reinsertion search per part.
    pub reinsert_rounds: usize,
    /// Passes of the sink/hoist pass.
    pub sink_hoist_passes: usize,
    /// How many of the best heuristic orders of a large part get the full
    /// local improvement (placement, reinsertion, windows).
    pub improve_candidates: usize,
}

impl Default for SolverParams {
    fn default() -> Self {
        SolverParams {
            key_points: true,
            parallel: true,
            focus_peak_parts: true,
            bound_stop: true,
            forward_greedy: true,
            reverse_greedy: true,
            dfs: true,
            sink_hoist: true,
            tidy: true,
            chain_hoist: true,
            update_placement: true,
            tail_sink: true,
            reinsertion: true,
            window_exact: true,
            exact_search: true,
            dominance: true,
            ilp: true,
            exact_max_ops: 200,
            exact_max_states: 200_000,
            ilp_max_ops: 24,
            ilp_time_limit: Duration::from_secs(2),
            window_ops: 24,
            window_states: 20_000,
            max_windows: 40,
            reinsert_rounds: 300,
            sink_hoist_passes: 16,
            improve_candidates: 2,
        }
    }
}

impl SolverParams {
    /// The switches by name, for ablations and reports.
    pub fn switches(&self) -> Vec<(&'static str, bool)> {
        vec![
            ("key_points", self.key_points),
            ("parallel", self.parallel),
            ("focus_peak_parts", self.focus_peak_parts),
            ("bound_stop", self.bound_stop),
            ("forward_greedy", self.forward_greedy),
            ("reverse_greedy", self.reverse_greedy),
            ("dfs", self.dfs),
            ("sink_hoist", self.sink_hoist),
            ("tidy", self.tidy),
            ("chain_hoist", self.chain_hoist),
            ("update_placement", self.update_placement),
            ("tail_sink", self.tail_sink),
            ("reinsertion", self.reinsertion),
            ("window_exact", self.window_exact),
            ("exact_search", self.exact_search),
            ("dominance", self.dominance),
            ("ilp", self.ilp),
        ]
    }

    /// Turns one switch off by name; `false` if there is no such switch.
    pub fn disable(&mut self, name: &str) -> bool {
        let f = match name {
            "key_points" => &mut self.key_points,
            "parallel" => &mut self.parallel,
            "focus_peak_parts" => &mut self.focus_peak_parts,
            "bound_stop" => &mut self.bound_stop,
            "forward_greedy" => &mut self.forward_greedy,
            "reverse_greedy" => &mut self.reverse_greedy,
            "dfs" => &mut self.dfs,
            "sink_hoist" => &mut self.sink_hoist,
            "tidy" => &mut self.tidy,
            "chain_hoist" => &mut self.chain_hoist,
            "update_placement" => &mut self.update_placement,
            "tail_sink" => &mut self.tail_sink,
            "reinsertion" => &mut self.reinsertion,
            "window_exact" => &mut self.window_exact,
            "exact_search" => &mut self.exact_search,
            "dominance" => &mut self.dominance,
            "ilp" => &mut self.ilp,
            _ => return false,
        };
        *f = false;
        true
    }
}
