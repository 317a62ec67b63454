//! The one interface of every executor: the CPU executor
//! ([`crate::cpu::CpuExecutor`]), the CUDA executor (`cuda::CudaExecutor`,
//! feature `cuda`) and the host emulator of the CUDA lowering
//! ([`crate::device::emulate::Emulator`]).
//!
//! An executor holds one program for one rank inside its own memory. The
//! caller writes tensors (a batch), runs steps with a communicator for the
//! collectives, and reads tensors back (losses, state); every step returns
//! the same [`StepReport`]. What differs between executors is only the
//! buffer their communicator moves ([`Executor::Buffer`]: host floats, or
//! device slices on CUDA). [`crate::runner::run_rank`] runs several steps on
//! any of them, so a run loop is written once.

use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::program::{DType, Program, TensorDesc, TensorIdx};

/// What one step did, on any executor.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// The step number just run (1 for the first).
    pub step: u64,
    /// With profiling on: each instruction's seconds, in program order.
    pub instr_seconds: Vec<f64>,
    /// Memory the step used: on CUDA the device's peak during the step
    /// (free memory before the allocation minus the low-water mark sampled
    /// while the step ran); on host executors their one allocation (arena +
    /// workspace), which is all they use.
    pub used_bytes: u64,
}

/// Values for one tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A program ready to run on one rank; see the module docs.
pub trait Executor {
    /// What the executor's communicator moves.
    type Buffer: ?Sized;

    fn program(&self) -> &Program;
    /// The rank this executor runs.
    fn rank(&self) -> usize;
    /// Bytes the executor allocated for the program (arena + workspace).
    fn allocated_bytes(&self) -> u64;
    /// Writes float tensor `t` (rounded when it is bf16).
    fn write_f32(&mut self, t: TensorIdx, v: &[f32]) -> Result<()>;
    fn write_i32(&mut self, t: TensorIdx, v: &[i32]) -> Result<()>;
    /// Reads float tensor `t` (widened when it is bf16).
    fn read_f32(&self, t: TensorIdx) -> Result<Vec<f32>>;
    /// Times each instruction of the following steps
    /// ([`StepReport::instr_seconds`]).
    fn set_profiling(&mut self, on: bool) -> Result<()>;
    /// Runs one step, the collectives through `comm`.
    fn step(&mut self, comm: &dyn Communicator<Self::Buffer>) -> Result<StepReport>;

    /// Fills every tensor that has an [`crate::init::Init`] (parameters,
    /// optimizer state) from `seed`, for this executor's rank: the same
    /// values on every executor.
    fn initialize(&mut self, seed: u64) -> Result<()> {
        let rank = self.rank() as u64;
        let todo: Vec<(TensorIdx, Vec<f32>)> = self
            .program()
            .tensors
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let init = t.init.as_ref()?;
                Some((TensorIdx(i as u32), init.values(seed, rank, t.elements())))
            })
            .collect();
        for (t, v) in todo {
            self.write_f32(t, &v)?;
        }
        Ok(())
    }

    /// Writes each tensor of `data`.
    fn write(&mut self, data: &[(TensorIdx, Data)]) -> Result<()> {
        for (t, d) in data {
            match d {
                Data::F32(v) => self.write_f32(*t, v)?,
                Data::I32(v) => self.write_i32(*t, v)?,
            }
        }
        Ok(())
    }
}

/// Tensor `t` of `p`, which must exist, be one of `dtypes` and, with `len`,
/// hold `len` elements: the check every executor makes before it reads or
/// writes a tensor for its caller.
pub fn accessed<'p>(
    p: &'p Program,
    t: TensorIdx,
    dtypes: &[DType],
    len: Option<usize>,
) -> Result<&'p TensorDesc> {
    let x = p
        .tensors
        .get(t.index())
        .ok_or_else(|| RuntimeError::Access {
            tensor: t.to_string(),
            why: format!("no such tensor (the program has {})", p.tensors.len()),
        })?;
    let names = dtypes
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(" or ");
    if !dtypes.contains(&x.dtype) {
        return Err(RuntimeError::Access {
            tensor: x.name.clone(),
            why: format!("is {}, not {names}", x.dtype),
        });
    }
    if let Some(len) = len.filter(|&n| n as u64 != x.elements()) {
        return Err(RuntimeError::Access {
            tensor: x.name.clone(),
            why: format!("holds {} elements, not {len}", x.elements()),
        });
    }
    Ok(x)
}
