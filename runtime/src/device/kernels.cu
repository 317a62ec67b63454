// memplan's CUDA kernels, compiled at run time with NVRTC.
//
// Every float operand is a `Buf`: f32, or bf16 when its `bf` flag is set.
// Kernels read operands widened to f32, compute in f32 and round each value
// they store to bf16 (nearest, ties to even), as the CPU executor does.
// Outputs accumulated by atomics (the loss, the squared norm) are f32 only;
// the lowering refuses anything else.
//
// Each kernel is correct when an output is the same buffer as the input
// named in its comment ("in place: y = x"): every thread reads the elements
// it writes before writing them, and row kernels finish reading a row
// (block reductions end in __syncthreads) before writing it.
// `device/emulate.rs` mirrors every kernel on the host; keep them in step.
// Formulas: docs/ops.md.

typedef long long i64;

// Every kernel declares the most threads per block it is launched with
// (`__launch_bounds__`): the compiler then keeps registers within what a
// block that size can get, and `device::launch_bound` reads the bound back
// so the lowering can never launch a larger block. 1024 unless noted.

#define GELU_C 0.7978845608028654f
// -infinity without math headers (NVRTC compiles without them).
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float sh[33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < nw ? sh[lane] : 0.f;
        x = warp_sum(x);
        if (lane == 0) sh[32] = x;
    }
    __syncthreads();
    float r = sh[32];
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float sh[33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < nw ? sh[lane] : NEG_INF;
        x = warp_max(x);
        if (lane == 0) sh[32] = x;
    }
    __syncthreads();
    float r = sh[32];
    __syncthreads();
    return r;
}

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// bf16 bits of x: rounded to nearest, ties to even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// A float operand (device pointer and dtype), passed by value: 16 bytes,
// as the host's `Buf` argument. `b[i]` reads element i as f32, `b.set(i, v)`
// stores v rounded to the operand's dtype, `b + k` is element k on.
struct Buf {
    void* p;
    int bf;
    __device__ __forceinline__ float operator[](i64 i) const {
        return bf ? __uint_as_float((unsigned)((const unsigned short*)p)[i] << 16) : ((const float*)p)[i];
    }
    __device__ __forceinline__ void set(i64 i, float v) const {
        if (bf) ((unsigned short*)p)[i] = bf16_bits(v);
        else ((float*)p)[i] = v;
    }
    __device__ __forceinline__ Buf operator+(i64 k) const {
        Buf b = {(char*)p + k * (bf ? 2 : 4), bf};
        return b;
    }
    __device__ __forceinline__ bool null() const { return p == 0; }
};

// The largest of x[0..n) and the sum of exp(x[j] - largest), over the
// block (blockDim.x a multiple of 32); every thread gets both. The row
// part of a softmax or a log-sum-exp.
__device__ void block_max_sum(Buf x, i64 n, float* mx, float* sum) {
    float m = NEG_INF;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m);
    float s = 0.f;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += expf(x[j] - m);
    *mx = m;
    *sum = block_sum(s);
}

// Records the first failing instruction (code = its index + 1).
__device__ __forceinline__ void fail(int* err, int code) { atomicCAS(err, 0, code); }

// y[i, j] = b[j]  (y: m x n)
extern "C" __global__ void __launch_bounds__(1024) fill_rows(Buf y, Buf b, i64 m, i64 n) {
    GRID_STRIDE(i, m * n) y.set(i, b[i % n]);
}

// out[j] = sum_i a[i, j]  (a: m x n), rows in order.
extern "C" __global__ void __launch_bounds__(1024) col_sum(Buf a, Buf out, i64 m, i64 n) {
    GRID_STRIDE(j, n) {
        float s = 0.f;
        for (i64 i = 0; i < m; ++i) s += a[i * n + j];
        out.set(j, s);
    }
}

// In place: c = a or c = b.
extern "C" __global__ void __launch_bounds__(1024) add_f32(Buf a, Buf b, Buf c, i64 n) {
    GRID_STRIDE(i, n) c.set(i, a[i] + b[i]);
}

// y = x in y's dtype. Never in place (a cast between dtypes changes sizes).
extern "C" __global__ void __launch_bounds__(1024) cast(Buf x, Buf y, i64 n) {
    GRID_STRIDE(i, n) y.set(i, x[i]);
}

__device__ __forceinline__ float gelu_f(float x) {
    float u = GELU_C * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(u));
}

__device__ __forceinline__ float gelu_g(float x) {
    float u = GELU_C * (x + 0.044715f * x * x * x);
    float t = tanhf(u);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_C * (1.f + 3.f * 0.044715f * x * x);
}

// In place: y = x.
extern "C" __global__ void __launch_bounds__(1024) gelu_fwd(Buf x, Buf y, i64 n) {
    GRID_STRIDE(i, n) y.set(i, gelu_f(x[i]));
}

// In place: dx = dy.
extern "C" __global__ void __launch_bounds__(1024) gelu_bwd(Buf dy, Buf x, Buf dx, i64 n) {
    GRID_STRIDE(i, n) dx.set(i, dy[i] * gelu_g(x[i]));
}

// In place: y = x.
extern "C" __global__ void __launch_bounds__(1024) relu_fwd(Buf x, Buf y, i64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        y.set(i, v > 0.f ? v : 0.f);
    }
}

// In place: dx = dy.
extern "C" __global__ void __launch_bounds__(1024) relu_bwd(Buf dy, Buf x, Buf dx, i64 n) {
    GRID_STRIDE(i, n) dx.set(i, x[i] > 0.f ? dy[i] : 0.f);
}

// One block per row.
extern "C" __global__ void __launch_bounds__(1024) layernorm_fwd(Buf x, Buf g, Buf b, Buf y, Buf mean, Buf rstd, i64 rows, i64 cols,
                                         float eps) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    Buf xr = x + r * cols;
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
    float m = block_sum(s) / (float)cols;
    float v = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = xr[j] - m;
        v += d * d;
    }
    v = block_sum(v) / (float)cols;
    float rs = rsqrtf(v + eps);
    if (threadIdx.x == 0) {
        mean.set(r, m);
        rstd.set(r, rs);
    }
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) y.set(r * cols + j, (xr[j] - m) * rs * g[j] + b[j]);
}

// dgamma[j] = sum_r dy[r,j] xhat[r,j], dbeta[j] = sum_r dy[r,j]: one thread per column.
extern "C" __global__ void __launch_bounds__(1024) layernorm_bwd_params(Buf dy, Buf x, Buf mean, Buf rstd, Buf dg, Buf db, i64 rows,
                                                i64 cols) {
    GRID_STRIDE(j, cols) {
        float sg = 0.f, sb = 0.f;
        for (i64 r = 0; r < rows; ++r) {
            float d = dy[r * cols + j];
            sg += d * (x[r * cols + j] - mean[r]) * rstd[r];
            sb += d;
        }
        dg.set(j, sg);
        db.set(j, sb);
    }
}

// One block per row. In place: dx = dy (runs after layernorm_bwd_params).
extern "C" __global__ void __launch_bounds__(1024) layernorm_bwd_data(Buf dy, Buf x, Buf mean, Buf rstd, Buf g, Buf dx, i64 rows,
                                              i64 cols) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const float m = mean[r], rs = rstd[r];
    float s1 = 0.f, s2 = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = dy[r * cols + j] * g[j];
        s1 += d;
        s2 += d * (x[r * cols + j] - m) * rs;
    }
    s1 = block_sum(s1) / (float)cols;
    s2 = block_sum(s2) / (float)cols;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float xhat = (x[r * cols + j] - m) * rs;
        dx.set(r * cols + j, rs * (dy[r * cols + j] * g[j] - s1 - xhat * s2));
    }
}

