//! A host emulator of device operations: runs the [`DevOp`]s a program
//! lowers to on a byte buffer laid out like the device allocation, with
//! each CUDA kernel of `kernels.cu` mirrored in Rust (same loops, same
//! order of reads and writes for in-place operands; the flash-attention
//! kernels by their formulas, the forward with the same 32-key tiles and
//! running maximum) and cuBLAS products computed from their column-major
//! definition.
//!
//! It is slow and exists to test the GPU lowering ([`super::lower`]) —
//! addresses, product shapes and transposes, launch arguments, staging and
//! in-place use — against the CPU executor on machines without a GPU.

use super::{
    Arg, AttentionLowering, CollectiveOp, DevKernel, DevOp, DeviceLayout, GemmCall, Launch,
    lower_all,
};
use crate::binding::Bindings;
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::executor::{Executor, StepReport, accessed};
use crate::program::{DType, Program, TensorIdx};
use half::bf16;

/// A program ready to run on the emulated device.
pub struct Emulator {
    program: Program,
    layout: DeviceLayout,
    ops: Vec<Vec<DevOp>>,
    /// The device allocation is `buf[start..start + total]`, `start` chosen
    /// so it begins on a 16-byte boundary: kernels compiled for the host
    /// access every element type at its natural alignment.
    buf: Vec<u8>,
    start: usize,
    rank: usize,
    steps_done: u64,
    /// Launch `kernels.cu` compiled for the host instead of the mirrors.
    host_kernels: bool,
}

/// Reads an argument list positionally.
struct Args<'a> {
    args: &'a [Arg],
    step: u64,
}

/// An operand: its byte address and whether it holds bf16 (integer
/// operands are never bf16).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct B {
    at: usize,
    bf: bool,
}

impl Args<'_> {
    fn ptr(&self, i: usize) -> Option<B> {
        match self.args[i] {
            Arg::Buf(b) => b.at.map(|at| B {
                at: at as usize,
                bf: b.bf16,
            }),
            Arg::Ptr(p) => Some(B {
                at: p as usize,
                bf: false,
            }),
            ref other => panic!("argument {i} is {other:?}, not a pointer"),
        }
    }
    fn p(&self, i: usize) -> B {
        self.ptr(i).expect("a non-null pointer")
    }
    fn n(&self, i: usize) -> usize {
        match self.args[i] {
            Arg::I64(v) => v as usize,
            Arg::Step(first) => (first + self.step - 1) as usize,
            ref other => panic!("argument {i} is {other:?}, not an i64"),
        }
    }
    fn i(&self, i: usize) -> i32 {
        match self.args[i] {
            Arg::I32(v) => v,
            ref other => panic!("argument {i} is {other:?}, not an i32"),
        }
    }
    fn f(&self, i: usize) -> f32 {
        match self.args[i] {
            Arg::F32(v) => v,
            ref other => panic!("argument {i} is {other:?}, not an f32"),
        }
    }
    fn d(&self, i: usize) -> f64 {
        match self.args[i] {
            Arg::F64(v) => v,
            ref other => panic!("argument {i} is {other:?}, not an f64"),
        }
    }
}

/// Element `i` of float operand `b`, widened.
fn load(mem: &[u8], b: B, i: usize) -> f32 {
    if b.bf {
        let o = b.at + 2 * i;
        bf16::from_ne_bytes([mem[o], mem[o + 1]]).to_f32()
    } else {
        let o = b.at + 4 * i;
        f32::from_ne_bytes(mem[o..o + 4].try_into().expect("4 bytes"))
    }
}

/// Access to emulated device memory: float operands widened to f32 and
/// stored rounded to their dtype (`kernels.cu`'s `Buf`), and i32s.
struct Mem<'a>(&'a mut [u8]);

