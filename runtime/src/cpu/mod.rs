//! The CPU executor: one host allocation of exactly the arena plus the
//! workspace, every tensor bound to its offset, instructions run in order.
//!
//! Memory: the arena holds every tensor; the workspace after it holds
//! staged inputs ([`crate::binding`]). Outside them the kernels use small
//! bounded scratch on the heap: GEMM packing buffers inside
//! `matrixmultiply` (a few hundred KiB per thread), one row per task for
//! row-wise kernels, one partial sum per 32 rows for row reductions, and the
//! position index of `embedding_backward` (one word per token and per
//! vocabulary entry). The in-process communicator copies each collective's
//! send buffer once per rank.

pub mod decoder;
pub mod flash;
pub mod gemm;
pub mod kernels;
mod wide;

pub use wide::round_bf16;

use std::alloc::Layout;
use std::time::Instant;

use crate::binding::{Bindings, InstrBinding};
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::executor::{Executor, accessed};
use crate::kernel::Kernel;
use crate::program::{DType, Instr, Program, TensorDesc, TensorIdx};

/// Alignment of the host arena.
pub const ARENA_ALIGN: usize = 4096;

/// One owned, zeroed, aligned host allocation.
struct HostBuffer {
    ptr: *mut u8,
    layout: Layout,
}