// ---- Llama-style decoder kernels -------------------------------------------

// One block per row: y = x * rstd * g, rstd = 1 / sqrt(mean(x^2) + eps).
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_fwd(Buf x, Buf g, Buf y, Buf rstd, i64 rows, i64 cols, float eps) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    Buf xr = x + r * cols;
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j] * xr[j];
    float rs = rsqrtf(block_sum(s) / (float)cols + eps);
    if (threadIdx.x == 0) rstd.set(r, rs);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) y.set(r * cols + j, xr[j] * rs * g[j]);
}

// dgamma[j] = sum_r dy[r,j] x[r,j] rstd[r]: one thread per column.
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_bwd_params(Buf dy, Buf x, Buf rstd, Buf dg, i64 rows, i64 cols) {
    GRID_STRIDE(j, cols) {
        float sg = 0.f;
        for (i64 r = 0; r < rows; ++r) sg += dy[r * cols + j] * x[r * cols + j] * rstd[r];
        dg.set(j, sg);
    }
}

// One block per row. In place: dx = dy (runs after rmsnorm_bwd_params).
// dx = rstd * (g dy - x rstd^2 mean(g dy x)).
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_bwd_data(Buf dy, Buf x, Buf rstd, Buf g, Buf dx, i64 rows, i64 cols) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const float rs = rstd[r];
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += dy[r * cols + j] * g[j] * x[r * cols + j];
    s = block_sum(s) / (float)cols * rs * rs;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x)
        dx.set(r * cols + j, rs * (dy[r * cols + j] * g[j] - x[r * cols + j] * s));
}

// Rotary embedding of the query and key heads of qkv rows ([rows, (H + 2 Hkv) D]):
// pair (i, i + D/2) of each head turns by sign * pos * theta^(-2i/D), pos = row % seq;
// the angle is computed in double. One thread per pair, then the value part
// is copied when y is not x. In place: y = x.
extern "C" __global__ void __launch_bounds__(1024) rope_fwd(Buf x, Buf y, i64 rows, i64 seq, i64 rot_heads, i64 width, i64 hd,
                                    double theta, float sign) {
    i64 half = hd / 2, pairs = rot_heads * half;
    GRID_STRIDE(k, rows * pairs) {
        i64 r = k / pairs, p = k % pairs, head = p / half, i = p % half;
        double ang = (double)(r % seq) * pow(theta, -2.0 * (double)i / (double)hd);
        double sn, cs;
        sincos(ang, &sn, &cs);
        float c = (float)cs, s = sign * (float)sn;
        i64 at = r * width + head * hd + i;
        float a = x[at], b = x[at + half];
        y.set(at, a * c - b * s);
        y.set(at + half, b * c + a * s);
    }
    if (x.p == y.p) return;
    i64 vstart = rot_heads * hd, vcols = width - vstart;
    GRID_STRIDE(k, rows * vcols) {
        i64 at = (k / vcols) * width + vstart + k % vcols;
        y.set(at, x[at]);
    }
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// h[r, j] = silu(gu[r, j]) * gu[r, F + j]
extern "C" __global__ void __launch_bounds__(1024) swiglu_fwd(Buf gu, Buf h, i64 rows, i64 hidden) {
    GRID_STRIDE(k, rows * hidden) {
        i64 r = k / hidden, j = k % hidden;
        float g = gu[r * 2 * hidden + j], u = gu[r * 2 * hidden + hidden + j];
        h.set(k, g * sigmoidf(g) * u);
    }
}

// dgate = dh * up * silu'(gate), dup = dh * silu(gate)
extern "C" __global__ void __launch_bounds__(1024) swiglu_bwd(Buf dh, Buf gu, Buf dgu, i64 rows, i64 hidden) {
    GRID_STRIDE(k, rows * hidden) {
        i64 r = k / hidden, j = k % hidden, at = r * 2 * hidden + j;
        float g = gu[at], u = gu[at + hidden], sg = sigmoidf(g), d = dh[k];
        dgu.set(at, d * u * sg * (1.f + g * (1.f - sg)));
        dgu.set(at + hidden, d * g * sg);
    }
}

// One block per row of length t (row r is row r % t of its matrix).
// In place: p = s.
extern "C" __global__ void __launch_bounds__(1024) causal_softmax_fwd(Buf s, Buf p, i64 rows, i64 t) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    i64 i = r % t;
    Buf sr = s + r * t;
    float mx, sum;
    block_max_sum(sr, i + 1, &mx, &sum);
    float inv = 1.f / sum;
    for (i64 j = threadIdx.x; j < t; j += blockDim.x) p.set(r * t + j, j <= i ? expf(sr[j] - mx) * inv : 0.f);
}

// Fused attention lowered to cuBLAS products (`AttentionLowering::Gemm`):
// the scores of a block of query rows live in a scratch `s` of heads ×
// rmax rows of `ld` floats, row (h, r) being query r0 + r of head h against
// keys 0 .. r1 - 1, already scaled. One block per row (rows = heads ×
// rcount). In place: P = softmax over the causally visible keys (zeros
// after them) over S; lse[h * t + r0 + r] = the row's log-sum-exp.
extern "C" __global__ void __launch_bounds__(1024) attn_rows_softmax(Buf s, Buf lse, i64 rows, i64 rcount, i64 rmax,
                                                                     i64 r0, i64 r1, i64 ld, i64 t) {
    i64 row = blockIdx.x;
    if (row >= rows) return;
    i64 h = row / rcount, r = row % rcount, lim = r0 + r + 1;
    Buf sr = s + (h * rmax + r) * ld;
    float mx, sum;
    block_max_sum(sr, lim, &mx, &sum);
    float inv = 1.f / sum;
    for (i64 j = threadIdx.x; j < r1; j += blockDim.x) sr.set(j, j < lim ? expf(sr[j] - mx) * inv : 0.f);
    if (threadIdx.x == 0) lse.set(h * t + r0 + r, mx + logf(sum));
}

// attn_rows_softmax's backward over the same rows: P = exp(S - lse) (zero
// after the causal limit) over S, and dS = P * (dP - D) over dP, with
// D = dsum[h * t + r0 + r] the row's sum of dO * O. One block per row.
extern "C" __global__ void __launch_bounds__(1024) attn_rows_softmax_bwd(Buf s, Buf dp, Buf lse, Buf dsum, i64 rows,
                                                                         i64 rcount, i64 rmax, i64 r0, i64 r1, i64 ld,
                                                                         i64 t) {
    i64 row = blockIdx.x;
    if (row >= rows) return;
    i64 h = row / rcount, r = row % rcount, lim = r0 + r + 1;
    Buf sr = s + (h * rmax + r) * ld, dr = dp + (h * rmax + r) * ld;
    float l = lse[h * t + r0 + r], d = dsum[h * t + r0 + r];
    for (i64 j = threadIdx.x; j < r1; j += blockDim.x) {
        float pj = j < lim ? expf(sr[j] - l) : 0.f;
        sr.set(j, pj);
        dr.set(j, pj * (dr[j] - d));
    }
}