impl Mem<'_> {
    fn f(&self, b: B, i: usize) -> f32 {
        load(self.0, b, i)
    }
    fn set(&mut self, b: B, i: usize, v: f32) {
        if b.bf {
            let o = b.at + 2 * i;
            self.0[o..o + 2].copy_from_slice(&bf16::from_f32(v).to_ne_bytes());
        } else {
            let o = b.at + 4 * i;
            self.0[o..o + 4].copy_from_slice(&v.to_ne_bytes());
        }
    }
    /// The largest of elements `at .. at + n` and the sum of `exp(x − that)`
    /// (`kernels.cu`'s `block_max_sum`).
    fn max_sum(&self, b: B, at: usize, n: usize) -> (f32, f32) {
        let mx = (at..at + n)
            .map(|j| self.f(b, j))
            .fold(f32::NEG_INFINITY, f32::max);
        let sum = (at..at + n).map(|j| (self.f(b, j) - mx).exp()).sum();
        (mx, sum)
    }
    fn i(&self, b: B, i: usize) -> i32 {
        let o = b.at + 4 * i;
        i32::from_ne_bytes(self.0[o..o + 4].try_into().expect("4 bytes"))
    }
    fn set_i(&mut self, b: B, i: usize, v: i32) {
        let o = b.at + 4 * i;
        self.0[o..o + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn fail(&mut self, err: B, code: i32) {
        if self.i(err, 0) == 0 {
            self.set_i(err, 0, code);
        }
    }
}

const GELU_C: f32 = 0.797_884_6;

fn gelu_f(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

fn gelu_g(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x)
}

/// Runs one launch; mirrors the kernel of the same name in `kernels.cu`.
fn launch(m: &mut Mem<'_>, l: &Launch, step: u64) {
    let a = Args {
        args: &l.args,
        step,
    };
    match l.kernel {
        DevKernel::FillRows
        | DevKernel::ColSum
        | DevKernel::Add
        | DevKernel::GeluFwd
        | DevKernel::ReluFwd
        | DevKernel::GeluBwd
        | DevKernel::ReluBwd
        | DevKernel::Cast
        | DevKernel::SumSquares
        | DevKernel::SqrtInplace => pointwise(m, l.kernel, &a),
        DevKernel::LayernormFwd | DevKernel::LayernormBwdParams | DevKernel::LayernormBwdData => {
            layernorm(m, l.kernel, &a)
        }
        DevKernel::CausalSoftmaxFwd
        | DevKernel::CausalSoftmaxBwd
        | DevKernel::ZeroUpper
        | DevKernel::ZeroQk => attention(m, l.kernel, &a),
        DevKernel::CrossEntropyFwd | DevKernel::CrossEntropyBwd => cross_entropy(m, l.kernel, &a),
        DevKernel::EmbeddingFwd
        | DevKernel::EmbeddingCount
        | DevKernel::ScanCounts
        | DevKernel::EmbeddingPlace
        | DevKernel::EmbeddingBwdRows
        | DevKernel::EmbeddingBwdPositions => embedding(m, l.kernel, &a),
        DevKernel::RmsnormFwd
        | DevKernel::RmsnormBwdParams
        | DevKernel::RmsnormBwdData
        | DevKernel::RopeFwd
        | DevKernel::SwigluFwd
        | DevKernel::SwigluBwd => decoder(m, l.kernel, &a),
        // The tensor-core kernels compute the same, with other roundings
        // (bf16 hi + lo parts of P and dS); `kernels.cu` itself runs them
        // with host kernels.
        DevKernel::FlashAttnFwd | DevKernel::FlashMma64Fwd | DevKernel::FlashMma128Fwd => {
            flash_fwd(m, &a)
        }
        DevKernel::FlashAttnBwdDq | DevKernel::FlashMma64BwdDq | DevKernel::FlashMma128BwdDq => {
            flash_bwd(m, &a, false)
        }
        DevKernel::FlashAttnBwdDkv | DevKernel::FlashMma64BwdDkv | DevKernel::FlashMma128BwdDkv => {
            flash_bwd(m, &a, true)
        }
        DevKernel::AdamStep => adam(m, &a),
        DevKernel::AttnRowsSoftmax | DevKernel::AttnRowsSoftmaxBwd | DevKernel::AttnRowDot => {
            attention_rows(m, l.kernel, &a)
        }
    }
}

/// The row kernels of fused attention lowered to products (see
/// `kernels.cu`'s `attn_rows_softmax`).
fn attention_rows(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    if k == DevKernel::AttnRowDot {
        let (dout, out, dsum) = (a.p(0), a.p(1), a.p(2));
        let (batch, seq, heads, hd) = (a.n(3), a.n(4), a.n(5), a.n(6));
        for i in 0..batch * seq * heads {
            let (h, bt) = (i % heads, i / heads);
            let acc: f32 = (0..hd)
                .map(|d| m.f(dout, i * hd + d) * m.f(out, i * hd + d))
                .sum();
            m.set(dsum, (bt / seq * heads + h) * seq + bt % seq, acc);
        }
        return;
    }
    // Forward: (s, lse, sizes…); backward: (s, dp, lse, dsum, sizes…).
    let backward = k == DevKernel::AttnRowsSoftmaxBwd;
    let first = if backward { 4 } else { 2 };
    let n = |i: usize| a.n(first + i);
    let (rows, rcount, rmax, r0, r1, ld, t) = (n(0), n(1), n(2), n(3), n(4), n(5), n(6));
    let s = a.p(0);
    let lse = a.p(if backward { 2 } else { 1 });
    for row in 0..rows {
        let (h, r) = (row / rcount, row % rcount);
        let (lim, base, at) = (r0 + r + 1, (h * rmax + r) * ld, h * t + r0 + r);
        if backward {
            let (dp, dsum) = (a.p(1), a.p(3));
            let (l, d) = (m.f(lse, at), m.f(dsum, at));
            for j in 0..r1 {
                let p = if j < lim {
                    (m.f(s, base + j) - l).exp()
                } else {
                    0.0
                };
                let g = p * (m.f(dp, base + j) - d);
                m.set(s, base + j, p);
                m.set(dp, base + j, g);
            }
            continue;
        }
        let (mx, sum) = m.max_sum(s, base, lim);
        for j in 0..r1 {
            let v = if j < lim {
                (m.f(s, base + j) - mx).exp() / sum
            } else {
                0.0
            };
            m.set(s, base + j, v);
        }
        m.set(lse, at, mx + sum.ln());
    }
}

/// Fills, sums, pointwise activations, casts and the squared norm.
fn pointwise(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    match k {
        DevKernel::FillRows => {
            let (y, b, rows, n) = (a.p(0), a.p(1), a.n(2), a.n(3));
            for i in 0..rows * n {
                let v = m.f(b, i % n);
                m.set(y, i, v);
            }
        }
        DevKernel::ColSum => {
            let (x, out, rows, n) = (a.p(0), a.p(1), a.n(2), a.n(3));
            for j in 0..n {
                let mut s = 0.0f32;
                for i in 0..rows {
                    s += m.f(x, i * n + j);
                }
                m.set(out, j, s);
            }
        }
        DevKernel::Add => {
            let (x, y, c, n) = (a.p(0), a.p(1), a.p(2), a.n(3));
            for i in 0..n {
                let v = m.f(x, i) + m.f(y, i);
                m.set(c, i, v);
            }
        }
        DevKernel::GeluFwd | DevKernel::ReluFwd => {
            let (x, y, n) = (a.p(0), a.p(1), a.n(2));
            for i in 0..n {
                let v = m.f(x, i);
                let r = if k == DevKernel::GeluFwd {
                    gelu_f(v)
                } else if v > 0.0 {
                    v
                } else {
                    0.0
                };
                m.set(y, i, r);
            }
        }
        DevKernel::GeluBwd | DevKernel::ReluBwd => {
            let (dy, x, dx, n) = (a.p(0), a.p(1), a.p(2), a.n(3));
            for i in 0..n {
                let (d, v) = (m.f(dy, i), m.f(x, i));
                let r = if k == DevKernel::GeluBwd {
                    d * gelu_g(v)
                } else if v > 0.0 {
                    d
                } else {
                    0.0
                };
                m.set(dx, i, r);
            }
        }
        DevKernel::Cast => {
            let (x, y, n) = (a.p(0), a.p(1), a.n(2));
            for i in 0..n {
                let v = m.f(x, i);
                m.set(y, i, v);
            }
        }
        DevKernel::SumSquares => {
            let (x, out, n) = (a.p(0), a.p(1), a.n(2));
            let mut s = 0.0f32;
            for i in 0..n {
                s += m.f(x, i) * m.f(x, i);
            }
            let v = m.f(out, 0) + s;
            m.set(out, 0, v);
        }
        DevKernel::SqrtInplace => {
            let x = a.p(0);
            let v = m.f(x, 0).sqrt();
            m.set(x, 0, v);
        }
        other => unreachable!("{other:?} is not a pointwise kernel"),
    }
}

/// LayerNorm forward and its two backward kernels.
fn layernorm(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    match k {
        DevKernel::LayernormFwd => {
            let (x, g, b, y, mean, rstd) = (a.p(0), a.p(1), a.p(2), a.p(3), a.p(4), a.p(5));
            let (rows, cols, eps) = (a.n(6), a.n(7), a.f(8));
            for r in 0..rows {
                let mut s = 0.0f32;
                for j in 0..cols {
                    s += m.f(x, r * cols + j);
                }
                let mu = s / cols as f32;
                let mut v = 0.0f32;
                for j in 0..cols {
                    let d = m.f(x, r * cols + j) - mu;
                    v += d * d;
                }
                v /= cols as f32;
                let rs = 1.0 / (v + eps).sqrt();
                m.set(mean, r, mu);
                m.set(rstd, r, rs);
                for j in 0..cols {
                    let o = (m.f(x, r * cols + j) - mu) * rs * m.f(g, j) + m.f(b, j);
                    m.set(y, r * cols + j, o);
                }
            }
        }
        DevKernel::LayernormBwdParams => {
            let (dy, x, mean, rstd, dg, db) = (a.p(0), a.p(1), a.p(2), a.p(3), a.p(4), a.p(5));
            let (rows, cols) = (a.n(6), a.n(7));
            for j in 0..cols {
                let (mut sg, mut sb) = (0.0f32, 0.0f32);
                for r in 0..rows {
                    let d = m.f(dy, r * cols + j);
                    sg += d * (m.f(x, r * cols + j) - m.f(mean, r)) * m.f(rstd, r);
                    sb += d;
                }
                m.set(dg, j, sg);
                m.set(db, j, sb);
            }
        }
        DevKernel::LayernormBwdData => {
            let (dy, x, mean, rstd, g, dx) = (a.p(0), a.p(1), a.p(2), a.p(3), a.p(4), a.p(5));
            let (rows, cols) = (a.n(6), a.n(7));
            for r in 0..rows {
                let (mu, rs) = (m.f(mean, r), m.f(rstd, r));
                let (mut s1, mut s2) = (0.0f32, 0.0f32);
                for j in 0..cols {
                    let d = m.f(dy, r * cols + j) * m.f(g, j);
                    s1 += d;
                    s2 += d * (m.f(x, r * cols + j) - mu) * rs;
                }
                s1 /= cols as f32;
                s2 /= cols as f32;
                for j in 0..cols {
                    let xhat = (m.f(x, r * cols + j) - mu) * rs;
                    let v = rs * (m.f(dy, r * cols + j) * m.f(g, j) - s1 - xhat * s2);
                    m.set(dx, r * cols + j, v);
                }
            }
        }
        other => unreachable!("{other:?} is not a layernorm kernel"),
    }
}

/// The unfused attention kernels: causal softmax and its backward, masking.
fn attention(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    match k {
        DevKernel::CausalSoftmaxFwd => {
            let (s, p, rows, t) = (a.p(0), a.p(1), a.n(2), a.n(3));
            for r in 0..rows {
                let i = r % t;
                let (mx, sum) = m.max_sum(s, r * t, i + 1);
                let inv = 1.0 / sum;
                for j in 0..t {
                    let v = if j <= i {
                        (m.f(s, r * t + j) - mx).exp() * inv
                    } else {
                        0.0
                    };
                    m.set(p, r * t + j, v);
                }
            }
        }
        DevKernel::CausalSoftmaxBwd => {
            let (dp, p, ds, rows, t) = (a.p(0), a.p(1), a.p(2), a.n(3), a.n(4));
            for r in 0..rows {
                let mut dot = 0.0f32;
                for j in 0..t {
                    dot += m.f(dp, r * t + j) * m.f(p, r * t + j);
                }
                for j in 0..t {
                    let v = m.f(p, r * t + j) * (m.f(dp, r * t + j) - dot);
                    m.set(ds, r * t + j, v);
                }
            }
        }
        DevKernel::ZeroUpper => {
            let (s, mats, t) = (a.p(0), a.n(1), a.n(2));
            for k in 0..mats * t * t {
                if k % t > (k / t) % t {
                    m.set(s, k, 0.0);
                }
            }
        }
        DevKernel::ZeroQk => {
            let (d, rows, c) = (a.p(0), a.n(1), a.n(2));
            for k in 0..rows * 2 * c {
                m.set(d, (k / (2 * c)) * 3 * c + k % (2 * c), 0.0);
            }
        }
        other => unreachable!("{other:?} is not a attention kernel"),
    }
}

/// Cross-entropy loss and its gradient (an out-of-range target sets the error flag).
fn cross_entropy(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    match k {
        DevKernel::CrossEntropyFwd => {
            let (x, tgt, loss, rows, classes, divisor, err, code) = (
                a.p(0),
                a.p(1),
                a.p(2),
                a.n(3),
                a.n(4),
                a.f(5),
                a.p(6),
                a.i(7),
            );
            for r in 0..rows {
                let (mx, s) = m.max_sum(x, r * classes, classes);
                let t = m.i(tgt, r);
                if t < 0 || t as usize >= classes {
                    m.fail(err, code);
                } else {
                    let v =
                        m.f(loss, 0) + (mx + s.ln() - m.f(x, r * classes + t as usize)) / divisor;
                    m.set(loss, 0, v);
                }
            }
        }
        DevKernel::CrossEntropyBwd => {
            let (x, tgt, d, rows, classes, scale, err, code) = (
                a.p(0),
                a.p(1),
                a.p(2),
                a.n(3),
                a.n(4),
                a.f(5),
                a.p(6),
                a.i(7),
            );
            for r in 0..rows {
                let (mx, s) = m.max_sum(x, r * classes, classes);
                let mut t = m.i(tgt, r) as i64;
                if t < 0 || t as usize >= classes {
                    m.fail(err, code);
                    t = -1;
                }
                let k = scale / s;
                for j in 0..classes {
                    let v = (m.f(x, r * classes + j) - mx).exp() * k
                        - if j as i64 == t { scale } else { 0.0 };
                    m.set(d, r * classes + j, v);
                }
            }
        }
        other => unreachable!("{other:?} is not a cross entropy kernel"),
    }
}

/// Token and position embeddings, forward and the sorted (deterministic) backward.
fn embedding(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    match k {
        DevKernel::EmbeddingFwd => {
            let (tok, wte, wpe, x) = (a.p(0), a.p(1), a.ptr(2), a.p(3));
            let (bt, seq, width, vocab, err, code) =
                (a.n(4), a.n(5), a.n(6), a.n(7), a.p(8), a.i(9));
            for i in 0..bt * width {
                let (r, c) = (i / width, i % width);
                let t = m.i(tok, r);
                if t < 0 || t as usize >= vocab {
                    m.fail(err, code);
                    m.set(x, i, 0.0);
                } else {
                    let pos = wpe.map_or(0.0, |wpe| m.f(wpe, (r % seq) * width + c));
                    let v = m.f(wte, t as usize * width + c) + pos;
                    m.set(x, i, v);
                }
            }
        }
        DevKernel::EmbeddingCount => {
            let (tok, count, bt, vocab, err, code) =
                (a.p(0), a.p(1), a.n(2), a.n(3), a.p(4), a.i(5));
            for r in 0..bt {
                let t = m.i(tok, r);
                if t < 0 || t as usize >= vocab {
                    m.fail(err, code);
                } else {
                    let c = m.i(count, t as usize + 1);
                    m.set_i(count, t as usize + 1, c + 1);
                }
            }
        }
        DevKernel::ScanCounts => {
            let (count, n) = (a.p(0), a.n(1));
            let mut run = 0;
            for i in 0..n {
                run += m.i(count, i);
                m.set_i(count, i, run);
            }
        }
        DevKernel::EmbeddingPlace => {
            let (tok, start, fill, order, bt, vocab) =
                (a.p(0), a.p(1), a.p(2), a.p(3), a.n(4), a.n(5));
            for r in 0..bt {
                let t = m.i(tok, r);
                if t >= 0 && (t as usize) < vocab {
                    let k = m.i(fill, t as usize);
                    m.set_i(fill, t as usize, k + 1);
                    let slot = (m.i(start, t as usize) + k) as usize;
                    m.set_i(order, slot, r as i32);
                }
            }
        }
        DevKernel::EmbeddingBwdRows => {
            let (dx, start, order, init, dwte) = (a.p(0), a.p(1), a.p(2), a.ptr(3), a.p(4));
            let (vocab, width) = (a.n(5), a.n(6));
            for v in 0..vocab {
                let (lo, hi) = (m.i(start, v) as usize, m.i(start, v + 1) as usize);
                for c in 0..width {
                    let mut s = init.map_or(0.0, |init| m.f(init, v * width + c));
                    for k in lo..hi {
                        s += m.f(dx, m.i(order, k) as usize * width + c);
                    }
                    m.set(dwte, v * width + c, s);
                }
            }
        }
        DevKernel::EmbeddingBwdPositions => {
            let (dx, dwpe, batch, seq, width) = (a.p(0), a.p(1), a.n(2), a.n(3), a.n(4));
            for i in 0..seq * width {
                let mut s = 0.0f32;
                for b in 0..batch {
                    s += m.f(dx, b * seq * width + i);
                }
                m.set(dwpe, i, s);
            }
        }
        other => unreachable!("{other:?} is not a embedding kernel"),
    }
}

/// AdamW (or Adam with L2 decay) on one parameter, the gradient scaled
/// by the clipping coefficient when a norm is given.
fn adam(m: &mut Mem<'_>, a: &Args<'_>) {
    let (g, norm, w, mm, v, denom) = (a.p(0), a.ptr(1), a.p(2), a.p(3), a.p(4), a.ptr(5));
    let (n, lr, b1, b2, eps, wd) = (a.n(6), a.f(7), a.f(8), a.f(9), a.f(10), a.f(11));
    let (decoupled, step, max_norm, norm_squared) = (a.i(12) != 0, a.n(13), a.f(14), a.i(15) != 0);
    let mut coef = 1.0f32;
    if let Some(np) = norm {
        let mut nn = m.f(np, 0);
        if norm_squared {
            nn = nn.max(0.0).sqrt();
        }
        coef = (max_norm / (nn + 1e-6)).min(1.0);
    }
    let bc1 = 1.0 - b1.powf(step as f32);
    let bc2_sqrt = (1.0 - b2.powf(step as f32)).sqrt();
    let step_size = lr / bc1;
    let decay = 1.0 - lr * wd;
    for i in 0..n {
        let mut gi = m.f(g, i) * coef;
        let mut wi = m.f(w, i);
        if decoupled {
            wi *= decay;
        } else if wd != 0.0 {
            gi += wd * wi;
        }
        let mi = b1 * m.f(mm, i) + (1.0 - b1) * gi;
        let vi = b2 * m.f(v, i) + (1.0 - b2) * gi * gi;
        let d = vi.sqrt() / bc2_sqrt + eps;
        m.set(w, i, wi - step_size * mi / d);
        m.set(mm, i, mi);
        m.set(v, i, vi);
        if let Some(dp) = denom {
            m.set(dp, i, d);
        }
    }
}

/// The kernels of `decoder` in `lower`: RMSNorm, rotary embedding, SwiGLU.
fn decoder(m: &mut Mem<'_>, k: DevKernel, a: &Args<'_>) {
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    match k {
        DevKernel::RmsnormFwd => {
            let (x, g, y, rstd, rows, cols, eps) =
                (a.p(0), a.p(1), a.p(2), a.p(3), a.n(4), a.n(5), a.f(6));
            for r in 0..rows {
                let s: f32 = (0..cols).map(|j| m.f(x, r * cols + j).powi(2)).sum();
                let rs = 1.0 / (s / cols as f32 + eps).sqrt();
                m.set(rstd, r, rs);
                for j in 0..cols {
                    let v = m.f(x, r * cols + j) * rs * m.f(g, j);
                    m.set(y, r * cols + j, v);
                }
            }
        }
        DevKernel::RmsnormBwdParams => {
            let (dy, x, rstd, dg, rows, cols) = (a.p(0), a.p(1), a.p(2), a.p(3), a.n(4), a.n(5));
            for j in 0..cols {
                let s: f32 = (0..rows)
                    .map(|r| m.f(dy, r * cols + j) * m.f(x, r * cols + j) * m.f(rstd, r))
                    .sum();
                m.set(dg, j, s);
            }
        }
        DevKernel::RmsnormBwdData => {
            let (dy, x, rstd, g, dx) = (a.p(0), a.p(1), a.p(2), a.p(3), a.p(4));
            let (rows, cols) = (a.n(5), a.n(6));
            for r in 0..rows {
                let rs = m.f(rstd, r);
                let s: f32 = (0..cols)
                    .map(|j| m.f(dy, r * cols + j) * m.f(g, j) * m.f(x, r * cols + j))
                    .sum();
                let s = s / cols as f32 * rs * rs;
                for j in 0..cols {
                    let v = rs * (m.f(dy, r * cols + j) * m.f(g, j) - m.f(x, r * cols + j) * s);
                    m.set(dx, r * cols + j, v);
                }
            }
        }
        DevKernel::RopeFwd => {
            let (x, y, rows, seq, rot_heads, width, hd) =
                (a.p(0), a.p(1), a.n(2), a.n(3), a.n(4), a.n(5), a.n(6));
            let (theta, sign) = (a.d(7), a.f(8));
            let half = hd / 2;
            for r in 0..rows {
                for head in 0..rot_heads {
                    for i in 0..half {
                        let ang = (r % seq) as f64 * theta.powf(-2.0 * i as f64 / hd as f64);
                        let (sn, cs) = ang.sin_cos();
                        let (c, s) = (cs as f32, sign * sn as f32);
                        let at = r * width + head * hd + i;
                        let (u, v) = (m.f(x, at), m.f(x, at + half));
                        m.set(y, at, u * c - v * s);
                        m.set(y, at + half, v * c + u * s);
                    }
                }
            }
            if x != y {
                for r in 0..rows {
                    for col in rot_heads * hd..width {
                        let v = m.f(x, r * width + col);
                        m.set(y, r * width + col, v);
                    }
                }
            }
        }
        DevKernel::SwigluFwd => {
            let (gu, h, rows, hidden) = (a.p(0), a.p(1), a.n(2), a.n(3));
            for k in 0..rows * hidden {
                let (r, j) = (k / hidden, k % hidden);
                let (g, u) = (
                    m.f(gu, r * 2 * hidden + j),
                    m.f(gu, r * 2 * hidden + hidden + j),
                );
                m.set(h, k, g * sigmoid(g) * u);
            }
        }
        DevKernel::SwigluBwd => {
            let (dh, gu, dgu, rows, hidden) = (a.p(0), a.p(1), a.p(2), a.n(3), a.n(4));
            for k in 0..rows * hidden {
                let at = (k / hidden) * 2 * hidden + k % hidden;
                let (g, u, d) = (m.f(gu, at), m.f(gu, at + hidden), m.f(dh, k));
                let sg = sigmoid(g);
                m.set(dgu, at, d * u * sg * (1.0 + g * (1.0 - sg)));
                m.set(dgu, at + hidden, d * g * sg);
            }
        }
        other => unreachable!("{other:?} is not a decoder kernel"),
    }
}

/// Sizes of a flash-attention launch, from argument `first` on: batch,
/// heads, key/value heads, seq, head dim, scale.
struct Fa {
    b: usize,
    h: usize,
    kvh: usize,
    t: usize,
    d: usize,
    scale: f32,
}

impl Fa {
    fn new(a: &Args<'_>, first: usize) -> Fa {
        Fa {
            b: a.n(first),
            h: a.n(first + 1),
            kvh: a.n(first + 2),
            t: a.n(first + 3),
            d: a.n(first + 4),
            scale: a.f(first + 5),
        }
    }
    fn c(&self) -> usize {
        self.h * self.d
    }
    /// Row `i` of part `part` of batch `b`: query head `h` for part 0, the
    /// key/value head that query head `h` reads otherwise.
    fn qkv(&self, b: usize, h: usize, part: usize, i: usize) -> usize {
        let g = h / (self.h / self.kvh);
        let col = match part {
            0 => h * self.d,
            1 => self.c() + g * self.d,
            _ => self.c() + (self.kvh + g) * self.d,
        };
        (b * self.t + i) * (self.h + 2 * self.kvh) * self.d + col
    }
    fn out(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.t + i) * self.c() + h * self.d
    }
    fn dot(&self, m: &Mem<'_>, x: (B, usize), y: (B, usize)) -> f32 {
        (0..self.d).fold(0.0, |s, e| s + m.f(x.0, x.1 + e) * m.f(y.0, y.1 + e))
    }
}

