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
    fn bf16(self) -> bool {
        self.dtype == DType::BF16
    }
    /// Batch entry `b` of a tensor of `per_batch` elements per entry.
    fn batch(self, b: u64, per_batch: u64) -> Operand {
        Operand {
            at: self.at + self.dtype.size() * b * per_batch,
            ..self
        }
    }
}

/// Where in the scratch (byte offsets in the allocation) a direction's
/// values go; `bytes` in all.
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
    /// The scratch from byte `base` on; `wide` says which of qkv, out, dout
    /// and dqkv are bf16 (and so need f32 copies).
    fn new(at: &Attention, rows: u64, base: u64, backward: bool, wide: [bool; 4]) -> Scratch {
        let (b, t) = (at.batch, at.seq);
        let qkv_elems = b * t * (at.heads + 2 * at.kv_heads) * at.head_dim;
        let out_elems = b * t * at.width();
        let mut end = base;
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
        s.bytes = end - base;
        s
    }
}

/// Scratch bytes of a fused attention (`backward`: its gradient); `wide`
/// says which of qkv, out, dout and dqkv are bf16.
pub fn scratch_bytes(at: &Attention, rows: u64, backward: bool, wide: [bool; 4]) -> u64 {
    Scratch::new(at, rows, 0, backward, wide).bytes
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
        bf16: o.bf16(),
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

/// Geometry of one attention's operands, in f32 elements.
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

/// A block of query rows `r0..r1` of batch entry `b`.
#[derive(Copy, Clone)]
struct Block {
    b: u64,
    r0: u64,
    r1: u64,
}

impl Block {
    fn rows(self) -> u64 {
        self.r1 - self.r0
    }
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
    /// Every block, batch entry by batch entry.
    fn blocks(&self) -> Vec<Block> {
        (0..self.b)
            .flat_map(|b| {
                (0..self.t)
                    .step_by(self.rmax as usize)
                    .map(move |r0| Block {
                        b,
                        r0,
                        r1: (r0 + self.rmax).min(self.t),
                    })
            })
            .collect()
    }
    /// Heads of an f32 `[B,T,w]` tensor at `base`, from row `r0` of batch
    /// entry `b`: with `member = Some(g)`, group member `g`'s query heads
    /// (one per key/value head); with `None`, the `kvh` heads from head
    /// column `col` on (keys at `h`, values at `h + kvh` in `qkv`).
    fn heads(&self, base: u64, w: u64, b: u64, r0: u64, member: Option<u64>, col: u64) -> RowMajor {
        let (col, stride) = match member {
            Some(g) => (g, self.g * self.d),
            None => (col, self.d),
        };
        let at = base + 4 * ((b * self.t + r0) * w + col * self.d);
        RowMajor::new(at, w, DType::F32).stride(stride)
    }
    fn queries(&self, x: u64, blk: Block, g: u64) -> RowMajor {
        self.heads(x, self.w3, blk.b, blk.r0, Some(g), 0)
    }
    fn keys(&self, x: u64, b: u64) -> RowMajor {
        self.heads(x, self.w3, b, 0, None, self.h)
    }
    fn values(&self, x: u64, b: u64) -> RowMajor {
        self.heads(x, self.w3, b, 0, None, self.h + self.kvh)
    }
    /// Group member `g`'s query heads of an `[B,T,C]` tensor (`out`, `dout`).
    fn outputs(&self, o: u64, blk: Block, g: u64) -> RowMajor {
        self.heads(o, self.c, blk.b, blk.r0, Some(g), 0)
    }
    /// Group member `g`'s block of scores at `base`: `rmax × t` per head.
    fn scores(&self, base: u64, g: u64) -> RowMajor {
        RowMajor::new(base + 4 * g * self.rmax * self.t, self.t, DType::F32)
            .stride(self.g * self.rmax * self.t)
    }
    /// `C (m × n) = alpha·A B + beta·C`, batched over the key/value heads.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        m: u64,
        n: u64,
        k: u64,
        alpha: f32,
        a: RowMajor,
        b: RowMajor,
        beta: f32,
        c: RowMajor,
    ) -> Result<DevOp> {
        Ok(DevOp::Gemm(gemm_row_major(
            m, n, k, alpha, a, b, beta, c, self.kvh,
        )?))
    }
    /// The scaled scores of a block's rows against keys `0..r1`, every head.
    fn scores_of(
        &self,
        x: u64,
        s: u64,
        blk: Block,
        scale: f32,
        ops: &mut Vec<DevOp>,
    ) -> Result<()> {
        for g in 0..self.g {
            let (q, k) = (self.queries(x, blk, g), self.keys(x, blk.b).t());
            ops.push(self.product(
                blk.rows(),
                blk.r1,
                self.d,
                scale,
                q,
                k,
                0.0,
                self.scores(s, g),
            )?);
        }
        Ok(())
    }
    /// A launch of a row kernel over every head's rows of a block: `front`
    /// arguments, then the block's sizes.
    fn rows_launch(&self, kernel: DevKernel, blk: Block, mut front: Vec<Arg>) -> Result<DevOp> {
        let count = self.h * blk.rows();
        front.extend([count, blk.rows(), self.rmax, blk.r0, blk.r1, self.t, self.t].map(n));
        per_row(kernel, count, blk.r1, front)
    }
}

