//! Fused attention lowered to cuBLAS products ([`AttentionLowering::Gemm`]).
//!
//! The flash kernels of `kernels.cu` do their arithmetic on the CUDA cores
//! one tile at a time; this lowering gives the same step the matrix
//! products of a library instead, a block of query rows at a time, so the
//! extra memory stays O(rows × T) rather than O(T²):
//!
//! - forward, per batch entry and block of `R` query rows `r0..r1`: the
//!   scaled scores `S = scale·Q Kᵀ` of every head against keys `0..r1` (one
//!   strided batched product per member of a key/value group), the causal
//!   softmax of each row in place with its log-sum-exp written to `lse`
//!   (`attn_rows_softmax`), then `O = P V`;
//! - backward: `D = Σ dO·O` per row (`attn_row_dot`); per block, `S` again
//!   and `dP = dO Vᵀ`, then `P = exp(S − lse)` and `dS = P ∘ (dP − D)` in
//!   place (`attn_rows_softmax_bwd`), and `dV += Pᵀ dO`, `dK += scale·dSᵀ Q`,
//!   `dQ += scale·dS K`, summed over a group's query heads in a fixed order.
//!
//! Every product is f32 (`CUBLAS_COMPUTE_32F`, no TF32): bf16 operands are
//! widened into the scratch first and bf16 results written through it and
//! rounded once, so the numerics are the CPU executor's (f32 arithmetic,
//! one rounding per stored value) up to the order of the sums. The scratch
//! (the device layout's, after the arena) holds the widened copies, two
//! blocks of scores and the row sums: [`scratch_bytes`].

use super::{Arg, Buf, DevKernel, DevOp, RowMajor, elementwise, gemm_row_major, per_row};
use crate::error::Result;
use crate::kernel::Attention;
use crate::program::DType;

/// Scores of one block take at most this many bytes (then the block is
/// smaller), unless a block of 64 rows needs more.
const BLOCK_BYTES: u64 = 64 << 20;

/// Query rows per block: `rows` when given (non-zero), else as many as fit
/// [`BLOCK_BYTES`] in multiples of 64; at most the sequence.
pub fn block_rows(at: &Attention, rows: u64) -> u64 {
    let rows = if rows > 0 {
        rows
    } else {
        let per_row = 4 * at.heads * at.seq;
        ((BLOCK_BYTES / per_row.max(1)) / 64 * 64).max(64)
    };
    rows.min(at.seq.max(1))
}

/// Where one instruction's operands are: byte offsets and dtypes.
#[derive(Copy, Clone, Debug)]
pub struct Operand {
    pub at: u64,
    pub dtype: DType,
}

impl Operand {
    /// Batch entry `b` of a tensor of `per_batch` elements per entry.
    fn batch(self, b: u64, per_batch: u64) -> Operand {
        Operand {
            at: self.at + self.dtype.size() * b * per_batch,
            ..self
        }
    }
}

/// Byte offsets (from the scratch's start) of what a direction needs.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// f32 copies of operands that are bf16, and f32 results to round.
    qkv: Option<u64>,
    out: Option<u64>,
    dout: Option<u64>,
    dqkv: Option<u64>,
    scores: u64,
    dscores: u64,
    dsum: u64,
    bytes: u64,
}

impl Scratch {
    fn new(at: &Attention, rows: u64, backward: bool, wide: [bool; 4]) -> Scratch {
        let (b, t) = (at.batch, at.seq);
        let qkv_elems = b * t * (at.heads + 2 * at.kv_heads) * at.head_dim;
        let out_elems = b * t * at.width();
        let mut end = 0u64;
        let mut take = |elems: u64| {
            let at = end;
            end = (end + 4 * elems).div_ceil(256) * 256;
            at
        };
        let [w_qkv, w_out, w_dout, w_dqkv] = wide;
        let block = at.heads * block_rows(at, rows) * t;
        let mut s = Scratch {
            qkv: w_qkv.then(|| take(qkv_elems)),
            scores: take(block),
            ..Scratch::default()
        };
        if backward {
            s.dscores = take(block);
            s.dsum = take(b * at.heads * t);
            s.dout = w_dout.then(|| take(out_elems));
            s.dqkv = w_dqkv.then(|| take(qkv_elems));
        } else {
            s.out = w_out.then(|| take(out_elems));
        }
        s.bytes = end;
        s
    }
}

/// Scratch bytes of a fused attention (`backward`: its gradient); `wide`
/// says which of qkv, out, dout and dqkv are bf16.
pub fn scratch_bytes(at: &Attention, rows: u64, backward: bool, wide: [bool; 4]) -> u64 {
    Scratch::new(at, rows, backward, wide).bytes
}

