// Warp-level tensor-core helpers shared by the attention kernels: mma.sync m16n8k16 with
// f32 accumulators (f16 or bf16 operands), ldmatrix, and ex2 (one MUFU op). Fragment
// layouts are PTX's ("Matrix Fragments for mma.m16n8k16"): with g = lane / 4 and
// t = lane % 4, A's registers hold (row g | g + 8, columns 2t, 2t + 1 | + 8), B's
// (k 2t, 2t + 1 | + 8, column g) and C's (row g | g + 8, columns 2t, 2t + 1).
#pragma once
#include "common.cuh"

namespace lowbit {

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma_f16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += a·b in the operand type T (__half or __nv_bfloat16), f32 accumulators.
template <typename T> __device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma_16816<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    mma_f16_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    mma_bf16_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

// Two f32 values rounded to one 32-bit pair of T (the first in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Four 8x8 b16 matrices from shared memory: lanes 8 q .. 8 q + 7 give the row addresses of
// matrix q; register q of lane l holds row l / 4, columns 2 (l % 4) .. + 1 of matrix q
// (`_trans`: row 2 (l % 4) .. + 1, column l / 4 — the B fragment of a row-major k x n tile).
__device__ __forceinline__ void ldsm_x4(uint32_t sa, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(sa));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t sa, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(sa));
}

}  // namespace lowbit
