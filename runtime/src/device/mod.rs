//! Lowering instructions to device operations: the GPU backend's logic,
//! independent of CUDA so it can be tested on any machine.
//!
//! A GPU runs an instruction as a few [`DevOp`]s: kernel launches (the CUDA
//! C kernels of `kernels.cu`, compiled at run time with NVRTC), cuBLAS
//! matrix products ([`GemmCall`], column-major as cuBLAS sees them),
//! memsets, copies and collectives. Addresses are byte offsets into the one
//! device allocation ([`DeviceLayout`]): the arena, then the staging
//! workspace, then the cuBLAS workspace, then a word for kernel errors.
//!
//! [`lower`] produces the operations of every instruction once;
//! the CUDA executor (feature `cuda`) issues them, and [`emulate`] runs them
//! on the host with kernels that mirror `kernels.cu` line by line — so the
//! pointer arithmetic, the row-major to column-major mapping of every
//! product, leading dimensions, batch strides and launch arguments are
//! tested against the CPU executor without a GPU.

pub mod emulate;

use crate::binding::{Bindings, InstrBinding};
use crate::error::{Result, RuntimeError};
use crate::kernel::{Attention, Kernel, ReduceOp};
use crate::program::{Instr, Program, TensorIdx};

/// Bytes of cuBLAS workspace given to each stream that runs matrix
/// products (cuBLAS's own recommendation for Hopper is 32 MiB).
pub const CUBLAS_WORKSPACE: u64 = 32 << 20;
/// Alignment of each region of the device allocation.
pub const REGION_ALIGN: u64 = 256;

/// Where everything lives in the one device allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayout {
    pub arena: u64,
    /// Start of the staging workspace (inputs copied before a kernel).
    pub staging: u64,
    pub staging_bytes: u64,
    /// Start of each stream's cuBLAS workspace (`None`: the stream runs no
    /// matrix product).
    pub blas: Vec<Option<u64>>,
    /// The error word (an i32): 0, or `1 + index` of the first instruction
    /// whose kernel found an out-of-range index.
    pub error_word: u64,
    /// Bytes of the whole allocation.
    pub total: u64,
}

impl DeviceLayout {
    /// The layout for `p` bound by `b`.
    pub fn new(p: &Program, b: &Bindings) -> DeviceLayout {
        let up = |x: u64| x.div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let staging = up(p.arena_bytes);
        let mut end = up(staging + b.workspace_bytes);
        let streams = p.num_streams() as usize;
        let mut uses_blas = vec![false; streams];
        for ins in &p.instrs {
            if uses_gemm(&ins.kernel) {
                uses_blas[ins.stream.index()] = true;
            }
        }
        let blas = uses_blas
            .into_iter()
            .map(|u| {
                u.then(|| {
                    let at = end;
                    end += CUBLAS_WORKSPACE;
                    at
                })
            })
            .collect();
        let error_word = end;
        end += REGION_ALIGN;
        DeviceLayout {
            arena: p.arena_bytes,
            staging,
            staging_bytes: b.workspace_bytes,
            blas,
            error_word,
            total: end,
        }
    }
    /// Bytes beyond the arena: staging, cuBLAS workspaces, error word and
    /// alignment padding.
    pub fn workspace(&self) -> u64 {
        self.total - self.arena
    }
}

fn uses_gemm(k: &Kernel) -> bool {
    matches!(
        k,
        Kernel::Linear(_)
            | Kernel::LinearBackwardData(_)
            | Kernel::LinearBackwardWeight(_)
            | Kernel::MatmulNn(_)
            | Kernel::MatmulNt(_)
            | Kernel::MatmulTn(_)
            | Kernel::AttentionScores(_)
            | Kernel::AttentionScoresBackward(_)
            | Kernel::AttentionValues(_)
            | Kernel::AttentionValuesBackward(_)
    )
}

