//! A plan: the order ops run in, every tensor's offset in one arena, and the
//! reuses taken. Its JSON form (`memplan-plan`, version 1) lives in
//! [`crate::io::plan_json`]: I/O depends on the plan, never the reverse.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::graph::{Graph, OpId, TensorId};

/// A memory plan for one graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Every op once, in the order they run.
    pub order: Vec<OpId>,
    /// Offset of every tensor that occupies memory; `None` for views and
    /// zero-sized tensors.
    pub offsets: Vec<Option<u64>>,
    /// Bytes of the one arena every tensor lives in.
    pub arena_bytes: u64,
    /// Taken reuses: `(output, input)`, the output lives in the input's bytes.
    /// `input` is a tensor that occupies memory (a root).
    pub reuses: Vec<(TensorId, TensorId)>,
    /// How the plan was made and how good it is.
    pub stats: PlanStats,
}

/// Figures that describe a plan. All byte counts include every tensor in the
/// arena (parameters and optimizer state too).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStats {
    /// The arena, as [`Plan::arena_bytes`] gives it; kept for one release
    /// (plan files still write it as `stats.peak_bytes`). "Peak" means max
    /// live bytes everywhere else ([`PlanStats::max_live_bytes`]).
    #[deprecated(
        since = "0.1.0",
        note = "the arena is `Plan::arena_bytes`; \"peak\" means max live (`max_live_bytes`)"
    )]
    pub peak_bytes: u64,
    /// The most bytes live at once in this order (the best any layout of
    /// this order can do).
    pub max_live_bytes: u64,
    /// A lower bound over every valid order (the min-cut floor when
    /// computed, else the simple bound).
    pub lower_bound_bytes: u64,
    /// Which bound `lower_bound_bytes` is.
    #[serde(default)]
    pub lower_bound_kind: String,
    /// The simple bound over every valid order (bytes made live by
    /// ancestry alone), never above `lower_bound_bytes`; kept to show how
    /// much the min-cut floor adds. When the time limit left no time for
    /// it, the solver's part bound stands in (`lower_bound_kind`
    /// `part-bound`, `time_limit_hit`).
    #[serde(default)]
    pub simple_bound_bytes: u64,
    /// Seconds spent computing the bounds (part of `solve_seconds`).
    #[serde(default)]
    pub bound_seconds: f64,
    /// Seconds spent planning.
    pub solve_seconds: f64,
    /// Which algorithm produced the order.
    #[serde(default)]
    pub order_source: String,
    /// Which algorithm produced the layout.
    #[serde(default)]
    pub layout_source: String,
    /// The time limit cut the planning short (a search, heuristics, a
    /// layout or the bound stopped at it): the plan is the best found by
    /// then, valid and checked like any other. Written only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub time_limit_hit: bool,
}

impl PlanStats {
    /// `arena / lower bound - 1`, from the deprecated copy of the arena.
    #[deprecated(since = "0.1.0", note = "use `Plan::gap`")]
    #[allow(deprecated)]
    pub fn gap(&self) -> f64 {
        gap(self.peak_bytes, self.lower_bound_bytes)
    }
}

/// `bytes / lower bound - 1` (0 without a bound).
fn gap(bytes: u64, lower_bound: u64) -> f64 {
    if lower_bound == 0 {
        0.0
    } else {
        bytes as f64 / lower_bound as f64 - 1.0
    }
}

impl Plan {
    /// `arena / lower bound - 1`: how far the plan may be from optimal.
    pub fn gap(&self) -> f64 {
        gap(self.arena_bytes, self.stats.lower_bound_bytes)
    }

    /// The step of every op in this plan's order.
    pub fn steps(&self, g: &Graph) -> Vec<usize> {
        let mut pos = vec![usize::MAX; g.num_ops()];
        for (i, &o) in self.order.iter().enumerate() {
            if o.index() < pos.len() {
                pos[o.index()] = i;
            }
        }
        pos
    }

    /// Map from reused input to the output that took its bytes.
    pub fn reuse_map(&self) -> HashMap<TensorId, TensorId> {
        self.reuses.iter().map(|&(o, i)| (i, o)).collect()
    }
}