// dsum[(b * heads + h) * seq + t] = sum over head h's hd columns of row
// (b, t) of dout * out, both [B, T, heads * hd].
extern "C" __global__ void __launch_bounds__(1024) attn_row_dot(Buf dout, Buf out, Buf dsum, i64 batch, i64 seq,
                                                                i64 heads, i64 hd) {
    GRID_STRIDE(i, batch * seq * heads) {
        i64 h = i % heads, bt = i / heads, b = bt / seq, t = bt % seq;
        float acc = 0.f;
        for (i64 d = 0; d < hd; ++d) acc += dout[i * hd + d] * out[i * hd + d];
        dsum.set((b * heads + h) * seq + t, acc);
    }
}

// One block per row. In place: ds = dp.
extern "C" __global__ void __launch_bounds__(1024) causal_softmax_bwd(Buf dp, Buf p, Buf ds, i64 rows, i64 t) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    float dot = 0.f;
    for (i64 j = threadIdx.x; j < t; j += blockDim.x) dot += dp[r * t + j] * p[r * t + j];
    dot = block_sum(dot);
    for (i64 j = threadIdx.x; j < t; j += blockDim.x) ds.set(r * t + j, p[r * t + j] * (dp[r * t + j] - dot));
}

// Zero above the diagonal of `mats` t x t matrices.
extern "C" __global__ void __launch_bounds__(1024) zero_upper(Buf s, i64 mats, i64 t) {
    GRID_STRIDE(k, mats * t * t) {
        i64 i = (k / t) % t, j = k % t;
        if (j > i) s.set(k, 0.f);
    }
}

// Zero the query and key parts (first 2c columns) of `rows` rows of 3c.
extern "C" __global__ void __launch_bounds__(1024) zero_qk(Buf dqkv, i64 rows, i64 c) {
    GRID_STRIDE(k, rows * 2 * c) {
        i64 r = k / (2 * c), j = k % (2 * c);
        dqkv.set(r * 3 * c + j, 0.f);
    }
}

// One block per row; loss (f32) must be zero beforehand.
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_fwd(Buf logits, const int* tgt, Buf loss, i64 rows, i64 classes,
                                             float divisor, int* err, int code) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    Buf x = logits + r * classes;
    float mx, s;
    block_max_sum(x, classes, &mx, &s);
    int t = tgt[r];
    if (threadIdx.x == 0) {
        if (t < 0 || t >= classes) fail(err, code);
        else atomicAdd((float*)loss.p, (mx + logf(s) - x[t]) / divisor);
    }
}

// One block per row. In place: d = logits.
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_bwd(Buf logits, const int* tgt, Buf d, i64 rows, i64 classes, float scale,
                                             int* err, int code) {
    i64 r = blockIdx.x;
    if (r >= rows) return;
    Buf x = logits + r * classes;
    float mx, s;
    block_max_sum(x, classes, &mx, &s);
    int t = tgt[r];
    if (t < 0 || t >= classes) {
        if (threadIdx.x == 0) fail(err, code);
        t = -1;
    }
    float k = scale / s;
    for (i64 j = threadIdx.x; j < classes; j += blockDim.x)
        d.set(r * classes + j, expf(x[j] - mx) * k - (j == t ? scale : 0.f));
}

// x[r, :] = wte[tok[r], :] + wpe[r % seq, :]  (wpe may be null: no positions)
extern "C" __global__ void __launch_bounds__(1024) embedding_fwd(const int* tok, Buf wte, Buf wpe, Buf x, i64 bt, i64 seq, i64 width,
                                         i64 vocab, int* err, int code) {
    GRID_STRIDE(i, bt * width) {
        i64 r = i / width, c = i % width;
        int t = tok[r];
        if (t < 0 || t >= vocab) {
            fail(err, code);
            x.set(i, 0.f);
        } else {
            x.set(i, wte[(i64)t * width + c] + (wpe.null() ? 0.f : wpe[(r % seq) * width + c]));
        }
    }
}

// The token-embedding gradient without float atomics, so a bf16 gradient
// is rounded once per element: the positions of each token are bucketed
// (a counting sort over `vocab` buckets in scratch memory), then one block
// per vocabulary row sums its positions' rows in f32.
//
// 1. count[t + 1] += 1 for every valid token t (count zeroed beforehand,
//    vocab + 1 entries).
extern "C" __global__ void __launch_bounds__(1024) embedding_count(const int* tok, int* count, i64 bt, i64 vocab, int* err, int code) {
    GRID_STRIDE(r, bt) {
        int t = tok[r];
        if (t < 0 || t >= vocab) fail(err, code);
        else atomicAdd(&count[t + 1], 1);
    }
}

// 2. Inclusive prefix sum of n ints in place, by one block: each thread
//    sums a contiguous chunk, the block scans the chunk sums, and each
//    thread rewrites its chunk. Afterwards count[t] is the first slot of
//    token t and count[t + 1] one past its last.
extern "C" __global__ void __launch_bounds__(1024) scan_counts(int* count, i64 n) {
    __shared__ int sums[1024];
    i64 chunk = (n + blockDim.x - 1) / blockDim.x;
    i64 lo = threadIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    int s = 0;
    for (i64 i = lo; i < hi; ++i) s += count[i];
    sums[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int k = 1; k < (int)blockDim.x; ++k) sums[k] += sums[k - 1];
    __syncthreads();
    int run = threadIdx.x == 0 ? 0 : sums[threadIdx.x - 1];
    for (i64 i = lo; i < hi; ++i) {
        run += count[i];
        count[i] = run;
    }
}

// 3. order[start[t] + k] = r for the k-th position r of token t to arrive
//    (fill zeroed beforehand, vocab entries). Positions of one token land
//    in any order, so the f32 sums below may differ in their last bits
//    between runs, as float atomics would.
extern "C" __global__ void __launch_bounds__(1024) embedding_place(const int* tok, const int* start, int* fill, int* order, i64 bt,
                                           i64 vocab) {
    GRID_STRIDE(r, bt) {
        int t = tok[r];
        if (t >= 0 && t < vocab) order[start[t] + atomicAdd(&fill[t], 1)] = (int)r;
    }
}

// 4. One block per vocabulary row v: dwte[v, :] = init[v, :] (or 0 when
//    init is null) + the sum of dx's rows at v's positions. In place:
//    dwte = init.
extern "C" __global__ void __launch_bounds__(1024) embedding_bwd_rows(Buf dx, const int* start, const int* order, Buf init, Buf dwte,
                                              i64 vocab, i64 width) {
    i64 v = blockIdx.x;
    if (v >= vocab) return;
    int lo = start[v], hi = start[v + 1];
    for (i64 c = threadIdx.x; c < width; c += blockDim.x) {
        float s = init.null() ? 0.f : init[v * width + c];
        for (int k = lo; k < hi; ++k) s += dx[(i64)order[k] * width + c];
        dwte.set(v * width + c, s);
    }
}

// dwpe[t, c] = sum_b dx[b, t, c]
extern "C" __global__ void __launch_bounds__(1024) embedding_bwd_positions(Buf dx, Buf dwpe, i64 batch, i64 seq, i64 width) {
    GRID_STRIDE(i, seq * width) {
        float s = 0.f;
        for (i64 b = 0; b < batch; ++b) s += dx[b * seq * width + i];
        dwpe.set(i, s);
    }
}

// out (f32) += sum of squares (out zeroed beforehand).
extern "C" __global__ void __launch_bounds__(1024) sum_squares(Buf x, Buf out, i64 n) {
    float s = 0.f;
    GRID_STRIDE(i, n) {
        float v = x[i];
        s += v * v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) atomicAdd((float*)out.p, s);
}