impl HostBuffer {
    fn new(bytes: u64, what: &str) -> Result<HostBuffer> {
        let oom = || RuntimeError::OutOfMemory {
            device: "host".into(),
            bytes,
            what: what.to_string(),
        };
        let size = usize::try_from(bytes.max(1)).map_err(|_| oom())?;
        let layout = Layout::from_size_align(size, ARENA_ALIGN).map_err(|_| oom())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        Ok(HostBuffer { ptr, layout })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

// SAFETY: the buffer is plain memory owned by the executor.
unsafe impl Send for HostBuffer {}

pub use crate::executor::StepReport;

/// Runs a [`Program`] on the CPU inside one arena; see the module docs.
pub struct CpuExecutor {
    program: Program,
    bindings: Bindings,
    buf: HostBuffer,
    rank: usize,
    steps_done: u64,
    /// Time each instruction ([`StepReport::instr_seconds`]).
    profiling: bool,
}

/// Makes rayon's global pool, which the kernels' parallel loops use,
/// before they do. Where no thread can start (a process at its thread or
/// address-space limit) rayon would panic at the first parallel loop;
/// instead the pool is made of the calling thread alone, so the loops run
/// there one after another. Once per process; a pool made elsewhere first
/// is kept.
fn global_pool() {
    static MADE: std::sync::Once = std::sync::Once::new();
    MADE.call_once(|| {
        // A failed build_global leaves the global pool failed for good, so
        // a throwaway pool of the default size is tried first.
        let threads_start = rayon::ThreadPoolBuilder::new().build().is_ok();
        let single = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .use_current_thread();
        let builder = if threads_start {
            rayon::ThreadPoolBuilder::new()
        } else {
            single
        };
        builder.build_global().ok();
    });
}

impl CpuExecutor {
    /// Validates `program`, analyses its bindings, and allocates the arena
    /// and the workspace for rank `rank`.
    pub fn new(program: Program, rank: usize) -> Result<CpuExecutor> {
        program.validate()?;
        global_pool();
        if rank >= program.world_size as usize {
            return Err(RuntimeError::InvalidProgram(format!(
                "rank {rank} in a world of {}",
                program.world_size
            )));
        }
        let bindings = Bindings::new(&program)?;
        let total = program
            .arena_bytes
            .checked_add(bindings.workspace_bytes)
            .ok_or_else(|| RuntimeError::InvalidProgram("arena plus workspace overflows".into()))?;
        let buf = HostBuffer::new(total, "the arena and workspace")?;
        Ok(CpuExecutor {
            program,
            bindings,
            buf,
            rank,
            steps_done: 0,
            profiling: false,
        })
    }

    pub fn arena_bytes(&self) -> u64 {
        self.program.arena_bytes
    }
    /// Bytes after the arena for staged inputs.
    pub fn workspace_bytes(&self) -> u64 {
        self.bindings.workspace_bytes
    }
    pub fn bindings(&self) -> &Bindings {
        &self.bindings
    }
    /// Steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    fn bytes_of(&self, x: &TensorDesc) -> &[u8] {
        // SAFETY: validated: the tensor lies inside the arena; `&self` means
        // no kernel is writing.
        unsafe {
            std::slice::from_raw_parts(self.buf.ptr.add(x.offset as usize), x.bytes() as usize)
        }
    }
    fn bytes_of_mut(&mut self, t: TensorIdx) -> &mut [u8] {
        let x = &self.program.tensors[t.index()];
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe {
            std::slice::from_raw_parts_mut(self.buf.ptr.add(x.offset as usize), x.bytes() as usize)
        }
    }

    /// The values of i32 tensor `t`.
    pub fn read_i32(&self, t: TensorIdx) -> Result<Vec<i32>> {
        let x = accessed(&self.program, t, &[DType::I32], None)?;
        Ok(self
            .bytes_of(x)
            .chunks_exact(4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Copies `bytes` (whole elements of `t`) into tensor `t`.
    fn write_bytes(&mut self, t: TensorIdx, bytes: impl Iterator<Item = u8>) {
        for (d, v) in self.bytes_of_mut(t).iter_mut().zip(bytes) {
            *d = v;
        }
    }
}

impl Executor for CpuExecutor {
    type Buffer = [f32];

    fn program(&self) -> &Program {
        &self.program
    }
    fn rank(&self) -> usize {
        self.rank
    }
    /// Bytes of the one host allocation (arena + workspace).
    fn allocated_bytes(&self) -> u64 {
        self.program.arena_bytes + self.bindings.workspace_bytes
    }
    fn set_profiling(&mut self, on: bool) -> Result<()> {
        self.profiling = on;
        Ok(())
    }

    fn write_f32(&mut self, t: TensorIdx, v: &[f32]) -> Result<()> {
        if accessed(&self.program, t, &[DType::F32, DType::BF16], Some(v.len()))?.dtype
            == DType::BF16
        {
            let bytes = v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_ne_bytes());
            self.write_bytes(t, bytes);
        } else {
            self.write_bytes(t, v.iter().flat_map(|x| x.to_ne_bytes()));
        }
        Ok(())
    }

    fn write_i32(&mut self, t: TensorIdx, v: &[i32]) -> Result<()> {
        accessed(&self.program, t, &[DType::I32], Some(v.len()))?;
        self.write_bytes(t, v.iter().flat_map(|x| x.to_ne_bytes()));
        Ok(())
    }

    fn read_f32(&self, t: TensorIdx) -> Result<Vec<f32>> {
        let x = accessed(&self.program, t, &[DType::F32, DType::BF16], None)?;
        let bytes = self.bytes_of(x);
        Ok(if x.dtype == DType::BF16 {
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_ne_bytes([b[0], b[1]]).to_f32())
                .collect()
        } else {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
    }

    /// Runs one step: every instruction in order, collectives through `comm`.
    fn step(&mut self, comm: &dyn Communicator<[f32]>) -> Result<StepReport> {
        if comm.world_size() != self.program.world_size as usize || comm.rank() != self.rank {
            return Err(RuntimeError::InvalidProgram(format!(
                "the communicator is rank {} of {}, the executor rank {} of {}",
                comm.rank(),
                comm.world_size(),
                self.rank,
                self.program.world_size
            )));
        }
        let start = Instant::now();
        let step = self.steps_done + 1;
        let mut instr_seconds = Vec::with_capacity(if self.profiling {
            self.program.instrs.len()
        } else {
            0
        });
        for (ins, bind) in self.program.instrs.iter().zip(&self.bindings.instrs) {
            let began = self.profiling.then(Instant::now);
            let mut ops = Operands {
                base: self.buf.ptr,
                program: &self.program,
                ins,
                bind,
                wide: None,
            };
            // SAFETY: the program was validated and bound (every operand
            // inside the allocation, written operands disjoint from all
            // others except the aliased pairs the kernels read in place).
            unsafe { ops.stage() };
            if let Kernel::CopyToHost { .. } | Kernel::CopyToDevice { .. } = ins.kernel {
                // SAFETY: as above; a copy's two tensors are disjoint (the
                // host pool lies after the device arena).
                unsafe { ops.copy_bytes() };
                if let Some(t) = began {
                    instr_seconds.push(t.elapsed().as_secs_f64());
                }
                continue;
            }
            // SAFETY: as above; bf16 operands are widened after staging.
            let wide = unsafe { ops.widen() };
            ops.wide = wide.as_ref();
            // SAFETY: as above.
            let result = unsafe { run_instr(&ops, comm, step) };
            if let Some(w) = &wide {
                // SAFETY: the instruction is done with its operands.
                unsafe { w.narrow() };
            }
            result.map_err(|why| match why {
                Failure::Kernel(why) => RuntimeError::Kernel {
                    instr: ins.name.clone(),
                    kernel: ins.kernel.name(),
                    why,
                },
                Failure::Runtime(e) => e,
            })?;
            if let Some(t) = began {
                instr_seconds.push(t.elapsed().as_secs_f64());
            }
        }
        self.steps_done = step;
        Ok(StepReport {
            seconds: start.elapsed().as_secs_f64(),
            step,
            instr_seconds,
            used_bytes: self.allocated_bytes(),
        })
    }
}

enum Failure {
    Kernel(String),
    Runtime(RuntimeError),
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure::Kernel(s)
    }
}
impl From<RuntimeError> for Failure {
    fn from(e: RuntimeError) -> Self {
        Failure::Runtime(e)
    }
}

/// Typed views of one instruction's operands on the arena.
struct Operands<'a> {
    base: *mut u8,
    program: &'a Program,
    ins: &'a Instr,
    bind: &'a InstrBinding,
    /// f32 copies of bf16 operands, when there are any.
    wide: Option<&'a wide::Wide>,
}

impl<'a> Operands<'a> {
    fn desc(&self, t: TensorIdx) -> &'a TensorDesc {
        self.program.tensor(t)
    }

    /// Copies staged inputs into the workspace.
    unsafe fn stage(&self) {
        for &(pos, ws) in &self.bind.staged {
            let x = self.desc(self.ins.inputs[pos]);
            // SAFETY: both ranges lie inside the allocation and the
            // workspace range overlaps nothing else.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.base.add(x.offset as usize),
                    self.base.add((self.program.arena_bytes + ws) as usize),
                    x.bytes() as usize,
                );
            }
        }
    }

    /// A copy kernel's bytes, as they are, from its input to its output or
    /// update.
    unsafe fn copy_bytes(&self) {
        let src = self.desc(self.ins.inputs[0]);
        let dst = self.desc(
            *self
                .ins
                .outputs
                .first()
                .or(self.ins.updates.first())
                .expect("checked"),
        );
        // SAFETY: both ranges lie inside the allocation and are disjoint.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(self.input_offset(0) as usize),
                self.base.add(dst.offset as usize),
                src.bytes() as usize,
            );
        }
    }

    /// Byte offset of input `pos` (its staged copy when staged).
    fn input_offset(&self, pos: usize) -> u64 {
        match self.bind.staged_input(pos) {
            Some(ws) => self.program.arena_bytes + ws,
            None => self.desc(self.ins.inputs[pos]).offset,
        }
    }

    /// f32 copies of the bf16 operands (inputs read in place are read
    /// through their outputs' copies).
    ///
    /// # Safety
    /// Staging must be done; the operands must be live.
    unsafe fn widen(&self) -> Option<wide::Wide> {
        // A view computes nothing: its outputs are its base's bytes, which
        // must not be written back.
        if self.ins.kernel == Kernel::View {
            return None;
        }
        let slot = |t: TensorIdx, off: u64, read: bool| {
            let x = self.desc(t);
            wide::Slot {
                // SAFETY: inside the allocation (validated program).
                at: unsafe { self.base.add(off as usize) },
                elements: x.elements() as usize,
                bf16: x.dtype == DType::BF16,
                read,
            }
        };
        let inputs: Vec<Option<wide::Slot>> = (0..self.ins.inputs.len())
            .map(|pos| {
                let aliased = self.bind.aliased_input(pos).is_some();
                (!aliased).then(|| slot(self.ins.inputs[pos], self.input_offset(pos), true))
            })
            .collect();
        // An output is read only when an input is read through it.
        let outputs: Vec<wide::Slot> = (self.ins.outputs.iter().enumerate())
            .map(|(pos, &t)| {
                let read = self.bind.aliased.iter().any(|&(o, _)| o == pos);
                slot(t, self.desc(t).offset, read)
            })
            .collect();
        let updates: Vec<wide::Slot> = (self.ins.updates.iter())
            .map(|&t| slot(t, self.desc(t).offset, true))
            .collect();
        // SAFETY: the function's contract.
        unsafe { wide::Wide::new(&inputs, &outputs, &updates) }
    }

    /// Input `pos`, or `None` if the kernel reads it in place.
    unsafe fn input(&self, pos: usize) -> Option<&'a [f32]> {
        if self.bind.aliased_input(pos).is_some() {
            return None;
        }
        let x = self.desc(self.ins.inputs[pos]);
        if let Some(p) = self.wide.and_then(|w| w.input[pos]) {
            // SAFETY: a widened copy of the input's elements.
            return Some(unsafe { std::slice::from_raw_parts(p, x.elements() as usize) });
        }
        let off = self.input_offset(pos);
        // SAFETY: inside the allocation; not written by this instruction.
        Some(unsafe {
            std::slice::from_raw_parts(
                self.base.add(off as usize) as *const f32,
                x.elements() as usize,
            )
        })
    }

    /// Input `pos`, which is never read in place for this kernel.
    unsafe fn input_ro(&self, pos: usize) -> &'a [f32] {
        // SAFETY: forwarded.
        unsafe { self.input(pos) }.expect("an input the kernel does not take in place")
    }

    unsafe fn input_i32(&self, pos: usize) -> &'a [i32] {
        let x = self.desc(self.ins.inputs[pos]);
        let off = match self.bind.staged_input(pos) {
            Some(ws) => self.program.arena_bytes + ws,
            None => x.offset,
        };
        // SAFETY: inside the allocation; i32 inputs are never written here.
        unsafe {
            std::slice::from_raw_parts(
                self.base.add(off as usize) as *const i32,
                x.elements() as usize,
            )
        }
    }

    fn all_inputs(&self) -> Vec<&'a [f32]> {
        (0..self.ins.inputs.len())
            // SAFETY: inputs of kernels that take none in place.
            .map(|i| unsafe { self.input_ro(i) })
            .collect()
    }

    /// Output `pos` (each is taken once per instruction).
    #[allow(clippy::mut_from_ref)]
    unsafe fn output(&self, pos: usize) -> &'a mut [f32] {
        let x = self.desc(self.ins.outputs[pos]);
        if let Some(p) = self.wide.and_then(|w| w.output[pos]) {
            // SAFETY: this output's own widened copy, taken once.
            return unsafe { std::slice::from_raw_parts_mut(p, x.elements() as usize) };
        }
        // SAFETY: disjoint from every other operand slice made for this
        // instruction (aliased inputs are not made into slices).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.add(x.offset as usize) as *mut f32,
                x.elements() as usize,
            )
        }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn update(&self, pos: usize) -> &'a mut [f32] {
        let x = self.desc(self.ins.updates[pos]);
        if let Some(p) = self.wide.and_then(|w| w.update[pos]) {
            // SAFETY: this update's own widened copy, taken once.
            return unsafe { std::slice::from_raw_parts_mut(p, x.elements() as usize) };
        }
        // SAFETY: as for outputs.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.add(x.offset as usize) as *mut f32,
                x.elements() as usize,
            )
        }
    }
}

