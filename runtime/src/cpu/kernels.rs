//! CPU kernels, f32. Formulas: `docs/ops.md`.
//!
//! An input given as `None` is read through the output it shares bytes
//! with (an in-place pair, see [`crate::binding`]): every such kernel reads
//! an element (or a whole row) of that input before writing the same
//! element (row) of the output. Reductions over rows (bias and LayerNorm
//! parameter gradients, losses, norms) sum fixed-size chunks in parallel and
//! then the chunk sums in order, so results do not depend on the number of
//! threads.

use rayon::prelude::*;

use super::gemm::{MatMut, MatPtr, gemm_serial, matmul};
use crate::kernel::{AdamParams, Attention, ChunkLayout};

/// Elements per parallel task of an elementwise kernel.
const CHUNK: usize = 1 << 14;
/// Rows per chunk of a row reduction.
const ROW_CHUNK: usize = 32;

/// `out[i] = f(x[i])`, or in place.
fn unary(x: Option<&[f32]>, out: &mut [f32], f: impl Fn(f32) -> f32 + Sync) {
    match x {
        Some(x) => out
            .par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| {
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = f(x);
                }
            }),
        None => out.par_chunks_mut(CHUNK).for_each(|o| {
            for o in o {
                *o = f(*o);
            }
        }),
    }
}

/// `out[i] = f(a[i], b[i])`, where at most one of `a`, `b` is read in place.
fn binary(
    a: Option<&[f32]>,
    b: Option<&[f32]>,
    out: &mut [f32],
    f: impl Fn(f32, f32) -> f32 + Sync,
) {
    match (a, b) {
        (Some(a), Some(b)) => out
            .par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
            .for_each(|(o, (a, b))| {
                for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                    *o = f(a, b);
                }
            }),
        (None, Some(b)) => out
            .par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(o, b)| {
                for (o, &b) in o.iter_mut().zip(b) {
                    *o = f(*o, b);
                }
            }),
        (Some(a), None) => out
            .par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .for_each(|(o, a)| {
                for (o, &a) in o.iter_mut().zip(a) {
                    *o = f(a, *o);
                }
            }),
        (None, None) => unreachable!("at most one input of a binary kernel is in place"),
    }
}

pub fn add(a: Option<&[f32]>, b: Option<&[f32]>, out: &mut [f32]) {
    binary(a, b, out, |a, b| a + b);
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2 / pi)

pub fn gelu_scalar(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh())
}

pub fn gelu_grad_scalar(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x)
}

pub fn gelu(x: Option<&[f32]>, out: &mut [f32]) {
    unary(x, out, gelu_scalar);
}

/// `dx = dy · gelu'(x)`; `dy` may be read in place.
pub fn gelu_backward(dy: Option<&[f32]>, x: &[f32], dx: &mut [f32]) {
    binary(dy, Some(x), dx, |d, x| d * gelu_grad_scalar(x));
}

pub fn relu(x: Option<&[f32]>, out: &mut [f32]) {
    unary(x, out, |x| if x > 0.0 { x } else { 0.0 });
}

pub fn relu_backward(dy: Option<&[f32]>, x: &[f32], dx: &mut [f32]) {
    binary(dy, Some(x), dx, |d, x| if x > 0.0 { d } else { 0.0 });
}

#[allow(clippy::too_many_arguments)]
pub fn layernorm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    cols: usize,
    eps: f32,
) {
    y.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|((y, x), (mu, rs))| {
            let m = x.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = x.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / cols as f64;
            let r = 1.0 / (var + eps as f64).sqrt();
            *mu = m as f32;
            *rs = r as f32;
            let (m, r) = (m as f32, r as f32);
            for j in 0..cols {
                y[j] = (x[j] - m) * r * gamma[j] + beta[j];
            }
        });
}