/// The CUDA kernels of `kernels.cu` (names as there).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DevKernel {
    FillRows,
    ColSum,
    Add,
    GeluFwd,
    GeluBwd,
    ReluFwd,
    ReluBwd,
    LayernormFwd,
    LayernormBwdParams,
    LayernormBwdData,
    CausalSoftmaxFwd,
    CausalSoftmaxBwd,
    ZeroUpper,
    ZeroQk,
    CrossEntropyFwd,
    CrossEntropyBwd,
    EmbeddingFwd,
    EmbeddingBwdTokens,
    EmbeddingBwdPositions,
    SumSquares,
    SqrtInplace,
    AdamStep,
    FlashAttnFwd,
    FlashAttnBwdDq,
    FlashAttnBwdDkv,
}

impl DevKernel {
    pub const ALL: [DevKernel; 25] = [
        DevKernel::FillRows,
        DevKernel::ColSum,
        DevKernel::Add,
        DevKernel::GeluFwd,
        DevKernel::GeluBwd,
        DevKernel::ReluFwd,
        DevKernel::ReluBwd,
        DevKernel::LayernormFwd,
        DevKernel::LayernormBwdParams,
        DevKernel::LayernormBwdData,
        DevKernel::CausalSoftmaxFwd,
        DevKernel::CausalSoftmaxBwd,
        DevKernel::ZeroUpper,
        DevKernel::ZeroQk,
        DevKernel::CrossEntropyFwd,
        DevKernel::CrossEntropyBwd,
        DevKernel::EmbeddingFwd,
        DevKernel::EmbeddingBwdTokens,
        DevKernel::EmbeddingBwdPositions,
        DevKernel::SumSquares,
        DevKernel::SqrtInplace,
        DevKernel::AdamStep,
        DevKernel::FlashAttnFwd,
        DevKernel::FlashAttnBwdDq,
        DevKernel::FlashAttnBwdDkv,
    ];
    /// The `extern "C"` name in `kernels.cu`.
    pub fn name(self) -> &'static str {
        match self {
            DevKernel::FillRows => "fill_rows",
            DevKernel::ColSum => "col_sum",
            DevKernel::Add => "add_f32",
            DevKernel::GeluFwd => "gelu_fwd",
            DevKernel::GeluBwd => "gelu_bwd",
            DevKernel::ReluFwd => "relu_fwd",
            DevKernel::ReluBwd => "relu_bwd",
            DevKernel::LayernormFwd => "layernorm_fwd",
            DevKernel::LayernormBwdParams => "layernorm_bwd_params",
            DevKernel::LayernormBwdData => "layernorm_bwd_data",
            DevKernel::CausalSoftmaxFwd => "causal_softmax_fwd",
            DevKernel::CausalSoftmaxBwd => "causal_softmax_bwd",
            DevKernel::ZeroUpper => "zero_upper",
            DevKernel::ZeroQk => "zero_qk",
            DevKernel::CrossEntropyFwd => "cross_entropy_fwd",
            DevKernel::CrossEntropyBwd => "cross_entropy_bwd",
            DevKernel::EmbeddingFwd => "embedding_fwd",
            DevKernel::EmbeddingBwdTokens => "embedding_bwd_tokens",
            DevKernel::EmbeddingBwdPositions => "embedding_bwd_positions",
            DevKernel::SumSquares => "sum_squares",
            DevKernel::SqrtInplace => "sqrt_inplace",
            DevKernel::AdamStep => "adam_step",
            DevKernel::FlashAttnFwd => "flash_attn_fwd",
            DevKernel::FlashAttnBwdDq => "flash_attn_bwd_dq",
            DevKernel::FlashAttnBwdDkv => "flash_attn_bwd_dkv",
        }
    }
}

/// The CUDA C source of every [`DevKernel`].
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// A kernel argument.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer: this byte offset into the allocation.
    Ptr(u64),
    /// A null pointer.
    Null,
    I64(i64),
    I32(i32),
    F32(f32),
    /// The step number (i64) of an Adam update: `first + steps already run`.
    Step(u64),
}

/// A launch: `grid` blocks of `block` threads.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub kernel: DevKernel,
    pub grid: u32,
    pub block: u32,
    pub args: Vec<Arg>,
}