// In place on one f32.
extern "C" __global__ void __launch_bounds__(1024) sqrt_inplace(Buf x) { x.set(0, sqrtf(x[0])); }

// PyTorch's single-tensor Adam/AdamW at step `step`; `norm` (nullable)
// clips by the global norm; `denom` (nullable) receives the denominator.
extern "C" __global__ void __launch_bounds__(1024) adam_step(Buf g, Buf norm, Buf w, Buf m, Buf v, Buf denom, i64 n, float lr, float b1,
                                     float b2, float eps, float wd, int decoupled, i64 step, float max_norm,
                                     int norm_squared) {
    float coef = 1.f;
    if (!norm.null()) {
        float nn = norm[0];
        if (norm_squared) nn = sqrtf(fmaxf(nn, 0.f));
        coef = fminf(max_norm / (nn + 1e-6f), 1.f);
    }
    float bc1 = 1.f - powf(b1, (float)step);
    float bc2_sqrt = sqrtf(1.f - powf(b2, (float)step));
    float step_size = lr / bc1;
    float decay = 1.f - lr * wd;
    GRID_STRIDE(i, n) {
        float gi = g[i] * coef;
        float wi = w[i];
        if (decoupled) wi *= decay;
        else if (wd != 0.f) gi += wd * wi;
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        float d = sqrtf(vi) / bc2_sqrt + eps;
        w.set(i, wi - step_size * mi / d);
        m.set(i, mi);
        v.set(i, vi);
        if (!denom.null()) denom.set(i, d);
    }
}

// ---- Fused causal attention (flash-style) -------------------------------
// qkv is [B, T, (H + 2 Hkv) D]: the query of head h at column hD, the key and
// value of key/value head g at C + gD and C + Hkv D + gD (C = H D); query
// head h reads key/value head h / (H / Hkv). out is [B, T, C]; lse is
// [B, H, T]. Head dimension D <= FA_DMAX.
// A block is FA_WARPS warps; each warp owns FA_RPW rows (query rows in the
// forward and dQ kernels, key rows in the dK/dV kernel) and keeps them in
// registers, lane l holding dimensions l, l + 32, l + 64, l + 96. The other
// side is staged through shared memory 32 rows at a time, lane j taking row
// j of the tile: a score is one lane's dot product of a register row
// (broadcast by shuffles) with its shared row, and a weighted sum of rows
// is 32 shuffles of the weights against the shared tile. Tiles are
// 32-aligned and blocks 16-aligned, so every key tile the forward pass
// visits holds a key at or before each of its query rows.
#define FA_DMAX 128
#define FA_DP (FA_DMAX + 1)
#define FA_RPW 4
#define FA_WARPS 4
#define FA_ROWS (FA_RPW * FA_WARPS)
// Threads per block of the flash-attention kernels (their launch bound).
#define FA_THREADS 128
static_assert(FA_THREADS == 32 * FA_WARPS, "a flash-attention block is FA_WARPS warps");
#define FA_U (FA_DMAX / 32)

struct FaShape {
    i64 batch, heads, kvh, seq, hd;
    __device__ i64 c() const { return heads * hd; }
    __device__ i64 stride() const { return (heads + 2 * kvh) * hd; }
    __device__ i64 group() const { return heads / kvh; }
    // Element (row i, dim 0) of part (0 q, 1 k, 2 v) of head h in batch b
    // (a query head for part 0, a key/value head otherwise).
    __device__ i64 qkv(i64 b, i64 h, int part, i64 i) const {
        i64 col = part == 0 ? h * hd : part == 1 ? c() + h * hd : c() + (kvh + h) * hd;
        return (b * seq + i) * stride() + col;
    }
    __device__ i64 out(i64 b, i64 h, i64 i) const { return (b * seq + i) * c() + h * hd; }
};

// Loads 32 rows (row r from src + r * stride) into tile[32][FA_DP]: the
// first `units` * 32 columns, zero beyond `valid` rows and beyond hd columns
// (so padded lanes add 0). Each thread issues FA_BATCH loads before it
// stores any, so a tile costs a few memory latencies, not one per element.
#define FA_BATCH 8
__device__ void fa_load(float (*tile)[FA_DP], Buf src, i64 stride, i64 valid, i64 hd, int units) {
    int cols = 32 * units, n = 32 * cols;
    for (int base = threadIdx.x; base < n; base += FA_BATCH * blockDim.x) {
        float v[FA_BATCH];
#pragma unroll
        for (int e = 0; e < FA_BATCH; ++e) {
            int k = base + e * blockDim.x, r = k / cols, d = k % cols;
            v[e] = (k < n && r < valid && d < hd) ? src[r * stride + d] : 0.f;
        }
#pragma unroll
        for (int e = 0; e < FA_BATCH; ++e) {
            int k = base + e * blockDim.x;
            if (k < n) tile[k / cols][k % cols] = v[e];
        }
    }
}

// Lane `lane` of a row held across the warp (dims lane + 32u) into regs.
__device__ __forceinline__ void fa_row(float* reg, Buf src, i64 hd, int lane) {
#pragma unroll
    for (int u = 0; u < FA_U; ++u) {
        int d = lane + 32 * u;
        reg[u] = d < hd ? src[d] : 0.f;
    }
}

// dot(register row, tile row `lane`), the register row broadcast by shuffles.
// s[r] = dot(register row r, tile row `lane`) for the warp's FA_RPW rows:
// each tile element is read from shared memory once for all rows, the
// register rows are broadcast by shuffles, and each (row, 32 dimensions)
// pair is its own chain of additions.
__device__ __forceinline__ void fa_dots(const float (*reg)[FA_U], const float (*tile)[FA_DP], int lane, int units,
                                        float* s) {
    float part[FA_RPW][FA_U];
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r)
#pragma unroll
        for (int u = 0; u < FA_U; ++u) part[r][u] = 0.f;
#pragma unroll
    for (int u = 0; u < FA_U; ++u) {
        if (u < units) {
#pragma unroll
            for (int src = 0; src < 32; ++src) {
                float t = tile[lane][32 * u + src];
#pragma unroll
                for (int r = 0; r < FA_RPW; ++r) part[r][u] += __shfl_sync(0xffffffffu, reg[r][u], src) * t;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        s[r] = 0.f;
#pragma unroll
        for (int u = 0; u < FA_U; ++u) s[r] += part[r][u];
    }
}

// acc[r][u] += sum_j w[r]_j * tile[j][lane + 32u] for the warp's rows, the
// weight w[r]_j held by lane j.
__device__ __forceinline__ void fa_axpys(float (*acc)[FA_U], const float* w, const float (*tile)[FA_DP], int lane,
                                         int units) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        float wj[FA_RPW];
#pragma unroll
        for (int r = 0; r < FA_RPW; ++r) wj[r] = __shfl_sync(0xffffffffu, w[r], j);
#pragma unroll
        for (int u = 0; u < FA_U; ++u) {
            if (u < units) {
                float t = tile[j][lane + 32 * u];
#pragma unroll
                for (int r = 0; r < FA_RPW; ++r) acc[r][u] += wj[r] * t;
            }
        }
    }
}