/// The row loop of a normalization's backward: `row(r, dy_r, dx_r, sums)`
/// writes row `r` of `dx` from row `r` of `dy` (read from `dx` itself when
/// `dy` is `None`: in place) and adds the row's parameter-gradient terms to
/// `sums` (`params` floats). Chunks of rows run in parallel with their own
/// sums, which are then added in chunk order, so the result does not depend
/// on the number of threads. Returns the summed parameter gradients.
pub(crate) fn backward_rows(
    dy: Option<&[f32]>,
    dx: &mut [f32],
    cols: usize,
    params: usize,
    row: impl Fn(usize, &[f32], &mut [f32], &mut [f32]) + Sync,
) -> Vec<f32> {
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(cols * ROW_CHUNK)
        .enumerate()
        .map(|(ci, dxc)| {
            let mut part = vec![0.0f32; params];
            let mut dyrow = vec![0.0f32; cols];
            for (ri, dxr) in dxc.chunks_mut(cols).enumerate() {
                let r = ci * ROW_CHUNK + ri;
                match dy {
                    Some(dy) => dyrow.copy_from_slice(&dy[r * cols..(r + 1) * cols]),
                    None => dyrow.copy_from_slice(dxr),
                }
                row(r, &dyrow, dxr, &mut part);
            }
            part
        })
        .collect();
    let mut sums = vec![0.0f32; params];
    for p in &partials {
        for (s, &v) in sums.iter_mut().zip(p) {
            *s += v;
        }
    }
    sums
}

/// LayerNorm backward; `dy` may be read in place from `dx`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dy: Option<&[f32]>,
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    cols: usize,
) {
    let sums = backward_rows(dy, dx, cols, 2 * cols, |r, dyrow, dxr, part| {
        let xr = &x[r * cols..(r + 1) * cols];
        let (m, rs) = (mean[r], rstd[r]);
        let mut s1 = 0.0f32; // mean of dxhat
        let mut s2 = 0.0f32; // mean of dxhat * xhat
        for j in 0..cols {
            let xhat = (xr[j] - m) * rs;
            let d = dyrow[j] * gamma[j];
            s1 += d;
            s2 += d * xhat;
            part[j] += dyrow[j] * xhat;
            part[cols + j] += dyrow[j];
        }
        s1 /= cols as f32;
        s2 /= cols as f32;
        for j in 0..cols {
            let xhat = (xr[j] - m) * rs;
            dxr[j] = rs * (dyrow[j] * gamma[j] - s1 - xhat * s2);
        }
    });
    dgamma.copy_from_slice(&sums[..cols]);
    dbeta.copy_from_slice(&sums[cols..]);
}

/// `y = x w + b`: `x: m × k`, `w: k × n`.
pub fn linear(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
    y.par_chunks_mut(n).for_each(|row| row.copy_from_slice(b));
    matmul(x, w, y, m, k, n, false, false, true);
}

/// `dx = dy wᵀ`: `dy: m × n`, `w: k × n`.
pub fn linear_backward_data(dy: &[f32], w: &[f32], dx: &mut [f32], m: usize, k: usize, n: usize) {
    matmul(dy, w, dx, m, n, k, false, true, false);
}

/// Column sums of an `m × n` matrix into `out`, in row order per chunk.
fn column_sums(a: &[f32], out: &mut [f32], n: usize) {
    let partials: Vec<Vec<f32>> = a
        .par_chunks(n * ROW_CHUNK)
        .map(|c| {
            let mut p = vec![0.0f32; n];
            for row in c.chunks(n) {
                for (s, &v) in p.iter_mut().zip(row) {
                    *s += v;
                }
            }
            p
        })
        .collect();
    out.fill(0.0);
    for p in &partials {
        for (o, &v) in out.iter_mut().zip(p) {
            *o += v;
        }
    }
}

/// `dw = xᵀ dy`, `db = Σ_rows dy`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_weight(
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) {
    matmul(x, dy, dw, k, m, n, true, false, false);
    column_sums(dy, db, n);
}

/// Raw pointers handed to parallel attention tasks.
#[derive(Clone, Copy)]
pub(super) struct Ptr(pub(super) *mut f32);
// SAFETY: each task touches a disjoint part of the buffer (see callers).
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    /// The address (a method, so closures capture the whole `Ptr`).
    pub(super) fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

fn zero_upper(s: &mut [f32], t: usize) {
    for i in 0..t {
        s[i * t + i + 1..(i + 1) * t].fill(0.0);
    }
}