/// `flash_attn_fwd`: per query row, key tiles of 32 with the kernel's
/// running maximum and sum.
fn flash_fwd(m: &mut Mem<'_>, a: &Args<'_>) {
    let (qkv, out, lse) = (a.p(0), a.p(1), a.p(2));
    let f = Fa::new(a, 3);
    for b in 0..f.b {
        for h in 0..f.h {
            for i in 0..f.t {
                let (mut mx, mut l) = (f32::NEG_INFINITY, 0.0f32);
                let mut acc = vec![0.0f32; f.d];
                for j0 in (0..=i).step_by(32) {
                    let keys = j0..(j0 + 32).min(i + 1);
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            f.dot(m, (qkv, f.qkv(b, h, 0, i)), (qkv, f.qkv(b, h, 1, j))) * f.scale
                        })
                        .collect();
                    let m_new = s.iter().copied().fold(mx, f32::max);
                    let rescale = (mx - m_new).exp();
                    let p: Vec<f32> = s.iter().map(|x| (x - m_new).exp()).collect();
                    l = l * rescale + p.iter().sum::<f32>();
                    mx = m_new;
                    for (e, x) in acc.iter_mut().enumerate() {
                        *x *= rescale;
                        for (pj, j) in p.iter().zip(keys.clone()) {
                            *x += pj * m.f(qkv, f.qkv(b, h, 2, j) + e);
                        }
                    }
                }
                for (e, x) in acc.iter().enumerate() {
                    m.set(out, f.out(b, h, i) + e, x / l);
                }
                m.set(lse, (b * f.h + h) * f.t + i, mx + l.ln());
            }
        }
    }
}

