//! CPU kernels of Llama-style decoders: RMSNorm, rotary position embedding
//! and SwiGLU, f32. Formulas: `docs/ops.md`.
//!
//! As in [`super::kernels`], an input given as `None` is read through the
//! output it shares bytes with; each kernel reads a row of such an input
//! before it writes the same row. RMSNorm's parameter gradient sums rows
//! as LayerNorm's does ([`backward_rows`]), so results do not depend on the
//! number of threads.

use rayon::prelude::*;

use super::kernels::backward_rows;
use crate::kernel::Rope;

/// `y = x · rstd · gamma` with `rstd = 1 / √(mean(x²) + eps)` per row.
pub fn rmsnorm(x: &[f32], gamma: &[f32], y: &mut [f32], rstd: &mut [f32], cols: usize, eps: f32) {
    y.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .zip(rstd.par_iter_mut())
        .for_each(|((y, x), rs)| {
            let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / cols as f64;
            let r = (1.0 / (ms + eps as f64).sqrt()) as f32;
            *rs = r;
            for j in 0..cols {
                y[j] = x[j] * r * gamma[j];
            }
        });
}

/// RMSNorm backward; `dy` may be read in place from `dx`.
/// `dx = rstd · (g∘dy − x · rstd² · mean(g∘dy∘x))`, `dgamma = Σ_rows dy∘x·rstd`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dy: Option<&[f32]>,
    x: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    cols: usize,
) {
    let sums = backward_rows(dy, dx, cols, cols, |r, dyrow, dxr, part| {
        let xr = &x[r * cols..(r + 1) * cols];
        let rs = rstd[r];
        let mut s = 0.0f32;
        for j in 0..cols {
            s += dyrow[j] * gamma[j] * xr[j];
            part[j] += dyrow[j] * xr[j] * rs;
        }
        let s = s / cols as f32 * rs * rs;
        for j in 0..cols {
            dxr[j] = rs * (dyrow[j] * gamma[j] - xr[j] * s);
        }
    });
    dgamma.copy_from_slice(&sums);
}

/// The frequency of pair `i`: `theta^(−2i/D)`, in f64 (as the CUDA kernel
/// computes it) so both executors round the same way.
fn inv_freq(i: usize, head_dim: usize, theta: f64) -> f64 {
    theta.powf(-2.0 * i as f64 / head_dim as f64)
}

/// `cos` and `sin` of the angle `pos · freq`, computed in f64.
fn rope_angle(pos: usize, freq: f64) -> (f32, f32) {
    let (s, c) = (pos as f64 * freq).sin_cos();
    (c as f32, s as f32)
}

