//! Lowering instructions to device operations: the GPU backend's logic,
//! independent of CUDA so it can be tested on any machine.
//!
//! A GPU runs an instruction as a few [`DevOp`]s: kernel launches (the CUDA
//! C kernels of `kernels.cu`, compiled at run time with NVRTC), cuBLAS
//! matrix products ([`GemmCall`], column-major as cuBLAS sees them),
//! memsets, copies and collectives. Addresses are byte offsets into the one
//! device allocation ([`DeviceLayout`]): the arena, then the staging
//! workspace, then integer scratch (the token-embedding gradient's bucket
//! sort), then the cuBLAS workspaces, then a word for kernel errors.
//!
//! Float operands are f32 or bf16 (a kernel argument [`Buf`] says which):
//! kernels compute in f32 and round what they store, products run through
//! cuBLAS's `gemmEx` with bf16 or f32 operands and f32 accumulation, and
//! collectives move the operand's own dtype. A bf16 step's arithmetic is
//! thus the CPU executor's (which widens bf16 operands around f32 kernels)
//! up to the order of f32 additions.
//!
//! Fused attention has three lowerings ([`AttentionLowering`]): flash
//! kernels with f32 arithmetic on the CUDA cores; the same kernels with
//! their products on the tensor cores (`mma.sync` with bf16 operands and
//! f32 accumulators; the f32 factors `P` and `dS` go in as a bf16 high part
//! plus a bf16 remainder, which keeps about 16 of their bits); or cuBLAS
//! products over blocks of query rows with the scores in the scratch
//! (module `gemm_attention`).
//!
//! [`lower`] (module `lower`, one function per kernel family) produces the
//! operations of every instruction once;
//! the CUDA executor (feature `cuda`) issues them, and [`emulate`] runs them
//! on the host with kernels that mirror `kernels.cu` line by line — so the
//! pointer arithmetic, the row-major to column-major mapping of every
//! product, leading dimensions, batch strides and launch arguments are
//! tested against the CPU executor without a GPU. With feature
//! `host-kernels` ([`host`]) the emulator can launch `kernels.cu` itself,
//! compiled for the host with a C++ shim of CUDA's threads, barriers, warp
//! shuffles and atomics, so the same tests also check the CUDA source's own
//! arithmetic and indexing, not only its mirror.

pub mod emulate;
mod gemm_attention;
#[cfg(feature = "host-kernels")]
pub mod host;
mod lower;

pub use lower::{lower, lower_all};

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::binding::Bindings;
use crate::error::{Result, RuntimeError};
use crate::kernel::{Kernel, ReduceOp};
use crate::program::{DType, Program};

/// Bytes of cuBLAS workspace given to each stream that runs matrix
/// products (cuBLAS's own recommendation for Hopper is 32 MiB).
pub const CUBLAS_WORKSPACE: u64 = 32 << 20;
/// Alignment of each region of the device allocation.
pub const REGION_ALIGN: u64 = 256;

/// Where everything lives in the one device allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayout {
    /// How fused attention is lowered (its scratch is in `scratch`).
    pub attention: AttentionLowering,
    pub arena: u64,
    /// Start of the staging workspace (inputs copied before a kernel).
    pub staging: u64,
    pub staging_bytes: u64,
    /// Start of the integer scratch some kernels need ([`scratch_bytes`]).
    pub scratch: u64,
    pub scratch_bytes: u64,
    /// Start of each stream's cuBLAS workspace (`None`: the stream runs no
    /// matrix product).
    pub blas: Vec<Option<u64>>,
    /// The error word (an i32): 0, or `1 + index` of the first instruction
    /// whose kernel found an out-of-range index.
    pub error_word: u64,
    /// Bytes of the whole allocation.
    pub total: u64,
}