fn f32_buf(at: u64) -> Arg {
    Arg::Buf(Buf {
        at: Some(at),
        bf16: false,
    })
}
fn buf(o: Operand) -> Arg {
    Arg::Buf(Buf {
        at: Some(o.at),
        bf16: o.dtype == DType::BF16,
    })
}
fn n(x: u64) -> Arg {
    Arg::I64(x as i64)
}

/// `x` widened to f32 at `to` (when there is a copy to make), and where
/// the f32 values are.
fn widened(x: Operand, to: Option<u64>, elems: u64, ops: &mut Vec<DevOp>) -> u64 {
    match to {
        Some(to) => {
            ops.push(elementwise(
                DevKernel::Cast,
                elems,
                vec![buf(x), f32_buf(to), n(elems)],
            ));
            to
        }
        None => x.at,
    }
}

/// Geometry of one attention's f32 operands, in bytes.
struct Shape {
    b: u64,
    t: u64,
    h: u64,
    kvh: u64,
    g: u64,
    d: u64,
    /// Row width of `qkv` and of its gradient, and of `out`.
    w3: u64,
    c: u64,
    rmax: u64,
}

impl Shape {
    fn new(at: &Attention, rows: u64) -> Shape {
        Shape {
            b: at.batch,
            t: at.seq,
            h: at.heads,
            kvh: at.kv_heads,
            g: at.heads / at.kv_heads.max(1),
            d: at.head_dim,
            w3: (at.heads + 2 * at.kv_heads) * at.head_dim,
            c: at.heads * at.head_dim,
            rmax: block_rows(at, rows),
        }
    }
    /// Group member `g`'s query heads (one per key/value head) of a
    /// `[B,T,w]` tensor at `base`, rows from `r0`, column block `col`
    /// (in heads) — or, with `g` = None, the key/value heads at `col`.
    fn heads(&self, base: u64, w: u64, b: u64, r0: u64, col: u64, per_group: bool) -> RowMajor {
        let at = base + 4 * ((b * self.t + r0) * w + col * self.d);
        let stride = if per_group { self.g * self.d } else { self.d };
        RowMajor::new(at, w, DType::F32).stride(stride)
    }
    /// Group member `g`'s block of scores at `base`: `rmax × t` per head.
    fn scores(&self, base: u64, g: u64) -> RowMajor {
        RowMajor::new(base + 4 * g * self.rmax * self.t, self.t, DType::F32)
            .stride(self.g * self.rmax * self.t)
    }
    /// The scaled scores of rows `r0..r1` against keys `0..r1`, every head.
    fn scores_of(
        &self,
        x: u64,
        s: u64,
        b: u64,
        (r0, r1): (u64, u64),
        scale: f32,
        ops: &mut Vec<DevOp>,
    ) -> Result<()> {
        for g in 0..self.g {
            let q = self.heads(x, self.w3, b, r0, g, true);
            let k = self.heads(x, self.w3, b, 0, self.h, false).t();
            ops.push(DevOp::Gemm(gemm_row_major(
                r1 - r0,
                r1,
                self.d,
                scale,
                q,
                k,
                0.0,
                self.scores(s, g),
                self.kvh,
            )?));
        }
        Ok(())
    }
}

/// `[qkv] -> [out, lse]`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    at: &Attention,
    rows: u64,
    qkv: Operand,
    out: Operand,
    lse: Operand,
    scratch: u64,
    ops: &mut Vec<DevOp>,
) -> Result<()> {
    let sh = Shape::new(at, rows);
    let bf = |o: Operand| o.dtype == DType::BF16;
    let sc = Scratch::new(at, rows, false, [bf(qkv), bf(out), false, false]);
    let rel = |o: Option<u64>| o.map(|x| scratch + x);
    let x = widened(qkv, rel(sc.qkv), sh.b * sh.t * sh.w3, ops);
    let o = rel(sc.out).unwrap_or(out.at);
    let s = scratch + sc.scores;
    for b in 0..sh.b {
        for r0 in (0..sh.t).step_by(sh.rmax as usize) {
            let r1 = (r0 + sh.rmax).min(sh.t);
            sh.scores_of(x, s, b, (r0, r1), at.scale, ops)?;
            let rows = sh.h * (r1 - r0);
            ops.push(per_row(
                DevKernel::AttnRowsSoftmax,
                rows,
                r1,
                vec![
                    f32_buf(s),
                    buf(lse.batch(b, sh.h * sh.t)),
                    n(rows),
                    n(r1 - r0),
                    n(sh.rmax),
                    n(r0),
                    n(r1),
                    n(sh.t),
                    n(sh.t),
                ],
            )?);
            for g in 0..sh.g {
                let v = sh.heads(x, sh.w3, b, 0, sh.h + sh.kvh, false);
                let dst = sh.heads(o, sh.c, b, r0, g, true);
                ops.push(DevOp::Gemm(gemm_row_major(
                    r1 - r0,
                    sh.d,
                    r1,
                    1.0,
                    sh.scores(s, g),
                    v,
                    0.0,
                    dst,
                    sh.kvh,
                )?));
            }
        }
    }
    if sc.out.is_some() {
        let elems = sh.b * sh.t * sh.c;
        ops.push(elementwise(
            DevKernel::Cast,
            elems,
            vec![f32_buf(o), buf(out), n(elems)],
        ));
    }
    Ok(())
}