/// `scores[b,h] = scale · Q Kᵀ` below and on the diagonal, 0 above.
pub fn attention_scores(qkv: &[f32], scores: &mut [f32], a: &Attention) {
    let (t, h, d) = (a.seq as usize, a.heads as usize, a.head_dim as usize);
    let c = h * d;
    scores
        .par_chunks_mut(t * t)
        .enumerate()
        .for_each(|(bh, s)| {
            let (b, hh) = (bh / h, bh % h);
            let base = b * t * 3 * c + hh * d;
            let q = MatPtr {
                ptr: qkv[base..].as_ptr(),
                rs: 3 * c as isize,
                cs: 1,
            };
            let kt = MatPtr {
                ptr: qkv[base + c..].as_ptr(),
                rs: 1,
                cs: 3 * c as isize,
            };
            // SAFETY: q and k lie inside qkv; s is this task's own block.
            unsafe { gemm_serial(t, d, t, a.scale as f32, q, kt, 0.0, MatMut::row_major(s, t)) };
            zero_upper(s, t);
        });
}

/// Row-wise causal softmax (row `i` over columns `0..=i`), 0 above the
/// diagonal; `scores` may be read in place.
pub fn causal_softmax(scores: Option<&[f32]>, probs: &mut [f32], a: &Attention) {
    let t = a.seq as usize;
    probs.par_chunks_mut(t).enumerate().for_each(|(r, p)| {
        let i = r % t;
        if let Some(s) = scores {
            p[..=i].copy_from_slice(&s[r * t..r * t + i + 1]);
        }
        let max = p[..=i].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in &mut p[..=i] {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in &mut p[..=i] {
            *v *= inv;
        }
        p[i + 1..].fill(0.0);
    });
}

/// `att[b, :, h] = P V`.
pub fn attention_values(probs: &[f32], qkv: &[f32], att: &mut [f32], a: &Attention) {
    let (bsz, t, h, d) = (
        a.batch as usize,
        a.seq as usize,
        a.heads as usize,
        a.head_dim as usize,
    );
    let c = h * d;
    let out = Ptr(att.as_mut_ptr());
    (0..bsz * h).into_par_iter().for_each(|bh| {
        let (b, hh) = (bh / h, bh % h);
        let p = MatPtr::row_major(&probs[bh * t * t..(bh + 1) * t * t], t, false);
        let v = MatPtr {
            ptr: qkv[b * t * 3 * c + 2 * c + hh * d..].as_ptr(),
            rs: 3 * c as isize,
            cs: 1,
        };
        let o = MatMut {
            ptr: out.at(b * t * c + hh * d),
            rs: c as isize,
            cs: 1,
        };
        // SAFETY: tasks write disjoint column blocks of att.
        unsafe { gemm_serial(t, t, d, 1.0, p, v, 0.0, o) };
    });
}

/// `dprobs = dAtt Vᵀ` (0 above the diagonal); `dqkv`: query and key parts
/// 0, value part `Pᵀ dAtt`.
pub fn attention_values_backward(
    datt: &[f32],
    probs: &[f32],
    qkv: &[f32],
    dprobs: &mut [f32],
    dqkv: &mut [f32],
    a: &Attention,
) {
    let (bsz, t, h, d) = (
        a.batch as usize,
        a.seq as usize,
        a.heads as usize,
        a.head_dim as usize,
    );
    let c = h * d;
    let dp = Ptr(dprobs.as_mut_ptr());
    let dq = Ptr(dqkv.as_mut_ptr());
    (0..bsz * h).into_par_iter().for_each(|bh| {
        let (b, hh) = (bh / h, bh % h);
        let qkv_b = b * t * 3 * c;
        let datt_m = MatPtr {
            ptr: datt[b * t * c + hh * d..].as_ptr(),
            rs: c as isize,
            cs: 1,
        };
        let vt = MatPtr {
            ptr: qkv[qkv_b + 2 * c + hh * d..].as_ptr(),
            rs: 1,
            cs: 3 * c as isize,
        };
        // SAFETY: block `bh` of dprobs and head `hh` columns of batch `b`
        // of dqkv belong to this task alone.
        unsafe {
            let s = std::slice::from_raw_parts_mut(dp.at(bh * t * t), t * t);
            gemm_serial(t, d, t, 1.0, datt_m, vt, 0.0, MatMut::row_major(s, t));
            zero_upper(s, t);
            for i in 0..t {
                let row = dq.at(qkv_b + i * 3 * c);
                std::ptr::write_bytes(row.add(hh * d), 0, d);
                std::ptr::write_bytes(row.add(c + hh * d), 0, d);
            }
            let pt = MatPtr::row_major(&probs[bh * t * t..(bh + 1) * t * t], t, true);
            let dv = MatMut {
                ptr: dq.at(qkv_b + 2 * c + hh * d),
                rs: 3 * c as isize,
                cs: 1,
            };
            gemm_serial(t, t, d, 1.0, pt, datt_m, 0.0, dv);
        }
    });
}

/// `dscores = P ⊙ (dP − rowsum(dP ⊙ P))`; `dprobs` may be read in place.
pub fn causal_softmax_backward(
    dprobs: Option<&[f32]>,
    probs: &[f32],
    dscores: &mut [f32],
    a: &Attention,
) {
    let t = a.seq as usize;
    dscores.par_chunks_mut(t).enumerate().for_each(|(r, ds)| {
        if let Some(dp) = dprobs {
            ds.copy_from_slice(&dp[r * t..(r + 1) * t]);
        }
        let p = &probs[r * t..(r + 1) * t];
        let dot: f32 = ds.iter().zip(p).map(|(&x, &y)| x * y).sum();
        for (v, &pv) in ds.iter_mut().zip(p) {
            *v = pv * (*v - dot);
        }
    });
}

/// `dQ += scale · dS K`, `dK += scale · dSᵀ Q`, per batch and head.
pub fn attention_scores_backward(dscores: &[f32], qkv: &[f32], dqkv: &mut [f32], a: &Attention) {
    let (bsz, t, h, d) = (
        a.batch as usize,
        a.seq as usize,
        a.heads as usize,
        a.head_dim as usize,
    );
    let c = h * d;
    let dq = Ptr(dqkv.as_mut_ptr());
    (0..bsz * h).into_par_iter().for_each(|bh| {
        let (b, hh) = (bh / h, bh % h);
        let qkv_b = b * t * 3 * c;
        let ds = &dscores[bh * t * t..(bh + 1) * t * t];
        let q = MatPtr {
            ptr: qkv[qkv_b + hh * d..].as_ptr(),
            rs: 3 * c as isize,
            cs: 1,
        };
        let k = MatPtr {
            ptr: qkv[qkv_b + c + hh * d..].as_ptr(),
            rs: 3 * c as isize,
            cs: 1,
        };
        // SAFETY: head `hh` columns of batch `b` of dqkv are this task's.
        unsafe {
            let dqm = MatMut {
                ptr: dq.at(qkv_b + hh * d),
                rs: 3 * c as isize,
                cs: 1,
            };
            let dkm = MatMut {
                ptr: dq.at(qkv_b + c + hh * d),
                rs: 3 * c as isize,
                cs: 1,
            };
            gemm_serial(
                t,
                t,
                d,
                a.scale as f32,
                MatPtr::row_major(ds, t, false),
                k,
                1.0,
                dqm,
            );
            gemm_serial(
                t,
                t,
                d,
                a.scale as f32,
                MatPtr::row_major(ds, t, true),
                q,
                1.0,
                dkm,
            );
        }
    });
}

fn check_index(what: &str, v: i32, range: u64, at: usize) -> Result<usize, String> {
    if v < 0 || v as u64 >= range {
        Err(format!(
            "{what} {v} at position {at} is outside [0, {range})"
        ))
    } else {
        Ok(v as usize)
    }
}

/// `x[b,t] = wte[tokens[b,t]] + wpe[t]` (without `wpe`: the token rows).
pub fn embedding(
    tokens: &[i32],
    wte: &[f32],
    wpe: Option<&[f32]>,
    x: &mut [f32],
    seq: usize,
    width: usize,
    vocab: u64,
) -> Result<(), String> {
    for (at, &tok) in tokens.iter().enumerate() {
        check_index("token", tok, vocab, at)?;
    }
    x.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let tok = tokens[r] as usize;
        let t = r % seq;
        let e = &wte[tok * width..(tok + 1) * width];
        match wpe {
            Some(wpe) => {
                let p = &wpe[t * width..(t + 1) * width];
                for j in 0..width {
                    row[j] = e[j] + p[j];
                }
            }
            None => row.copy_from_slice(e),
        }
    });
    Ok(())
}

