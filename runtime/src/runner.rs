//! Running several steps of a program on CPU ranks: initialize, feed a
//! fixed synthetic batch, step, collect losses, times and final state.
//!
//! The synthetic batch is a pure function of `(seed, tensor name, global
//! element index)`: rank `r` of `W` holds elements `[r·n, (r+1)·n)` of a
//! global batch `W` times as large, so a sharded run over `W` ranks sees the
//! same data as one device running the whole batch. Integer inputs are drawn
//! below the smallest range a kernel reading them accepts (the vocabulary
//! for token ids, the classes for targets).

use crate::comm::{Communicator, run_ranks};
use crate::cpu::CpuExecutor;
use crate::error::{Result, RuntimeError};
use crate::init::{hash_key, integer, normal};
use crate::kernel::Kernel;
use crate::program::{DType, Program, Role, TensorIdx};

/// Values for one input tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// The largest value + 1 each i32 input may hold, from the kernels that
/// read it; `None` if no kernel bounds it.
fn int_ranges(p: &Program) -> Vec<Option<u64>> {
    let mut range: Vec<Option<u64>> = vec![None; p.tensors.len()];
    let mut bound = |t: TensorIdx, r: u64| {
        let e = &mut range[t.index()];
        *e = Some(e.map_or(r, |x| x.min(r)));
    };
    for ins in &p.instrs {
        match &ins.kernel {
            Kernel::Embedding { vocab, .. } | Kernel::EmbeddingBackward { vocab, .. } => {
                let pos = if matches!(ins.kernel, Kernel::Embedding { .. }) {
                    0
                } else {
                    1
                };
                bound(ins.inputs[pos], *vocab);
            }
            Kernel::CrossEntropy { classes, .. } | Kernel::CrossEntropyBackward { classes, .. } => {
                bound(ins.inputs[1], *classes)
            }
            _ => {}
        }
    }
    range
}

/// The synthetic batch of rank `rank`: every non-view tensor with role
/// input (i32 within its range, f32 standard normal).
pub fn synthetic_batch(p: &Program, seed: u64, rank: usize) -> Result<Vec<(TensorIdx, Data)>> {
    let ranges = int_ranges(p);
    let mut out = Vec::new();
    for (i, t) in p.tensors.iter().enumerate() {
        if t.role != Role::Input || t.view_of.is_some() {
            continue;
        }
        let n = t.elements();
        let key = hash_key(seed, &t.name);
        let first = rank as u64 * n;
        let data = match t.dtype {
            DType::I32 => {
                let r = ranges[i].ok_or_else(|| RuntimeError::InvalidTensor {
                    tensor: t.name.clone(),
                    why: "an i32 input no kernel bounds (token ids or targets): cannot make synthetic data for it".into(),
                })?;
                Data::I32((first..first + n).map(|e| integer(key, e, r)).collect())
            }
            DType::F32 => Data::F32((first..first + n).map(|e| normal(key, e)).collect()),
            DType::BF16 => {
                return Err(RuntimeError::Unavailable(
                    "bf16 synthetic inputs",
                    format!("tensor {:?}", t.name),
                ));
            }
        };
        out.push((TensorIdx(i as u32), data));
    }
    Ok(out)
}

/// The outputs of the program's cross-entropy kernels (the losses).
pub fn loss_tensors(p: &Program) -> Vec<TensorIdx> {
    p.instrs
        .iter()
        .filter(|i| matches!(i.kernel, Kernel::CrossEntropy { .. }))
        .map(|i| i.outputs[0])
        .collect()
}

/// What to run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub steps: usize,
    /// Seed of parameter initialization.
    pub init_seed: u64,
    /// Seed of the synthetic batch (fixed over the steps).
    pub data_seed: u64,
    /// Read every persistent tensor back after the last step.
    pub keep_state: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            steps: 1,
            init_seed: 0,
            data_seed: 1,
            keep_state: false,
        }
    }
}

/// One step, over all ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    /// Mean over ranks of the sum of the program's losses.
    pub loss: f32,
    /// The slowest rank's seconds.
    pub seconds: f64,
    /// Memory the step used on the most loaded rank: on CPU the one host
    /// allocation (arena + workspace); on CUDA the device memory measured
    /// with `cuMemGetInfo` around the step.
    pub measured_bytes: u64,
}

/// A whole run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    pub steps: Vec<StepResult>,
    /// Bytes of each rank's arena.
    pub arena_bytes: u64,
    /// Bytes each rank allocated for the step (arena + workspace).
    pub allocated_bytes: u64,
    /// Bytes of workspace after the arena (staged inputs; on CUDA also the
    /// cuBLAS workspace).
    pub workspace_bytes: u64,
    /// With `keep_state`: each rank's persistent tensors after the last
    /// step, by name (f32 ones).
    pub state: Vec<Vec<(String, Vec<f32>)>>,
}

/// Runs `cfg.steps` steps of `p` on `p.world_size` CPU ranks (threads).
pub fn run_cpu(p: &Program, cfg: &RunConfig) -> Result<RunReport> {
    let losses = loss_tensors(p);
    let world = p.world_size as usize;
    let per_rank = run_ranks(world, |rank, comm| {
        let mut ex = CpuExecutor::new(p.clone(), rank)?;
        ex.initialize(cfg.init_seed)?;
        let batch = synthetic_batch(p, cfg.data_seed, rank)?;
        let mut steps = Vec::with_capacity(cfg.steps);
        for _ in 0..cfg.steps {
            for (t, d) in &batch {
                match d {
                    Data::F32(v) => ex.write_f32(*t, v)?,
                    Data::I32(v) => ex.write_i32(*t, v)?,
                }
            }
            let rep = ex.step(&comm as &dyn Communicator<[f32]>)?;
            let mut loss = 0.0f32;
            for &t in &losses {
                loss += ex.read_f32(t)?[0];
            }
            steps.push((loss, rep.seconds));
        }
        let state = if cfg.keep_state {
            p.persistent_tensors()
                .filter(|&t| p.tensor(t).dtype == DType::F32)
                .map(|t| Ok((p.tensor(t).name.clone(), ex.read_f32(t)?)))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok((steps, state, ex.allocated_bytes()))
    })?;
    let steps = (0..cfg.steps)
        .map(|s| StepResult {
            loss: per_rank.iter().map(|r| r.0[s].0).sum::<f32>() / world as f32,
            seconds: per_rank.iter().map(|r| r.0[s].1).fold(0.0, f64::max),
            measured_bytes: per_rank.iter().map(|r| r.2).max().unwrap_or(0),
        })
        .collect();
    Ok(RunReport {
        steps,
        arena_bytes: p.arena_bytes,
        allocated_bytes: per_rank.first().map_or(0, |r| r.2),
        workspace_bytes: per_rank.first().map_or(0, |r| r.2) - p.arena_bytes,
        state: per_rank.into_iter().map(|r| r.1).collect(),
    })
}