// Grid: B * H * ceil(T / FA_ROWS) blocks of 32 * FA_WARPS threads.
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attn_fwd(Buf qkv, Buf out, Buf lse, i64 batch, i64 heads, i64 kvh, i64 seq, i64 hd,
                                          float scale) {
    __shared__ float ks[32][FA_DP];
    __shared__ float vs[32][FA_DP];
    FaShape sh = {batch, heads, kvh, seq, hd};
    i64 tiles = (seq + FA_ROWS - 1) / FA_ROWS;
    i64 bh = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * FA_ROWS;
    i64 b = bh / heads, h = bh % heads, g = h / sh.group();
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, units = (int)((hd + 31) / 32);
    float q[FA_RPW][FA_U], acc[FA_RPW][FA_U], m[FA_RPW], l[FA_RPW];
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 i = i0 + w * FA_RPW + r;
        fa_row(q[r], qkv + sh.qkv(b, h, 0, i < seq ? i : 0), hd, lane);
#pragma unroll
        for (int u = 0; u < FA_U; ++u) acc[r][u] = 0.f;
        m[r] = NEG_INF;
        l[r] = 0.f;
    }
    i64 last = i0 + FA_ROWS - 1 < seq ? i0 + FA_ROWS - 1 : seq - 1;
    for (i64 j0 = 0; j0 <= last; j0 += 32) {
        __syncthreads();
        fa_load(ks, qkv + sh.qkv(b, g, 1, j0), sh.stride(), seq - j0, hd, units);
        fa_load(vs, qkv + sh.qkv(b, g, 2, j0), sh.stride(), seq - j0, hd, units);
        __syncthreads();
        // Rows past the sequence compute on row 0's query and are not
        // written; every row has a visible key (j0 <= i0).
        float s[FA_RPW], p[FA_RPW];
        fa_dots(q, ks, lane, units, s);
        i64 j = j0 + lane;
#pragma unroll
        for (int r = 0; r < FA_RPW; ++r) {
            i64 i = i0 + w * FA_RPW + r;
            bool on = j <= i && j < seq;
            float x = s[r] * scale;
            float m_new = fmaxf(m[r], warp_max(on ? x : NEG_INF));
            p[r] = on ? expf(x - m_new) : 0.f;
            float rescale = expf(m[r] - m_new);
            l[r] = l[r] * rescale + warp_sum(p[r]);
            m[r] = m_new;
#pragma unroll
            for (int u = 0; u < FA_U; ++u) acc[r][u] *= rescale;
        }
        fa_axpys(acc, p, vs, lane, units);
    }
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 i = i0 + w * FA_RPW + r;
        if (i >= seq) continue;
        float inv = 1.f / l[r];
#pragma unroll
        for (int u = 0; u < FA_U; ++u) {
            int d = lane + 32 * u;
            if (d < hd) out.set(sh.out(b, h, i) + d, acc[r][u] * inv);
        }
        if (lane == 0) lse.set(bh * seq + i, m[r] + logf(l[r]));
    }
}

// dQ (the query part of dqkv). Grid and block as flash_attn_fwd.
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attn_bwd_dq(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                             i64 kvh, i64 seq, i64 hd, float scale) {
    __shared__ float ks[32][FA_DP];
    __shared__ float vs[32][FA_DP];
    FaShape sh = {batch, heads, kvh, seq, hd};
    i64 tiles = (seq + FA_ROWS - 1) / FA_ROWS;
    i64 bh = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * FA_ROWS;
    i64 b = bh / heads, h = bh % heads, g = h / sh.group();
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, units = (int)((hd + 31) / 32);
    float q[FA_RPW][FA_U], go[FA_RPW][FA_U], dq[FA_RPW][FA_U], dd[FA_RPW], ls[FA_RPW];
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 i = i0 + w * FA_RPW + r;
        i64 ii = i < seq ? i : 0;
        float o[FA_U];
        fa_row(q[r], qkv + sh.qkv(b, h, 0, ii), hd, lane);
        fa_row(go[r], dout + sh.out(b, h, ii), hd, lane);
        fa_row(o, out + sh.out(b, h, ii), hd, lane);
        float part = 0.f;
#pragma unroll
        for (int u = 0; u < FA_U; ++u) {
            part += go[r][u] * o[u];
            dq[r][u] = 0.f;
        }
        dd[r] = warp_sum(part);
        ls[r] = lse[bh * seq + ii];
    }
    i64 last = i0 + FA_ROWS - 1 < seq ? i0 + FA_ROWS - 1 : seq - 1;
    for (i64 j0 = 0; j0 <= last; j0 += 32) {
        __syncthreads();
        fa_load(ks, qkv + sh.qkv(b, g, 1, j0), sh.stride(), seq - j0, hd, units);
        fa_load(vs, qkv + sh.qkv(b, g, 2, j0), sh.stride(), seq - j0, hd, units);
        __syncthreads();
        float s[FA_RPW], dp[FA_RPW], ds[FA_RPW];
        fa_dots(q, ks, lane, units, s);
        fa_dots(go, vs, lane, units, dp);
        i64 j = j0 + lane;
#pragma unroll
        for (int r = 0; r < FA_RPW; ++r) {
            i64 i = i0 + w * FA_RPW + r;
            float p = i < seq && j <= i ? expf(s[r] * scale - ls[r]) : 0.f;
            ds[r] = p * (dp[r] - dd[r]) * scale;
        }
        fa_axpys(dq, ds, ks, lane, units);
    }
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 i = i0 + w * FA_RPW + r;
        if (i >= seq) continue;
#pragma unroll
        for (int u = 0; u < FA_U; ++u) {
            int d = lane + 32 * u;
            if (d < hd) dqkv.set(sh.qkv(b, h, 0, i) + d, dq[r][u]);
        }
    }
}

// dK and dV (the key and value parts of dqkv). Each warp owns FA_RPW key
// rows of one key/value head; query tiles of 32 (with their lse and
// D = dO . O) of each query head of its group are staged in turn.
// Grid: B * Hkv * ceil(T / FA_ROWS) blocks.
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attn_bwd_dkv(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                              i64 kvh, i64 seq, i64 hd, float scale) {
    __shared__ float qs[32][FA_DP];
    __shared__ float gs[32][FA_DP];
    __shared__ float lse_s[32], dd_s[32];
    FaShape sh = {batch, heads, kvh, seq, hd};
    i64 tiles = (seq + FA_ROWS - 1) / FA_ROWS;
    i64 bg = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * FA_ROWS;
    i64 b = bg / kvh, g = bg % kvh;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, units = (int)((hd + 31) / 32);
    float k[FA_RPW][FA_U], v[FA_RPW][FA_U], dk[FA_RPW][FA_U], dv[FA_RPW][FA_U];
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 j = j0 + w * FA_RPW + r;
        i64 jj = j < seq ? j : 0;
        fa_row(k[r], qkv + sh.qkv(b, g, 1, jj), hd, lane);
        fa_row(v[r], qkv + sh.qkv(b, g, 2, jj), hd, lane);
#pragma unroll
        for (int u = 0; u < FA_U; ++u) dk[r][u] = dv[r][u] = 0.f;
    }
    for (i64 h = g * sh.group(); h < (g + 1) * sh.group(); ++h)
    for (i64 i0 = (j0 / 32) * 32; i0 < seq; i0 += 32) {
        i64 bh = b * heads + h;
        __syncthreads();
        fa_load(qs, qkv + sh.qkv(b, h, 0, i0), sh.stride(), seq - i0, hd, units);
        fa_load(gs, dout + sh.out(b, h, i0), sh.c(), seq - i0, hd, units);
        // D for the tile's query rows: warp w computes rows w, w + 4, ...,
        // all loads first, then the reductions.
        float part[32 / FA_WARPS];
#pragma unroll
        for (int q = 0; q < 32 / FA_WARPS; ++q) {
            i64 i = i0 + w + q * FA_WARPS;
            part[q] = 0.f;
#pragma unroll
            for (int u = 0; u < FA_U; ++u) {
                int d = lane + 32 * u;
                if (i < seq && d < hd) part[q] += dout[sh.out(b, h, i) + d] * out[sh.out(b, h, i) + d];
            }
        }
#pragma unroll
        for (int q = 0; q < 32 / FA_WARPS; ++q) {
            int t = w + q * FA_WARPS;
            float x = warp_sum(part[q]);
            if (lane == 0) {
                dd_s[t] = x;
                lse_s[t] = i0 + t < seq ? lse[bh * seq + i0 + t] : 0.f;
            }
        }
        __syncthreads();
        float s[FA_RPW], dp[FA_RPW], p[FA_RPW], ds[FA_RPW];
        fa_dots(k, qs, lane, units, s);
        fa_dots(v, gs, lane, units, dp);
        i64 i = i0 + lane;
#pragma unroll
        for (int r = 0; r < FA_RPW; ++r) {
            i64 j = j0 + w * FA_RPW + r;
            bool on = i < seq && j < seq && i >= j;
            p[r] = on ? expf(s[r] * scale - lse_s[lane]) : 0.f;
            ds[r] = p[r] * (dp[r] - dd_s[lane]) * scale;
        }
        fa_axpys(dv, p, gs, lane, units);
        fa_axpys(dk, ds, qs, lane, units);
    }