/// `dwte = (dhead or 0) + scatter-add of dx rows by token`, `dwpe[t] = Σ_b dx[b,t]`
/// (when there is a `dwpe`).
/// `dhead`: `None` = no accumulation, `Some(None)` = read in place from `dwte`.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward(
    dx: &[f32],
    tokens: &[i32],
    dhead: Option<Option<&[f32]>>,
    dwte: &mut [f32],
    dwpe: Option<&mut [f32]>,
    batch: usize,
    seq: usize,
    width: usize,
    vocab: u64,
) -> Result<(), String> {
    // Positions of each token, in order (counting sort), so every row of
    // dwte sums its positions in position order.
    let v = vocab as usize;
    let mut start = vec![0usize; v + 1];
    for (at, &tok) in tokens.iter().enumerate() {
        start[check_index("token", tok, vocab, at)? + 1] += 1;
    }
    for i in 0..v {
        start[i + 1] += start[i];
    }
    let mut fill = start.clone();
    let mut pos = vec![0usize; tokens.len()];
    for (at, &tok) in tokens.iter().enumerate() {
        pos[fill[tok as usize]] = at;
        fill[tok as usize] += 1;
    }
    match dhead {
        None => dwte.par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0)),
        Some(Some(h)) => dwte
            .par_chunks_mut(CHUNK)
            .zip(h.par_chunks(CHUNK))
            .for_each(|(o, h)| o.copy_from_slice(h)),
        Some(None) => {}
    }
    dwte.par_chunks_mut(width)
        .enumerate()
        .for_each(|(tok, row)| {
            for &at in &pos[start[tok]..start[tok + 1]] {
                for (o, &g) in row.iter_mut().zip(&dx[at * width..(at + 1) * width]) {
                    *o += g;
                }
            }
        });
    let Some(dwpe) = dwpe else { return Ok(()) };
    dwpe.par_chunks_mut(width).enumerate().for_each(|(t, row)| {
        row.fill(0.0);
        for b in 0..batch {
            let at = b * seq + t;
            for (o, &g) in row.iter_mut().zip(&dx[at * width..(at + 1) * width]) {
                *o += g;
            }
        }
    });
    Ok(())
}

