// Decode attention (one query token per sequence) over a dense KV cache, split along the
// keys ("flash-decoding"), grouped-query aware: one block reads a KV head's chunk once for
// all the query heads that share it.
//
// Layouts (row-major, contiguous; T in {f32, f16, bf16}):
//   qkv      [b, (nh + 2*nkv) * hd] T  fused projection of the new token; its q heads are
//                                     rotated here (RoPE position pos - pads[s], tables
//                                     cos/sin [max_pos, hd/2] f32, "rotate half" pairs)
//   k_cache  [b, nkv, max_len, hd] T  keys 0..=pos are valid (pos = *pos_p, device u32)
//   v_cache  [b, nkv, max_len, hd] T
//   pads     [b] u32                  keys j < pads[s] are left padding (masked), except j = pos
//   part_o   [b, nh, n_split, hd] f32 scratch: unnormalised partial outputs per key chunk
//   part_ml  [b, nh, n_split, 2] f32  scratch: (running max, sum of exp) per chunk
//   out      [b, nh, hd] T
// Chunks are ATTN_CHUNK keys; n_split = ceil(max_len / ATTN_CHUNK) is fixed by the cache
// capacity and chunks past pos exit at once, so the launch shape does not depend on pos.
// Limits (checked on the host): hd <= 128 and divides 128; nh / nkv <= ATTN_MAX_G.
#include "common.cuh"

using namespace lowbit;

#define ATTN_CHUNK 256
#define ATTN_MAX_G 8
#define ATTN_THREADS 128

// grid (n_split, nkv, b), block ATTN_THREADS, dynamic smem (g*hd + g*ATTN_CHUNK) floats.
template <typename T>
__device__ void attn_partial(const T* __restrict__ qkv, const float* __restrict__ cos,
                             const float* __restrict__ sin, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const uint32_t* __restrict__ pos_p,
                             const uint32_t* __restrict__ pads, float* __restrict__ part_o,
                             float* __restrict__ part_ml, int nh, int nkv, int hd, int max_len,
                             int n_split, float scale) {
    extern __shared__ float sh[];
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int g = nh / nkv;
    const int len = (int)pos_p[0] + 1;
    const int start = split * ATTN_CHUNK;
    if (start >= len) return;
    const int end = min(start + ATTN_CHUNK, len);
    const int pad = (int)pads[s];
    float* q_sh = sh;               // [g, hd]
    float* p_sh = sh + g * hd;      // [g, ATTN_CHUNK]

    {
        const int half = hd / 2, rpos = max(len - 1 - pad, 0);
        const T* q_gl_rd = qkv + (size_t)s * (nh + 2 * nkv) * hd + (size_t)kvh * g * hd;
        for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
            const int hh = idx / hd, d = idx % hd, j = d % half;
            const float c = cos[(size_t)rpos * half + j], sn = sin[(size_t)rpos * half + j];
            const float x0 = to_f32(q_gl_rd[hh * hd + j]), x1 = to_f32(q_gl_rd[hh * hd + j + half]);
            q_sh[idx] = (d < half ? x0 * c - x1 * sn : x1 * c + x0 * sn) * scale;
        }
    }
    __syncthreads();

    // Scores: one warp per key, each lane holds hd/32 (<= 4) elements.
    const size_t head_off = ((size_t)s * nkv + kvh) * (size_t)max_len * hd;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    for (int j = start + warp; j < end; j += n_warps) {
        const T* k_gl_rd = k_cache + head_off + (size_t)j * hd;
        float kr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) kr[e] = (lane + 32 * e < hd) ? to_f32(k_gl_rd[lane + 32 * e]) : 0.f;
        const bool visible = j >= pad || j == len - 1;
