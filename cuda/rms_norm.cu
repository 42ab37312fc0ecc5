// Fused residual-add + RMSNorm.
//
// Layout (all row-major, contiguous, T in {f32, f16, bf16}):
//   x        [rows, h]   T   the sub-layer output to add (e.g. attention or MLP output)
//   res      [rows, h]   T   the running residual stream
//   w        [h]         T   the RMSNorm weight
//   out      [2, rows, h] T  out[0] = x + res (the new residual, rounded to T),
//                            out[1] = rmsnorm(out[0]) * w
// The sum is rounded to T before the norm is taken, exactly as an unfused
// `(x + res)` followed by `rms_norm` would do, so fused and unfused agree.
// Accumulation is in f32. One block of RMS_THREADS threads per row; h is arbitrary.
//
// Fast path (h a multiple of VEC = 16 / sizeof(T), h <= RMS_THREADS * RMS_MAX_V * VEC,
// every pointer 16-byte aligned): each thread holds its RMS_MAX_V 16-byte vectors of x,
// res and w in registers, so the row costs one round of loads, one block reduction and
// one round of stores; w (a weight, never written by a kernel) is loaded before
// `pdl_wait`. Otherwise a strided scalar loop does the same arithmetic.
// Launched with programmatic dependent launch (see pdl_wait in common.cuh).
#include "common.cuh"

using namespace lowbit;

#define RMS_THREADS 256
#define RMS_MAX_V 8

template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ res,
                             const T* __restrict__ w, T* __restrict__ out,
                             int rows, int h, float eps) {
    constexpr int VEC = 16 / sizeof(T);
    __shared__ float sh[32];
    pdl_trigger();
    const int row = blockIdx.x;
    const T* x_rd = x + (size_t)row * h;
    const T* res_rd = res + (size_t)row * h;
    T* sum_wr = out + (size_t)row * h;
    T* norm_wr = out + (size_t)rows * h + (size_t)row * h;
    const bool vec = h % VEC == 0 && h <= RMS_THREADS * RMS_MAX_V * VEC &&
                     (((uintptr_t)x | (uintptr_t)res | (uintptr_t)w | (uintptr_t)out) & 15) == 0;

    if (vec) {
        const int nv = h / VEC;
        uint4 wv[RMS_MAX_V], sv[RMS_MAX_V];
#pragma unroll
        for (int u = 0; u < RMS_MAX_V; ++u) {
            const int i = threadIdx.x + u * RMS_THREADS;
            if (i < nv) wv[u] = __ldg(reinterpret_cast<const uint4*>(w) + i);
        }
        pdl_wait();  // x and res may come from the previous kernel
        uint4 xv[RMS_MAX_V], rv[RMS_MAX_V];
#pragma unroll
        for (int u = 0; u < RMS_MAX_V; ++u) {
            const int i = threadIdx.x + u * RMS_THREADS;
            if (i < nv) {
                xv[u] = reinterpret_cast<const uint4*>(x_rd)[i];
                rv[u] = reinterpret_cast<const uint4*>(res_rd)[i];
            }
        }
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < RMS_MAX_V; ++u) {
            const int i = threadIdx.x + u * RMS_THREADS;
            if (i < nv) {
                float a[VEC], b[VEC];
                unpack16<T>(xv[u], a);
                unpack16<T>(rv[u], b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[e] += b[e];
                sv[u] = pack16<T>(a);  // the new residual, rounded to T
                reinterpret_cast<uint4*>(sum_wr)[i] = sv[u];
                unpack16<T>(sv[u], a);
#pragma unroll
                for (int e = 0; e < VEC; ++e) ss += a[e] * a[e];
            }
        }
        ss = block_sum(ss, sh);
        const float inv = rsqrtf(ss / (float)h + eps);
#pragma unroll
        for (int u = 0; u < RMS_MAX_V; ++u) {
            const int i = threadIdx.x + u * RMS_THREADS;
            if (i < nv) {
                float a[VEC], b[VEC];
                unpack16<T>(sv[u], a);
                unpack16<T>(wv[u], b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[e] = a[e] * inv * b[e];
                reinterpret_cast<uint4*>(norm_wr)[i] = pack16<T>(a);
            }
        }
        return;
    }

    pdl_wait();  // every input may come from the previous kernel
    float ss = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        const T s = from_f32<T>(to_f32(x_rd[i]) + to_f32(res_rd[i]));
        sum_wr[i] = s;
        const float sf = to_f32(s);
        ss += sf * sf;
    }
    ss = block_sum(ss, sh);
    const float inv = rsqrtf(ss / (float)h + eps);
    // Each thread re-reads only the elements it wrote itself: no barrier needed.
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        norm_wr[i] = from_f32<T>(to_f32(sum_wr[i]) * inv * to_f32(w[i]));
    }
}

#define ADD_RMS_NORM(NAME, T)                                                              \
    extern "C" __global__ void NAME(const T* x, const T* res, const T* w, T* out, int rows, \
                                    int h, float eps) {                                    \
        add_rms_norm<T>(x, res, w, out, rows, h, eps);                                     \
    }

ADD_RMS_NORM(add_rms_norm_f32, float)
ADD_RMS_NORM(add_rms_norm_f16, __half)
ADD_RMS_NORM(add_rms_norm_bf16, __nv_bfloat16)
