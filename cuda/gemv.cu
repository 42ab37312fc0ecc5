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
// gemv_silu_mul (the MLP's gate/up projection with SiLU·mul fused):
//   w   [2 * inter, k] T   gate rows, then up rows
//   y   [m, inter] T       silu(x · gate_r) * (x · up_r), rounded as the unfused pair
// Alignment (checked on the host): k * sizeof(T) is a multiple of 16 and x, w start on
// 16-byte boundaries, so rows are read as uint4 (8 halves or 4 floats per load).
//
// Work split (Split<WPR> below; WPR is the host's choice): rows under 8 KiB get one warp
// each, 4 rows per block, 4 16-byte loads per lane per round; longer rows get 8 warps
// each, one row per block, 2 loads per lane per round. Warp j of a row reads rounds j,
// j + WPR, ...; the WPR partial sums meet in shared memory, added in warp order
// (deterministic). W is read with L1::no_allocate (it is touched once); x is small and
// stays in L1/L2.
//
// H200, f16, m = 1 (`bench --filter kernels/ --m 1`, µs; 1 warp x 4 loads / 4 warps x 4 /
// 8 warps x 2 per row): 4096x4096 12.5 / 9.6 / 9.5, 4096x11008 (k = 11008) 23.0 / 23.1 /
// 22.3; Llama-2-7B f16 decode 4.01 / 3.75 / 3.68 ms/token. More warps per row keep more
// loads in flight early and late in these short (10-25 µs) kernels.
#include "common.cuh"

using namespace lowbit;

#define GEMV_MAX_M 8

// Per warps-per-row choice: U 16-byte loads per lane per round, WB warps per block.
template <int WPR> struct Split;
template <> struct Split<1> { static constexpr int U = 4, WB = 4; };
template <> struct Split<8> { static constexpr int U = 2, WB = 8; };

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

// The dot products of x's m rows with R rows of W (`w_rows`), shared by WPR warps: every
// lane of the row's first warp (part 0) gets acc[r][i] = x[i] · w_rows[r]. Every warp of
// the block calls it (`valid` false past the last row: it reads nothing but takes part in
// the block barrier). A lane issues U loads per row of W (predicated at the row's end)
// before using any. Few loads per lane and few registers (32-40 for f16, m = 1) beat deep
// per-lane batches: more resident warps keep as many bytes in flight (16 loads per lane:
// 4096x4096 13.5 µs, 87 registers). The first round is loaded before `pdl_wait` (W is
// never written by a kernel), so under programmatic dependent launch it streams in while
// the previous kernel finishes.
template <typename T, int M, int R, int WPR>
__device__ __forceinline__ void warp_dots(const T* __restrict__ x, const uint4* const (&w_rows)[R], bool valid,
                                          int m, int k, float (&acc)[R][M]) {
    constexpr int U = Split<WPR>::U, WB = Split<WPR>::WB;
    __shared__ float red[WB][R][M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % WPR;
    const int nvec = valid ? k * (int)sizeof(T) / 16 : 0;  // uint4 chunks per row
    const uint4* x_gl_rd = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

    bool waited = false;
    for (int base = part * 32 * U; base < nvec; base += WPR * 32 * U) {
        uint4 wv[R][U];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = base + lane + 32 * u;
                wv[r][u] = c < nvec ? ld_stream(w_rows[r] + c) : make_uint4(0, 0, 0, 0);
            }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + lane + 32 * u;
            if (c < nvec) {
#pragma unroll
                for (int i = 0; i < M; ++i) {
                    if (i < m) {
                        const uint4 xv = __ldg(x_gl_rd + (size_t)i * nvec + c);
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][i] += dot16<T>(wv[r][u], xv);
                    }
                }
            }
        }
    }
    if (!waited) pdl_wait();
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) acc[r][i] = warp_sum(acc[r][i]);
    if (WPR > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < M; ++i) red[warp][r][i] = acc[r][i];
        }
        __syncthreads();
        if (part == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < M; ++i) {
                    float v = red[warp][r][i];
                    for (int j = 1; j < WPR; ++j) v += red[warp + j][r][i];
                    acc[r][i] = v;
                }
        }
    }
}

