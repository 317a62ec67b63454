//! Operator ordering for memplan: choose the order in which a training
//! step's ops run so that the most bytes live at one time (the peak) is as
//! small as possible, and place the weight updates and collectives.
//!
//! # Problem
//! A [`Problem`] holds ops, buffers (tensors that own bytes) with a
//! producer, users and a persistence flag, dependency edges (data, and the
//! ordering rules of in-place updates and global reductions), and reuse
//! hints. A buffer is live from its producer's step to its last user's step,
//! both included ([`problem`] has the exact rules); the peak of an order is
//! the most bytes live at one step. Minimising it is NP-hard for general
//! DAGs.
//!
//! # Algorithm
//! 1. **Decomposition** ([`partition`]). Key points — ops comparable with
//!    every other op — are found in `O(n + m)`; every valid order runs the
//!    ops between two consecutive key points as one block, and a buffer's
//!    liveness inside a block depends only on the block's order. So the
//!    minimum peak is the maximum over parts of the bytes live across the
//!    part plus the part's own minimum, and **ordering each part separately is
//!    exact**: no optimum is lost. Inside a large part, two further
//!    decompositions are used, both as *restrictions* that never lose the
//!    incumbent but carry no optimality guarantee of their own: weight
//!    updates and collectives are taken out and put back one at a time into
//!    the best gap of their legal window ([`placement`]), and the current
//!    order is cut into windows of consecutive steps, each re-ordered
//!    exactly with the rest fixed ([`local::window_exact`]; a window is the
//!    same stand-alone problem as a part, so the guarantee is: the result is
//!    optimal among orders that keep every op in its window). A large part's
//!    result is certified only by its lower bound, and the report gives the
//!    gap.
//! 2. **Heuristics** for every part: greedy orders with three priority
//!    rules built forward and in reverse ([`greedy`]), XLA-style DFS
//!    post-orders ([`dfs`]), and the caller's orders (program order); each
//!    followed by the sink/hoist pass ([`local::sink_hoist`]).
//! 3. **Improvement** of the parts that can still set the step's peak:
//!    chain hoisting of net-freeing ops with their private producers
//!    ([`local::chain_hoist`]), update/collective placement into valleys
//!    ([`placement`]), peak-driven
//!    reinsertion with incremental scoring ([`profile`], [`local::reinsert`]),
//!    exact windows, then sinking of small descendant-closed blocks past the
//!    peak ([`local::tail_sink`]: a weight-gradient op with its gradient's
//!    packing, reduction and update, moved where the activations it would
//!    have met are gone); for small parts an exact best-first search over
//!    scheduled sets with memory-bound pruning ([`exact`], Serenity-style) and
//!    a time-indexed ILP on HiGHS ([`ilp`], MODeL/ROAM-style) where the
//!    search's state budget runs out.
//! 4. **Tidy** ([`local::tidy`]): each part's final order sinks every op
//!    that allocates more than it frees to just before its first consumer
//!    wherever the peak does not rise, so recomputation runs just before its
//!    use in the backward pass even when the step's peak is elsewhere;
//!    then chain hoisting again, since placement and tidy can defer a
//!    weight-gradient op and its recomputed input next to a late update.
//! 5. **Bounds**: every part has a lower bound ([`part_bound`]); a part
//!    stops as soon as it meets it, and parts whose peak is below the best
//!    global bound are not worked on, since they cannot set the peak. The
//!    caller's bound for the whole step is the min-cut floor
//!    ([`bounds::min_cut_floor`]: at each op, the fewest live bytes over
//!    every set of ops that can run before it, a minimum cut ([`cut`])),
//!    raised by group floors
//!    ([`group_bound`]: of a group of big allocators or freers one runs
//!    first and one last, which the per-op cuts cannot see).
//!
//! # Recomputation
//! [`remat`] chooses which forward ops to run again in the backward pass so
//! that a step fits a memory budget at the least added cost: exact over
//! subsets for a few candidates, else greedy at the planned peak with
//! checkpointing-style starts, then pruned; the caller's planner prices
//! every set. [`remat::select_within`] answers the dual question with the
//! same moves: the lowest peak whose recomputation costs at most so much.
//!
//! # Guarantees
//! Every returned order is valid; it is never worse than the orders the
//! caller passes in; a part marked proven is optimal; the whole order is
//! proven optimal when every part at the peak is. Results are deterministic
//! for a given input and [`SolverParams`] (limits are work counts); only a
//! solve cut short by its time limit may depend on the machine, and its
//! report says so.
//!
//! # Complexity
//! Partition `O(n + m)`; greedy orders `O(n · r + m)` (`r` the largest
//! ready set); part bounds `O(n · m / 64)` per part; exact search and ILP
//! exponential in the worst case, bounded by state and time limits;
//! chain hoisting `O(n · (n + m))` (at most 16 scored insertions per op);
//! local search `O(window · degree)` per scored move plus `O(n + m)` per
//! accepted move.
//!
//! # Sources
//! Key points and the per-part independence: ROAM (Shu et al., 2023), with
//! a linear-time test in place of its per-node searches. Exact DP over
//! scheduled sets: Serenity (Ahn et al., MLSys 2020). Time-indexed ILP:
//! MODeL / ROAM. List scheduling, DFS orders: XLA's memory scheduler;
//! "fit under the peak" rule: LESCEA. Reverse scheduling: a schedule and
//! its reverse have the same peak (Kayaaslan et al., 2018). Valley placement
//! of updates: Liu's hill–valley idea applied to ROAM's update rules.

pub mod bounds;
pub mod budget;
pub mod cut;
pub mod dfs;
pub mod exact;
pub mod greedy;
pub mod group_bound;
#[cfg(feature = "ilp")]
pub mod ilp;
pub mod list_schedule;
pub mod local;
pub mod maxflow;
pub mod params;
pub mod part_bound;
pub mod partition;
pub mod placement;
pub mod problem;
pub mod profile;
pub mod random;
pub mod remat;
pub mod report;
pub mod simulate;
pub mod solve;
#[cfg(test)]
mod testing;

pub use budget::Budget;
pub use list_schedule::list_schedule;
pub use params::SolverParams;
pub use problem::{Buf, BufIdx, OpClass, OpIdx, Problem, ProblemBuilder, ProblemError, Reuse};
pub use report::{PartReport, Progress, SolveReport};
pub use simulate::{Evaluation, evaluate};
pub use solve::{Solution, solve};