/// `flash_attn_bwd_dq` (`kv == false`: the query part of dqkv) and
/// `flash_attn_bwd_dkv` (the key and value parts).
fn flash_bwd(m: &mut Mem<'_>, a: &Args<'_>, kv: bool) {
    let (dout, qkv, out, lse, dqkv) = (a.p(0), a.p(1), a.p(2), a.p(3), a.p(4));
    let f = Fa::new(a, 5);
    let group = f.h / f.kvh;
    for b in 0..f.b {
        let (mut dk, mut dv) = (
            vec![0.0f32; f.kvh * f.t * f.d],
            vec![0.0f32; f.kvh * f.t * f.d],
        );
        for h in 0..f.h {
            let row = |i: usize| (b * f.h + h) * f.t + i;
            let dd: Vec<f32> = (0..f.t)
                .map(|i| f.dot(m, (dout, f.out(b, h, i)), (out, f.out(b, h, i))))
                .collect();
            // ds(i, j) = P ∘ (dP − D) · scale, P recomputed from lse.
            let grad = |m: &Mem<'_>, i: usize, j: usize| {
                let s = f.dot(m, (qkv, f.qkv(b, h, 0, i)), (qkv, f.qkv(b, h, 1, j))) * f.scale;
                let p = (s - m.f(lse, row(i))).exp();
                let dp = f.dot(m, (dout, f.out(b, h, i)), (qkv, f.qkv(b, h, 2, j)));
                (p, p * (dp - dd[i]) * f.scale)
            };
            for r in 0..f.t {
                let (mut g1, mut g2) = (vec![0.0f32; f.d], vec![0.0f32; f.d]);
                if kv {
                    for i in r..f.t {
                        let (p, ds) = grad(m, i, r);
                        for e in 0..f.d {
                            g1[e] += ds * m.f(qkv, f.qkv(b, h, 0, i) + e);
                            g2[e] += p * m.f(dout, f.out(b, h, i) + e);
                        }
                    }
                    // The query heads of a group add to their key/value
                    // head's dK and dV in f32 (the kernel's registers),
                    // stored after the group's last head.
                    let at = (h / group * f.t + r) * f.d;
                    for e in 0..f.d {
                        dk[at + e] += g1[e];
                        dv[at + e] += g2[e];
                    }
                    if (h + 1) % group == 0 {
                        for e in 0..f.d {
                            m.set(dqkv, f.qkv(b, h, 1, r) + e, dk[at + e]);
                            m.set(dqkv, f.qkv(b, h, 2, r) + e, dv[at + e]);
                        }
                    }
                } else {
                    for j in 0..=r {
                        let (_, ds) = grad(m, r, j);
                        for (e, x) in g1.iter_mut().enumerate() {
                            *x += ds * m.f(qkv, f.qkv(b, h, 1, j) + e);
                        }
                    }
                    for (e, x) in g1.iter().enumerate() {
                        m.set(dqkv, f.qkv(b, h, 0, r) + e, *x);
                    }
                }
            }
        }
    }
}