/// A cuBLAS `sgemm` / `sgemmStridedBatched` call in cuBLAS's own
/// column-major terms: `C = alpha · op(A) · op(B) + beta · C`, `op(A)` is
/// `m × k`, `op(B)` is `k × n`, `C` is `m × n`; matrix `X` has element
/// `(i, j)` at `X + i + j·ldx`; batch `q` adds `q·stride` elements to each
/// pointer. Pointers are byte offsets into the allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmCall {
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    pub a: u64,
    pub lda: i32,
    pub stride_a: i64,
    pub b: u64,
    pub ldb: i32,
    pub stride_b: i64,
    pub beta: f32,
    pub c: u64,
    pub ldc: i32,
    pub stride_c: i64,
    pub batch: i32,
}

/// A collective.
#[derive(Clone, Debug, PartialEq)]
pub enum CollectiveOp {
    /// `send` holds `count` elements; `recv` gets `world × count`.
    AllGather { send: u64, recv: u64, count: u64 },
    /// `send` holds `world × count` elements; `recv` gets `count`.
    ReduceScatter {
        send: u64,
        recv: u64,
        count: u64,
        op: ReduceOp,
    },
    /// In place on `count` elements.
    AllReduce { buf: u64, count: u64, op: ReduceOp },
}

/// One device operation.
#[derive(Clone, Debug, PartialEq)]
pub enum DevOp {
    Launch(Launch),
    Gemm(GemmCall),
    /// Zero `bytes` bytes at `at`.
    Memset {
        at: u64,
        bytes: u64,
    },
    /// Copy `bytes` bytes (regions do not overlap).
    Copy {
        src: u64,
        dst: u64,
        bytes: u64,
    },
    Collective(CollectiveOp),
}

/// A row-major operand of a product: element `(i, j)` of the stored matrix
/// at `at + 4·(i·ld + j)`; `t`: the operand is the transpose of what is
/// stored.
#[derive(Copy, Clone, Debug)]
pub struct RowMajor {
    pub at: u64,
    pub ld: u64,
    pub t: bool,
    /// Elements between consecutive batch entries.
    pub stride: u64,
}

impl RowMajor {
    pub fn new(at: u64, ld: u64) -> Self {
        RowMajor {
            at,
            ld,
            t: false,
            stride: 0,
        }
    }
    pub fn t(mut self) -> Self {
        self.t = true;
        self
    }
    pub fn stride(mut self, s: u64) -> Self {
        self.stride = s;
        self
    }
}

fn int(what: &str, v: u64) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        RuntimeError::Unavailable(
            "cuBLAS",
            format!("{what} = {v} does not fit cuBLAS's 32-bit sizes"),
        )
    })
}

/// The cuBLAS call computing row-major `C (m × n) = alpha · A · B + beta · C`
/// for `batch` matrices. Row-major `X` is column-major `Xᵀ`, so cuBLAS
/// computes `Cᵀ = op(B)ᵀ · op(A)ᵀ`: operands swap, sizes `(n, m, k)`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_row_major(
    m: u64,
    n: u64,
    k: u64,
    alpha: f32,
    a: RowMajor,
    b: RowMajor,
    beta: f32,
    c: RowMajor,
    batch: u64,
) -> Result<GemmCall> {
    Ok(GemmCall {
        transa: b.t,
        transb: a.t,
        m: int("n", n)?,
        n: int("m", m)?,
        k: int("k", k)?,
        alpha,
        a: b.at,
        lda: int("ldb", b.ld)?,
        stride_a: b.stride as i64,
        b: a.at,
        ldb: int("lda", a.ld)?,
        stride_b: a.stride as i64,
        beta,
        c: c.at,
        ldc: int("ldc", c.ld)?,
        stride_c: c.stride as i64,
        batch: int("batch", batch)?,
    })
}

/// Threads per block of elementwise kernels.
pub const BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch.
pub const MAX_GRID: u64 = 65535 * 8;