/// How the CUDA lowering runs a fused attention.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum AttentionLowering {
    /// The flash kernels of `kernels.cu`: no scratch, arithmetic on the
    /// CUDA cores.
    #[default]
    Flash,
    /// cuBLAS products over blocks of `rows` query rows (0: as many as
    /// fit 64 MiB of scores), with the scores in the scratch
    /// (`gemm_attention`).
    Gemm { rows: u64 },
    /// The flash kernels' tensor-core versions (`flash_mma64_*` and
    /// `flash_mma128_*`: bf16 `mma.sync` products, f32 accumulation) where
    /// they apply — bf16 operands, a head dimension that is a multiple of
    /// 16 up to [`MMA_MAX_HEAD_DIM`], a GPU of compute capability 8.0 or
    /// later — and the flash kernels elsewhere. No scratch.
    TensorCores,
    /// The fastest that applies: [`AttentionLowering::TensorCores`] on a GPU
    /// of compute capability 8.0 or later (bf16 attention there runs on
    /// the tensor cores, f32 attention on the flash kernels), the flash
    /// kernels on older GPUs. The CUDA executor resolves it
    /// ([`AttentionLowering::resolved`]) before lowering.
    Auto,
}

impl AttentionLowering {
    /// Products over blocks sized to the scratch's default budget.
    pub const GEMM: AttentionLowering = AttentionLowering::Gemm { rows: 0 };

    /// The lowering [`AttentionLowering::Auto`] stands for on a GPU of
    /// compute capability `major`.x; any other lowering as it is.
    pub fn resolved(self, major: i32) -> AttentionLowering {
        match self {
            AttentionLowering::Auto if major >= 8 => AttentionLowering::TensorCores,
            AttentionLowering::Auto => AttentionLowering::Flash,
            other => other,
        }
    }
}

impl DeviceLayout {
    /// The layout for `p` bound by `b`, fused attention by the flash
    /// kernels.
    pub fn new(p: &Program, b: &Bindings) -> DeviceLayout {
        DeviceLayout::with_attention(p, b, AttentionLowering::Flash)
    }