/// cuBLAS `gemm(StridedBatched)Ex` by its definition (column-major, f32
/// accumulation, `C` rounded once to its dtype; with `beta == 0`, `C` is
/// not read).
fn gemm(m: &mut Mem<'_>, g: &GemmCall) {
    let (mm, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
    let operand = |at: u64, stride: i64, dtype: DType, q: usize| B {
        at: at as usize + dtype.size() as usize * q * stride as usize,
        bf: dtype == DType::BF16,
    };
    for q in 0..g.batch as usize {
        let a = operand(g.a, g.stride_a, g.ab, q);
        let b = operand(g.b, g.stride_b, g.ab, q);
        let c = operand(g.c, g.stride_c, g.c_dtype, q);
        for j in 0..n {
            for i in 0..mm {
                let mut s = 0.0f32;
                for p in 0..k {
                    let x = if g.transa {
                        m.f(a, p + i * lda)
                    } else {
                        m.f(a, i + p * lda)
                    };
                    let y = if g.transb {
                        m.f(b, j + p * ldb)
                    } else {
                        m.f(b, p + j * ldb)
                    };
                    s += x * y;
                }
                let old = if g.beta == 0.0 {
                    0.0
                } else {
                    g.beta * m.f(c, i + j * ldc)
                };
                m.set(c, i + j * ldc, g.alpha * s + old);
            }
        }
    }
}

impl Emulator {
    /// Lowers `program` (validated here) for the emulated device, for rank
    /// `rank`.
    pub fn new(program: Program, rank: usize) -> Result<Emulator> {
        Emulator::with_attention(program, rank, AttentionLowering::Flash)
    }

    /// As [`Self::new`], fused attention lowered as `attention` says.
    pub fn with_attention(
        program: Program,
        rank: usize,
        attention: AttentionLowering,
    ) -> Result<Emulator> {
        program.validate()?;
        if rank >= program.world_size as usize {
            return Err(RuntimeError::InvalidProgram(format!(
                "rank {rank} in a world of {}",
                program.world_size
            )));
        }
        let b = Bindings::new(&program)?;
        let layout = DeviceLayout::with_attention(&program, &b, attention);
        let ops = lower_all(&program, &b, &layout)?;
        let buf = vec![0u8; layout.total as usize + 15];
        let start = buf.as_ptr().align_offset(16);
        Ok(Emulator {
            program,
            layout,
            ops,
            buf,
            start,
            rank,
            steps_done: 0,
            host_kernels: false,
        })
    }

    /// From now on, launches run `kernels.cu` itself, compiled for the
    /// host ([`super::host`]), instead of this module's Rust mirrors; an
    /// error when the crate was built without feature `host-kernels`.
    pub fn use_host_kernels(&mut self) -> Result<()> {
        if cfg!(feature = "host-kernels") {
            self.host_kernels = true;
            Ok(())
        } else {
            Err(RuntimeError::Unavailable(
                "host kernels",
                "memplan-runtime was built without feature `host-kernels`".into(),
            ))
        }
    }

    fn mem(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.layout.total as usize]
    }

    fn mem_mut(&mut self) -> &mut [u8] {
        let total = self.layout.total as usize;
        &mut self.buf[self.start..self.start + total]
    }

    pub fn layout(&self) -> &DeviceLayout {
        &self.layout
    }

    /// The device operations of each instruction.
    pub fn ops(&self) -> &[Vec<DevOp>] {
        &self.ops
    }
}

