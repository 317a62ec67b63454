//! Offset planning: give every buffer of a training step a byte offset in one
//! arena so that buffers live at the same time never share a byte, and the
//! arena is as small as possible.
//!
//! The input is a [`Problem`]: buffers with a size, an alignment, an optional
//! pinned offset and a half-open live interval `[lower, upper)` in time steps.
//! The floor is [`Problem::max_live`], the most bytes live at one time: no
//! layout goes below it.
//!
//! # Algorithms
//! - [`greedy_by_size`]: largest buffer first, each into the smallest gap
//!   among buffers it overlaps in time (best fit), else on top.
//!
//! Every layout can be checked on its own with [`validate`], which shares no
//! code with the planners.
//!
//! # Example
//! ```
//! use memplan_allocator::{Buffer, Problem, greedy_by_size, validate};
//! let p = Problem { buffers: vec![
//!     Buffer::new("a", 0, 2, 4),
//!     Buffer::new("b", 0, 4, 4),
//!     Buffer::new("c", 2, 4, 4),
//! ]};
//! let s = greedy_by_size(&p);
//! validate(&p, &s, None).unwrap();
//! assert_eq!(s.height, p.max_live());
//! ```

pub mod best_fit;
pub mod problem;

pub use best_fit::{greedy_by_size, place_in_order};
pub use problem::{Buffer, LayoutError, Problem, Solution, validate};