    /// The layout for `p` bound by `b`, fused attention lowered as
    /// `attention` says.
    pub fn with_attention(p: &Program, b: &Bindings, attention: AttentionLowering) -> DeviceLayout {
        // Unresolved (no GPU to ask, as in the emulator): the tensor cores.
        let attention = attention.resolved(8);
        let up = |x: u64| x.div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let staging = up(p.arena_bytes);
        let scratch = up(staging + b.workspace_bytes);
        let scratch_bytes = p
            .instrs
            .iter()
            .map(|i| scratch_bytes(p, i, attention))
            .max()
            .unwrap_or(0);
        let mut end = up(scratch + scratch_bytes);
        let streams = p.num_streams() as usize;
        let mut uses_blas = vec![false; streams];
        let fused = |k: &Kernel| {
            matches!(
                k,
                Kernel::FusedAttention(_) | Kernel::FusedAttentionBackward(_)
            )
        };
        for ins in &p.instrs {
            if uses_gemm(&ins.kernel)
                || (matches!(attention, AttentionLowering::Gemm { .. }) && fused(&ins.kernel))
            {
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
            attention,
            arena: p.arena_bytes,
            staging,
            staging_bytes: b.workspace_bytes,
            scratch,
            scratch_bytes,
            blas,
            error_word,
            total: end,
        }
    }
    /// Bytes beyond the arena: staging, scratch, cuBLAS workspaces, error
    /// word and alignment padding.
    pub fn workspace(&self) -> u64 {
        self.total - self.arena
    }
}

/// Bytes of integer scratch kernel `k` needs: the token-embedding
/// gradient's bucket sort keeps `vocab + 1` bucket starts, `vocab` fill
/// counters and one slot per token.
pub fn scratch_bytes(
    p: &Program,
    ins: &crate::program::Instr,
    attention: AttentionLowering,
) -> u64 {
    let bf = |t: Option<&crate::program::TensorIdx>| {
        t.is_some_and(|&t| p.tensor(t).dtype == DType::BF16)
    };
    let (i, o) = (&ins.inputs, &ins.outputs);
    match (&ins.kernel, attention) {
        (
            Kernel::EmbeddingBackward {
                batch, seq, vocab, ..
            },
            _,
        ) => 4 * (2 * vocab + 1 + batch * seq),
        (Kernel::FusedAttention(at), AttentionLowering::Gemm { rows }) => {
            let wide = [bf(i.first()), bf(o.first()), false, false];
            gemm_attention::scratch_bytes(at, rows, false, wide)
        }
        (Kernel::FusedAttentionBackward(at), AttentionLowering::Gemm { rows }) => {
            let wide = [bf(i.get(1)), false, bf(i.first()), bf(o.first())];
            gemm_attention::scratch_bytes(at, rows, true, wide)
        }
        _ => 0,
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
    EmbeddingCount,
    ScanCounts,
    EmbeddingPlace,
    EmbeddingBwdRows,
    EmbeddingBwdPositions,
    SumSquares,
    SqrtInplace,
    AdamStep,
    FlashAttnFwd,
    FlashAttnBwdDq,
    FlashAttnBwdDkv,
    FlashMma64Fwd,
    FlashMma64BwdDq,
    FlashMma64BwdDkv,
    FlashMma128Fwd,
    FlashMma128BwdDq,
    FlashMma128BwdDkv,
    RmsnormFwd,
    RmsnormBwdParams,
    RmsnormBwdData,
    RopeFwd,
    SwigluFwd,
    SwigluBwd,
    Cast,
    AttnRowsSoftmax,
    AttnRowsSoftmaxBwd,
    AttnRowDot,
}

impl DevKernel {
    pub const ALL: [DevKernel; 44] = [
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
        DevKernel::EmbeddingCount,
        DevKernel::ScanCounts,
        DevKernel::EmbeddingPlace,
        DevKernel::EmbeddingBwdRows,
        DevKernel::EmbeddingBwdPositions,
        DevKernel::SumSquares,
        DevKernel::SqrtInplace,
        DevKernel::AdamStep,
        DevKernel::FlashAttnFwd,
        DevKernel::FlashAttnBwdDq,
        DevKernel::FlashAttnBwdDkv,
        DevKernel::FlashMma64Fwd,
        DevKernel::FlashMma64BwdDq,
        DevKernel::FlashMma64BwdDkv,
        DevKernel::FlashMma128Fwd,
        DevKernel::FlashMma128BwdDq,
        DevKernel::FlashMma128BwdDkv,
        DevKernel::RmsnormFwd,
        DevKernel::RmsnormBwdParams,
        DevKernel::RmsnormBwdData,
        DevKernel::RopeFwd,
        DevKernel::SwigluFwd,
        DevKernel::SwigluBwd,
        DevKernel::Cast,
        DevKernel::AttnRowsSoftmax,
        DevKernel::AttnRowsSoftmaxBwd,
        DevKernel::AttnRowDot,
    ];
    /// The tensor-core flash kernels (fwd, dQ, dK/dV) for head dimensions
    /// up to 64 or, above that, up to 128.
    pub fn tensor_core_attention(head_dim: u64) -> [DevKernel; 3] {
        if head_dim <= 64 {
            [
                DevKernel::FlashMma64Fwd,
                DevKernel::FlashMma64BwdDq,
                DevKernel::FlashMma64BwdDkv,
            ]
        } else {
            [
                DevKernel::FlashMma128Fwd,
                DevKernel::FlashMma128BwdDq,
                DevKernel::FlashMma128BwdDkv,
            ]
        }
    }

    /// Whether this is one of the tensor-core flash kernels (blocks of 64
    /// rows).
    pub fn is_tensor_core_attention(self) -> bool {
        self.name().starts_with("flash_mma")
    }

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
            DevKernel::EmbeddingCount => "embedding_count",
            DevKernel::ScanCounts => "scan_counts",
            DevKernel::EmbeddingPlace => "embedding_place",
            DevKernel::EmbeddingBwdRows => "embedding_bwd_rows",
            DevKernel::EmbeddingBwdPositions => "embedding_bwd_positions",
            DevKernel::SumSquares => "sum_squares",
            DevKernel::SqrtInplace => "sqrt_inplace",
            DevKernel::AdamStep => "adam_step",
            DevKernel::FlashAttnFwd => "flash_attn_fwd",
            DevKernel::FlashAttnBwdDq => "flash_attn_bwd_dq",
            DevKernel::FlashAttnBwdDkv => "flash_attn_bwd_dkv",
            DevKernel::FlashMma64Fwd => "flash_mma64_fwd",
            DevKernel::FlashMma64BwdDq => "flash_mma64_bwd_dq",
            DevKernel::FlashMma64BwdDkv => "flash_mma64_bwd_dkv",
            DevKernel::FlashMma128Fwd => "flash_mma128_fwd",
            DevKernel::FlashMma128BwdDq => "flash_mma128_bwd_dq",
            DevKernel::FlashMma128BwdDkv => "flash_mma128_bwd_dkv",
            DevKernel::RmsnormFwd => "rmsnorm_fwd",
            DevKernel::RmsnormBwdParams => "rmsnorm_bwd_params",
            DevKernel::RmsnormBwdData => "rmsnorm_bwd_data",
            DevKernel::RopeFwd => "rope_fwd",
            DevKernel::SwigluFwd => "swiglu_fwd",
            DevKernel::SwigluBwd => "swiglu_bwd",
            DevKernel::Cast => "cast",
            DevKernel::AttnRowsSoftmax => "attn_rows_softmax",
            DevKernel::AttnRowsSoftmaxBwd => "attn_rows_softmax_bwd",
            DevKernel::AttnRowDot => "attn_row_dot",
        }
    }
}

