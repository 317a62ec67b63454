//! Fused causal attention on the CPU, flash-style: the scores of one head
//! are computed a `TILE × TILE` block at a time and never stored whole.
//!
//! Forward, per (batch, head, query tile): for each key tile at or before
//! the diagonal, `S = scale·Q Kᵀ`, masked above the diagonal; each query
//! row keeps a running maximum `m`, a running sum `l` of `exp(S − m)` and an
//! accumulator of `exp(S − m) V`, rescaled by `exp(m_old − m_new)` when the
//! maximum grows. At the end `out = acc / l` and `lse = m + ln l`, the
//! log-sum-exp that the backward pass needs to recompute the probabilities
//! `P = exp(S − lse)` exactly.
//!
//! Backward, per (batch, key/value head): `Dᵢ = Σ dOᵢ·Oᵢ` for every query
//! row of the query heads that share this key/value head, then for each
//! key tile `j`, each of those query heads and each query tile `i ≥ j`:
//! recompute `P`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`; accumulate
//! `dV_j += Pᵀ dO`, `dK_j += scale·dSᵀ Q` in the tile's own buffers (summed
//! over the group's query heads: grouped-query attention) and
//! `dQ_i += scale·dS K` directly in the output. A task owns one key/value
//! head's columns and its query heads' columns, so tasks write disjoint
//! bytes and the sums run in a fixed order: results do not depend on the
//! thread count.
//!
//! Scratch memory per task is a few `TILE × max(TILE, D)` blocks (plus `T`
//! floats for `D` in the backward pass), independent of the batch and of
//! the number of heads.

use rayon::prelude::*;

use super::gemm::{MatMut, MatPtr, gemm_serial};
use super::kernels::Ptr;
use crate::kernel::Attention;

/// Query and key rows per tile.
const TILE: usize = 64;

#[derive(Copy, Clone)]
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Dims {
    fn new(a: &Attention) -> Dims {
        Dims {
            batch: a.batch as usize,
            seq: a.seq as usize,
            heads: a.heads as usize,
            kv_heads: a.kv_heads as usize,
            d: a.head_dim as usize,
        }
    }
    fn width(self) -> usize {
        self.heads * self.d
    }
    /// Elements between consecutive rows of `qkv`.
    fn stride(self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }
    /// Query heads per key/value head.
    fn group(self) -> usize {
        self.heads / self.kv_heads
    }
    /// Offset in `qkv` of row `i` of part `part` (0 query, 1 key, 2 value)
    /// of head `h` in batch `b` (a query head for part 0, a key/value head
    /// otherwise).
    fn qkv_at(self, b: usize, h: usize, part: usize, i: usize) -> usize {
        let col = match part {
            0 => h * self.d,
            1 => self.width() + h * self.d,
            _ => self.width() + (self.kv_heads + h) * self.d,
        };
        (b * self.seq + i) * self.stride() + col
    }
    /// Offset in `out` (`[B, T, C]`) of row `i` of head `h`.
    fn out_at(self, b: usize, h: usize, i: usize) -> usize {
        (b * self.seq + i) * self.width() + h * self.d
    }
}

fn rows_of(x: &[f32], at: usize, row_stride: usize) -> MatPtr {
    MatPtr {
        ptr: x[at..].as_ptr(),
        rs: row_stride as isize,
        cs: 1,
    }
}

fn transposed(m: MatPtr) -> MatPtr {
    MatPtr {
        ptr: m.ptr,
        rs: m.cs,
        cs: m.rs,
    }
}

fn block(s: &mut [f32], cols: usize) -> MatMut {
    MatMut {
        ptr: s.as_mut_ptr(),
        rs: cols as isize,
        cs: 1,
    }
}