/// A grid-stride launch over `n` elements.
pub fn elementwise(kernel: DevKernel, n: u64, args: Vec<Arg>) -> DevOp {
    let grid = n.div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32;
    DevOp::Launch(Launch {
        kernel,
        grid,
        block: BLOCK,
        args,
    })
}

/// One block per row, threads covering a row of `cols` (a multiple of 32,
/// at most 1024).
pub fn per_row(kernel: DevKernel, rows: u64, cols: u64, args: Vec<Arg>) -> Result<DevOp> {
    let grid = u32::try_from(rows.max(1)).map_err(|_| {
        RuntimeError::Unavailable("CUDA", format!("{rows} rows exceed the grid limit"))
    })?;
    let block = cols.div_ceil(32).clamp(1, 32) as u32 * 32;
    Ok(DevOp::Launch(Launch {
        kernel,
        grid,
        block,
        args,
    }))
}

/// Largest head dimension of the flash-attention kernels (`FA_DMAX`).
pub const FLASH_MAX_HEAD_DIM: u64 = 128;
/// Rows per block of the flash-attention kernels (`FA_ROWS`).
const FLASH_ROWS: u64 = 16;

/// A launch of one of the flash-attention kernels: one block of 4 warps per
/// 16 rows of each head; `args` are the pointers, the sizes follow.
fn flash(kernel: DevKernel, at: &Attention, mut args: Vec<Arg>) -> Result<DevOp> {
    if at.head_dim > FLASH_MAX_HEAD_DIM {
        return Err(RuntimeError::Unavailable(
            "fused attention on CUDA",
            format!(
                "head_dim {} exceeds the kernels' {FLASH_MAX_HEAD_DIM}",
                at.head_dim
            ),
        ));
    }
    let blocks = at.batch * at.heads * at.seq.div_ceil(FLASH_ROWS);
    let grid = u32::try_from(blocks).map_err(|_| {
        RuntimeError::Unavailable("CUDA", format!("{blocks} blocks exceed the grid limit"))
    })?;
    args.extend([
        n(at.batch),
        n(at.heads),
        n(at.seq),
        n(at.head_dim),
        Arg::F32(at.scale),
    ]);
    Ok(DevOp::Launch(Launch {
        kernel,
        grid,
        block: 128,
        args,
    }))
}

/// Where one instruction's operands are.
struct Addr<'a> {
    p: &'a Program,
    ins: &'a Instr,
    bind: &'a InstrBinding,
    layout: &'a DeviceLayout,
}

impl Addr<'_> {
    fn off(&self, t: TensorIdx) -> u64 {
        self.p.tensor(t).offset
    }
    /// Input `pos` (its staged copy if staged; an aliased input is at its
    /// output's bytes, which are its own).
    fn i(&self, pos: usize) -> u64 {
        match self.bind.staged_input(pos) {
            Some(w) => self.layout.staging + w,
            None => self.off(self.ins.inputs[pos]),
        }
    }
    fn o(&self, pos: usize) -> u64 {
        self.off(self.ins.outputs[pos])
    }
    fn u(&self, pos: usize) -> u64 {
        self.off(self.ins.updates[pos])
    }
}

fn p(x: u64) -> Arg {
    Arg::Ptr(x)
}
fn n(x: u64) -> Arg {
    Arg::I64(x as i64)
}

