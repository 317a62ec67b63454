// kernels.cu compiled for the host (cargo feature `host-kernels`), so tests
// run the CUDA source itself, not only its Rust mirror in emulate.rs.
//
// A launch runs every block of the grid in turn. In a kernel whose threads
// meet (__syncthreads, warp shuffles), each thread of a block is a fiber
// (ucontext) on the launching thread, and a meeting point switches to the
// next fiber until all the block's threads (or the warp's lanes, for a
// shuffle, which is an exchange through per-warp slots) have arrived; the
// threads of other kernels simply run one after another. Atomics are
// std::atomic_ref. A tensor-core product (mma.sync) is a warp meeting too:
// each lane computes its part of the result from all lanes' fragments.
// __shared__ variables are `static`: one copy, which is right because one
// block runs at a time.
// What this cannot show is what only a GPU does: the memory model across
// blocks running at once, occupancy, timing.

// Fibers switch with _setjmp/_longjmp (swapcontext would make a system
// call per switch to save the signal mask); ucontext only starts them.
#undef _FORTIFY_SOURCE
#include <algorithm>
#include <csetjmp>
#include <atomic>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)

namespace host {
struct Dim {
    unsigned x, y, z;
};
}  // namespace host

thread_local host::Dim threadIdx;
thread_local host::Dim blockIdx;
host::Dim blockDim;
host::Dim gridDim;

namespace host {
// Where a fiber is: ready to run, waiting at a block barrier or at its
// warp's, or finished.
enum class State { Ready, Block, Warp, Done };

struct Fiber {
    ucontext_t start;  // entry to fiber_main on the fiber's stack
    jmp_buf resume;    // where it waits
    bool started;
    std::vector<char> stack;
    State state;
};

// The threads of the block being run, as fibers.
struct Block {
    jmp_buf scheduler;
    std::vector<Fiber> fibers;
    unsigned current = 0;
    unsigned arrived = 0;                // at the block barrier
    std::vector<unsigned> warp_arrived;  // per warp, at its barrier
    void (*call)(void**) = nullptr;
    void** params = nullptr;
    bool active = false;  // a cooperative kernel is running
};
Block blk;

[[noreturn]] void not_cooperative(const char* what) {
    std::fprintf(stderr, "host kernels: %s in a kernel marked independent (mark it cooperative)\n", what);
    std::abort();
}

unsigned lanes_of(unsigned w) { return std::min(32u, blockDim.x - w * 32); }

// The current fiber waits at a block (`warp == false`) or warp barrier.
void meet(bool warp) {
    if (!blk.active) not_cooperative(warp ? "a warp shuffle" : "__syncthreads");
    unsigned t = blk.current, w = t / 32;
    Fiber& me = blk.fibers[t];
    if (warp) {
        me.state = State::Warp;
        if (++blk.warp_arrived[w] == lanes_of(w)) {
            blk.warp_arrived[w] = 0;
            for (unsigned l = w * 32; l < w * 32 + lanes_of(w); ++l) blk.fibers[l].state = State::Ready;
        }
    } else {
        me.state = State::Block;
        if (++blk.arrived == blockDim.x) {
            blk.arrived = 0;
            for (auto& f : blk.fibers) f.state = State::Ready;
        }
    }
    if (!_setjmp(me.resume)) _longjmp(blk.scheduler, 1);
}

void fiber_main() {
    blk.call(blk.params);
    blk.fibers[blk.current].state = State::Done;
    _longjmp(blk.scheduler, 1);
}

// Runs one block of a cooperative kernel: the fibers in turn, each until it
// finishes or waits, until all have finished.
void run_block(unsigned n) {
    constexpr std::size_t stack_bytes = 256 << 10;
    blk.fibers.resize(n);
    blk.warp_arrived.assign((n + 31) / 32, 0);
    blk.arrived = 0;
    for (auto& f : blk.fibers) {
        f.stack.resize(stack_bytes);
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = f.stack.data();
        f.start.uc_stack.ss_size = stack_bytes;
        f.start.uc_link = nullptr;
        makecontext(&f.start, fiber_main, 0);
        f.started = false;
        f.state = State::Ready;
    }
    for (;;) {
        bool ran = false, done = true;
        for (unsigned t = 0; t < n; ++t) {
            if (blk.fibers[t].state == State::Ready) {
                blk.current = t;
                threadIdx = {t, 0, 0};
                Fiber& f = blk.fibers[t];
                if (!_setjmp(blk.scheduler)) {
                    if (f.started) _longjmp(f.resume, 1);
                    f.started = true;
                    setcontext(&f.start);
                }
                ran = true;
            }
            done = done && blk.fibers[t].state == State::Done;
        }
        if (done) return;
        if (!ran) {
            std::fprintf(stderr, "host kernels: the threads of block %u wait for each other forever\n",
                         blockIdx.x);
            std::abort();
        }
    }
}

float exchange(float v, int from) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    static float slots[32][32];
    slots[w][lane] = v;
    meet(true);
    float r = slots[w][from & 31];
    meet(true);
    return r;
}
}  // namespace host

