//! Every knob of the allocator in one place. Each search technique is a
//! named switch, on by default, so an ablation is one field away.

use std::time::Duration;

use crate::heuristics::Heuristic;

/// A static order of the units, used to break ties between candidates at
/// the same offset and as the order candidates are tried in. Keys (all
/// decreasing): `Total`: the most bytes live in any section the unit
/// covers; `Width`: its duration; `Area`: size × duration; `Size`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Preorder {
    /// Total, then width, then area.
    TotalWidthArea,
    /// Width, then area, then total.
    WidthAreaTotal,
    /// Total, then area, then width.
    TotalAreaWidth,
    /// Size, then width.
    SizeWidth,
}

impl Preorder {
    pub fn name(self) -> &'static str {
        match self {
            Preorder::TotalWidthArea => "TWA",
            Preorder::WidthAreaTotal => "WAT",
            Preorder::TotalAreaWidth => "TAW",
            Preorder::SizeWidth => "SW",
        }
    }
}

/// How the allocator searches. `Default` turns every technique on.
#[derive(Clone, Debug)]
pub struct SolverParams {
    /// Wall-clock budget for the whole solve (`None`: no limit).
    pub time_limit: Option<Duration>,
    /// Greedy layouts tried first; the best one is the starting point.
    pub heuristics: Vec<Heuristic>,
    /// Run the exact search when the heuristics miss the floor.
    pub exact_search: bool,
    /// Search only canonical layouts: each unit at the lowest offset its
    /// placed neighbours allow, units placed in non-decreasing offset order.
    pub canonical_only: bool,
    /// Prune when a section's floor plus the bytes still to place in it
    /// passes the capacity.
    pub section_inference: bool,
    /// Use the lowest offset any unplaced unit of a section can take as
    /// that section's floor in the inference (stronger, costs a pass).
    pub unallocated_floor: bool,
    /// Prune placements that leave a gap some unplaced unit would fill for
    /// good (a lower layout dominates them).
    pub dominance: bool,
    /// Do not try alternatives to a unit that no unplaced unit conflicts
    /// with: its place can never change.
    pub hatless_pruning: bool,
    /// Split the units into independent partitions up front, wherever no
    /// unit crosses a time cut.
    pub static_decomposition: bool,
    /// Split during the search too, wherever placements leave no unplaced
    /// unit across a cut; solve the parts independently.
    pub dynamic_decomposition: bool,
    /// Give each part found by a decomposition its own preorder, computed
    /// from the bytes still to place in its sections.
    pub rerank_parts: bool,
    /// Move units that are live over their whole partition to its bottom
    /// before searching (safe when alignments allow; see `solve`).
    pub peel_full_span: bool,
    /// Static orders tried round-robin, each run with a node limit that
    /// doubles every round (restarts).
    pub preorders: Vec<Preorder>,
    /// Shuffled preorders in the restarts: in capacity mode, in turn with
    /// the doubling rounds ([`crate::search::Restarts::Mixed`]); in the
    /// minimise descent, only them ([`crate::search::Restarts::Randomized`]).
    /// Off: doubling rounds over the preorders as they are, everywhere.
    pub random_restarts: bool,
    /// Seed of the shuffled preorders (same seed, same layouts).
    pub seed: u64,
    /// Node limit of the first round of restarts.
    pub initial_node_limit: u64,
    /// In minimise mode, solve partitions up to this many units with the ILP
    /// (good_lp + HiGHS) instead of the search (0: never).
    pub ilp_max_units: usize,
    /// Total search nodes of one solve, over all its exact decisions; each
    /// decision may use at most an eighth of it (`None`: only the time
    /// limit stops the search). With a budget that runs out before the time
    /// limit, the result does not depend on the machine's speed.
    pub node_budget: Option<u64>,
    /// Minimise mode: a layout within this fraction of the floor is good
    /// enough and ends the search (0: only the floor does). The bound
    /// reported stays the proven one.
    pub tolerance: f64,
    /// Threads for the runs of a round of restarts (0: one per core). The
    /// result does not depend on it: see [`crate::search::decide_with`].
    pub threads: usize,
}

impl SolverParams {
    /// [`SolverParams::threads`], with 0 read as the number of cores.
    pub fn thread_count(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            self.threads
        }
    }
}

impl Default for SolverParams {
    fn default() -> Self {
        SolverParams {
            time_limit: Some(Duration::from_secs(10)),
            heuristics: Heuristic::ALL.to_vec(),
            exact_search: true,
            canonical_only: true,
            section_inference: true,
            unallocated_floor: true,
            dominance: true,
            hatless_pruning: true,
            static_decomposition: true,
            dynamic_decomposition: true,
            rerank_parts: true,
            peel_full_span: true,
            // The two orders led by the bytes in the unit's sections come
            // first: on MiniMalloc's challenging set one of them solves
            // each problem within its first 160k nodes (TWA: A, D-G, I-K;
            // TAW: B, C, H), so with two threads both run from the start.
            preorders: vec![
                Preorder::TotalWidthArea,
                Preorder::TotalAreaWidth,
                Preorder::WidthAreaTotal,
            ],
            random_restarts: true,
            seed: 0,
            initial_node_limit: 2048,
            ilp_max_units: 0,
            node_budget: None,
            threads: 0,
            tolerance: 0.0,
        }
    }
}