/// The device operations of instruction `index` of `prog`, in order.
pub fn lower(
    prog: &Program,
    b: &Bindings,
    layout: &DeviceLayout,
    index: usize,
) -> Result<Vec<DevOp>> {
    let ins = &prog.instrs[index];
    let a = Addr {
        p: prog,
        ins,
        bind: &b.instrs[index],
        layout,
    };
    let err = Arg::Ptr(layout.error_word);
    let code = Arg::I32(index as i32 + 1);
    let mut ops = Vec::new();
    for &(pos, w) in &a.bind.staged {
        let x = prog.tensor(ins.inputs[pos]);
        ops.push(DevOp::Copy {
            src: x.offset,
            dst: layout.staging + w,
            bytes: x.bytes(),
        });
    }
    let elems = |t: TensorIdx| prog.tensor(t).elements();
    match &ins.kernel {
        Kernel::Embedding {
            batch,
            seq,
            width,
            vocab,
        } => {
            let bt = batch * seq;
            ops.push(elementwise(
                DevKernel::EmbeddingFwd,
                bt * width,
                vec![
                    p(a.i(0)),
                    p(a.i(1)),
                    p(a.i(2)),
                    p(a.o(0)),
                    n(bt),
                    n(*seq),
                    n(*width),
                    n(*vocab),
                    err,
                    code,
                ],
            ));
        }
        Kernel::EmbeddingBackward {
            batch,
            seq,
            width,
            vocab,
            accumulate,
        } => {
            let bt = batch * seq;
            let bytes = vocab * width * 4;
            if *accumulate {
                if a.i(2) != a.o(0) {
                    ops.push(DevOp::Copy {
                        src: a.i(2),
                        dst: a.o(0),
                        bytes,
                    });
                }
            } else {
                ops.push(DevOp::Memset { at: a.o(0), bytes });
            }
            ops.push(elementwise(
                DevKernel::EmbeddingBwdTokens,
                bt * width,
                vec![
                    p(a.i(0)),
                    p(a.i(1)),
                    p(a.o(0)),
                    n(bt),
                    n(*width),
                    n(*vocab),
                    err,
                    code,
                ],
            ));
            ops.push(elementwise(
                DevKernel::EmbeddingBwdPositions,
                seq * width,
                vec![p(a.i(0)), p(a.o(1)), n(*batch), n(*seq), n(*width)],
            ));
        }
        Kernel::LayerNorm { rows, cols, eps } => ops.push(per_row(
            DevKernel::LayernormFwd,
            *rows,
            *cols,
            vec![
                p(a.i(0)),
                p(a.i(1)),
                p(a.i(2)),
                p(a.o(0)),
                p(a.o(1)),
                p(a.o(2)),
                n(*rows),
                n(*cols),
                Arg::F32(*eps),
            ],
        )?),
        Kernel::LayerNormBackward { rows, cols } => {
            // Parameter gradients first: the data kernel may overwrite dy.
            ops.push(elementwise(
                DevKernel::LayernormBwdParams,
                *cols,
                vec![
                    p(a.i(0)),
                    p(a.i(1)),
                    p(a.i(2)),
                    p(a.i(3)),
                    p(a.o(1)),
                    p(a.o(2)),
                    n(*rows),
                    n(*cols),
                ],
            ));
            ops.push(per_row(
                DevKernel::LayernormBwdData,
                *rows,
                *cols,
                vec![
                    p(a.i(0)),
                    p(a.i(1)),
                    p(a.i(2)),
                    p(a.i(3)),
                    p(a.i(4)),
                    p(a.o(0)),
                    n(*rows),
                    n(*cols),
                ],
            )?);
        }
        Kernel::Linear(mm) => {
            ops.push(elementwise(
                DevKernel::FillRows,
                mm.m * mm.n,
                vec![p(a.o(0)), p(a.i(2)), n(mm.m), n(mm.n)],
            ));
            ops.push(DevOp::Gemm(gemm_row_major(
                mm.m,
                mm.n,
                mm.k,
                1.0,
                RowMajor::new(a.i(0), mm.k),
                RowMajor::new(a.i(1), mm.n),
                1.0,
                RowMajor::new(a.o(0), mm.n),
                1,
            )?));
        }
        Kernel::LinearBackwardData(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.k,
            mm.n,
            1.0,
            RowMajor::new(a.i(0), mm.n),
            RowMajor::new(a.i(1), mm.n).t(),
            0.0,
            RowMajor::new(a.o(0), mm.k),
            1,
        )?)),
        Kernel::LinearBackwardWeight(mm) => {
            ops.push(DevOp::Gemm(gemm_row_major(
                mm.k,
                mm.n,
                mm.m,
                1.0,
                RowMajor::new(a.i(1), mm.k).t(),
                RowMajor::new(a.i(0), mm.n),
                0.0,
                RowMajor::new(a.o(0), mm.n),
                1,
            )?));
            ops.push(elementwise(
                DevKernel::ColSum,
                mm.n,
                vec![p(a.i(0)), p(a.o(1)), n(mm.m), n(mm.n)],
            ));
        }
        Kernel::MatmulNt(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.k),
            RowMajor::new(a.i(1), mm.k).t(),
            0.0,
            RowMajor::new(a.o(0), mm.n),
            1,
        )?)),
        Kernel::MatmulNn(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.k),
            RowMajor::new(a.i(1), mm.n),
            0.0,
            RowMajor::new(a.o(0), mm.n),
            1,
        )?)),
        Kernel::MatmulTn(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.m).t(),
            RowMajor::new(a.i(1), mm.n),
            0.0,
            RowMajor::new(a.o(0), mm.n),
            1,
        )?)),
        Kernel::AttentionScores(at) => {
            let g = Geometry::new(at);
            for bi in 0..at.batch {
                // scores_h = scale · Q_h K_hᵀ
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.t,
                    g.d,
                    at.scale,
                    g.qkv(a.i(0), bi, 0),
                    g.qkv(a.i(0), bi, 1).t(),
                    0.0,
                    g.square(a.o(0), bi),
                    at.heads,
                )?));
            }
            ops.push(elementwise(
                DevKernel::ZeroUpper,
                at.batch * at.heads * g.t * g.t,
                vec![p(a.o(0)), n(at.batch * at.heads), n(g.t)],
            ));
        }
        Kernel::CausalSoftmax(at) => {
            let rows = at.batch * at.heads * at.seq;
            ops.push(per_row(
                DevKernel::CausalSoftmaxFwd,
                rows,
                at.seq,
                vec![p(a.i(0)), p(a.o(0)), n(rows), n(at.seq)],
            )?);
        }
        Kernel::AttentionValues(at) => {
            let g = Geometry::new(at);
            for bi in 0..at.batch {
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    1.0,
                    g.square(a.i(0), bi),
                    g.qkv(a.i(1), bi, 2),
                    0.0,
                    g.heads_out(a.o(0), bi),
                    at.heads,
                )?));
            }
        }
        Kernel::AttentionValuesBackward(at) => {
            let g = Geometry::new(at);
            for bi in 0..at.batch {
                // dprobs_h = dAtt_h V_hᵀ
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.t,
                    g.d,
                    1.0,
                    g.heads_out(a.i(0), bi),
                    g.qkv(a.i(2), bi, 2).t(),
                    0.0,
                    g.square(a.o(0), bi),
                    at.heads,
                )?));
            }
            ops.push(elementwise(
                DevKernel::ZeroUpper,
                at.batch * at.heads * g.t * g.t,
                vec![p(a.o(0)), n(at.batch * at.heads), n(g.t)],
            ));
            ops.push(elementwise(
                DevKernel::ZeroQk,
                at.batch * g.t * 2 * g.c,
                vec![p(a.o(1)), n(at.batch * g.t), n(g.c)],
            ));
            for bi in 0..at.batch {
                // dV_h = P_hᵀ dAtt_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    1.0,
                    g.square(a.i(1), bi).t(),
                    g.heads_out(a.i(0), bi),
                    0.0,
                    g.qkv(a.o(1), bi, 2),
                    at.heads,
                )?));
            }
        }
        Kernel::CausalSoftmaxBackward(at) => {
            let rows = at.batch * at.heads * at.seq;
            ops.push(per_row(
                DevKernel::CausalSoftmaxBwd,
                rows,
                at.seq,
                vec![p(a.i(0)), p(a.i(1)), p(a.o(0)), n(rows), n(at.seq)],
            )?);
        }
        Kernel::AttentionScoresBackward(at) => {
            let g = Geometry::new(at);
            for bi in 0..at.batch {
                // dQ_h += scale · dS_h K_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    at.scale,
                    g.square(a.i(0), bi),
                    g.qkv(a.i(1), bi, 1),
                    1.0,
                    g.qkv(a.u(0), bi, 0),
                    at.heads,
                )?));
                // dK_h += scale · dS_hᵀ Q_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    at.scale,
                    g.square(a.i(0), bi).t(),
                    g.qkv(a.i(1), bi, 0),
                    1.0,
                    g.qkv(a.u(0), bi, 1),
                    at.heads,
                )?));
            }
        }
        Kernel::FusedAttention(at) => ops.push(flash(
            DevKernel::FlashAttnFwd,
            at,
            vec![p(a.i(0)), p(a.o(0)), p(a.o(1))],
        )?),
        Kernel::FusedAttentionBackward(at) => {
            let args = vec![p(a.i(0)), p(a.i(1)), p(a.i(2)), p(a.i(3)), p(a.o(0))];
            ops.push(flash(DevKernel::FlashAttnBwdDq, at, args.clone())?);
            ops.push(flash(DevKernel::FlashAttnBwdDkv, at, args)?);
        }
        Kernel::Add { elements } => ops.push(elementwise(
            DevKernel::Add,
            *elements,
            vec![p(a.i(0)), p(a.i(1)), p(a.o(0)), n(*elements)],
        )),
        Kernel::Gelu { elements } => ops.push(elementwise(
            DevKernel::GeluFwd,
            *elements,
            vec![p(a.i(0)), p(a.o(0)), n(*elements)],
        )),
        Kernel::GeluBackward { elements } => ops.push(elementwise(
            DevKernel::GeluBwd,
            *elements,
            vec![p(a.i(0)), p(a.i(1)), p(a.o(0)), n(*elements)],
        )),
        Kernel::Relu { elements } => ops.push(elementwise(
            DevKernel::ReluFwd,
            *elements,
            vec![p(a.i(0)), p(a.o(0)), n(*elements)],
        )),
        Kernel::ReluBackward { elements } => ops.push(elementwise(
            DevKernel::ReluBwd,
            *elements,
            vec![p(a.i(0)), p(a.i(1)), p(a.o(0)), n(*elements)],
        )),
        Kernel::CrossEntropy { rows, classes } => {
            ops.push(DevOp::Memset {
                at: a.o(0),
                bytes: 4,
            });
            ops.push(per_row(
                DevKernel::CrossEntropyFwd,
                *rows,
                *classes,
                vec![
                    p(a.i(0)),
                    p(a.i(1)),
                    p(a.o(0)),
                    n(*rows),
                    n(*classes),
                    err,
                    code,
                ],
            )?);
        }
        Kernel::CrossEntropyBackward {
            rows,
            classes,
            scale,
        } => ops.push(per_row(
            DevKernel::CrossEntropyBwd,
            *rows,
            *classes,
            vec![
                p(a.i(0)),
                p(a.i(1)),
                p(a.o(0)),
                n(*rows),
                n(*classes),
                Arg::F32(*scale),
                err,
                code,
            ],
        )?),
        Kernel::GradNorm { squared } => {
            ops.push(DevOp::Memset {
                at: a.o(0),
                bytes: 4,
            });
            for (pos, &t) in ins.inputs.iter().enumerate() {
                ops.push(elementwise(
                    DevKernel::SumSquares,
                    elems(t),
                    vec![p(a.i(pos)), p(a.o(0)), n(elems(t))],
                ));
            }
            if !squared {
                ops.push(DevOp::Launch(Launch {
                    kernel: DevKernel::SqrtInplace,
                    grid: 1,
                    block: 1,
                    args: vec![p(a.o(0))],
                }));
            }
        }
        Kernel::Adam(ad) => {
            let norm = if ad.max_norm.is_some() {
                p(a.i(1))
            } else {
                Arg::Null
            };
            let denom = if ins.outputs.len() == 1 {
                p(a.o(0))
            } else {
                Arg::Null
            };
            ops.push(elementwise(
                DevKernel::AdamStep,
                ad.elements,
                vec![
                    p(a.i(0)),
                    norm,
                    p(a.u(0)),
                    p(a.u(1)),
                    p(a.u(2)),
                    denom,
                    n(ad.elements),
                    Arg::F32(ad.lr),
                    Arg::F32(ad.beta1),
                    Arg::F32(ad.beta2),
                    Arg::F32(ad.eps),
                    Arg::F32(ad.weight_decay),
                    Arg::I32(ad.decoupled as i32),
                    Arg::Step(ad.first_step),
                    Arg::F32(ad.max_norm.unwrap_or(0.0)),
                    Arg::I32(ad.norm_squared as i32),
                ],
            ));
        }
        Kernel::View => {}
        Kernel::Pack { offsets, .. } => {
            let out = prog.tensor(ins.outputs[0]);
            ops.push(DevOp::Memset {
                at: out.offset,
                bytes: out.bytes(),
            });
            for (pos, (&t, &off)) in ins.inputs.iter().zip(offsets).enumerate() {
                let x = prog.tensor(t);
                ops.push(DevOp::Copy {
                    src: a.i(pos),
                    dst: out.offset + off * x.dtype.size(),
                    bytes: x.bytes(),
                });
            }
        }
        Kernel::AllGather { .. } => ops.push(DevOp::Collective(CollectiveOp::AllGather {
            send: a.i(0),
            recv: a.o(0),
            count: elems(ins.inputs[0]),
        })),
        Kernel::ReduceScatter { op, .. } => {
            ops.push(DevOp::Collective(CollectiveOp::ReduceScatter {
                send: a.i(0),
                recv: a.o(0),
                count: elems(ins.outputs[0]),
                op: *op,
            }))
        }
        Kernel::AllReduce { op, .. } => ops.push(DevOp::Collective(CollectiveOp::AllReduce {
            buf: a.u(0),
            count: elems(ins.updates[0]),
            op: *op,
        })),
    }
    Ok(ops)
}