#pragma unroll
    for (int r = 0; r < FA_RPW; ++r) {
        i64 j = j0 + w * FA_RPW + r;
        if (j >= seq) continue;
#pragma unroll
        for (int u = 0; u < FA_U; ++u) {
            int d = lane + 32 * u;
            if (d < hd) {
                dqkv.set(sh.qkv(b, g, 1, j) + d, dk[r][u]);
                dqkv.set(sh.qkv(b, g, 2, j) + d, dv[r][u]);
            }
        }
    }
}

// ---- Fused causal attention on the tensor cores (bf16 q, k, v) ----------
// The three launches above for bf16 operands and a head dimension that is
// a multiple of 16 (`AttentionLowering::TensorCores`), with the products
// done by warp-wide `mma.sync.m16n8k16` instructions (bf16 operands, f32
// accumulation; sm_80 and later). Each is a template over D, the largest
// head dimension it takes, instantiated for 64 (`flash_mma64_*`) and 128
// (`flash_mma128_*`). A block is FA_WARPS warps of 16 rows (FM_ROWS rows);
// the other side is staged through shared memory FM_TILE rows at a time,
// as bf16 pairs along the head dimension: W = D / 2 + 4 words a row, the 4
// of padding putting the rows one fragment load touches in different
// banks. Helpers take their sizes from their array arguments' extents:
// S = D / 16 k-steps of A fragments, N = D / 8 accumulator tiles.
// Fragments follow the PTX ISA's tables for m16n8k16 (lane = 4 g + t):
//   A (16 x 16): regs {row g, cols 2t, 2t+1}, {row g+8, same}, {row g,
//                cols 2t+8, 2t+9}, {row g+8, same};
//   B (16 x 8):  regs {rows 2t, 2t+1 of column g}, {rows 2t+8, 2t+9};
//   C (16 x 8):  {row g, cols 2t, 2t+1}, {row g+8, same};
// the lower-numbered element in the low half of each register. The C
// fragments of two adjacent 8-column tiles of scores are exactly the A
// fragment of the next product's 16-wide k-step, so P and dS stay in
// registers. Those two are f32 values: each is split into bf16 hi + lo
// parts and multiplied twice, which keeps about 16 of its bits, so the
// results stay close to the f32 flash kernels' rather than to a bf16 P's.
typedef unsigned int u32;
typedef unsigned short u16;
#define FM_ROWS (16 * FA_WARPS)
#define FM_TILE 64

// d (C fragment) += a (A fragment) * b (B fragment), for the whole warp.
__device__ __forceinline__ void mma16816(float* d, const u32* a, const u32* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    __trap();  // the lowering never picks these kernels below sm_80
#else
    host_mma16816(d, a, b);
#endif
}

__device__ __forceinline__ u32 pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// (x0, x1) as bf16 pairs: hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void split2(float x0, float x1, u32* hi, u32* lo) {
    u16 h0 = bf16_bits(x0), h1 = bf16_bits(x1);
    *hi = pack2(h0, h1);
    *lo = pack2(bf16_bits(x0 - __uint_as_float((u32)h0 << 16)), bf16_bits(x1 - __uint_as_float((u32)h1 << 16)));
}

// The A fragment (hi and lo parts) of the k-step made of C fragments c[0]
// (columns 0..7) and c[1] (columns 8..15).
__device__ __forceinline__ void c_to_a(const float (*c)[4], u32* hi, u32* lo) {
    split2(c[0][0], c[0][1], &hi[0], &lo[0]);
    split2(c[0][2], c[0][3], &hi[1], &lo[1]);
    split2(c[1][0], c[1][1], &hi[2], &lo[2]);
    split2(c[1][2], c[1][3], &hi[3], &lo[3]);
}

// FM_TILE rows of bf16 src (row r at src + r * stride) into tile as pairs,
// zero past `valid` rows and `hd` columns.
template <int W>
__device__ void fm_stage(u32 (&tile)[FM_TILE][W], const u16* src, i64 stride, i64 valid, i64 hd) {
    constexpr int pairs = W - 4;
    for (int e = threadIdx.x; e < FM_TILE * pairs; e += blockDim.x) {
        int r = e / pairs, c = 2 * (e % pairs);
        u32 v = 0;
        if (r < valid && c < hd) {
            const u16* p = src + r * stride + c;
            v = pack2(p[0], p[1]);
        }
        tile[r][c / 2] = v;
    }
}

// The A fragments of 16 bf16 rows (row r at src + r * stride; zero at rows
// from `valid` and columns from `hd`), one per 16 columns.
template <int S>
__device__ void fm_afrag(u32 (&a)[S][4], const u16* src, i64 stride, i64 valid, i64 hd, int lane) {
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            int r = g + 8 * (q & 1), c = 16 * s + 2 * t + 8 * (q >> 1);
            a[s][q] = 0;
            if (r < valid && c < hd) {
                const u16* p = src + r * stride + c;
                a[s][q] = pack2(p[0], p[1]);
            }
        }
}

// The B fragment of columns n0.. and rows k0.. of the transpose of a staged
// tile: B(k, n) = tile row n0 + n, column k0 + k (K for Q Kᵀ).
template <int W>
__device__ __forceinline__ void fm_bt(u32* b, const u32 (&tile)[FM_TILE][W], int n0, int k0, int lane) {
    int g = lane >> 2, t = lane & 3;
    b[0] = tile[n0 + g][k0 / 2 + t];
    b[1] = tile[n0 + g][k0 / 2 + t + 4];
}

// Element (r, c) of a staged tile.
template <int W>
__device__ __forceinline__ u16 fm_at(const u32 (&tile)[FM_TILE][W], int r, int c) {
    return (u16)(tile[r][c >> 1] >> (16 * (c & 1)));
}