/// Sums of `f(row index, row)` over rows, chunked for determinism, in f64.
fn row_sum(rows: usize, f: impl Fn(usize) -> Result<f64, String> + Sync) -> Result<f64, String> {
    let parts: Vec<Result<f64, String>> = (0..rows.div_ceil(ROW_CHUNK))
        .into_par_iter()
        .map(|c| {
            let mut s = 0.0f64;
            for r in c * ROW_CHUNK..((c + 1) * ROW_CHUNK).min(rows) {
                s += f(r)?;
            }
            Ok(s)
        })
        .collect();
    let mut total = 0.0;
    for p in parts {
        total += p?;
    }
    Ok(total)
}

/// `loss = mean over rows of (logsumexp(logits[r]) − logits[r, target[r]])`.
pub fn cross_entropy(logits: &[f32], targets: &[i32], classes: usize) -> Result<f32, String> {
    let rows = targets.len();
    if rows == 0 {
        return Ok(0.0);
    }
    let total = row_sum(rows, |r| {
        let x = &logits[r * classes..(r + 1) * classes];
        let tgt = check_index("target", targets[r], classes as u64, r)?;
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
        Ok(max as f64 + sum.ln() - x[tgt] as f64)
    })?;
    Ok((total / rows as f64) as f32)
}

/// `dlogits = scale · (softmax(logits) − onehot(target))`; `logits` may be
/// read in place.
pub fn cross_entropy_backward(
    logits: Option<&[f32]>,
    targets: &[i32],
    dlogits: &mut [f32],
    classes: usize,
    scale: f32,
) -> Result<(), String> {
    for (r, &t) in targets.iter().enumerate() {
        check_index("target", t, classes as u64, r)?;
    }
    dlogits
        .par_chunks_mut(classes)
        .enumerate()
        .for_each(|(r, d)| {
            if let Some(x) = logits {
                d.copy_from_slice(&x[r * classes..(r + 1) * classes]);
            }
            let max = d.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for v in d.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let k = scale / sum;
            for v in d.iter_mut() {
                *v *= k;
            }
            d[targets[r] as usize] -= scale;
        });
    Ok(())
}