inline void __syncthreads() { host::meet(false); }
inline float __shfl_xor_sync(unsigned, float v, int o) { return host::exchange(v, (threadIdx.x % 32) ^ o); }
inline float __shfl_sync(unsigned, float v, int src) { return host::exchange(v, src); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline int atomicCAS(int* p, int expected, int desired) {
    std::atomic_ref<int>(*p).compare_exchange_strong(expected, desired);
    return expected;
}
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline void sincos(double a, double* s, double* c) {
    *s = std::sin(a);
    *c = std::cos(a);
}

namespace host {
// mma.sync.m16n8k16 with bf16 operands and f32 accumulators, for the warp:
// every lane leaves its fragments in the warp's slots; once all have, each
// rebuilds A (16 x 16) and B (16 x 8) from the PTX ISA's fragment tables
// and computes its four elements of D = A B + C.
void mma16816(float* d, const unsigned* a, const unsigned* b) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    static unsigned as[32][32][4], bs[32][32][2];
    std::memcpy(as[w][lane], a, sizeof as[w][lane]);
    std::memcpy(bs[w][lane], b, sizeof bs[w][lane]);
    meet(true);
    // Element e (0: low half, 1: high half) of a register, widened.
    auto half = [](unsigned reg, unsigned e) { return __uint_as_float(((reg >> (16 * e)) & 0xffffu) << 16); };
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        unsigned g = l >> 2, t = l & 3;
        for (unsigned i = 0; i < 8; ++i) {  // a_i
            unsigned row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            unsigned col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = half(as[w][l][i / 2], i % 2);
        }
        for (unsigned i = 0; i < 4; ++i) {  // b_i
            unsigned row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
            B[row][g] = half(bs[w][l][i / 2], i % 2);
        }
    }
    meet(true);
    unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 4; ++i) {  // c_i and d_i
        unsigned row = i < 2 ? g : g + 8, col = 2 * t + (i & 1);
        float s = 0.f;
        for (unsigned k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
        d[i] += s;
    }
}
}  // namespace host
inline void host_mma16816(float* d, const unsigned* a, const unsigned* b) { host::mma16816(d, a, b); }

#include "kernels.cu"