// The B fragment of rows k0.. and columns n0.. of a staged tile: B(k, n) =
// tile row k0 + k, column n0 + n (V for P V).
template <int W>
__device__ __forceinline__ void fm_b(u32* b, const u32 (&tile)[FM_TILE][W], int k0, int n0, int lane) {
    int g = lane >> 2, t = lane & 3;
    b[0] = pack2(fm_at(tile, k0 + 2 * t, n0 + g), fm_at(tile, k0 + 2 * t + 1, n0 + g));
    b[1] = pack2(fm_at(tile, k0 + 2 * t + 8, n0 + g), fm_at(tile, k0 + 2 * t + 9, n0 + g));
}

// The sum of x over the four lanes of a fragment row group.
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// x[0..1] (16 columns from n0) = a1 t1ᵀ and y[0..1] = a2 t2ᵀ over the first
// `steps` k-steps: scores and dP against 16 staged rows.
template <int S, int W>
__device__ __forceinline__ void fm_two_products(float (*x)[4], float (*y)[4], const u32 (&a1)[S][4],
                                                const u32 (&t1)[FM_TILE][W], const u32 (&a2)[S][4],
                                                const u32 (&t2)[FM_TILE][W], int n0, int steps, int lane) {
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int d = 0; d < S; ++d) {
            u32 bb[2];
            if (d >= steps) break;
            fm_bt(bb, t1, n0 + 8 * q, 16 * d, lane);
            mma16816(x[q], a1[d], bb);
            fm_bt(bb, t2, n0 + 8 * q, 16 * d, lane);
            mma16816(y[q], a2[d], bb);
        }
}

// acc (the head dimension's columns) += (hi + lo) rows k0..k0+15 of tile.
template <int N, int W>
__device__ __forceinline__ void fm_accumulate(float (&acc)[N][4], const u32* hi, const u32* lo,
                                              const u32 (&tile)[FM_TILE][W], int k0, int steps, int lane) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        u32 bb[2];
        if (n >= 2 * steps) break;
        fm_b(bb, tile, k0, 8 * n, lane);
        mma16816(acc[n], hi, bb);
        mma16816(acc[n], lo, bb);
    }
}

// Row hf (0: the lane's row g, 1: g + 8) of accumulators acc, times mul,
// into dst from element `at` on (hd columns).
template <int N>
__device__ __forceinline__ void fm_store(Buf dst, i64 at, const float (&acc)[N][4], int hf, float mul, i64 hd, int t) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            int d = 8 * n + 2 * t + e;
            if (d < hd) dst.set(at + d, acc[n][2 * hf + e] * mul);
        }
}

// Grid: B * H * ceil(T / FM_ROWS) blocks of FA_THREADS threads. A lane's
// rows are r0 + g and r0 + g + 8 (r0: its warp's first row).
template <int D>
__device__ void fm_fwd(Buf qkv, Buf out, Buf lse, i64 batch, i64 heads, i64 kvh, i64 seq, i64 hd, float scale) {
    constexpr int W = D / 2 + 4;
    __shared__ u32 ks[FM_TILE][W];
    __shared__ u32 vs[FM_TILE][W];
    FaShape sh = {batch, heads, kvh, seq, hd};
    const u16* x = (const u16*)qkv.p;
    i64 tiles = (seq + FM_ROWS - 1) / FM_ROWS;
    i64 bh = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * FM_ROWS;
    i64 b = bh / heads, h = bh % heads, g = h / sh.group();
    int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, steps = (int)(hd / 16);
    i64 r0 = i0 + 16 * (threadIdx.x >> 5);
    u32 qf[D / 16][4];
    fm_afrag(qf, x + sh.qkv(b, h, 0, r0 < seq ? r0 : 0), sh.stride(), seq - r0, hd, lane);
    float o[D / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    i64 last = i0 + FM_ROWS - 1 < seq ? i0 + FM_ROWS - 1 : seq - 1;
    // Tiles and blocks are 64-aligned, so key j0 is visible to every row.
    for (i64 j0 = 0; j0 <= last; j0 += FM_TILE) {
        __syncthreads();
        fm_stage(ks, x + sh.qkv(b, g, 1, j0), sh.stride(), seq - j0, hd);
        fm_stage(vs, x + sh.qkv(b, g, 2, j0), sh.stride(), seq - j0, hd);
        __syncthreads();
        float s[FM_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < FM_TILE / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            if (j0 + 8 * n > r0 + 15) continue;  // keys after the warp's rows
#pragma unroll
            for (int k = 0; k < D / 16; ++k) {
                u32 bb[2];
                if (k >= steps) break;
                fm_bt(bb, ks, 8 * n, 16 * k, lane);
                mma16816(s[n], qf[k], bb);
            }
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            i64 i = r0 + gq + 8 * hf;
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < FM_TILE / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    i64 j = j0 + 8 * n + 2 * t + e;
                    float v = j <= i && j < seq ? s[n][2 * hf + e] * scale : NEG_INF;
                    s[n][2 * hf + e] = v;
                    mx = fmaxf(mx, v);
                }
            float m_new = fmaxf(m[hf], quad_max(mx)), rescale = expf(m[hf] - m_new), sum = 0.f;
#pragma unroll
            for (int n = 0; n < FM_TILE / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float p = expf(s[n][2 * hf + e] - m_new);
                    s[n][2 * hf + e] = p;
                    sum += p;
                }
            l[hf] = l[hf] * rescale + quad_sum(sum);
            m[hf] = m_new;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * hf] *= rescale;
                o[n][2 * hf + 1] *= rescale;
            }
        }
#pragma unroll
        for (int k = 0; k < FM_TILE / 16; ++k) {
            if (j0 + 16 * k > r0 + 15) break;
            u32 ph[4], pl[4];
            c_to_a(s + 2 * k, ph, pl);
            fm_accumulate(o, ph, pl, vs, 16 * k, steps, lane);
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        i64 i = r0 + gq + 8 * hf;
        if (i >= seq) continue;
        fm_store(out, sh.out(b, h, i), o, hf, 1.f / l[hf], hd, t);
        if (t == 0) lse.set(bh * seq + i, m[hf] + logf(l[hf]));
    }
}

