//! Offset planning: give every buffer of a training step a byte offset in one
//! arena so that buffers live at the same time never share a byte, and the
//! arena is as small as possible.
//!
//! # Problem
//! A [`Problem`] is a set of buffers, each with a size, an alignment, an
//! optional pinned offset and a half-open live interval `[lower, upper)` in
//! time steps ([`Buffer::persistent`] for ones that live the whole step),
//! plus [`Reuse`]s: an output that takes over a dying input's bytes (an
//! in-place op) gets the same offset. The floor is [`Problem::max_live`],
//! the most bytes live at one time: no layout goes below it. Deciding
//! whether a capacity is enough is NP-complete (it contains bin packing), yet
//! real step graphs almost always reach the floor.
//!
//! # Algorithm ([`solve`])
//! 1. Reuse groups become single rectangles; time is cut into sections,
//!    and the rectangles into partitions wherever no rectangle crosses a
//!    cut ([`sweep`]). A rectangle live over its whole partition goes to
//!    the bottom (provably without loss), which often splits the rest
//!    further.
//! 2. Greedy layouts ([`heuristics`]): six orders (size, lifetime, area,
//!    start time, and XLA's spatial and temporal sorts) × best or first fit;
//!    the lowest per partition wins. `O(u^2)` worst case each, far less on
//!    step graphs. With a deadline, a partition of 16,384 units or more
//!    starts from a runtime allocator's layout (by start time, the
//!    smallest free slot; `O(u log u)`), so the clock cuts only
//!    improvements.
//! 3. Where that misses the floor, an exact depth-first search over
//!    canonical layouts ([`search`]) with section inference, dominance,
//!    hatless pruning, dynamic decomposition (each part re-ranked) and
//!    restarts over static orders (the techniques of MiniMalloc, Moffitt,
//!    ASPLOS 2023). It is complete: given time, it finds a layout within a
//!    capacity or proves there is none. Restarts run in batches on threads,
//!    with the result the sequential order would give, so the thread count
//!    changes neither the layout nor the work. Rounds on the fixed orders
//!    alternate with short runs on slightly shuffled orders (Luby
//!    restarts): each solves quickly problems the other is slow on. In
//!    minimise mode the floor is tried first, so a layout there comes with
//!    a proof of optimality; then capacities descend from the best layout
//!    with shuffled runs only, which find much lower layouts near the
//!    optimum than longer runs on the fixed orders. An ILP ([`ilp`], good_lp + HiGHS) is available
//!    for small partitions; it is off by default (see `docs/allocator.md`).
//!
//! The floor counts alignment ([`units::aligned_floor`]): when every
//! offset must be a multiple of some `a`, every buffer but the top one of a
//! time step takes its size rounded up to `a`, so a layout can be proven
//! optimal above the raw max live.
//!
//! Every layout can be checked on its own with [`validate`], which shares
//! no code with the planners. Every search technique is a switch in
//! [`SolverParams`] (all on by default), so ablations are one field away.
//! [`io::minimalloc_csv`] reads and writes MiniMalloc's CSV format.
//!
//! # Example
//! ```
//! use memplan_allocator::{Buffer, Mode, Problem, SolverParams, Status, solve, validate};
//! let p = Problem::new(vec![
//!     Buffer::new("a", 0, 2, 4),
//!     Buffer::new("b", 0, 4, 4),
//!     Buffer::new("c", 2, 4, 4),
//!     Buffer::persistent("weights", 16).aligned(8),
//! ]);
//! let out = solve(&p, Mode::Minimize, &SolverParams::default()).unwrap();
//! validate(&p, &out.solution, None).unwrap();
//! assert_eq!(out.solution.height, p.max_live());
//! assert_eq!(out.status, Status::Optimal);
//! ```

pub mod error;
pub mod heuristics;
#[cfg(feature = "ilp")]
pub mod ilp;
pub mod io;
pub mod params;
pub mod problem;
pub mod search;
pub mod solve;
pub mod sweep;
pub mod units;

pub use error::AllocError;
pub use heuristics::{Fit, Heuristic, Order, greedy_by_size, greedy_by_size_until};
pub use params::{Preorder, SolverParams};
pub use problem::{Buffer, LayoutError, Problem, ProblemError, Reuse, Solution, validate};
pub use solve::{Mode, Outcome, SolveStats, Status, solve};
