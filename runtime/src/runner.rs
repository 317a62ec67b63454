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
pub use crate::executor::Data;
use crate::executor::Executor;
use crate::init::{hash_key, integer, normal};
use crate::kernel::Kernel;
use crate::program::{DType, Program, Role, TensorIdx};

/// The largest value + 1 each i32 input may hold, from the kernels that
/// read it (a bound on a view holds for its base); `None` if no kernel
/// bounds it.
fn int_ranges(p: &Program) -> Vec<Option<u64>> {
    let mut range: Vec<Option<u64>> = vec![None; p.tensors.len()];
    let mut bound = |mut t: TensorIdx, r: u64| {
        while let Some(b) = p.tensors[t.index()].view_of {
            t = b;
        }
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
    // An input offloaded to host memory is read by its copies only: the
    // copies' readers bound it.
    for ins in &p.instrs {
        if let Kernel::CopyToDevice { .. } = ins.kernel
            && let Some(r) = range[ins.outputs[0].index()]
        {
            let e = &mut range[ins.inputs[0].index()];
            *e = Some(e.map_or(r, |x| x.min(r)));
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

/// The program's losses: the outputs of its cross-entropy kernels, or
/// where a loss was split into chunks, the persistent sum (`add`s) of the
/// partial losses, read once: a partial loss that feeds such a sum is not
/// itself a loss (nor does it outlive the step).
pub fn loss_tensors(p: &Program) -> Vec<TensorIdx> {
    let mut loss = vec![false; p.tensors.len()];
    let mut summed = vec![false; p.tensors.len()];
    for i in &p.instrs {
        match i.kernel {
            Kernel::CrossEntropy { .. } => loss[i.outputs[0].index()] = true,
            Kernel::Add { elements: 1 } if i.inputs.iter().all(|t| loss[t.index()]) => {
                for t in &i.inputs {
                    summed[t.index()] = true;
                }
                loss[i.outputs[0].index()] = true;
            }
            _ => {}
        }
    }
    p.instrs
        .iter()
        .filter(|i| matches!(i.kernel, Kernel::CrossEntropy { .. } | Kernel::Add { .. }))
        .map(|i| i.outputs[0])
        .filter(|t| loss[t.index()] && !summed[t.index()])
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
    /// Time every instruction (rank 0) and report the time by kernel
    /// ([`RunReport::profile`]). On CUDA this adds two events per
    /// instruction, so the step times of a profiled run are not the plain
    /// step's.
    pub profile: bool,
    /// How the CUDA executor runs fused attention (the CPU executor has
    /// one way).
    pub attention: crate::device::AttentionLowering,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            steps: 1,
            init_seed: 0,
            data_seed: 1,
            keep_state: false,
            profile: false,
            attention: crate::device::AttentionLowering::Flash,
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
    /// allocation (arena + workspace); on CUDA the device's peak during the
    /// step (free memory before the allocation minus the low-water mark
    /// sampled while the step ran).
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
    /// With `profile`: rank 0's time per step by kernel, most first.
    pub profile: Vec<KernelTime>,
}

/// The time one kernel took in a step, over all its instructions.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub kernel: &'static str,
    /// Instructions of this kernel in a step.
    pub instrs: usize,
    /// Seconds per step: the mean over the profiled steps (every step but
    /// the first, which warms up, when there are several).
    pub seconds: f64,
}

/// Instruction times summed over the steps of a profiled run.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    sums: Vec<f64>,
    steps: usize,
}

impl Profile {
    /// Adds step `index` (0 for the first) of `of` steps: its seconds per
    /// instruction, in program order. The first of several is left out.
    pub fn add(&mut self, index: usize, of: usize, instr_seconds: &[f64]) {
        if index == 0 && of > 1 {
            return;
        }
        self.sums.resize(instr_seconds.len(), 0.0);
        for (sum, s) in self.sums.iter_mut().zip(instr_seconds) {
            *sum += s;
        }
        self.steps += 1;
    }

    /// The mean time per step by kernel of `p`'s instructions, most first.
    pub fn by_kernel(&self, p: &Program) -> Vec<KernelTime> {
        let mut by: Vec<KernelTime> = Vec::new();
        for (ins, sum) in p.instrs.iter().zip(&self.sums) {
            let name = ins.kernel.name();
            let k = match by.iter().position(|k| k.kernel == name) {
                Some(i) => i,
                None => {
                    by.push(KernelTime {
                        kernel: name,
                        instrs: 0,
                        seconds: 0.0,
                    });
                    by.len() - 1
                }
            };
            by[k].instrs += 1;
            by[k].seconds += sum / self.steps.max(1) as f64;
        }
        by.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.kernel.cmp(b.kernel)));
        by
    }
}