/// `s[r, e] = scale · q_r · k_e` for a `rows × cols` tile (row stride
/// `TILE`).
fn scaled_scores(
    q: MatPtr,
    k: MatPtr,
    s: &mut [f32],
    rows: usize,
    cols: usize,
    d: usize,
    scale: f32,
) {
    debug_assert!(rows <= TILE && cols <= TILE && s.len() >= TILE * TILE);
    // SAFETY: `s` is the caller's own buffer of a whole tile; q and k reach
    // `rows` and `cols` rows of `d` elements inside the inputs.
    unsafe { gemm_serial(rows, d, cols, scale, q, transposed(k), 0.0, block(s, TILE)) };
}

/// Keys `j0 .. j0 + valid` of a tile are at or before query `i`.
fn visible(i: usize, j0: usize, cols: usize) -> usize {
    (i + 1).saturating_sub(j0).min(cols)
}

/// `out = softmax(scale·Q Kᵀ, causal) V` per head, and `lse` per query row.
pub fn fused_attention(qkv: &[f32], out: &mut [f32], lse: &mut [f32], a: &Attention) {
    let dm = Dims::new(a);
    let (t, d, stride) = (dm.seq, dm.d, dm.stride());
    let tiles = t.div_ceil(TILE);
    let (out_p, lse_p) = (Ptr(out.as_mut_ptr()), Ptr(lse.as_mut_ptr()));
    (0..dm.batch * dm.heads * tiles)
        .into_par_iter()
        .for_each(|task| {
            let (bh, qt) = (task / tiles, task % tiles);
            let (b, h) = (bh / dm.heads, bh % dm.heads);
            let g = h / dm.group();
            let i0 = qt * TILE;
            let rows = TILE.min(t - i0);
            let mut s = vec![0.0f32; TILE * TILE];
            let mut acc = vec![0.0f32; TILE * d];
            let mut m = [f32::NEG_INFINITY; TILE];
            let mut l = [0.0f32; TILE];
            let q = rows_of(qkv, dm.qkv_at(b, h, 0, i0), stride);
            for j0 in (0..i0 + rows).step_by(TILE) {
                let cols = TILE.min(t - j0);
                let k = rows_of(qkv, dm.qkv_at(b, g, 1, j0), stride);
                let v = rows_of(qkv, dm.qkv_at(b, g, 2, j0), stride);
                scaled_scores(q, k, &mut s, rows, cols, d, a.scale as f32);
                for r in 0..rows {
                    let row = &mut s[r * TILE..r * TILE + cols];
                    let valid = visible(i0 + r, j0, cols);
                    if valid == 0 {
                        row.fill(0.0);
                        continue;
                    }
                    let top = row[..valid]
                        .iter()
                        .copied()
                        .fold(f32::NEG_INFINITY, f32::max);
                    let m_new = m[r].max(top);
                    let rescale = (m[r] - m_new).exp();
                    let mut sum = 0.0f32;
                    for x in &mut row[..valid] {
                        *x = (*x - m_new).exp();
                        sum += *x;
                    }
                    row[valid..].fill(0.0);
                    l[r] = l[r] * rescale + sum;
                    m[r] = m_new;
                    for x in &mut acc[r * d..(r + 1) * d] {
                        *x *= rescale;
                    }
                }
                let p = MatPtr::row_major(&s, TILE, false);
                // SAFETY: `acc` is this task's own buffer.
                unsafe { gemm_serial(rows, cols, d, 1.0, p, v, 1.0, block(&mut acc, d)) };
            }
            for r in 0..rows {
                let inv = 1.0 / l[r];
                let o = out_p.at(dm.out_at(b, h, i0 + r));
                for (e, &x) in acc[r * d..(r + 1) * d].iter().enumerate() {
                    // SAFETY: row i0 + r of head h: only this task writes it.
                    unsafe { *o.add(e) = x * inv };
                }
                // SAFETY: as above, one element per query row.
                unsafe { *lse_p.at(bh * t + i0 + r) = m[r] + l[r].ln() };
            }
        });
}