/// The CUDA C source of every [`DevKernel`].
pub const KERNELS_CU: &str = include_str!("kernels.cu");

impl DevKernel {
    /// The most threads per block this kernel may be launched with: its
    /// `__launch_bounds__` in `kernels.cu`, so the source stays the one
    /// place that says it (the compiler fits registers to that size, and a
    /// larger launch would fail on the device).
    pub fn launch_bound(self) -> u32 {
        launch_bounds()
            .get(self.name())
            .copied()
            .unwrap_or_else(|| panic!("kernels.cu declares no launch bound for {}", self.name()))
    }
}

/// `__launch_bounds__(N) name(` of every kernel in [`KERNELS_CU`]; `N` is a
/// number or a name `#define`d as one.
fn launch_bounds() -> &'static HashMap<&'static str, u32> {
    static BOUNDS: OnceLock<HashMap<&'static str, u32>> = OnceLock::new();
    BOUNDS.get_or_init(|| {
        let defined = |name: &str| {
            KERNELS_CU.lines().find_map(|l| {
                let mut w = l.strip_prefix("#define ")?.split_whitespace();
                (w.next()? == name).then(|| w.next()?.parse().ok())?
            })
        };
        KERNELS_CU
            .split("__launch_bounds__(")
            .skip(1)
            .filter_map(|rest| {
                let (bound, rest) = rest.split_once(')')?;
                let name = rest.trim_start().split('(').next()?.trim();
                let n = bound
                    .trim()
                    .parse()
                    .ok()
                    .or_else(|| defined(bound.trim()))?;
                Some((name, n))
            })
            .collect()
    })
}

/// Refuses a launch the device would refuse: no threads, more than the
/// kernel's launch bound, or no blocks.
pub fn check_launch(l: &Launch) -> std::result::Result<(), String> {
    let bound = l.kernel.launch_bound();
    if l.block == 0 || l.block > bound || l.grid == 0 {
        return Err(format!(
            "{} launched as {} blocks of {} threads (at most {bound} per block)",
            l.kernel.name(),
            l.grid,
            l.block
        ));
    }
    Ok(())
}

/// A float operand of a kernel: where it is (a byte offset into the
/// allocation; `None`: a null pointer) and whether it holds bf16 (else
/// f32). Kernels take it as `kernels.cu`'s 16-byte `Buf` (pointer, flag).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Buf {
    pub at: Option<u64>,
    pub bf16: bool,
}

/// A kernel argument.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Arg {
    /// A float operand.
    Buf(Buf),
    /// A device pointer to ints (token ids, targets, counts, the error
    /// word): this byte offset into the allocation.
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
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

