//! Operator ordering for memplan: choose the order in which a training
//! step's ops run so that the most bytes live at one time (the peak) is as
//! small as possible.
//!
//! The input is a [`Problem`]: ops, buffers (tensors that own bytes) with a
//! producer, users and a persistence flag, dependency edges, and reuse hints.
//! See [`problem`] for the exact liveness rules every part of the solver
//! shares.
//!
//! # Algorithms
//! - [`list_schedule`]: memory-aware greedy list scheduling (XLA's rule:
//!   prefer the ready op that frees the most bytes net).
//! - [`simulate::evaluate`]: the live-bytes curve of any order.

pub mod bounds;
pub mod list_schedule;
pub mod maxflow;
pub mod problem;
pub mod simulate;

pub use list_schedule::list_schedule;
pub use problem::{Buf, BufIdx, OpClass, OpIdx, Problem, ProblemBuilder, ProblemError, Reuse};
pub use simulate::{Evaluation, evaluate};
