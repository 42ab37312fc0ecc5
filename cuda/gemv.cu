// Skinny matmul for decode: y = x · Wᵀ with few activation rows (m <= 8), dense weights.
//
// At batch 1..8 a linear layer is a streaming read of W: every weight is used m times, so
// the kernel's one job is to keep enough 16-byte loads of W in flight to run at DRAM speed
// and to do little else per weight. cuBLAS's GEMM at m = 1 reads 4096x4096 f16 at about
// 2.4 TB/s on the H200; this kernel is held to the streaming-read ceiling instead.
//
// Layouts (row-major, contiguous; T in {f32, f16, bf16}; OUT in {T, f32}):
//   x   [m, k] T      activations (m <= GEMV_MAX_M)
//   w   [n, k] T      weight, one output feature per row (candle_nn::Linear layout)
//   y   [m, n] OUT    y[i, r] = sum_j x[i, j] * w[r, j], accumulated in f32, rounded once
// Alignment (checked on the host): k * sizeof(T) is a multiple of 16 and x, w start on
// 16-byte boundaries, so rows are read as uint4 (8 halves or 4 floats per load).
//
// Work split: one warp per output row; GEMV_WARPS warps per block. A lane reads chunks
// lane, lane + 32, ... of its row, GEMV_UNROLL chunks per batch. W is read with
// L1::no_allocate (it is touched once); x is small and stays in L1/L2.
#include "common.cuh"

using namespace lowbit;

#define GEMV_MAX_M 8
#define GEMV_WARPS 4
#define GEMV_UNROLL 4

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Dot product of one 16-byte chunk of w with the same chunk of x, in f32.
template <typename T> __device__ __forceinline__ float dot16(uint4 w, uint4 x) {
    constexpr int VEC = 16 / sizeof(T);
    float a[VEC], b[VEC];
    unpack16<T>(w, a);
    unpack16<T>(x, b);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s += a[e] * b[e];
    return s;
}

// grid ceil(n / GEMV_WARPS), block 32 * GEMV_WARPS. M: compile-time bound on m (1, 2, 4, 8).
// A lane issues GEMV_UNROLL loads of W (predicated at the row's end) before using any.
// Few loads per lane and few registers (38 for f16, m = 1) beat deep per-lane batches:
// more resident warps keep as many bytes in flight and the grid runs in fewer waves
// (H200, f16, m = 1: 4096x4096 12.3 µs with 4 loads per lane against 13.5 with 16, and
// 11008x4096 23.7 against 25.0; Llama-2-7B decode 4.21 ms/token against 4.41). The first batch is loaded
// before `pdl_wait` (W is never written by a kernel), so under programmatic dependent
// launch it streams in while the previous kernel finishes.
template <typename T, typename OUT, int M>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w, OUT* __restrict__ y, int m,
                     int n, int k) {
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;
    const int nvec = k * (int)sizeof(T) / 16;  // uint4 chunks per row
    const uint4* w_gl_rd = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const uint4* x_gl_rd = reinterpret_cast<const uint4*>(x);
    float acc[M];
#pragma unroll
    for (int i = 0; i < M; ++i) acc[i] = 0.f;

    for (int base = 0; base < nvec; base += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = base + lane + 32 * u;
            wv[u] = c < nvec ? ld_stream(w_gl_rd + c) : make_uint4(0, 0, 0, 0);
        }
        if (base == 0) pdl_wait();
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = base + lane + 32 * u;
            if (c < nvec) {
#pragma unroll
                for (int i = 0; i < M; ++i)
                    if (i < m) acc[i] += dot16<T>(wv[u], __ldg(x_gl_rd + (size_t)i * nvec + c));
            }
        }
    }
    if (nvec == 0) pdl_wait();
#pragma unroll
    for (int i = 0; i < M; ++i) {
        if (i < m) {
            const float s = warp_sum(acc[i]);
            if (lane == 0) y[(size_t)i * n + row] = from_f32<OUT>(s);
        }
    }
}

#define GEMV_KERNEL(SUF, T, OSUF, OUT, M)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                                  \
        gemv_##SUF##_##OSUF##_m##M(const T* x, const T* w, OUT* y, int m, int n, int k) {          \
        gemv<T, OUT, M>(x, w, y, m, n, k);                                                         \
    }

#define GEMV_KERNELS(SUF, T, OSUF, OUT)                                                            \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 1)                                                              \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 2)                                                              \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 4)                                                              \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 8)

GEMV_KERNELS(f32, float, f32, float)
GEMV_KERNELS(f16, __half, f16, __half)
GEMV_KERNELS(f16, __half, f32, float)
GEMV_KERNELS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
GEMV_KERNELS(bf16, __nv_bfloat16, f32, float)
