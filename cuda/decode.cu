// Decode-step kernels: token embedding, RoPE + KV-cache append, SiLU·mul, position advance.
// (At decode, one token per sequence, decode attention rotates the query and does the
// RoPE + append of K and V itself; rope_kv serves prompts.)
// Positions come from device memory (`pos`, one u32), so a captured CUDA graph replays
// the same launches at every step; per-sequence left padding `pads` [b] u32.
//
// Layouts (row-major, contiguous; T in {f32, f16, bf16}):
//   embed_gather:  table [vocab, h] T, ids [n] u32           -> out [n, h] T
//   rope_kv:       qkv   [b, seq, (nh + 2*nkv) * hd] T  (q heads, then k heads, then v heads)
//                  cos, sin [max_pos, hd/2] f32 (HF "rotate half" RoPE: pairs i, i + hd/2)
//                  k_cache, v_cache [b, nkv, max_len, hd] T: row (pos + i) written in place
//                  The RoPE position of token i of sequence s is pos + i - pads[s] (0 if < 0).
//   silu_mul:      gu [rows, 2*I] T (gate then up) -> out [rows, I] T = silu(gate) * up
// Every kernel here is launched with programmatic dependent launch (pdl_wait, common.cuh).
#include "common.cuh"

using namespace lowbit;

template <typename T>
__device__ void embed_gather(const T* __restrict__ table, const uint32_t* __restrict__ ids,
                             T* __restrict__ out, int n, int h, int vocab) {
    pdl_trigger();
    pdl_wait();  // every input may come from the previous kernel
    const int row = blockIdx.x;
    if (row >= n) return;
    uint32_t id = ids[row];
    if (id >= (uint32_t)vocab) id = 0;  // validated on the host where ids are host values
    const T* src = table + (size_t)id * h;
    T* dst = out + (size_t)row * h;
    if ((h * sizeof(T)) % 16 == 0 && ((uintptr_t)src | (uintptr_t)dst) % 16 == 0) {
        // 16-byte vectors, all of a thread's loads issued before its stores.
        const int nv = h * (int)sizeof(T) / 16;
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
        for (int base = 0; base < nv; base += 4 * blockDim.x) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = base + u * blockDim.x + threadIdx.x;
                if (i < nv) v[u] = s4[i];
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = base + u * blockDim.x + threadIdx.x;
                if (i < nv) d4[i] = v[u];
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x) dst[i] = src[i];
}

// grid: (seq, b, nkv), block: hd/2 threads (one rotation pair each).
template <typename T>
__device__ void rope_kv(const T* __restrict__ qkv, const float* __restrict__ cos,
                        const float* __restrict__ sin, const uint32_t* __restrict__ pos_p,
                        const uint32_t* __restrict__ pads, T* __restrict__ k_cache,
                        T* __restrict__ v_cache, int seq, int nh, int nkv, int hd, int max_len) {
    pdl_trigger();
    pdl_wait();  // every input may come from the previous kernel
    const int i = blockIdx.x, s = blockIdx.y, kh = blockIdx.z, j = threadIdx.x;
    const int half = hd / 2;
    if (j >= half) return;
    const int pos = (int)pos_p[0];
    const T* row = qkv + ((size_t)s * seq + i) * (size_t)((nh + 2 * nkv) * hd);
    int rpos = pos + i - (int)pads[s];
    if (rpos < 0) rpos = 0;
    const float c = cos[(size_t)rpos * half + j], sn = sin[(size_t)rpos * half + j];
    const T* k_gl_rd = row + (nh + kh) * hd;
    const T* v_gl_rd = row + (nh + nkv + kh) * hd;
    const size_t off = (((size_t)s * nkv + kh) * max_len + pos + i) * hd;
    const float k0 = to_f32(k_gl_rd[j]), k1 = to_f32(k_gl_rd[j + half]);
    k_cache[off + j] = from_f32<T>(k0 * c - k1 * sn);
    k_cache[off + j + half] = from_f32<T>(k1 * c + k0 * sn);
    v_cache[off + j] = v_gl_rd[j];
    v_cache[off + j + half] = v_gl_rd[j + half];
}

template <typename T>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, int rows, int inter) {
    pdl_trigger();
    pdl_wait();  // every input may come from the previous kernel
    const size_t n = (size_t)rows * inter;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t r = idx / inter, c = idx % inter;
        const float g = to_f32(gu[r * 2 * inter + c]);
        const float u = to_f32(gu[r * 2 * inter + inter + c]);
        // Round silu(g) to T first, as the unfused candle ops do.
        const float sg = to_f32(from_f32<T>(g / (1.f + __expf(-g))));
        out[idx] = from_f32<T>(sg * u);
    }
}

#define DECODE_KERNELS(SUF, T)                                                                   \
    extern "C" __global__ void embed_gather_##SUF(const T* table, const uint32_t* ids, T* out,   \
                                                  int n, int h, int vocab) {                     \
        embed_gather<T>(table, ids, out, n, h, vocab);                                           \
    }                                                                                            \
    extern "C" __global__ void rope_kv_##SUF(const T* qkv, const float* cos, const float* sin,   \
                                             const uint32_t* pos, const uint32_t* pads,           \
                                             T* k_cache, T* v_cache, int seq, int nh, int nkv,   \
                                             int hd, int max_len) {                              \
        rope_kv<T>(qkv, cos, sin, pos, pads, k_cache, v_cache, seq, nh, nkv, hd, max_len);       \
    }                                                                                            \
    extern "C" __global__ void silu_mul_##SUF(const T* gu, T* out, int rows, int inter) {        \
        silu_mul<T>(gu, out, rows, inter);                                                       \
    }

DECODE_KERNELS(f32, float)
DECODE_KERNELS(f16, __half)
DECODE_KERNELS(bf16, __nv_bfloat16)

// pos [1] u32 += by (the last launch of a captured decode step). It does not trigger its
// dependents early, so every later kernel starts after pos is written and may read pos
// (and the cache rows the step wrote) before its own pdl_wait (decode_attention.cu).
extern "C" __global__ void advance_pos(uint32_t* pos, uint32_t by) {
    pdl_wait();  // every input may come from the previous kernel
    if (threadIdx.x == 0 && blockIdx.x == 0) pos[0] += by;
}
