// Streaming read: the bandwidth ceiling each benchmark row is held against.
//
// A plain read of N bytes with 16-byte loads, nothing else: the fastest any kernel can
// read the same bytes in one launch. The loaded words are folded with XOR and one word
// per block is written, so the loads cannot be optimised away.
//
// Layout:
//   src   [n16]        uint4   the buffer's bytes (any dtype), 16-byte aligned, N = 16 * n16
//   out   [gridDim.x]  u32     out[b] = XOR of every 32-bit word of the uint4s block b read
// Work split (grid-stride): thread g = blockIdx.x * blockDim.x + threadIdx.x reads uint4
// indices g, g + G, g + 2G, ... with G = gridDim.x * blockDim.x, four loads in flight per
// iteration. So uint4 i belongs to block (i mod G) / blockDim.x: the CPU reference
// (src/ops/stream_read.rs) folds the same words into the same blocks.
// blockDim.x must be a multiple of 32 and at most 1024.
#include <stdint.h>

__device__ __forceinline__ uint32_t fold4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint32_t warp_xor(uint32_t v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void stream_read_xor(const uint4* __restrict__ src, uint32_t* __restrict__ out,
                                           unsigned long long n16) {
    __shared__ uint32_t sh[32];
    const unsigned long long g_stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long src_rd = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;

    // Load stage: four independent 16-byte loads per iteration, then the tail.
    uint32_t acc = 0;
    for (; src_rd + 3 * g_stride < n16; src_rd += 4 * g_stride) {
        const uint4 a = src[src_rd];
        const uint4 b = src[src_rd + g_stride];
        const uint4 c = src[src_rd + 2 * g_stride];
        const uint4 d = src[src_rd + 3 * g_stride];
        acc ^= fold4(a) ^ fold4(b) ^ fold4(c) ^ fold4(d);
    }
    for (; src_rd < n16; src_rd += g_stride) acc ^= fold4(src[src_rd]);

    // Reduce stage: warp, then block; one word per block.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    acc = warp_xor(acc);
    if (lane == 0) sh[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        uint32_t v = lane < n_warps ? sh[lane] : 0u;
        v = warp_xor(v);
        if (lane == 0) out[blockIdx.x] = v;
    }
}