impl Executor for Emulator {
    type Buffer = [f32];

    fn program(&self) -> &Program {
        &self.program
    }
    fn rank(&self) -> usize {
        self.rank
    }
    /// The emulated device allocation (arena + workspace).
    fn allocated_bytes(&self) -> u64 {
        self.layout.total
    }
    /// The emulator does not time instructions: a profiled step reports
    /// none.
    fn set_profiling(&mut self, _on: bool) -> Result<()> {
        Ok(())
    }

    fn write_f32(&mut self, t: TensorIdx, v: &[f32]) -> Result<()> {
        let x = accessed(&self.program, t, &[DType::F32, DType::BF16], Some(v.len()))?;
        let (at, dtype) = (x.offset, x.dtype);
        store(self.mem_mut(), at, v, dtype);
        Ok(())
    }
    fn write_i32(&mut self, t: TensorIdx, v: &[i32]) -> Result<()> {
        let off = accessed(&self.program, t, &[DType::I32], Some(v.len()))?.offset as usize;
        let mem = self.mem_mut();
        for (i, x) in v.iter().enumerate() {
            mem[off + 4 * i..off + 4 * i + 4].copy_from_slice(&x.to_ne_bytes());
        }
        Ok(())
    }
    fn read_f32(&self, t: TensorIdx) -> Result<Vec<f32>> {
        let x = accessed(&self.program, t, &[DType::F32, DType::BF16], None)?;
        Ok(floats(self.mem(), x.offset, x.elements(), x.dtype))
    }