/// The sum of squares of every element of every input.
pub fn sum_of_squares(inputs: &[&[f32]]) -> f64 {
    inputs
        .iter()
        .map(|x| {
            let parts: Vec<f64> = x
                .par_chunks(CHUNK)
                .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum())
                .collect();
            parts.iter().sum::<f64>()
        })
        .sum()
}

/// One Adam/AdamW step at step number `step` (1-based). `norm`: the
/// gradient norm (or its square, per `p.norm_squared`) when clipping.
#[allow(clippy::too_many_arguments)]
pub fn adam(
    g: &[f32],
    norm: Option<f32>,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    denom: Option<&mut [f32]>,
    p: &AdamParams,
    step: u64,
) {
    // The hyper-parameters in the precision the update runs in.
    let (lr, b1, b2, eps, wd) = (
        p.lr as f32,
        p.beta1 as f32,
        p.beta2 as f32,
        p.eps as f32,
        p.weight_decay as f32,
    );
    let coef = match (p.max_norm, norm) {
        (Some(max), Some(n)) => {
            let n = if p.norm_squared { n.max(0.0).sqrt() } else { n };
            (max as f32 / (n + 1e-6)).min(1.0)
        }
        _ => 1.0,
    };
    let bc1 = 1.0 - b1.powi(step.min(i32::MAX as u64) as i32);
    let bc2_sqrt = (1.0 - b2.powi(step.min(i32::MAX as u64) as i32)).sqrt();
    let step_size = lr / bc1;
    let decay = 1.0 - lr * wd;
    let one = |i: usize, w: &mut f32, m: &mut f32, v: &mut f32| -> f32 {
        let mut gi = g[i] * coef;
        if p.decoupled {
            *w *= decay;
        } else if wd != 0.0 {
            gi += wd * *w;
        }
        *m = b1 * *m + (1.0 - b1) * gi;
        *v = b2 * *v + (1.0 - b2) * gi * gi;
        let d = v.sqrt() / bc2_sqrt + eps;
        *w -= step_size * *m / d;
        d
    };
    let chunks = w
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate();
    match denom {
        Some(den) => chunks
            .zip(den.par_chunks_mut(CHUNK))
            .for_each(|((ci, ((w, m), v)), den)| {
                for j in 0..w.len() {
                    den[j] = one(ci * CHUNK + j, &mut w[j], &mut m[j], &mut v[j]);
                }
            }),
        None => chunks.for_each(|(ci, ((w, m), v))| {
            for j in 0..w.len() {
                one(ci * CHUNK + j, &mut w[j], &mut m[j], &mut v[j]);
            }
        }),
    }
}

/// FSDP2's `chunk_cat`: chunk `r` of every input into segment `r` of `out`.
pub fn chunk_cat(inputs: &[&[f32]], l: &ChunkLayout, out: &mut [f32]) {
    out.fill(0.0);
    for (i, x) in inputs.iter().enumerate() {
        for (at, from, n) in l.pieces(i, x.len() as u64) {
            let (at, from, n) = (at as usize, from as usize, n as usize);
            out[at..at + n].copy_from_slice(&x[from..from + n]);
        }
    }
}

/// FSDP2's copy-out: every parameter from its chunks in `full`.
pub fn copy_out(full: &[f32], l: &ChunkLayout, outs: &mut [&mut [f32]]) {
    for (i, x) in outs.iter_mut().enumerate() {
        for (at, to, n) in l.pieces(i, x.len() as u64) {
            let (at, to, n) = (at as usize, to as usize, n as usize);
            x[to..to + n].copy_from_slice(&full[at..at + n]);
        }
    }
}

/// `out[offsets[i] ..] = inputs[i]`, zeros elsewhere.
pub fn pack(inputs: &[&[f32]], offsets: &[u64], out: &mut [f32]) {
    let mut end = 0usize;
    for (x, &off) in inputs.iter().zip(offsets) {
        let off = off as usize;
        out[end..off].fill(0.0);
        out[off..off + x.len()].copy_from_slice(x);
        end = off + x.len();
    }
    out[end..].fill(0.0);
}