/// `[dout, qkv, out, lse] -> [dqkv]`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    at: &Attention,
    rows: u64,
    dout: Operand,
    qkv: Operand,
    out: Operand,
    lse: Operand,
    dqkv: Operand,
    scratch: u64,
    ops: &mut Vec<DevOp>,
) -> Result<()> {
    let sh = Shape::new(at, rows);
    let bf = |o: Operand| o.dtype == DType::BF16;
    let sc = Scratch::new(at, rows, true, [bf(qkv), false, bf(dout), bf(dqkv)]);
    let rel = |o: Option<u64>| o.map(|x| scratch + x);
    let x = widened(qkv, rel(sc.qkv), sh.b * sh.t * sh.w3, ops);
    let dy = widened(dout, rel(sc.dout), sh.b * sh.t * sh.c, ops);
    let dx = rel(sc.dqkv).unwrap_or(dqkv.at);
    let (s, dp, dsum) = (scratch + sc.scores, scratch + sc.dscores, scratch + sc.dsum);
    ops.push(DevOp::Memset {
        at: dx,
        bytes: 4 * sh.b * sh.t * sh.w3,
    });
    ops.push(elementwise(
        DevKernel::AttnRowDot,
        sh.b * sh.t * sh.h,
        vec![
            buf(dout),
            buf(out),
            f32_buf(dsum),
            n(sh.b),
            n(sh.t),
            n(sh.h),
            n(sh.d),
        ],
    ));
    for b in 0..sh.b {
        for r0 in (0..sh.t).step_by(sh.rmax as usize) {
            let r1 = (r0 + sh.rmax).min(sh.t);
            let rc = r1 - r0;
            sh.scores_of(x, s, b, (r0, r1), at.scale, ops)?;
            for g in 0..sh.g {
                let v = sh.heads(x, sh.w3, b, 0, sh.h + sh.kvh, false).t();
                let dyg = sh.heads(dy, sh.c, b, r0, g, true);
                ops.push(DevOp::Gemm(gemm_row_major(
                    rc,
                    r1,
                    sh.d,
                    1.0,
                    dyg,
                    v,
                    0.0,
                    sh.scores(dp, g),
                    sh.kvh,
                )?));
            }
            let count = sh.h * rc;
            let per_b = 4 * b * sh.h * sh.t;
            ops.push(per_row(
                DevKernel::AttnRowsSoftmaxBwd,
                count,
                r1,
                vec![
                    f32_buf(s),
                    f32_buf(dp),
                    buf(lse.batch(b, sh.h * sh.t)),
                    f32_buf(dsum + per_b),
                    n(count),
                    n(rc),
                    n(sh.rmax),
                    n(r0),
                    n(r1),
                    n(sh.t),
                    n(sh.t),
                ],
            )?);
            for g in 0..sh.g {
                let dyg = sh.heads(dy, sh.c, b, r0, g, true);
                let q = sh.heads(x, sh.w3, b, r0, g, true);
                let k = sh.heads(x, sh.w3, b, 0, sh.h, false);
                // dV += Pᵀ dO, dK += scale·dSᵀ Q, dQ += scale·dS K.
                let dv = sh.heads(dx, sh.w3, b, 0, sh.h + sh.kvh, false);
                let dk = sh.heads(dx, sh.w3, b, 0, sh.h, false);
                let dq = sh.heads(dx, sh.w3, b, r0, g, true);
                ops.push(DevOp::Gemm(gemm_row_major(
                    r1,
                    sh.d,
                    rc,
                    1.0,
                    sh.scores(s, g).t(),
                    dyg,
                    1.0,
                    dv,
                    sh.kvh,
                )?));
                ops.push(DevOp::Gemm(gemm_row_major(
                    r1,
                    sh.d,
                    rc,
                    at.scale,
                    sh.scores(dp, g).t(),
                    q,
                    1.0,
                    dk,
                    sh.kvh,
                )?));
                ops.push(DevOp::Gemm(gemm_row_major(
                    rc,
                    sh.d,
                    r1,
                    at.scale,
                    sh.scores(dp, g),
                    k,
                    1.0,
                    dq,
                    sh.kvh,
                )?));
            }
        }
    }
    if sc.dqkv.is_some() {
        let elems = sh.b * sh.t * sh.w3;
        ops.push(elementwise(
            DevKernel::Cast,
            elems,
            vec![f32_buf(dx), buf(dqkv), n(elems)],
        ));
    }
    Ok(())
}