/// One rank's part of a run ([`run_rank`]).
#[derive(Clone, Debug)]
pub struct RankRun {
    /// Each step's loss (the sum of the program's losses), seconds and
    /// bytes used ([`crate::executor::StepReport::used_bytes`]).
    pub steps: Vec<(f32, f64, u64)>,
    /// With `keep_state`: the persistent f32 tensors after the last step,
    /// by name.
    pub state: Vec<(String, Vec<f32>)>,
    /// Bytes the executor allocated (arena + workspace).
    pub allocated_bytes: u64,
    /// With `profile`: the instruction times.
    pub profile: Profile,
}

/// Runs `cfg.steps` steps on one rank's executor, any executor: initializes
/// it from `cfg.init_seed`, writes the rank's synthetic batch before each
/// step and reads the losses after it.
pub fn run_rank<E: Executor + ?Sized>(
    ex: &mut E,
    comm: &dyn Communicator<E::Buffer>,
    cfg: &RunConfig,
) -> Result<RankRun> {
    let p = ex.program();
    let losses = loss_tensors(p);
    let batch = synthetic_batch(p, cfg.data_seed, ex.rank())?;
    let kept: Vec<(TensorIdx, String)> = p
        .persistent_tensors()
        .filter(|&t| cfg.keep_state && p.tensor(t).dtype == DType::F32)
        .map(|t| (t, p.tensor(t).name.clone()))
        .collect();
    ex.initialize(cfg.init_seed)?;
    ex.set_profiling(cfg.profile && ex.rank() == 0)?;
    // Not `with_capacity(cfg.steps)`: the count is the user's (`--steps`)
    // and may be beyond any allocation.
    let mut steps = Vec::new();
    let mut profile = Profile::default();
    for s in 0..cfg.steps {
        ex.write(&batch)?;
        let rep = ex.step(comm)?;
        let mut loss = 0.0f32;
        for &t in &losses {
            loss += ex.read_f32(t)?[0];
        }
        steps.push((loss, rep.seconds, rep.used_bytes));
        profile.add(s, cfg.steps, &rep.instr_seconds);
    }
    let state = kept
        .into_iter()
        .map(|(t, name)| Ok((name, ex.read_f32(t)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(RankRun {
        steps,
        state,
        allocated_bytes: ex.allocated_bytes(),
        profile,
    })
}

/// The report of a run of `p` from each rank's part.
pub fn report(per_rank: Vec<RankRun>, cfg: &RunConfig, p: &Program) -> RunReport {
    let arena_bytes = p.arena_bytes;
    let world = per_rank.len().max(1);
    let steps = (0..cfg.steps)
        .map(|s| StepResult {
            loss: per_rank.iter().map(|r| r.steps[s].0).sum::<f32>() / world as f32,
            seconds: per_rank.iter().map(|r| r.steps[s].1).fold(0.0, f64::max),
            measured_bytes: per_rank.iter().map(|r| r.steps[s].2).max().unwrap_or(0),
        })
        .collect();
    let profile = match (cfg.profile, per_rank.first()) {
        (true, Some(r)) => r.profile.by_kernel(p),
        _ => Vec::new(),
    };
    let allocated = per_rank.first().map_or(0, |r| r.allocated_bytes);
    RunReport {
        steps,
        arena_bytes,
        allocated_bytes: allocated,
        workspace_bytes: allocated.saturating_sub(arena_bytes),
        state: per_rank.into_iter().map(|r| r.state).collect(),
        profile,
    }
}

/// Runs `cfg.steps` steps of `p` on `p.world_size` CPU ranks (threads).
pub fn run_cpu(p: &Program, cfg: &RunConfig) -> Result<RunReport> {
    let per_rank = run_ranks(p.world_size as usize, |rank, comm| {
        let mut ex = CpuExecutor::new(p.clone(), rank)?;
        run_rank(&mut ex, &comm as &dyn Communicator<[f32]>, cfg)
    })?;
    Ok(report(per_rank, cfg, p))
}

/// How far one run's results are from another's (e.g. CUDA from CPU).
#[derive(Clone, Debug, PartialEq)]
pub struct Agreement {
    /// The largest |loss_a − loss_b| / max(|loss_b|, 1) over the steps.
    pub loss_rel: f64,
    /// ‖a − b‖ / ‖b‖ over every persistent f32 element of every rank.
    pub state_rel_l2: f64,
    /// The tensor with the largest ‖a − b‖ / ‖b‖ and that ratio.
    pub worst_tensor: Option<(String, f64)>,
    /// Elements compared.
    pub elements: u64,
}

/// `√(diff² / ref²)`; infinite where the reference is zero and the
/// difference is not.
fn rel_l2(diff2: f64, ref2: f64) -> f64 {
    if ref2 > 0.0 {
        (diff2 / ref2).sqrt()
    } else if diff2 > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// Compares run `a` with reference `b` of the same program (both with
/// `keep_state`). An element that is NaN in either run counts as an
/// infinite error.
pub fn agreement(a: &RunReport, b: &RunReport) -> Result<Agreement> {
    let mismatch = |why: String| RuntimeError::InvalidProgram(format!("comparing runs: {why}"));
    if a.steps.len() != b.steps.len() || a.state.len() != b.state.len() {
        return Err(mismatch("the runs have different steps or ranks".into()));
    }
    let mut loss_rel = 0.0f64;
    for (x, y) in a.steps.iter().zip(&b.steps) {
        let d = (x.loss as f64 - y.loss as f64).abs() / (y.loss as f64).abs().max(1.0);
        loss_rel = loss_rel.max(if d.is_nan() { f64::INFINITY } else { d });
    }
    let (mut diff2, mut ref2, mut elements) = (0.0f64, 0.0f64, 0u64);
    let mut worst: Option<(String, f64)> = None;
    for (ra, rb) in a.state.iter().zip(&b.state) {
        if ra.len() != rb.len() {
            return Err(mismatch(format!(
                "{} persistent tensors vs {}",
                ra.len(),
                rb.len()
            )));
        }
        for ((na, va), (nb, vb)) in ra.iter().zip(rb) {
            if na != nb || va.len() != vb.len() {
                return Err(mismatch(format!("tensor {na:?} vs {nb:?}")));
            }
            let (mut d2, mut r2) = (0.0f64, 0.0f64);
            for (&x, &y) in va.iter().zip(vb) {
                let d = x as f64 - y as f64;
                d2 += if d.is_nan() { f64::INFINITY } else { d * d };
                r2 += y as f64 * y as f64;
            }
            let rel = rel_l2(d2, r2);
            if worst.as_ref().is_none_or(|w| rel > w.1) {
                worst = Some((na.clone(), rel));
            }
            diff2 += d2;
            ref2 += r2;
            elements += va.len() as u64;
        }
    }
    let state_rel_l2 = rel_l2(diff2, ref2);
    Ok(Agreement {
        loss_rel,
        state_rel_l2,
        worst_tensor: worst,
        elements,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(loss: f32, state: Vec<f32>) -> RunReport {
        RunReport {
            steps: vec![StepResult {
                loss,
                seconds: 0.0,
                measured_bytes: 0,
            }],
            arena_bytes: 0,
            allocated_bytes: 0,
            workspace_bytes: 0,
            state: vec![vec![("w".into(), state), ("b".into(), vec![0.0, 0.0])]],
            profile: Vec::new(),
        }
    }

    #[test]
    fn a_profile_leaves_out_the_first_step_and_groups_by_kernel() {
        use crate::kernel::Kernel;
        use crate::program::Instr;
        let kernels = [
            Kernel::LayerNormBackward { rows: 1, cols: 1 },
            Kernel::RmsNormBackward { rows: 1, cols: 1 },
            Kernel::LayerNormBackward { rows: 2, cols: 2 },
            Kernel::RmsNormBackward { rows: 2, cols: 2 },
            Kernel::LayerNormBackward { rows: 3, cols: 3 },
        ];
        let p = Program {
            name: "t".into(),
            arena_bytes: 0,
            tensors: vec![],
            instrs: kernels
                .iter()
                .enumerate()
                .map(|(i, k)| Instr::new(format!("i{i}"), k.clone()))
                .collect(),
            world_size: 1,
        };
        let mut prof = Profile::default();
        prof.add(0, 3, &[100.0; 5]); // the warm-up: left out
        prof.add(1, 3, &[1.0, 2.0, 3.0, 4.0, 5.0]);
        prof.add(2, 3, &[3.0, 4.0, 5.0, 6.0, 7.0]);
        let by = prof.by_kernel(&p);
        // Means per step: layer norms 2 + 4 + 6, RMS norms 3 + 5.
        let (ln, rms) = (kernels[0].name(), kernels[1].name());
        assert_eq!(
            by,
            vec![
                KernelTime {
                    kernel: ln,
                    instrs: 3,
                    seconds: 12.0
                },
                KernelTime {
                    kernel: rms,
                    instrs: 2,
                    seconds: 8.0
                },
            ]
        );
        // One step only: that step is the profile.
        let mut one = Profile::default();
        one.add(0, 1, &[1.0; 5]);
        assert_eq!(
            one.by_kernel(&p).iter().map(|k| k.seconds).sum::<f64>(),
            5.0
        );
    }

    #[test]
    fn agreement_measures_relative_errors() {
        let cpu = report(2.0, vec![3.0, 4.0]);
        let same = agreement(&cpu, &cpu).unwrap();
        assert_eq!(
            (same.loss_rel, same.state_rel_l2, same.elements),
            (0.0, 0.0, 4)
        );
        // ‖(0.3, 0.4)‖ / ‖(3, 4)‖ = 0.1; the loss differs by 0.5 / 2.
        let g = agreement(&report(2.5, vec![3.3, 4.4]), &cpu).unwrap();
        assert!((g.loss_rel - 0.25).abs() < 1e-6, "{g:?}");
        assert!((g.state_rel_l2 - 0.1).abs() < 1e-6, "{g:?}");
        assert_eq!(g.worst_tensor.as_ref().unwrap().0, "w");
        // A NaN anywhere is an infinite error, never a pass.
        let nan = agreement(&report(f32::NAN, vec![f32::NAN, 4.0]), &cpu).unwrap();
        assert!(nan.loss_rel.is_infinite() && nan.state_rel_l2.is_infinite());
        // Non-zero where the reference is all zeros is infinite too.
        let mut z = report(2.0, vec![3.0, 4.0]);
        z.state[0][1].1 = vec![1.0, 0.0];
        let zb = agreement(&z, &cpu).unwrap();
        assert_eq!(zb.worst_tensor.unwrap(), ("b".to_string(), f64::INFINITY));
        // Different programs are an error.
        let mut other = cpu.clone();
        other.state[0].pop();
        assert!(agreement(&other, &cpu).is_err());
    }
}