/// The gradient of [`fused_attention`] with respect to all of `qkv`.
pub fn fused_attention_backward(
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dqkv: &mut [f32],
    a: &Attention,
) {
    let dm = Dims::new(a);
    let (t, d, c, stride, group) = (dm.seq, dm.d, dm.width(), dm.stride(), dm.group());
    let dq_p = Ptr(dqkv.as_mut_ptr());
    (0..dm.batch * dm.kv_heads).into_par_iter().for_each(|bg| {
        let (b, g) = (bg / dm.kv_heads, bg % dm.kv_heads);
        let heads = g * group..(g + 1) * group;
        // D_i = dO_i · O_i per query head of the group, and dQ starts at zero.
        let dd: Vec<Vec<f32>> = heads
            .clone()
            .map(|h| row_dots(dout, out, &dm, b, h))
            .collect();
        for h in heads.clone() {
            for i in 0..t {
                let at = dm.qkv_at(b, h, 0, i);
                for e in 0..d {
                    // SAFETY: the group's query columns belong to this task.
                    unsafe { *dq_p.at(at + e) = 0.0 };
                }
            }
        }
        let mut p = vec![0.0f32; TILE * TILE];
        let mut ds = vec![0.0f32; TILE * TILE];
        let mut dk = vec![0.0f32; TILE * d];
        let mut dv = vec![0.0f32; TILE * d];
        for j0 in (0..t).step_by(TILE) {
            let cols = TILE.min(t - j0);
            let k = rows_of(qkv, dm.qkv_at(b, g, 1, j0), stride);
            let v = rows_of(qkv, dm.qkv_at(b, g, 2, j0), stride);
            dk.fill(0.0);
            dv.fill(0.0);
            for (hi, h) in heads.clone().enumerate() {
                let lse = &lse[(b * dm.heads + h) * t..(b * dm.heads + h + 1) * t];
                let dd = &dd[hi];
                for i0 in (j0..t).step_by(TILE) {
                    let rows = TILE.min(t - i0);
                    let q = rows_of(qkv, dm.qkv_at(b, h, 0, i0), stride);
                    let go = rows_of(dout, dm.out_at(b, h, i0), c);
                    scaled_scores(q, k, &mut p, rows, cols, d, a.scale as f32);
                    // SAFETY (every product below): the destinations are this
                    // task's buffers or its own heads' dQ rows; the sources
                    // lie in the inputs.
                    unsafe {
                        gemm_serial(
                            rows,
                            d,
                            cols,
                            1.0,
                            go,
                            transposed(v),
                            0.0,
                            block(&mut ds, TILE),
                        );
                    }
                    softmax_grad_tile(&mut p, &mut ds, (i0, rows), (j0, cols), lse, dd);
                    let pm = MatPtr::row_major(&p, TILE, false);
                    let dsm = MatPtr::row_major(&ds, TILE, false);
                    let dq = MatMut {
                        ptr: dq_p.at(dm.qkv_at(b, h, 0, i0)),
                        rs: stride as isize,
                        cs: 1,
                    };
                    unsafe {
                        gemm_serial(
                            cols,
                            rows,
                            d,
                            1.0,
                            transposed(pm),
                            go,
                            1.0,
                            block(&mut dv, d),
                        );
                        gemm_serial(
                            cols,
                            rows,
                            d,
                            a.scale as f32,
                            transposed(dsm),
                            q,
                            1.0,
                            block(&mut dk, d),
                        );
                        gemm_serial(rows, cols, d, a.scale as f32, dsm, k, 1.0, dq);
                    }
                }
            }
            for r in 0..cols {
                let (ka, va) = (dm.qkv_at(b, g, 1, j0 + r), dm.qkv_at(b, g, 2, j0 + r));
                for e in 0..d {
                    // SAFETY: key/value head g's columns belong to this task.
                    unsafe {
                        *dq_p.at(ka + e) = dk[r * d + e];
                        *dq_p.at(va + e) = dv[r * d + e];
                    }
                }
            }
        }
    });
}