// dQ (the query part of dqkv). Grid and block as fm_fwd; keys are
// taken 16 at a time: scores and dP of those, dS, then dQ += dS K.
template <int D>
__device__ void fm_bwd_dq(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads, i64 kvh, i64 seq,
                          i64 hd, float scale) {
    constexpr int W = D / 2 + 4;
    __shared__ u32 ks[FM_TILE][W];
    __shared__ u32 vs[FM_TILE][W];
    FaShape sh = {batch, heads, kvh, seq, hd};
    const u16 *x = (const u16*)qkv.p, *go = (const u16*)dout.p;
    i64 tiles = (seq + FM_ROWS - 1) / FM_ROWS;
    i64 bh = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * FM_ROWS;
    i64 b = bh / heads, h = bh % heads, g = h / sh.group();
    int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, steps = (int)(hd / 16);
    i64 r0 = i0 + 16 * (threadIdx.x >> 5), rr = r0 < seq ? r0 : 0;
    u32 qf[D / 16][4], gf[D / 16][4];
    fm_afrag(qf, x + sh.qkv(b, h, 0, rr), sh.stride(), seq - r0, hd, lane);
    fm_afrag(gf, go + sh.out(b, h, rr), sh.c(), seq - r0, hd, lane);
    // D = dO . O of the lane's rows: its fragment columns, then the quad.
    float dd[2], ls[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        i64 i = r0 + gq + 8 * hf;
        float part = 0.f;
        if (i < seq)
            for (int c = 2 * t; c < hd; c += 8)
                for (int e = 0; e < 2; ++e) part += dout[sh.out(b, h, i) + c + e] * out[sh.out(b, h, i) + c + e];
        dd[hf] = quad_sum(part);
        ls[hf] = i < seq ? lse[bh * seq + i] : 0.f;
    }
    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
    i64 last = i0 + FM_ROWS - 1 < seq ? i0 + FM_ROWS - 1 : seq - 1;
    for (i64 j0 = 0; j0 <= last; j0 += FM_TILE) {
        __syncthreads();
        fm_stage(ks, x + sh.qkv(b, g, 1, j0), sh.stride(), seq - j0, hd);
        fm_stage(vs, x + sh.qkv(b, g, 2, j0), sh.stride(), seq - j0, hd);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < FM_TILE / 16; ++k) {
            if (j0 + 16 * k > r0 + 15) break;  // keys after the warp's rows
            float s[2][4] = {}, dp[2][4] = {};
            fm_two_products(s, dp, qf, ks, gf, vs, 16 * k, steps, lane);
#pragma unroll
            for (int q = 0; q < 2; ++q)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    int hf = c >> 1;
                    i64 i = r0 + gq + 8 * hf, j = j0 + 16 * k + 8 * q + 2 * t + (c & 1);
                    float p = i < seq && j <= i ? expf(s[q][c] * scale - ls[hf]) : 0.f;
                    s[q][c] = p * (dp[q][c] - dd[hf]) * scale;
                }
            u32 dsh[4], dsl[4];
            c_to_a(s, dsh, dsl);
            fm_accumulate(dq, dsh, dsl, ks, 16 * k, steps, lane);
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        i64 i = r0 + gq + 8 * hf;
        if (i < seq) fm_store(dqkv, sh.qkv(b, h, 0, i), dq, hf, 1.f, hd, t);
    }
}

// dK and dV (the key and value parts of dqkv). A warp owns 16 key rows of
// one key/value head, K and V as A fragments; query tiles of each query
// head of the group are staged in turn (with their lse and D = dO . O) and
// taken 16 queries at a time: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then dV += Pᵀ dO and
// dK += dSᵀ Q. Grid: B * Hkv * ceil(T / FM_ROWS) blocks.
template <int D>
__device__ void fm_bwd_dkv(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads, i64 kvh, i64 seq,
                           i64 hd, float scale) {
    constexpr int W = D / 2 + 4;
    __shared__ u32 qs[FM_TILE][W];
    __shared__ u32 gs[FM_TILE][W];
    __shared__ float lse_s[FM_TILE], dd_s[FM_TILE];
    FaShape sh = {batch, heads, kvh, seq, hd};
    const u16 *x = (const u16*)qkv.p, *go = (const u16*)dout.p;
    i64 tiles = (seq + FM_ROWS - 1) / FM_ROWS;
    i64 bg = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * FM_ROWS;
    i64 b = bg / kvh, g = bg % kvh;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3, steps = (int)(hd / 16);
    i64 r0 = j0 + 16 * w, rr = r0 < seq ? r0 : 0;
    u32 kf[D / 16][4], vf[D / 16][4];
    fm_afrag(kf, x + sh.qkv(b, g, 1, rr), sh.stride(), seq - r0, hd, lane);
    fm_afrag(vf, x + sh.qkv(b, g, 2, rr), sh.stride(), seq - r0, hd, lane);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dk[n][c] = dv[n][c] = 0.f;
    for (i64 h = g * sh.group(); h < (g + 1) * sh.group(); ++h)
        for (i64 i0 = j0; i0 < seq; i0 += FM_TILE) {
            i64 bh = b * heads + h;
            __syncthreads();
            fm_stage(qs, x + sh.qkv(b, h, 0, i0), sh.stride(), seq - i0, hd);
            fm_stage(gs, go + sh.out(b, h, i0), sh.c(), seq - i0, hd);
            for (int q = w; q < FM_TILE; q += FA_WARPS) {
                i64 i = i0 + q;
                float part = 0.f;
                if (i < seq)
                    for (i64 d = lane; d < hd; d += 32) part += dout[sh.out(b, h, i) + d] * out[sh.out(b, h, i) + d];
                part = warp_sum(part);
                if (lane == 0) {
                    dd_s[q] = part;
                    lse_s[q] = i < seq ? lse[bh * seq + i] : 0.f;
                }
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < FM_TILE / 16; ++k) {
                if (i0 + 16 * k >= seq) break;
                if (i0 + 16 * k + 15 < r0) continue;  // queries before the warp's keys
                float s[2][4] = {}, dp[2][4] = {};
                fm_two_products(s, dp, kf, qs, vf, gs, 16 * k, steps, lane);
#pragma unroll
                for (int q = 0; q < 2; ++q)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        int tq = 16 * k + 8 * q + 2 * t + (c & 1);
                        i64 j = r0 + gq + 8 * (c >> 1), i = i0 + tq;
                        bool on = i < seq && j < seq && i >= j;
                        float p = on ? expf(s[q][c] * scale - lse_s[tq]) : 0.f;
                        s[q][c] = p;
                        dp[q][c] = p * (dp[q][c] - dd_s[tq]) * scale;
                    }
                u32 ph[4], pl[4], dh[4], dl[4];
                c_to_a(s, ph, pl);
                c_to_a(dp, dh, dl);
                fm_accumulate(dv, ph, pl, gs, 16 * k, steps, lane);
                fm_accumulate(dk, dh, dl, qs, 16 * k, steps, lane);
            }
        }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        i64 j = r0 + gq + 8 * hf;
        if (j >= seq) continue;
        fm_store(dqkv, sh.qkv(b, g, 1, j), dk, hf, 1.f, hd, t);
        fm_store(dqkv, sh.qkv(b, g, 2, j), dv, hf, 1.f, hd, t);
    }
}

// The instantiations: D = 64 (head dimensions 16 to 64) and 128 (80 to 128).
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma64_fwd(Buf qkv, Buf out, Buf lse, i64 batch, i64 heads, i64 kvh, i64 seq, i64 hd,
                                         float scale) {
    fm_fwd<64>(qkv, out, lse, batch, heads, kvh, seq, hd, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma128_fwd(Buf qkv, Buf out, Buf lse, i64 batch, i64 heads, i64 kvh, i64 seq, i64 hd,
                                         float scale) {
    fm_fwd<128>(qkv, out, lse, batch, heads, kvh, seq, hd, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma64_bwd_dq(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                            i64 kvh, i64 seq, i64 hd, float scale) {
    fm_bwd_dq<64>(dout, qkv, out, lse, dqkv, batch, heads, kvh, seq, hd, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma128_bwd_dq(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                            i64 kvh, i64 seq, i64 hd, float scale) {
    fm_bwd_dq<128>(dout, qkv, out, lse, dqkv, batch, heads, kvh, seq, hd, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma64_bwd_dkv(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                             i64 kvh, i64 seq, i64 hd, float scale) {
    fm_bwd_dkv<64>(dout, qkv, out, lse, dqkv, batch, heads, kvh, seq, hd, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_mma128_bwd_dkv(Buf dout, Buf qkv, Buf out, Buf lse, Buf dqkv, i64 batch, i64 heads,
                                             i64 kvh, i64 seq, i64 hd, float scale) {
    fm_bwd_dkv<128>(dout, qkv, out, lse, dqkv, batch, heads, kvh, seq, hd, scale);
}