    /// Runs one step; collectives go through `comm`.
    fn step(&mut self, comm: &dyn Communicator<[f32]>) -> Result<StepReport> {
        let began = std::time::Instant::now();
        let step = self.steps_done + 1;
        let ew = self.layout.error_word as usize;
        let (start, total, host) = (self.start, self.layout.total as usize, self.host_kernels);
        let mem = &mut self.buf[start..start + total];
        mem[ew..ew + 4].fill(0);
        for ops in &self.ops {
            for op in ops {
                match op {
                    DevOp::Launch(l) if host => host_launch(l, mem, step)?,
                    DevOp::Launch(l) => launch(&mut Mem(mem), l, step),
                    DevOp::Gemm(g) => gemm(&mut Mem(mem), g),
                    DevOp::Memset { at, bytes } => {
                        mem[*at as usize..(*at + *bytes) as usize].fill(0)
                    }
                    DevOp::Copy { src, dst, bytes } => {
                        let (s, d, n) = (*src as usize, *dst as usize, *bytes as usize);
                        mem.copy_within(s..s + n, d);
                    }
                    DevOp::Collective(c) => collective(mem, c, comm)?,
                }
            }
        }
        let code = i32::from_ne_bytes(mem[ew..ew + 4].try_into().expect("4 bytes"));
        if code != 0 {
            let ins = &self.program.instrs[code as usize - 1];
            return Err(RuntimeError::Kernel {
                instr: ins.name.clone(),
                kernel: ins.kernel.name(),
                why: "an index (token id or target) is out of range".into(),
            });
        }
        self.steps_done = step;
        Ok(StepReport {
            seconds: began.elapsed().as_secs_f64(),
            step,
            instr_seconds: Vec::new(),
            used_bytes: self.layout.total,
        })
    }
}