#pragma unroll
        for (int hh = 0; hh < ATTN_MAX_G; ++hh) {
            if (hh >= g) break;
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (lane + 32 * e < hd) d += kr[e] * q_sh[hh * hd + lane + 32 * e];
            d = warp_sum(d);
            if (lane == 0) p_sh[hh * ATTN_CHUNK + (j - start)] = visible ? d : -INFINITY;
        }
    }
    __syncthreads();

    // Per head: max and exp over the chunk.
    __shared__ float red[32];
    __shared__ float m_sh[ATTN_MAX_G], l_sh[ATTN_MAX_G];
    const int n = end - start;
    for (int hh = 0; hh < g; ++hh) {
        float m = -INFINITY;
        for (int t = threadIdx.x; t < n; t += blockDim.x) m = fmaxf(m, p_sh[hh * ATTN_CHUNK + t]);
        m = block_max(m, red);
        float l = 0.f;
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            const float e = (m == -INFINITY) ? 0.f : __expf(p_sh[hh * ATTN_CHUNK + t] - m);
            p_sh[hh * ATTN_CHUNK + t] = e;
            l += e;
        }
        l = block_sum(l, red);
        if (threadIdx.x == 0) { m_sh[hh] = m; l_sh[hh] = l; }
    }
    __syncthreads();

    // P·V: thread (sub, d) takes keys t ≡ sub (mod n_sub); partial sums meet in smem.
    const int n_sub = blockDim.x / hd, sub = threadIdx.x / hd, d = threadIdx.x % hd;
    float acc[ATTN_MAX_G];
#pragma unroll
    for (int hh = 0; hh < ATTN_MAX_G; ++hh) acc[hh] = 0.f;
    if (sub < n_sub) {
        for (int t = sub; t < n; t += n_sub) {
            const float v = to_f32(v_cache[head_off + (size_t)(start + t) * hd + d]);
#pragma unroll
            for (int hh = 0; hh < ATTN_MAX_G; ++hh)
                if (hh < g) acc[hh] += p_sh[hh * ATTN_CHUNK + t] * v;
        }
    }
    __syncthreads();  // p_sh is reused below as the reduction buffer [n_sub, g, hd]
    float* r_sh = p_sh;
    if (sub < n_sub) {
#pragma unroll
        for (int hh = 0; hh < ATTN_MAX_G; ++hh)
            if (hh < g) r_sh[(sub * g + hh) * hd + d] = acc[hh];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
        const int hh = idx / hd, dd = idx % hd;
        float o = 0.f;
        for (int u = 0; u < n_sub; ++u) o += r_sh[(u * g + hh) * hd + dd];
        const size_t row = ((size_t)s * nh + kvh * g + hh) * n_split + split;
        part_o[row * hd + dd] = o;
        if (dd == 0) { part_ml[row * 2] = m_sh[hh]; part_ml[row * 2 + 1] = l_sh[hh]; }
    }
}

// grid (nh, b), block hd threads.
template <typename T>
__device__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             const uint32_t* __restrict__ pos_p, T* __restrict__ out, int nh,
                             int hd, int n_split) {
    const int head = blockIdx.x, s = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    const int len = (int)pos_p[0] + 1;
    const int active = min(n_split, (len + ATTN_CHUNK - 1) / ATTN_CHUNK);
    const size_t row0 = ((size_t)s * nh + head) * n_split;
    float m = -INFINITY;
    for (int i = 0; i < active; ++i) m = fmaxf(m, part_ml[(row0 + i) * 2]);
    float l = 0.f, o = 0.f;
    for (int i = 0; i < active; ++i) {
        const float mi = part_ml[(row0 + i) * 2];
        const float w = (mi == -INFINITY) ? 0.f : __expf(mi - m);
        l += w * part_ml[(row0 + i) * 2 + 1];
        o += w * part_o[(row0 + i) * hd + d];
    }
    out[((size_t)s * nh + head) * hd + d] = from_f32<T>(o / l);
}

#define ATTN_KERNELS(SUF, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_partial_##SUF(                \
        const T* qkv, const float* cos, const float* sin, const T* k, const T* v,                 \
        const uint32_t* pos, const uint32_t* pads, float* part_o, float* part_ml, int nh,         \
        int nkv, int hd, int max_len, int n_split, float scale) {                                 \
        attn_partial<T>(qkv, cos, sin, k, v, pos, pads, part_o, part_ml, nh, nkv, hd, max_len,    \
                        n_split, scale);                                                          \
    }                                                                                             \
    extern "C" __global__ void attn_combine_##SUF(const float* part_o, const float* part_ml,       \
                                                  const uint32_t* pos, T* out, int nh, int hd,    \
                                                  int n_split) {                                  \
        attn_combine<T>(part_o, part_ml, pos, out, nh, hd, n_split);                              \
    }

ATTN_KERNELS(f32, float)
ATTN_KERNELS(f16, __half)
ATTN_KERNELS(bf16, __nv_bfloat16)