/// Rotates the query and key heads of each `qkv` row (pairs `i`, `i + D/2`)
/// by their position's angles (the opposite angles when `r.inverse`); the
/// value part is copied. `x == None`: in place.
pub fn rope(x: Option<&[f32]>, out: &mut [f32], r: &Rope) {
    let (t, d) = (r.seq as usize, r.head_dim as usize);
    let width = (r.heads + 2 * r.kv_heads) as usize * d;
    let rotated = (r.heads + r.kv_heads) as usize * d;
    let half = d / 2;
    let sign = if r.inverse { -1.0f32 } else { 1.0 };
    let freqs: Vec<f64> = (0..half).map(|i| inv_freq(i, d, r.theta)).collect();
    out.par_chunks_mut(width).enumerate().for_each(|(row, o)| {
        if let Some(x) = x {
            o.copy_from_slice(&x[row * width..(row + 1) * width]);
        }
        let pos = row % t;
        for (i, &freq) in freqs.iter().enumerate() {
            let (c, s) = rope_angle(pos, freq);
            let s = sign * s;
            for head in o[..rotated].chunks_mut(d) {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    });
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `h = silu(gate) · up`, each input row holding `hidden` gate elements,
/// then `hidden` up elements.
pub fn swiglu(gu: &[f32], h: &mut [f32], hidden: usize) {
    h.par_chunks_mut(hidden)
        .zip(gu.par_chunks(2 * hidden))
        .for_each(|(h, gu)| {
            let (g, u) = gu.split_at(hidden);
            for j in 0..hidden {
                h[j] = silu(g[j]) * u[j];
            }
        });
}

/// `dgate = dh · up · silu'(gate)`, `dup = dh · silu(gate)`.
pub fn swiglu_backward(dh: &[f32], gu: &[f32], dgu: &mut [f32], hidden: usize) {
    dgu.par_chunks_mut(2 * hidden)
        .zip(gu.par_chunks(2 * hidden).zip(dh.par_chunks(hidden)))
        .for_each(|(d, (gu, dh))| {
            let (g, u) = gu.split_at(hidden);
            let (dg, du) = d.split_at_mut(hidden);
            for j in 0..hidden {
                let sig = 1.0 / (1.0 + (-g[j]).exp());
                dg[j] = dh[j] * u[j] * sig * (1.0 + g[j] * (1.0 - sig));
                du[j] = dh[j] * g[j] * sig;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{hash_key, normal};

    fn random(seed: &str, n: usize) -> Vec<f32> {
        let key = hash_key(3, seed);
        (0..n as u64).map(|i| normal(key, i)).collect()
    }

    /// Central differences of `loss = Σ w∘f(x)` against the analytic
    /// gradients of RMSNorm and SwiGLU.
    #[test]
    fn gradients_match_finite_differences() {
        let (rows, cols) = (3, 8);
        let x = random("x", rows * cols);
        let g = random("g", cols);
        let w = random("w", rows * cols);
        let loss = |x: &[f32], g: &[f32]| {
            let mut y = vec![0.0; rows * cols];
            let mut rs = vec![0.0; rows];
            rmsnorm(x, g, &mut y, &mut rs, cols, 1e-6);
            y.iter().zip(&w).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let mut y = vec![0.0; rows * cols];
        let mut rs = vec![0.0; rows];
        rmsnorm(&x, &g, &mut y, &mut rs, cols, 1e-6);
        let (mut dx, mut dg) = (vec![0.0; rows * cols], vec![0.0; cols]);
        rmsnorm_backward(Some(&w), &x, &rs, &g, &mut dx, &mut dg, cols);
        let h = 1e-2f32;
        for i in 0..rows * cols {
            let (mut p, mut m) = (x.clone(), x.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p, &g) - loss(&m, &g)) / (2.0 * h as f64);
            assert!(
                (fd - dx[i] as f64).abs() < 2e-3,
                "dx[{i}]: {fd} vs {}",
                dx[i]
            );
        }
        for j in 0..cols {
            let (mut p, mut m) = (g.clone(), g.clone());
            p[j] += h;
            m[j] -= h;
            let fd = (loss(&x, &p) - loss(&x, &m)) / (2.0 * h as f64);
            assert!((fd - dg[j] as f64).abs() < 2e-3, "dgamma[{j}]");
        }

        let hidden = 5;
        let gu = random("gu", rows * 2 * hidden);
        let wh = random("wh", rows * hidden);
        let sw = |gu: &[f32]| {
            let mut out = vec![0.0; rows * hidden];
            swiglu(gu, &mut out, hidden);
            out.iter()
                .zip(&wh)
                .map(|(a, b)| (a * b) as f64)
                .sum::<f64>()
        };
        let mut dgu = vec![0.0; rows * 2 * hidden];
        swiglu_backward(&wh, &gu, &mut dgu, hidden);
        for i in 0..gu.len() {
            let (mut p, mut m) = (gu.clone(), gu.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (sw(&p) - sw(&m)) / (2.0 * h as f64);
            assert!(
                (fd - dgu[i] as f64).abs() < 2e-3,
                "dgu[{i}]: {fd} vs {}",
                dgu[i]
            );
        }
    }

    /// The inverse rotation undoes the rotation, values pass unchanged,
    /// position 0 is the identity, and norms of each pair are kept.
    #[test]
    fn rope_inverse_undoes_rope() {
        let r = Rope {
            batch: 2,
            seq: 5,
            heads: 4,
            kv_heads: 2,
            head_dim: 6,
            theta: 10000.0,
            inverse: false,
        };
        let x = random("qkv", r.elements() as usize);
        let mut y = vec![0.0; x.len()];
        rope(Some(&x), &mut y, &r);
        let width = 8 * 6;
        assert_eq!(&y[..width], &x[..width], "position 0 is not rotated");
        assert_eq!(
            y[width + 36..2 * width],
            x[width + 36..2 * width],
            "values copied"
        );
        assert_ne!(y[width..width + 36], x[width..width + 36]);
        let mut back = y.clone();
        rope(None, &mut back, &Rope { inverse: true, ..r });
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