// y = x · Wᵀ. grid ceil(n * WPR / WB), block 32 * WB, WPR warps per output row.
// M: compile-time bound on m (1, 2, 4, 8).
template <typename T, typename OUT, int M, int WPR>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w, OUT* __restrict__ y, int m,
                     int n, int k) {
    pdl_trigger();
    const int warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (Split<WPR>::WB / WPR) + warp / WPR;
    const bool valid = row < n;
    const uint4* rows[1] = {reinterpret_cast<const uint4*>(w + (size_t)(valid ? row : 0) * k)};
    float acc[1][M];
    warp_dots<T, M, 1, WPR>(x, rows, valid, m, k, acc);
    if (valid && threadIdx.x % (32 * WPR) == 0) {
#pragma unroll
        for (int i = 0; i < M; ++i)
            if (i < m) y[(size_t)i * n + row] = from_f32<OUT>(acc[0][i]);
    }
}

// Gate/up projection with SiLU·mul in its epilogue: W [2 * inter, k] holds the gate rows
// then the up rows; y [m, inter] T = silu(x · gate_r) * (x · up_r). One warp per output
// column r reads gate row r and up row r + inter together. Rounded exactly as the unfused
// pair (gemv to T, then silu_mul of decode.cu): gate and up sums to T, silu(g) to T, the
// product to T, so fused and unfused agree bit for bit.
template <typename T, int M, int WPR>
__device__ void gemv_silu_mul(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int m,
                              int inter, int k) {
    pdl_trigger();
    const int warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (Split<WPR>::WB / WPR) + warp / WPR;
    const bool valid = row < inter;
    const size_t r0 = valid ? row : 0;
    const uint4* rows[2] = {reinterpret_cast<const uint4*>(w + r0 * k),
                            reinterpret_cast<const uint4*>(w + (r0 + inter) * k)};
    float acc[2][M];
    warp_dots<T, M, 2, WPR>(x, rows, valid, m, k, acc);
    if (valid && threadIdx.x % (32 * WPR) == 0) {
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                const float g = to_f32(from_f32<T>(acc[0][i])), u = to_f32(from_f32<T>(acc[1][i]));
                const float sg = to_f32(from_f32<T>(g / (1.f + __expf(-g))));
                y[(size_t)i * inter + row] = from_f32<T>(sg * u);
            }
        }
    }
}

#define GEMV_KERNEL(SUF, T, OSUF, OUT, M, WPR)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * Split<WPR>::WB)                              \
        gemv_##SUF##_##OSUF##_m##M##_w##WPR(const T* x, const T* w, OUT* y, int m, int n, int k) { \
        gemv<T, OUT, M, WPR>(x, w, y, m, n, k);                                                    \
    }

#define GEMV_KERNELS_W(SUF, T, OSUF, OUT, WPR)                                                     \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 1, WPR)                                                         \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 2, WPR)                                                         \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 4, WPR)                                                         \
    GEMV_KERNEL(SUF, T, OSUF, OUT, 8, WPR)

#define GEMV_KERNELS(SUF, T, OSUF, OUT)                                                            \
    GEMV_KERNELS_W(SUF, T, OSUF, OUT, 1)                                                           \
    GEMV_KERNELS_W(SUF, T, OSUF, OUT, 8)

GEMV_KERNELS(f32, float, f32, float)
GEMV_KERNELS(f16, __half, f16, __half)
GEMV_KERNELS(f16, __half, f32, float)
GEMV_KERNELS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
GEMV_KERNELS(bf16, __nv_bfloat16, f32, float)

#define GEMV_SILU_KERNEL(SUF, T, M, WPR)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * Split<WPR>::WB)                              \
        gemv_silu_mul_##SUF##_m##M##_w##WPR(const T* x, const T* w, T* y, int m, int inter, int k) { \
        gemv_silu_mul<T, M, WPR>(x, w, y, m, inter, k);                                            \
    }

#define GEMV_SILU_KERNELS_W(SUF, T, WPR)                                                           \
    GEMV_SILU_KERNEL(SUF, T, 1, WPR)                                                               \
    GEMV_SILU_KERNEL(SUF, T, 2, WPR)                                                               \
    GEMV_SILU_KERNEL(SUF, T, 4, WPR)                                                               \
    GEMV_SILU_KERNEL(SUF, T, 8, WPR)

#define GEMV_SILU_KERNELS(SUF, T)                                                                  \
    GEMV_SILU_KERNELS_W(SUF, T, 1)                                                                 \
    GEMV_SILU_KERNELS_W(SUF, T, 8)

GEMV_SILU_KERNELS(f32, float)
GEMV_SILU_KERNELS(f16, __half)
GEMV_SILU_KERNELS(bf16, __nv_bfloat16)
