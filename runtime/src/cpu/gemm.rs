//! Matrix products on the CPU: `matrixmultiply`'s packed SIMD kernels over
//! arbitrary strides, split over rayon threads along the longer side of the
//! result. Each element of the result is summed over `k` by one call, in
//! the same order whatever the split, so results do not depend on the
//! number of threads.

use rayon::prelude::*;

/// A strided matrix: element `(i, j)` is at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy, Debug)]
pub struct MatPtr {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

/// A strided matrix written by a product.
#[derive(Clone, Copy, Debug)]
pub struct MatMut {
    pub ptr: *mut f32,
    pub rs: isize,
    pub cs: isize,
}

// SAFETY: these are plain addresses; every function that dereferences them
// is `unsafe` and documents what the caller guarantees.
unsafe impl Send for MatPtr {}
unsafe impl Sync for MatPtr {}
unsafe impl Send for MatMut {}
unsafe impl Sync for MatMut {}

impl MatPtr {
    /// A row-major `rows × cols` matrix (`transposed`: its transpose, i.e.
    /// the matrix stored row-major as `cols × rows`).
    pub fn row_major(s: &[f32], cols: usize, transposed: bool) -> MatPtr {
        let (rs, cs) = if transposed {
            (1, cols as isize)
        } else {
            (cols as isize, 1)
        };
        MatPtr {
            ptr: s.as_ptr(),
            rs,
            cs,
        }
    }
    fn offset(self, rows: usize, cols: usize) -> MatPtr {
        // SAFETY: callers stay inside the matrix they were given.
        let ptr = unsafe {
            self.ptr
                .offset(rows as isize * self.rs + cols as isize * self.cs)
        };
        MatPtr { ptr, ..self }
    }
}

impl MatMut {
    pub fn row_major(s: &mut [f32], cols: usize) -> MatMut {
        MatMut {
            ptr: s.as_mut_ptr(),
            rs: cols as isize,
            cs: 1,
        }
    }
    fn offset(self, rows: usize, cols: usize) -> MatMut {
        // SAFETY: callers stay inside the matrix they were given.
        let ptr = unsafe {
            self.ptr
                .offset(rows as isize * self.rs + cols as isize * self.cs)
        };
        MatMut { ptr, ..self }
    }
}

/// Below this many multiply-adds a product runs on one thread.
const PARALLEL_MIN_FLOPS: usize = 1 << 20;

/// `c = alpha · a · b + beta · c` for `a: m × k`, `b: k × n`, `c: m × n`,
/// on one thread. With `beta == 0`, `c` is not read.
///
/// # Safety
/// Every element the strides reach must be valid; `c` must not overlap `a`
/// or `b` and nothing else may access `c` meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_serial(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: MatPtr,
    b: MatPtr,
    beta: f32,
    c: MatMut,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        matrixmultiply::sgemm(
            m, k, n, alpha, a.ptr, a.rs, a.cs, b.ptr, b.rs, b.cs, beta, c.ptr, c.rs, c.cs,
        );
    }
}

/// [`gemm_serial`] split over the rayon pool along the longer side of `c`.
///
/// # Safety
/// As for [`gemm_serial`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: MatPtr,
    b: MatPtr,
    beta: f32,
    c: MatMut,
) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || m.saturating_mul(n).saturating_mul(k.max(1)) < PARALLEL_MIN_FLOPS {
        // SAFETY: forwarded.
        unsafe { gemm_serial(m, k, n, alpha, a, b, beta, c) };
        return;
    }
    let split_rows = m >= n;
    let len = if split_rows { m } else { n };
    let chunk = len.div_ceil(threads * 2).max(16).div_ceil(8) * 8;
    (0..len.div_ceil(chunk)).into_par_iter().for_each(|ci| {
        let lo = ci * chunk;
        let hi = (lo + chunk).min(len);
        // SAFETY: the chunks write disjoint rows (columns) of `c`.
        unsafe {
            if split_rows {
                gemm_serial(
                    hi - lo,
                    k,
                    n,
                    alpha,
                    a.offset(lo, 0),
                    b,
                    beta,
                    c.offset(lo, 0),
                );
            } else {
                gemm_serial(
                    m,
                    k,
                    hi - lo,
                    alpha,
                    a,
                    b.offset(0, lo),
                    beta,
                    c.offset(0, lo),
                );
            }
        }
    });
}

/// `c (m × n) = op(a) · op(b)` for row-major slices: `a` is `m × k` (stored
/// `k × m` if `ta`), `b` is `k × n` (stored `n × k` if `tb`). With
/// `accumulate`, adds to `c`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    accumulate: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let ma = MatPtr::row_major(a, if ta { m } else { k }, ta);
    let mb = MatPtr::row_major(b, if tb { k } else { n }, tb);
    let mc = MatMut::row_major(c, n);
    // SAFETY: the slices hold the matrices (checked above); `c` is a unique
    // borrow so it overlaps neither input.
    unsafe { gemm(m, k, n, 1.0, ma, mb, if accumulate { 1.0 } else { 0.0 }, mc) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let x = if ta { a[p * m + i] } else { a[i * k + p] };
                    let y = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += x as f64 * y as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    #[test]
    fn every_transpose_matches_the_naive_product() {
        for &(m, k, n) in &[(3, 5, 4), (130, 70, 90), (17, 300, 400)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0)
                .collect();
            for ta in [false, true] {
                for tb in [false, true] {
                    let mut c = vec![f32::NAN; m * n];
                    matmul(&a, &b, &mut c, m, k, n, ta, tb, false);
                    let want = naive(&a, &b, m, k, n, ta, tb);
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
                    }
                    matmul(&a, &b, &mut c, m, k, n, ta, tb, true);
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - 2.0 * y).abs() <= 2e-4 * (1.0 + y.abs()));
                    }
                }
            }
        }
    }
}