/// A launch's parameters as `cuLaunchKernel` takes them: one 16-byte slot
/// per argument, pointers as `base + offset`. A [`Buf`] fills both words
/// (`kernels.cu`'s `struct Buf { void* p; int bf; }`); any other argument
/// sits at the start of the first word (little-endian, so a 4-byte value
/// is its low half). [`Arg::Step`] becomes `first + step - 1`.
pub fn kernel_params(l: &Launch, base: u64, step: u64) -> Vec<[u64; 2]> {
    l.args
        .iter()
        .map(|a| match *a {
            Arg::Buf(b) => [b.at.map_or(0, |at| base + at), b.bf16 as u64],
            Arg::Ptr(off) => [base + off, 0],
            Arg::I64(v) => [v as u64, 0],
            Arg::I32(v) => [v as u32 as u64, 0],
            Arg::F32(v) => [v.to_bits() as u64, 0],
            Arg::F64(v) => [v.to_bits(), 0],
            Arg::Step(first) => [first + step - 1, 0],
        })
        .collect()
}

/// A cuBLAS `gemmEx` / `gemmStridedBatchedEx` call in cuBLAS's own
/// column-major terms: `C = alpha · op(A) · op(B) + beta · C`, `op(A)` is
/// `m × k`, `op(B)` is `k × n`, `C` is `m × n`; matrix `X` has element
/// `(i, j)` at `X + i + j·ldx`; batch `q` adds `q·stride` elements to each
/// pointer. Pointers are byte offsets into the allocation. `A` and `B` are
/// both `ab` (f32 or bf16), `C` is `c` (`ab`, or f32); products accumulate
/// in f32 (`CUBLAS_COMPUTE_32F`), a bf16 `C` is rounded once at the end.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmCall {
    pub ab: DType,
    pub c_dtype: DType,
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