namespace host {
// Calls `f` with its parameters read from `params[i]` (each points to the
// argument's bytes, as cuLaunchKernel's kernelParams do).
template <class... A, std::size_t... I>
void invoke(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}
template <class... A>
void invoke(void (*f)(A...), void** params) {
    invoke(f, params, std::index_sequence_for<A...>{});
}

// `cooperative`: the kernel's threads meet in __syncthreads() or warp
// shuffles, so each runs on a thread of its own. An independent kernel's
// threads share nothing but atomics: they run one after another on the
// launching thread (a barrier or shuffle there aborts, naming the cause).
struct Entry {
    const char* name;
    void (*call)(void**);
    bool cooperative;
};

#define KERNEL(k) {#k, [](void** p) { invoke(k, p); }, false}
#define COOPERATIVE(k) {#k, [](void** p) { invoke(k, p); }, true}
const Entry kernels[] = {
    KERNEL(fill_rows),
    KERNEL(col_sum),
    KERNEL(add_f32),
    KERNEL(cast),
    KERNEL(gelu_fwd),
    KERNEL(gelu_bwd),
    KERNEL(relu_fwd),
    KERNEL(relu_bwd),
    COOPERATIVE(layernorm_fwd),
    KERNEL(layernorm_bwd_params),
    COOPERATIVE(layernorm_bwd_data),
    COOPERATIVE(rmsnorm_fwd),
    KERNEL(rmsnorm_bwd_params),
    COOPERATIVE(rmsnorm_bwd_data),
    KERNEL(rope_fwd),
    KERNEL(swiglu_fwd),
    KERNEL(swiglu_bwd),
    COOPERATIVE(causal_softmax_fwd),
    COOPERATIVE(causal_softmax_bwd),
    KERNEL(zero_upper),
    KERNEL(zero_qk),
    COOPERATIVE(cross_entropy_fwd),
    COOPERATIVE(cross_entropy_bwd),
    KERNEL(embedding_fwd),
    KERNEL(embedding_count),
    COOPERATIVE(scan_counts),
    KERNEL(embedding_place),
    KERNEL(embedding_bwd_rows),
    KERNEL(embedding_bwd_positions),
    COOPERATIVE(sum_squares),
    KERNEL(sqrt_inplace),
    KERNEL(adam_step),
    COOPERATIVE(flash_attn_fwd),
    COOPERATIVE(flash_attn_bwd_dq),
    COOPERATIVE(flash_attn_bwd_dkv),
    COOPERATIVE(flash_mma64_fwd),
    COOPERATIVE(flash_mma64_bwd_dq),
    COOPERATIVE(flash_mma64_bwd_dkv),
    COOPERATIVE(flash_mma128_fwd),
    COOPERATIVE(flash_mma128_bwd_dq),
    COOPERATIVE(flash_mma128_bwd_dkv),
    COOPERATIVE(attn_rows_softmax),
    KERNEL(attn_rows_softmax_bwd),
    KERNEL(attn_row_dot),
};
}  // namespace host

// Runs kernel `name` over `grid` blocks of `block` threads (at most 1024);
// concurrent calls wait for each other.
// Returns 0, or 1 when there is no such kernel, 2 for a bad block size.
extern "C" int memplan_host_launch(const char* name, unsigned grid, unsigned block, void** params) {
    // One launch at a time in the process: the launch state above and the
    // kernels' static __shared__ arrays are global (ranks of a sharded
    // emulation launch from their own threads).
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    const host::Entry* e = nullptr;
    for (const auto& k : host::kernels)
        if (std::strcmp(k.name, name) == 0) e = &k;
    if (!e) return 1;
    if (block == 0 || block > 1024) return 2;
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    if (e->cooperative) {
        host::blk.call = e->call;
        host::blk.params = params;
        host::blk.active = true;
        for (unsigned b = 0; b < grid; ++b) {
            blockIdx = {b, 0, 0};
            host::run_block(block);
        }
        host::blk.active = false;
    } else {
        for (unsigned b = 0; b < grid; ++b)
            for (unsigned t = 0; t < block; ++t) {
                blockIdx = {b, 0, 0};
                threadIdx = {t, 0, 0};
                e->call(params);
            }
    }
    return 0;
}

// Lists the kernels this build has, separated by spaces, into `out`
// (at most `len` bytes with the terminating zero); returns the count.
extern "C" int memplan_host_kernels(char* out, int len) {
    std::string s;
    int n = 0;
    for (const auto& k : host::kernels) {
        if (n++) s += ' ';
        s += k.name;
    }
    std::snprintf(out, len, "%s", s.c_str());
    return n;
}
