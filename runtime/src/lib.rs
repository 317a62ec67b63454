//! Executors that run a memory-planned training step inside one arena.
//!
//! # Problem
//! A memory plan gives every tensor of a training step a byte offset in one
//! arena and fixes the order of the ops. The plan is only worth what a real
//! step achieves with it: this crate runs the step inside one allocation of
//! exactly the planned size (plus a small, documented workspace), and
//! checks, by running, that the plan's reuse of bytes is sound.
//!
//! # Design
//! - [`program`]: the executor's own program representation — tensors with
//!   dtypes, shapes and absolute arena offsets; instructions with a typed
//!   [`kernel::Kernel`] and operands; streams. It knows nothing of graphs or
//!   planners (memplan lowers its graph and plan to it in `memplan::exec`).
//! - [`binding`]: how operands sit on the arena. An output may take the
//!   bytes of an input that dies at that instruction (a taken reuse hint);
//!   kernels that support that read the input through the output, any other
//!   overlap is staged through the workspace.
//! - [`schedule`]: cross-stream waits derived from byte ranges alone (a later
//!   instruction that touches bytes an earlier one on another stream
//!   touched, one of them writing, waits for it) — this covers both data
//!   dependencies and the reuse of bytes over time.
//! - [`executor`]: the [`executor::Executor`] trait every executor below
//!   implements (write tensors, step with a communicator, read tensors
//!   back; one [`executor::StepReport`]).
//! - [`comm`]: the [`comm::Communicator`] trait for collectives, with an
//!   in-process implementation (one thread per rank) for CPU runs.
//! - [`cpu`]: the CPU executor — f32 kernels, matrix products through
//!   `matrixmultiply`, rayon over rows, heads and chunks.
//! - [`device`]: the GPU backend's logic without CUDA — each instruction
//!   lowered to kernel launches, cuBLAS calls, memsets, copies and
//!   collectives over one device allocation — and [`device::emulate`], a
//!   host emulator of those operations that tests the lowering on any
//!   machine.
//! - `cuda` (feature `cuda`): the CUDA executor — one `cuMemAlloc`'d arena,
//!   cuBLAS for matrix products, NVRTC-compiled kernels, one stream per plan
//!   stream with events, NCCL collectives; CUDA is loaded at run time.
//! - [`init`]: deterministic initialization and synthetic data, identical
//!   for a tensor whole or sharded; [`runner`]: several steps over CPU
//!   ranks with a fixed synthetic batch, through
//!   [`runner::run_rank`], the one run loop of every executor.
//!
//! # Guarantees
//! [`program::Program::validate`] rejects any program whose operands leave
//! the arena, are misaligned for their dtype, or do not match their
//! kernel's signature; [`binding::Bindings::new`] rejects written operands
//! that share bytes. Kernels are deterministic: reductions sum fixed chunks
//! in a fixed order, so a planned run and an unplanned one differ only by
//! the order-independent rounding of identical operations (in practice:
//! bitwise equal on CPU). Errors are values ([`error::RuntimeError`]), never
//! panics: a failed allocation, a bad token id, a failed collective or a
//! missing CUDA library each names what failed.
//!
//! # Cost
//! Validation and binding are linear in the operands; the cross-stream
//! schedule is quadratic in the instructions in the worst case and skipped
//! for one stream. The step itself costs what its kernels cost.

pub mod binding;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod executor;
pub mod init;
pub mod kernel;
pub mod program;
pub mod runner;
pub mod schedule;

pub use comm::{Communicator, SingleRank, ThreadComm, run_ranks};
pub use cpu::CpuExecutor;
pub use error::{Result, RuntimeError};
pub use executor::{Data, Executor, StepReport};
pub use init::{Fill, Init, InitSegment};
pub use kernel::{AdamParams, Attention, ChunkLayout, Kernel, Matmul, ReduceOp, Rope};
pub use program::{DType, Instr, InstrIdx, Program, Role, StreamId, TensorDesc, TensorIdx};