/// Launch `l` of `kernels.cu` compiled for the host.
fn host_launch(l: &Launch, mem: &mut [u8], step: u64) -> Result<()> {
    #[cfg(feature = "host-kernels")]
    return super::host::launch(l, mem, step);
    #[cfg(not(feature = "host-kernels"))]
    {
        let _ = (l, mem, step);
        unreachable!("use_host_kernels refuses without feature host-kernels")
    }
}

/// `n` elements of `dtype` at `at`, widened.
fn floats(mem: &[u8], at: u64, n: u64, dtype: DType) -> Vec<f32> {
    let b = B {
        at: at as usize,
        bf: dtype == DType::BF16,
    };
    (0..n as usize).map(|i| load(mem, b, i)).collect()
}

/// Stores `v` at `at`, rounded to `dtype`.
fn store(mem: &mut [u8], at: u64, v: &[f32], dtype: DType) {
    let mut m = Mem(mem);
    let b = B {
        at: at as usize,
        bf: dtype == DType::BF16,
    };
    for (i, &x) in v.iter().enumerate() {
        m.set(b, i, x);
    }
}

/// A collective through the host communicator: bf16 operands travel
/// widened and are rounded where they land (a reduction sums in f32).
fn collective(mem: &mut [u8], c: &CollectiveOp, comm: &dyn Communicator<[f32]>) -> Result<()> {
    let w = comm.world_size() as u64;
    match *c {
        CollectiveOp::AllGather {
            send,
            recv,
            count,
            dtype,
        } => {
            let s = floats(mem, send, count, dtype);
            let mut r = vec![0.0; (w * count) as usize];
            comm.all_gather(&s, &mut r)?;
            store(mem, recv, &r, dtype);
        }
        CollectiveOp::ReduceScatter {
            send,
            recv,
            count,
            op,
            dtype,
        } => {
            let s = floats(mem, send, w * count, dtype);
            let mut r = vec![0.0; count as usize];
            comm.reduce_scatter(&s, &mut r, op)?;
            store(mem, recv, &r, dtype);
        }
        CollectiveOp::AllReduce {
            buf,
            count,
            op,
            dtype,
        } => {
            let mut b = floats(mem, buf, count, dtype);
            comm.all_reduce(&mut b, op)?;
            store(mem, buf, &b, dtype);
        }
    }
    Ok(())
}