/// Strides of attention operands, in elements.
struct Geometry {
    t: u64,
    d: u64,
    c: u64,
    h: u64,
}

impl Geometry {
    fn new(a: &Attention) -> Self {
        Geometry {
            t: a.seq,
            d: a.head_dim,
            c: a.heads * a.head_dim,
            h: a.heads,
        }
    }
    /// Part `part` (0 query, 1 key, 2 value) of batch `b` of a `[B,T,3C]`
    /// tensor at `base`, one `T × D` matrix per head.
    fn qkv(&self, base: u64, b: u64, part: u64) -> RowMajor {
        let off = b * self.t * 3 * self.c + part * self.c;
        RowMajor::new(base + 4 * off, 3 * self.c).stride(self.d)
    }
    /// Batch `b` of a `[B,H,T,T]` tensor, one `T × T` matrix per head.
    fn square(&self, base: u64, b: u64) -> RowMajor {
        RowMajor::new(base + 4 * b * self.h * self.t * self.t, self.t).stride(self.t * self.t)
    }
    /// Batch `b` of a `[B,T,C]` tensor, one `T × D` matrix per head.
    fn heads_out(&self, base: u64, b: u64) -> RowMajor {
        RowMajor::new(base + 4 * b * self.t * self.c, self.c).stride(self.d)
    }
}

/// Every instruction's device operations.
pub fn lower_all(p: &Program, b: &Bindings, layout: &DeviceLayout) -> Result<Vec<Vec<DevOp>>> {
    (0..p.instrs.len())
        .map(|i| lower(p, b, layout, i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_in_the_cuda_source() {
        for k in DevKernel::ALL {
            let decl = format!("__global__ void {}(", k.name());
            assert!(KERNELS_CU.contains(&decl), "{decl} missing from kernels.cu");
        }
    }

    #[test]
    fn layout_puts_regions_after_the_arena() {
        let p = Program {
            name: "t".into(),
            arena_bytes: 1000,
            tensors: vec![],
            instrs: vec![],
            world_size: 1,
        };
        let l = DeviceLayout::new(&p, &Bindings::default());
        assert_eq!(l.staging, 1024);
        assert_eq!(l.blas, vec![None]);
        assert_eq!(l.error_word, 1024);
        assert_eq!(l.total, 1280);
        assert_eq!(l.workspace(), 280);
    }
}