/// Runs one instruction.
///
/// # Safety
/// `ops` must describe a validated, bound program's instruction over a live
/// allocation that nothing else accesses.
unsafe fn run_instr(
    ops: &Operands<'_>,
    comm: &dyn Communicator<[f32]>,
    step: u64,
) -> Result<(), Failure> {
    use kernels as k;
    let u = |x: u64| x as usize;
    // SAFETY (whole body): operand slices come from `ops` under the
    // function's contract; each output and update is taken once.
    unsafe {
        match &ops.ins.kernel {
            Kernel::Embedding {
                seq,
                width,
                vocab,
                positions,
                ..
            } => k::embedding(
                ops.input_i32(0),
                ops.input_ro(1),
                positions.then(|| ops.input_ro(2)),
                ops.output(0),
                u(*seq),
                u(*width),
                *vocab,
            )?,
            Kernel::EmbeddingBackward {
                batch,
                seq,
                width,
                vocab,
                accumulate,
                positions,
            } => {
                let dhead = accumulate.then(|| ops.input(2));
                k::embedding_backward(
                    ops.input_ro(0),
                    ops.input_i32(1),
                    dhead,
                    ops.output(0),
                    positions.then(|| ops.output(1)),
                    u(*batch),
                    u(*seq),
                    u(*width),
                    *vocab,
                )?
            }
            Kernel::LayerNorm { cols, eps, .. } => k::layernorm(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.output(0),
                ops.output(1),
                ops.output(2),
                u(*cols),
                *eps as f32,
            ),
            Kernel::LayerNormBackward { cols, .. } => k::layernorm_backward(
                ops.input(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.input_ro(3),
                ops.input_ro(4),
                ops.output(0),
                ops.output(1),
                ops.output(2),
                u(*cols),
            ),
            Kernel::RmsNorm { cols, eps, .. } => decoder::rmsnorm(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                ops.output(1),
                u(*cols),
                *eps as f32,
            ),
            Kernel::RmsNormBackward { cols, .. } => decoder::rmsnorm_backward(
                ops.input(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.input_ro(3),
                ops.output(0),
                ops.output(1),
                u(*cols),
            ),
            Kernel::Rope(r) => decoder::rope(ops.input(0), ops.output(0), r),
            Kernel::SwiGlu { hidden, .. } => {
                decoder::swiglu(ops.input_ro(0), ops.output(0), u(*hidden))
            }
            Kernel::SwiGluBackward { hidden, .. } => decoder::swiglu_backward(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                u(*hidden),
            ),
            Kernel::Linear(m) => k::linear(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.output(0),
                u(m.m),
                u(m.k),
                u(m.n),
            ),
            Kernel::LinearBackwardData(m) => k::linear_backward_data(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                u(m.m),
                u(m.k),
                u(m.n),
            ),
            Kernel::LinearBackwardWeight(m) => k::linear_backward_weight(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                ops.output(1),
                u(m.m),
                u(m.k),
                u(m.n),
            ),
            Kernel::MatmulNt(m) => gemm::matmul(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                u(m.m),
                u(m.k),
                u(m.n),
                false,
                true,
                false,
            ),
            Kernel::MatmulNn(m) => gemm::matmul(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                u(m.m),
                u(m.k),
                u(m.n),
                false,
                false,
                false,
            ),
            Kernel::MatmulTn(m) => gemm::matmul(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.output(0),
                u(m.m),
                u(m.k),
                u(m.n),
                true,
                false,
                false,
            ),
            Kernel::MatmulTnAccumulate(m) => gemm::matmul(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.update(0),
                u(m.m),
                u(m.k),
                u(m.n),
                true,
                false,
                true,
            ),
            Kernel::AttentionScores(a) => k::attention_scores(ops.input_ro(0), ops.output(0), a),
            Kernel::AttentionScoresBackward(a) => {
                k::attention_scores_backward(ops.input_ro(0), ops.input_ro(1), ops.update(0), a)
            }
            Kernel::CausalSoftmax(a) => k::causal_softmax(ops.input(0), ops.output(0), a),
            Kernel::CausalSoftmaxBackward(a) => {
                k::causal_softmax_backward(ops.input(0), ops.input_ro(1), ops.output(0), a)
            }
            Kernel::AttentionValues(a) => {
                k::attention_values(ops.input_ro(0), ops.input_ro(1), ops.output(0), a)
            }
            Kernel::AttentionValuesBackward(a) => k::attention_values_backward(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.output(0),
                ops.output(1),
                a,
            ),
            Kernel::FusedAttention(a) => {
                flash::fused_attention(ops.input_ro(0), ops.output(0), ops.output(1), a)
            }
            Kernel::FusedAttentionBackward(a) => flash::fused_attention_backward(
                ops.input_ro(0),
                ops.input_ro(1),
                ops.input_ro(2),
                ops.input_ro(3),
                ops.output(0),
                a,
            ),
            Kernel::Add { .. } => k::add(ops.input(0), ops.input(1), ops.output(0)),
            // bf16 operands are widened and rounded around every kernel.
            Kernel::Cast { .. } => ops.output(0).copy_from_slice(ops.input_ro(0)),
            Kernel::Gelu { .. } => k::gelu(ops.input(0), ops.output(0)),
            Kernel::GeluBackward { .. } => {
                k::gelu_backward(ops.input(0), ops.input_ro(1), ops.output(0))
            }
            Kernel::Relu { .. } => k::relu(ops.input(0), ops.output(0)),
            Kernel::ReluBackward { .. } => {
                k::relu_backward(ops.input(0), ops.input_ro(1), ops.output(0))
            }
            Kernel::CrossEntropy {
                rows,
                classes,
                divisor,
            } => {
                let loss = k::cross_entropy(ops.input_ro(0), ops.input_i32(1), u(*classes))?;
                // The kernel's mean, over `divisor` rows instead (in f64 as
                // the kernel sums; exact when `divisor == rows`).
                ops.output(0)[0] = if divisor == rows {
                    loss
                } else {
                    (loss as f64 * *rows as f64 / *divisor as f64) as f32
                };
            }
            Kernel::CrossEntropyBackward { classes, scale, .. } => k::cross_entropy_backward(
                ops.input(0),
                ops.input_i32(1),
                ops.output(0),
                u(*classes),
                *scale as f32,
            )?,
            Kernel::GradNorm { squared } => {
                let s = k::sum_of_squares(&ops.all_inputs());
                ops.output(0)[0] = if *squared { s as f32 } else { s.sqrt() as f32 };
            }
            Kernel::Adam(p) => {
                let norm = p.max_norm.map(|_| ops.input_ro(1)[0]);
                let denom = (ops.ins.outputs.len() == 1).then(|| ops.output(0));
                k::adam(
                    ops.input_ro(0),
                    norm,
                    ops.update(0),
                    ops.update(1),
                    ops.update(2),
                    denom,
                    p,
                    p.first_step + step - 1,
                )
            }
            Kernel::View => {}
            // Copied before widening (`copy_bytes`).
            Kernel::CopyToHost { .. } | Kernel::CopyToDevice { .. } => {}
            Kernel::Pack { offsets, .. } => k::pack(&ops.all_inputs(), offsets, ops.output(0)),
            Kernel::ChunkCat(l) => k::chunk_cat(&ops.all_inputs(), l, ops.output(0)),
            Kernel::CopyOut(l) => {
                let mut outs: Vec<&mut [f32]> =
                    (0..ops.ins.outputs.len()).map(|i| ops.output(i)).collect();
                k::copy_out(ops.input_ro(0), l, &mut outs)
            }
            Kernel::AllGather { .. } => comm.all_gather(ops.input_ro(0), ops.output(0))?,
            Kernel::ReduceScatter { op, .. } => {
                comm.reduce_scatter(ops.input_ro(0), ops.output(0), *op)?
            }
            Kernel::AllReduce { op, .. } => comm.all_reduce(ops.update(0), *op)?,
        }
    }
    Ok(())
}