/// A collective over elements of `dtype` (f32 or bf16).
#[derive(Clone, Debug, PartialEq)]
pub enum CollectiveOp {
    /// `send` holds `count` elements; `recv` gets `world × count`.
    AllGather {
        send: u64,
        recv: u64,
        count: u64,
        dtype: DType,
    },
    /// `send` holds `world × count` elements; `recv` gets `count`.
    ReduceScatter {
        send: u64,
        recv: u64,
        count: u64,
        op: ReduceOp,
        dtype: DType,
    },
    /// In place on `count` elements.
    AllReduce {
        buf: u64,
        count: u64,
        op: ReduceOp,
        dtype: DType,
    },
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
/// at `at + size·(i·ld + j)`, `size` the bytes of `dtype`; `t`: the operand
/// is the transpose of what is stored.
#[derive(Copy, Clone, Debug)]
pub struct RowMajor {
    pub at: u64,
    pub ld: u64,
    pub dtype: DType,
    pub t: bool,
    /// Elements between consecutive batch entries.
    pub stride: u64,
}

impl RowMajor {
    pub fn new(at: u64, ld: u64, dtype: DType) -> Self {
        RowMajor {
            at,
            ld,
            dtype,
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
/// `A` and `B` must share a dtype; `C` has theirs or is f32.
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
    let float = |d| matches!(d, DType::F32 | DType::BF16);
    if a.dtype != b.dtype || !float(a.dtype) || !(c.dtype == a.dtype || c.dtype == DType::F32) {
        return Err(RuntimeError::Unavailable(
            "cuBLAS",
            format!(
                "a product of {} by {} into {} (operands must share f32 or bf16; the result \
                 has their dtype or f32)",
                a.dtype, b.dtype, c.dtype
            ),
        ));
    }
    // cuBLAS refuses (CUBLAS_STATUS_INVALID_VALUE) a leading dimension
    // shorter than a stored row; the emulator would not notice.
    for (name, x, cols) in [
        ("A", a, if a.t { m } else { k }),
        ("B", b, if b.t { k } else { n }),
        ("C", c, n),
    ] {
        if x.ld < cols.max(1) {
            return Err(RuntimeError::InvalidProgram(format!(
                "a {m}×{n}×{k} product whose {name} has rows of {cols} elements {} apart",
                x.ld
            )));
        }
    }
    Ok(GemmCall {
        ab: a.dtype,
        c_dtype: c.dtype,
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
pub(crate) const FLASH_ROWS: u64 = 16;
/// Largest head dimension of the tensor-core flash kernels (their
/// larger instantiation, `D = 128`).
pub const MMA_MAX_HEAD_DIM: u64 = 128;
/// Rows per block of the tensor-core flash kernels (`FM_ROWS`).
pub(crate) const MMA_ROWS: u64 = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_attention_is_the_tensor_cores_from_ampere_on() {
        use AttentionLowering::*;
        assert_eq!(Auto.resolved(9), TensorCores);
        assert_eq!(Auto.resolved(8), TensorCores);
        assert_eq!(Auto.resolved(7), Flash);
        assert_eq!(Flash.resolved(9), Flash);
        assert_eq!(TensorCores.resolved(7), TensorCores); // refused later, by name
        assert_eq!(AttentionLowering::GEMM.resolved(9), AttentionLowering::GEMM);
    }

    #[test]
    fn every_kernel_is_defined_in_the_cuda_source() {
        for k in DevKernel::ALL {
            let decl = format!(
                "__global__ void __launch_bounds__({}) {}(",
                if k.name().starts_with("flash_") {
                    "FA_THREADS"
                } else {
                    "1024"
                },
                k.name()
            );
            assert!(KERNELS_CU.contains(&decl), "{decl} missing from kernels.cu");
        }
        assert_eq!(launch_bounds().len(), DevKernel::ALL.len());
    }

    #[test]
    fn launch_bounds_come_from_the_source() {
        assert_eq!(DevKernel::FlashAttnFwd.launch_bound(), 128);
        assert_eq!(DevKernel::Add.launch_bound(), 1024);
        let mut l = Launch {
            kernel: DevKernel::FlashAttnFwd,
            grid: 4,
            block: 128,
            args: vec![],
        };
        assert!(check_launch(&l).is_ok());
        l.block = 256;
        let e = check_launch(&l).unwrap_err();
        assert!(
            e.contains("flash_attn_fwd") && e.contains("at most 128"),
            "{e}"
        );
        l.block = 0;
        assert!(check_launch(&l).is_err());
        l.block = 64;
        l.grid = 0;
        assert!(check_launch(&l).is_err());
    }

    #[test]
    fn products_refuse_what_cublas_refuses() {
        let f = |at, ld| RowMajor::new(at, ld, DType::F32);
        // C (2 × 3) = A (2 × 4) · B (4 × 3): rows of 4, 3 and 3.
        let ok = gemm_row_major(2, 3, 4, 1.0, f(0, 4), f(64, 3), 0.0, f(128, 3), 1).unwrap();
        assert_eq!(
            (ok.m, ok.n, ok.k, ok.lda, ok.ldb, ok.ldc),
            (3, 2, 4, 3, 4, 3)
        );
        // Aᵀ stored as 4 × 2 rows of 2; wider rows are fine.
        assert!(gemm_row_major(2, 3, 4, 1.0, f(0, 2).t(), f(64, 5), 0.0, f(128, 3), 1).is_ok());
        for (a, b, c, short) in [
            (
                f(0, 3),
                f(64, 3),
                f(128, 3),
                "A has rows of 4 elements 3 apart",
            ),
            (
                f(0, 4),
                f(64, 2),
                f(128, 3),
                "B has rows of 3 elements 2 apart",
            ),
            (
                f(0, 4),
                f(64, 3).t(),
                f(128, 3),
                "B has rows of 4 elements 3 apart",
            ),
            (
                f(0, 4),
                f(64, 3),
                f(128, 2),
                "C has rows of 3 elements 2 apart",
            ),
        ] {
            let e = gemm_row_major(2, 3, 4, 1.0, a, b, 0.0, c, 1).unwrap_err();
            assert!(e.to_string().contains(short), "{e}");
        }
        let bf = RowMajor::new(0, 4, DType::BF16);
        assert!(gemm_row_major(2, 3, 4, 1.0, bf, f(64, 3), 0.0, f(128, 3), 1).is_err());
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
        assert_eq!((l.scratch, l.scratch_bytes), (1024, 0));
        assert_eq!(l.blas, vec![None]);
        assert_eq!(l.error_word, 1024);
        assert_eq!(l.total, 1280);
        assert_eq!(l.workspace(), 280);
    }
}