/// `D_i = dO_i · O_i` for every query row `i` of head `h` in batch `b`.
fn row_dots(dout: &[f32], out: &[f32], dm: &Dims, b: usize, h: usize) -> Vec<f32> {
    let d = dm.d;
    (0..dm.seq)
        .map(|i| {
            let at = dm.out_at(b, h, i);
            dout[at..at + d]
                .iter()
                .zip(&out[at..at + d])
                .map(|(x, y)| x * y)
                .sum()
        })
        .collect()
}

/// One tile of the softmax's gradient: `p` holds the scaled scores and
/// `ds` `dO·Vᵀ` for query rows `i0..i0 + rows` and key columns
/// `j0..j0 + cols`; on return `p` holds the probabilities
/// `exp(s - lse_i)` and `ds` their gradient `p · (dO·Vᵀ - D_i)`, both zero
/// where the causal mask hides the key.
fn softmax_grad_tile(
    p: &mut [f32],
    ds: &mut [f32],
    (i0, rows): (usize, usize),
    (j0, cols): (usize, usize),
    lse: &[f32],
    dd: &[f32],
) {
    for r in 0..rows {
        let i = i0 + r;
        let valid = visible(i, j0, cols);
        let (pr, dr) = (
            &mut p[r * TILE..r * TILE + cols],
            &mut ds[r * TILE..r * TILE + cols],
        );
        for e in 0..cols {
            if e < valid {
                pr[e] = (pr[e] - lse[i]).exp();
                dr[e] = pr[e] * (dr[e] - dd[i]);
            } else {
                pr[e] = 0.0;
                dr[e] = 0.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels as k;
    use crate::init::{hash_key, normal};

    fn random(seed: &str, n: usize, scale: f32) -> Vec<f32> {
        let key = hash_key(7, seed);
        (0..n as u64).map(|i| scale * normal(key, i)).collect()
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let (mut d, mut r) = (0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            d += (x as f64 - y as f64).powi(2);
            r += (y as f64).powi(2);
        }
        (d / r).sqrt()
    }

    /// The fused kernels against the explicit scores / softmax / values
    /// chain, forward and backward, on shapes whose sequence is not a
    /// multiple of the tile (and shorter than one).
    #[test]
    fn fused_attention_equals_the_explicit_chain() {
        for &(batch, heads, seq, d) in &[(2, 3, 70, 8), (1, 2, 5, 16), (1, 1, 129, 4)] {
            let a = Attention::mha(batch, heads, seq, d, (1.0 / (d as f32).sqrt()) as f64);
            let (b, h, t, d) = (batch as usize, heads as usize, seq as usize, d as usize);
            let c = h * d;
            // Large scores test the running maximum.
            let qkv = random("qkv", b * t * 3 * c, 3.0);
            let dout = random("dout", b * t * c, 1.0);

            let mut probs = vec![0.0f32; b * h * t * t];
            let mut scores = vec![0.0f32; b * h * t * t];
            k::attention_scores(&qkv, &mut scores, &a);
            k::causal_softmax(Some(&scores), &mut probs, &a);
            let mut want = vec![0.0f32; b * t * c];
            k::attention_values(&probs, &qkv, &mut want, &a);

            let mut out = vec![f32::NAN; b * t * c];
            let mut lse = vec![f32::NAN; b * h * t];
            fused_attention(&qkv, &mut out, &mut lse, &a);
            assert!(rel_err(&out, &want) < 1e-5, "out: {}", rel_err(&out, &want));
            // lse reproduces the probabilities of each row's first key.
            for (r, &l) in lse.iter().enumerate() {
                let p0 = (scores[r * t] - l).exp();
                assert!(
                    (p0 - probs[r * t]).abs() <= 1e-5 * (1.0 + probs[r * t]),
                    "row {r}"
                );
            }

            let mut dprobs = vec![0.0f32; b * h * t * t];
            let mut want_d = vec![0.0f32; b * t * 3 * c];
            k::attention_values_backward(&dout, &probs, &qkv, &mut dprobs, &mut want_d, &a);
            let mut dscores = vec![0.0f32; b * h * t * t];
            k::causal_softmax_backward(Some(&dprobs), &probs, &mut dscores, &a);
            k::attention_scores_backward(&dscores, &qkv, &mut want_d, &a);

            let mut got_d = vec![f32::NAN; b * t * 3 * c];
            fused_attention_backward(&dout, &qkv, &out, &lse, &mut got_d, &a);
            assert!(got_d.iter().all(|x| x.is_finite()), "every element written");
            let e = rel_err(&got_d, &want_d);
            assert!(e < 1e-4, "dqkv ({b}, {h}, {t}, {d}): {e}");
        }
    }

    /// Grouped-query attention equals multi-head attention over keys and
    /// values repeated for each query head of a group, and its key/value
    /// gradients are the group's summed.
    #[test]
    fn grouped_query_attention_equals_repeated_keys_and_values() {
        let (b, h, kvh, t, d) = (2usize, 6usize, 2usize, 70usize, 8usize);
        let group = h / kvh;
        let c = h * d;
        let grouped = Attention {
            kv_heads: kvh as u64,
            ..Attention::mha(b as u64, h as u64, t as u64, d as u64, 0.35)
        };
        let full = Attention::mha(b as u64, h as u64, t as u64, d as u64, 0.35);
        let wg = (h + 2 * kvh) * d;
        let qkv = random("gqa", b * t * wg, 2.0);
        let dout = random("gqa-dout", b * t * c, 1.0);
        // Repeat each key/value head for its query heads.
        let mut rep = vec![0.0f32; b * t * 3 * c];
        for row in 0..b * t {
            let (src, dst) = (&qkv[row * wg..(row + 1) * wg], &mut rep[row * 3 * c..]);
            dst[..c].copy_from_slice(&src[..c]);
            for hh in 0..h {
                let g = hh / group;
                for e in 0..d {
                    dst[c + hh * d + e] = src[c + g * d + e];
                    dst[2 * c + hh * d + e] = src[c + (kvh + g) * d + e];
                }
            }
        }
        let (mut out_g, mut lse_g) = (vec![0.0; b * t * c], vec![0.0; b * h * t]);
        let (mut out_f, mut lse_f) = (vec![0.0; b * t * c], vec![0.0; b * h * t]);
        fused_attention(&qkv, &mut out_g, &mut lse_g, &grouped);
        fused_attention(&rep, &mut out_f, &mut lse_f, &full);
        assert_eq!(out_g, out_f);
        assert_eq!(lse_g, lse_f);
        let mut dg = vec![f32::NAN; b * t * wg];
        let mut df = vec![0.0; b * t * 3 * c];
        fused_attention_backward(&dout, &qkv, &out_g, &lse_g, &mut dg, &grouped);
        fused_attention_backward(&dout, &rep, &out_f, &lse_f, &mut df, &full);
        for row in 0..b * t {
            let (g_row, f_row) = (&dg[row * wg..(row + 1) * wg], &df[row * 3 * c..]);
            for e in 0..c {
                assert!((g_row[e] - f_row[e]).abs() < 1e-5, "dq");
            }
            for g in 0..kvh {
                for e in 0..d {
                    let (mut k, mut v) = (0.0f32, 0.0f32);
                    for hh in g * group..(g + 1) * group {
                        k += f_row[c + hh * d + e];
                        v += f_row[2 * c + hh * d + e];
                    }
                    assert!((g_row[c + g * d + e] - k).abs() < 1e-4, "dk");
                    assert!((g_row[c + (kvh + g) * d + e] - v).abs() < 1e-4, "dv");
                }
            }
        }
    }
}
