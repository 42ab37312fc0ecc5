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
// Accumulation is in f32. One block of 256 threads per row; h is arbitrary.
// Launched with programmatic dependent launch (see pdl_wait in common.cuh).
#include "common.cuh"

using namespace lowbit;

template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ res,
                             const T* __restrict__ w, T* __restrict__ out,
                             int rows, int h, float eps) {
    __shared__ float sh[32];
    pdl_trigger();
    pdl_wait();  // every input may come from the previous kernel
    const int row = blockIdx.x;
    if (row >= rows) return;
    const T* x_rd = x + (size_t)row * h;
    const T* res_rd = res + (size_t)row * h;
    T* sum_wr = out + (size_t)row * h;
    T* norm_wr = out + (size_t)rows * h + (size_t)row * h;

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