/// `[qkv] -> [out, lse]`.
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
    let sc = Scratch::new(
        at,
        rows,
        scratch,
        false,
        [qkv.bf16(), out.bf16(), false, false],
    );
    let x = widened(qkv, sc.qkv, sh.b * sh.t * sh.w3, ops);
    let o = sc.out.unwrap_or(out.at);
    let s = sc.scores;
    for blk in sh.blocks() {
        sh.scores_of(x, s, blk, at.scale as f32, ops)?;
        let lse_b = buf(lse.batch(blk.b, sh.h * sh.t));
        ops.push(sh.rows_launch(DevKernel::AttnRowsSoftmax, blk, vec![f32_buf(s), lse_b])?);
        for g in 0..sh.g {
            let (p, v) = (sh.scores(s, g), sh.values(x, blk.b));
            ops.push(sh.product(
                blk.rows(),
                sh.d,
                blk.r1,
                1.0,
                p,
                v,
                0.0,
                sh.outputs(o, blk, g),
            )?);
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

/// Where the backward pass's f32 values are.
struct Grad {
    /// `qkv`, `dout` and the gradient of `qkv`.
    x: u64,
    dy: u64,
    dx: u64,
    /// Scores then probabilities; their gradient then `dS`; `Σ dO·O`.
    s: u64,
    dp: u64,
    dsum: u64,
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
    let wide = [qkv.bf16(), false, dout.bf16(), dqkv.bf16()];
    let sc = Scratch::new(at, rows, scratch, true, wide);
    let gr = Grad {
        x: widened(qkv, sc.qkv, sh.b * sh.t * sh.w3, ops),
        dy: widened(dout, sc.dout, sh.b * sh.t * sh.c, ops),
        dx: sc.dqkv.unwrap_or(dqkv.at),
        s: sc.scores,
        dp: sc.dscores,
        dsum: sc.dsum,
    };
    let qkv_elems = sh.b * sh.t * sh.w3;
    ops.push(DevOp::Memset {
        at: gr.dx,
        bytes: 4 * qkv_elems,
    });
    let sizes = [sh.b, sh.t, sh.h, sh.d].map(n);
    let mut args = vec![buf(dout), buf(out), f32_buf(gr.dsum)];
    args.extend(sizes);
    ops.push(elementwise(DevKernel::AttnRowDot, sh.b * sh.t * sh.h, args));
    for blk in sh.blocks() {
        block_backward(&sh, &gr, blk, at.scale as f32, lse, ops)?;
    }
    if sc.dqkv.is_some() {
        ops.push(elementwise(
            DevKernel::Cast,
            qkv_elems,
            vec![f32_buf(gr.dx), buf(dqkv), n(qkv_elems)],
        ));
    }
    Ok(())
}

/// One block's share of the backward pass: `S` and `dP = dO Vᵀ`, then `P`
/// and `dS` in place, then `dV += Pᵀ dO`, `dK += scale·dSᵀ Q` and
/// `dQ += scale·dS K` for each member of a key/value group.
fn block_backward(
    sh: &Shape,
    gr: &Grad,
    blk: Block,
    scale: f32,
    lse: Operand,
    ops: &mut Vec<DevOp>,
) -> Result<()> {
    let (rc, r1, d, b) = (blk.rows(), blk.r1, sh.d, blk.b);
    sh.scores_of(gr.x, gr.s, blk, scale, ops)?;
    for g in 0..sh.g {
        let (dy, vt) = (sh.outputs(gr.dy, blk, g), sh.values(gr.x, b).t());
        ops.push(sh.product(rc, r1, d, 1.0, dy, vt, 0.0, sh.scores(gr.dp, g))?);
    }
    let per_b = 4 * b * sh.h * sh.t;
    let front = vec![
        f32_buf(gr.s),
        f32_buf(gr.dp),
        buf(lse.batch(b, sh.h * sh.t)),
        f32_buf(gr.dsum + per_b),
    ];
    ops.push(sh.rows_launch(DevKernel::AttnRowsSoftmaxBwd, blk, front)?);
    for g in 0..sh.g {
        let (p, ds) = (sh.scores(gr.s, g), sh.scores(gr.dp, g));
        let dy = sh.outputs(gr.dy, blk, g);
        let (q, k) = (sh.queries(gr.x, blk, g), sh.keys(gr.x, b));
        ops.push(sh.product(r1, d, rc, 1.0, p.t(), dy, 1.0, sh.values(gr.dx, b))?);
        ops.push(sh.product(r1, d, rc, scale, ds.t(), q, 1.0, sh.keys(gr.dx, b))?);
        ops.push(sh.product(rc, d, r1, scale, ds, k, 1.0, sh.queries(gr.dx, blk, g))?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3_1b(seq: u64) -> Attention {
        Attention {
            batch: 1,
            heads: 32,
            kv_heads: 8,
            seq,
            head_dim: 64,
            scale: 0.125,
        }
    }

    #[test]
    fn blocks_fit_the_budget_and_scratch_adds_up() {
        let at = llama3_1b(1024);
        // 32 heads × 1024 keys × 4 bytes = 128 KiB a row: 512 rows.
        assert_eq!(block_rows(&at, 0), 512);
        assert_eq!(block_rows(&at, 16), 16);
        assert_eq!(block_rows(&llama3_1b(40), 0), 40);
        // At least 64 rows, however long the sequence.
        assert_eq!(block_rows(&llama3_1b(1 << 17), 0), 64);
        let mib = 1u64 << 20;
        // Forward, bf16: qkv widened (12 MiB), a block of scores (64 MiB),
        // out in f32 (8 MiB).
        assert_eq!(
            scratch_bytes(&at, 0, false, [true, true, false, false]),
            84 * mib
        );
        // Backward, bf16: qkv, two blocks, Σ dO·O (128 KiB), dout and
        // the gradient of qkv.
        let back = 12 * mib + 128 * mib + 128 * 1024 + 8 * mib + 12 * mib;
        assert_eq!(scratch_bytes(&at, 0, true, [true, false, true, true]), back);
        // f32 operands need no copies.
        assert_eq!(scratch_bytes(&at, 0, false, [false; 4]), 64 * mib);
    }

    #[test]
    fn blocks_cover_every_row_once() {
        let sh = Shape::new(
            &Attention {
                batch: 2,
                seq: 40,
                ..llama3_1b(40)
            },
            16,
        );
        let blocks: Vec<_> = sh.blocks().iter().map(|b| (b.b, b.r0, b.r1)).collect();
        assert_eq!(
            blocks,
            vec![
                (0, 0, 16),
                (0, 16, 32),
                (0, 32, 40),
                (1, 0, 16),
                (1, 16, 32),
                (1, 32, 40)
            ]
        );
    }
}
