// Decode attention (one query token per sequence) over a dense KV cache, split along the
// keys ("flash-decoding"), grouped-query aware: one block reads a KV head's chunk of keys
// once for all the query heads that share it. One launch. Up to `cluster` (8) active
// chunks per KV head merge inside a thread-block cluster: launched with clusters of
// `cluster` blocks along x, block 0 of the head reads the others' partial results from
// their shared memory (two cluster barriers, no global memory). More chunks (long
// contexts) merge through global memory: the last block of a KV head to finish merges
// the chunks' partials (a counter per (sequence, KV head), reset by that block, so a
// captured graph replays it), with the partials' loads batched (lanes over chunks for the
// maxima and sums, ATTN_MERGE chunks at a time for the outputs). `cluster` 0: always the
// global merge (the host uses clusters only on sm_90+, at batch 1, and for caches of at
// most ATTN_MAX_CLUSTER chunks, where one cluster covers a KV head). With `append` the same launch also does
// the decode step's RoPE + cache append: the block holding row pos rotates the new K,
// writes K and V to row pos (k_out, v_out: the same buffers as k_cache, v_cache) and uses
// them from shared memory; no other block reads row pos.
//
// One kernel per (run dtype T, KV encoding E, APPEND), all taking one AttnParams. The
// encodings (dense T rows, kv4, oaken) and their byte layouts are in kv_codec.cuh: a
// lane reads a chunk of E::EPL values of a row (16 bytes of T, or 4 bytes of codes plus
// the row's scales and, for oaken, its segment's sparse entries) and dequantizes it in
// registers; everything after that is the same for every encoding.
//
// Layouts (row-major, contiguous; T in {f32, f16, bf16}):
//   qkv      [b, (nh + 2*nkv) * hd] T  fused projection of the new token; its q heads are
//                                     rotated here (RoPE position pos - pads[s], tables
//                                     cos/sin [max_pos, hd/2] f32, "rotate half" pairs)
//   k        [b, nkv, max_len, rec]   K rows, `rec` bytes each (dense: hd T); rows
//   v        [b, nkv, max_len, rec]   0..pos are valid (pos = *pos, device u32); row pos
//                                     too without APPEND; with it, row pos is written
//                                     from qkv's k and v heads (k rotated like q; a
//                                     quantized row is encoded by warps 0 and 1 of the
//                                     block that holds it and read back after a barrier)
//   pads     [b] u32                  keys j < pads[s] are left padding (masked), except j = pos
//   part_o   [b, nh, n_split, hd] f32 scratch: unnormalised partial outputs per key chunk
//   part_ml  [b, nh, n_split, 2] f32  scratch: (max score, sum of exp) per chunk
//   counters [b, nkv] u32             zero between launches (the merging block resets it)
//   out      [b, nh, hd] T
// The launch shape is fixed by the capacity, not by pos: n_split = ceil(max_len / chunk)
// blocks per KV head (rounded up to a multiple of `cluster` in the grid), `chunk` (a host choice) bounding the keys per block. Each launch
// spreads the len = pos + 1 keys over those blocks: c = clamp(ceil(len / n_split), B,
// chunk) keys per block, B = the rows one round of loads covers (ATTN_UNROLL rows per lane
// group: 32 for f16 at hd 128), so a short context keeps many blocks busy (129 keys: 5
// blocks of 32 per KV head, each loading all its rows before pdl_wait) and blocks past
// the last key exit at once.
//
// Work split in a block (ATTN_THREADS threads): K and V rows are read in chunks of EPL
// values, LPK = hd / EPL lanes per row, ATTN_THREADS / LPK rows at a time,
// ATTN_UNROLL batches of loads issued before any is used. The first batch of K and V rows
// older than pos is loaded before `pdl_wait` (nothing in the step writes them, and pos
// is set before the step: see advance_pos in decode.cu), so at short contexts the whole
// chunk streams in while the QKV projection finishes.
// Limits (checked on the host): hd divides 128 and hd >= EPL (quantized: hd in 32, 64,
// 128); nh / nkv <= ATTN_MAX_G; chunk <= 256. Launched with programmatic dependent launch (pdl_wait, common.cuh).
#include "kv_codec.cuh"

using namespace lowbit;

#define ATTN_MAX_G 8
#define ATTN_THREADS 128
#define ATTN_UNROLL 4
#define ATTN_MERGE 8
#define ATTN_MAX_CLUSTER 8

// Every input of one launch (the host fills the same struct, src/ops/decode_cuda.rs).
struct AttnParams {
    const void* qkv;
    const float* cos;
    const float* sin;
    uint8_t* k;  // K rows of the whole cache
    uint8_t* v;  // V rows
    const uint32_t* pos;
    const uint32_t* pads;
    float* part_o;
    float* part_ml;
    uint32_t* counters;
    void* out;
    int nh, nkv, hd, max_len, n_split, chunk, cluster, rec;
    float scale, pad;
    KvThr thr_k, thr_v;
};

// grid (n_split, nkv, b), block ATTN_THREADS, dynamic smem
// (g*hd + g*chunk + ATTN_THREADS*EPL*g) floats.
template <typename T, typename E, bool APPEND>
__device__ void attn_decode(const AttnParams& p) {
    constexpr int EPL = E::EPL;
    using Chunk = typename E::Chunk;
    extern __shared__ float sh[];
    __shared__ float m_sh[ATTN_MAX_G], l_sh[ATTN_MAX_G];
    __shared__ __align__(16) T knew_sh[128], vnew_sh[128];
    __shared__ bool last_sh;
    pdl_trigger();
    // Before pdl_wait only what no kernel of this step writes: pos and pads (set by the
    // previous step's advance_pos, which does not trigger early, or by host copies) and
    // the cache rows before the new one.
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int nh = p.nh, nkv = p.nkv, hd = p.hd, chunk = p.chunk, n_split = p.n_split;
    const int g = nh / nkv;
    const int lpk = hd / EPL;               // lanes per K/V row
    const int rows_per_pass = ATTN_THREADS / lpk;
    const int len = (int)p.pos[0] + 1, j_new = len - 1;  // j_new: the current token's row
    // keys per block
    const int c = min(chunk, max(rows_per_pass * ATTN_UNROLL, (len + n_split - 1) / n_split));
    const int start = split * c;
    const int n_active = (len + c - 1) / c;
    // Up to `cluster` active chunks merge through distributed shared memory in cluster 0
    // (blocks 0..cluster of this KV head); more go through global memory and a counter.
    const bool in_cluster = p.cluster > 0 && n_active > 1 && n_active <= p.cluster;
    if (start >= len) {
        if (!in_cluster || split >= p.cluster) return;
        // An empty member of cluster 0: contributes nothing, stays until the merge is done.
        if (threadIdx.x < ATTN_MAX_G) { m_sh[threadIdx.x] = -INFINITY; l_sh[threadIdx.x] = 0.f; }
        cluster_sync();
        cluster_sync();
        return;
    }
    const int end = min(start + c, len), n = end - start;
    const bool has_new = j_new < end;  // this block holds the current token's key
    const int pad = (int)p.pads[s];
    // This thread's RoPE pair: every q element it rotates (idx = threadIdx.x + 128 i) and
    // the new key's pair j = threadIdx.x < hd / 2 share d = threadIdx.x % hd (hd | 128).
    const int half = hd / 2, rpos = max(j_new - pad, 0);
    const int jr = (threadIdx.x % hd) % half;
    const float rc = p.cos[(size_t)rpos * half + jr], rs = p.sin[(size_t)rpos * half + jr];
    const int sub = threadIdx.x % lpk, grp = threadIdx.x / lpk;
    float* q_sh = sh;                        // [g, hd]
    float* p_sh = q_sh + g * hd;             // [g, chunk]
    float* r_sh = p_sh + g * chunk;          // [rows_per_pass, g, hd]

    const size_t head_off = ((size_t)s * nkv + kvh) * (size_t)p.max_len * p.rec;
    const E kc{p.k + head_off, p.rec, hd, p.thr_k};
    const E vc{p.v + head_off, p.rec, hd, p.thr_v};
    // The first ATTN_UNROLL rows per lane group of K and V, older rows only.
    Chunk k_first[ATTN_UNROLL], v_first[ATTN_UNROLL];
#pragma unroll
    for (int u = 0; u < ATTN_UNROLL; ++u) {
        const int t = u * rows_per_pass + grp, j = start + t;
        const bool old = t < n && j != j_new;
        if (old) { k_first[u] = kc.load(j, sub); v_first[u] = vc.load(j, sub); }
        else { k_first[u] = Chunk{}; v_first[u] = Chunk{}; }
    }
    pdl_wait();  // qkv comes from the previous kernel

    const T* row_gl_rd = static_cast<const T*>(p.qkv) + (size_t)s * (nh + 2 * nkv) * hd;
    {
        const T* q_gl_rd = row_gl_rd + (size_t)kvh * g * hd;
        for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
            const int hh = idx / hd, d = idx % hd;
            const float x0 = to_f32(q_gl_rd[hh * hd + jr]), x1 = to_f32(q_gl_rd[hh * hd + jr + half]);
            q_sh[idx] = (d < half ? x0 * rc - x1 * rs : x1 * rc + x0 * rs) * p.scale;
        }
    }
    // The current token's K (rotated) and V: from qkv, also written to the cache (APPEND),
    // or from the cache, where an earlier kernel put them.
    if (has_new) {
        const int j = threadIdx.x;  // one rotation pair per thread (half <= 64)
        if constexpr (!E::QUANT) {
            T* k_out = reinterpret_cast<T*>(p.k + head_off) + (size_t)j_new * hd;
            T* v_out = reinterpret_cast<T*>(p.v + head_off) + (size_t)j_new * hd;
            if (j < half) {
                if (APPEND) {
                    const T* k_gl_rd1 = row_gl_rd + (size_t)(nh + kvh) * hd;
                    const T* v_gl_rd1 = row_gl_rd + (size_t)(nh + nkv + kvh) * hd;
                    const float k0 = to_f32(k_gl_rd1[j]), k1 = to_f32(k_gl_rd1[j + half]);
                    knew_sh[j] = from_f32<T>(k0 * rc - k1 * rs);
                    knew_sh[j + half] = from_f32<T>(k1 * rc + k0 * rs);
                    vnew_sh[j] = v_gl_rd1[j];
                    vnew_sh[j + half] = v_gl_rd1[j + half];
                    k_out[j] = knew_sh[j];
                    k_out[j + half] = knew_sh[j + half];
                    v_out[j] = vnew_sh[j];
                    v_out[j + half] = vnew_sh[j + half];
                } else {
                    knew_sh[j] = k_out[j];
                    knew_sh[j + half] = k_out[j + half];
                    vnew_sh[j] = v_out[j];
                    vnew_sh[j + half] = v_out[j + half];
                }
            }
        } else if (APPEND) {
            // The new rows in f32 (rounded to T, as a dense cache would hold them) in r_sh
            // (free until P·V), then warp 0 encodes K and warp 1 V into the cache.
            float* xk = r_sh;
            float* xv = r_sh + hd;
            if (j < half) {
                const T* k_gl_rd1 = row_gl_rd + (size_t)(nh + kvh) * hd;
                const T* v_gl_rd1 = row_gl_rd + (size_t)(nh + nkv + kvh) * hd;
                float y0, y1;
                rope_pair_rn(to_f32(k_gl_rd1[j]), to_f32(k_gl_rd1[j + half]), rc, rs, y0, y1);
                xk[j] = to_f32(from_f32<T>(y0));
                xk[j + half] = to_f32(from_f32<T>(y1));
                xv[j] = to_f32(v_gl_rd1[j]);
                xv[j + half] = to_f32(v_gl_rd1[j + half]);
            }
            __syncthreads();
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
            if (warp == 0) E::quantize_warp(xk, p.k + head_off + (size_t)j_new * p.rec, hd, p.thr_k, lane);
            if (warp == 1) E::quantize_warp(xv, p.v + head_off + (size_t)j_new * p.rec, hd, p.thr_v, lane);
        }
    }
    __syncthreads();
    const uint4* knew4 = reinterpret_cast<const uint4*>(knew_sh);
    const uint4* vnew4 = reinterpret_cast<const uint4*>(vnew_sh);
    // Row j_new: dense from shared memory; quantized from the cache (written above by
    // this block, or earlier), bypassing L1.
    auto new_k = [&](Chunk& dst) {
        if constexpr (E::QUANT) dst = kc.load_cg(j_new, sub);
        else dst = knew4[sub];
    };
    auto new_v = [&](Chunk& dst) {
        if constexpr (E::QUANT) dst = vc.load_cg(j_new, sub);
        else dst = vnew4[sub];
    };

    // Scores: LPK lanes per key, partial dots reduced with shuffles inside the lane group.
    for (int base = 0; base < n; base += rows_per_pass * ATTN_UNROLL) {
        Chunk kv[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp, j = start + t;
            if (base == 0) kv[u] = k_first[u];
            else if (t < n && j != j_new) kv[u] = kc.load(j, sub);
            else kv[u] = Chunk{};
            if (t < n && j == j_new) new_k(kv[u]);
        }
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp;
            float kf[EPL];
            kc.unpack(kv[u], sub, kf);
            const int j = start + t;
            const bool visible = j >= pad || j == j_new;
#pragma unroll
            for (int hh = 0; hh < ATTN_MAX_G; ++hh) {
                if (hh >= g) break;
                const float* q = q_sh + hh * hd + sub * EPL;
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) d += kf[e] * q[e];
                for (int o = lpk / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (sub == 0 && t < n) p_sh[hh * chunk + t] = visible ? d : -INFINITY;
            }
        }
    }
    __syncthreads();

    // Softmax pieces per head: a warp per head, no block-wide barrier inside.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int hh = warp; hh < g; hh += ATTN_THREADS / 32) {
        float m = -INFINITY;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, p_sh[hh * chunk + t]);
        m = warp_max(m);
        float l = 0.f;
        for (int t = lane; t < n; t += 32) {
            const float e = (m == -INFINITY) ? 0.f : __expf(p_sh[hh * chunk + t] - m);
            p_sh[hh * chunk + t] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { m_sh[hh] = m; l_sh[hh] = l; }
    }
    __syncthreads();

    // P·V: lane group `grp` takes rows t ≡ grp (mod rows_per_pass), EPL dims per thread.
    float acc[ATTN_MAX_G][EPL];
#pragma unroll
    for (int hh = 0; hh < ATTN_MAX_G; ++hh)
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[hh][e] = 0.f;
    for (int base = 0; base < n; base += rows_per_pass * ATTN_UNROLL) {
        Chunk vv[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp, j = start + t;
            if (base == 0) vv[u] = v_first[u];
            else if (t < n && j != j_new) vv[u] = vc.load(j, sub);
            else vv[u] = Chunk{};
            if (t < n && j == j_new) new_v(vv[u]);
        }
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp;
            if (t >= n) break;
            float vf[EPL];
            vc.unpack(vv[u], sub, vf);
#pragma unroll
            for (int hh = 0; hh < ATTN_MAX_G; ++hh) {
                if (hh >= g) break;
                const float pr = p_sh[hh * chunk + t];
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[hh][e] += pr * vf[e];
            }
        }
    }
    // r_sh held the new quantized rows: every thread is past its last read of them (the
    // barrier after the scores), so it is free again.
#pragma unroll
    for (int hh = 0; hh < ATTN_MAX_G; ++hh) {
        if (hh >= g) break;
#pragma unroll
        for (int e = 0; e < EPL; ++e) r_sh[(grp * g + hh) * hd + sub * EPL + e] = acc[hh][e];
    }
    __syncthreads();

    T* out = static_cast<T*>(p.out);
    const size_t row0 = (size_t)s * nh + (size_t)kvh * g;  // first query head of this block
    if (n_active == 1) {
        for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
            const int hh = idx / hd, d = idx % hd;
            float o = 0.f;
            for (int u = 0; u < rows_per_pass; ++u) o += r_sh[(u * g + hh) * hd + d];
            out[(row0 + hh) * hd + d] = from_f32<T>(o / l_sh[hh]);
        }
        return;
    }
    if (in_cluster) {
        // This block's unnormalised output into q_sh (free since the scores); block 0
        // reads every member's (m, l, o) from its shared memory and writes the result.
        for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
            const int hh = idx / hd, d = idx % hd;
            float o = 0.f;
            for (int u = 0; u < rows_per_pass; ++u) o += r_sh[(u * g + hh) * hd + d];
            q_sh[idx] = o;
        }
        cluster_sync();
        if (split == 0) {
            for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
                const int hh = idx / hd;
                float mi[ATTN_MAX_CLUSTER], m = -INFINITY;
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r) {
                    mi[r] = r < n_active ? ld_cluster(&m_sh[hh], r) : -INFINITY;
                    m = fmaxf(m, mi[r]);
                }
                float l = 0.f, o = 0.f;
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r) {
                    if (r < n_active && mi[r] != -INFINITY) {
                        const float w = __expf(mi[r] - m);
                        l += w * ld_cluster(&l_sh[hh], r);
                        o += w * ld_cluster(&q_sh[idx], r);
                    }
                }
                out[(row0 + hh) * hd + idx % hd] = from_f32<T>(o / l);
            }
        }
        cluster_sync();
        return;
    }
    float* part_o = p.part_o;
    float* part_ml = p.part_ml;
    for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
        const int hh = idx / hd, d = idx % hd;
        float o = 0.f;
        for (int u = 0; u < rows_per_pass; ++u) o += r_sh[(u * g + hh) * hd + d];
        const size_t row = (row0 + hh) * n_split + split;
        part_o[row * hd + d] = o;
        if (d == 0) { part_ml[row * 2] = m_sh[hh]; part_ml[row * 2 + 1] = l_sh[hh]; }
    }

    // The last block of this (sequence, KV head) to get here merges every chunk.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t ticket = atomicAdd(&p.counters[(size_t)s * nkv + kvh], 1u);
        last_sh = ticket == (uint32_t)(n_active - 1);
    }
    __syncthreads();
    if (!last_sh) return;
    __threadfence();
    // Per head: the largest chunk maximum M and the sum L of the chunks' exp sums scaled to
    // it, a warp per head with its lanes over the chunks (loads of 32 chunks in flight).
    for (int hh = warp; hh < g; hh += ATTN_THREADS / 32) {
        const size_t r0 = (row0 + hh) * n_split;
        float m = -INFINITY;
        for (int i = lane; i < n_active; i += 32) m = fmaxf(m, __ldcg(part_ml + (r0 + i) * 2));
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < n_active; i += 32) {
            const float mi = __ldcg(part_ml + (r0 + i) * 2);
            l += (mi == -INFINITY) ? 0.f : __expf(mi - m) * __ldcg(part_ml + (r0 + i) * 2 + 1);
        }
        l = warp_sum(l);
        if (lane == 0) { m_sh[hh] = m; l_sh[hh] = l; }
    }
    __syncthreads();
    // Outputs: each element sums its chunks in order, ATTN_MERGE chunks' loads at a time.
    for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
        const int hh = idx / hd, d = idx % hd;
        const size_t r0 = (row0 + hh) * n_split;
        const float m = m_sh[hh];
        float o = 0.f;
        for (int i0 = 0; i0 < n_active; i0 += ATTN_MERGE) {
            float mi[ATTN_MERGE], oi[ATTN_MERGE];
#pragma unroll
            for (int u = 0; u < ATTN_MERGE; ++u) {
                const int i = i0 + u;
                mi[u] = i < n_active ? __ldcg(part_ml + (r0 + i) * 2) : -INFINITY;
                oi[u] = i < n_active ? __ldcg(part_o + (r0 + i) * hd + d) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < ATTN_MERGE; ++u) o += (mi[u] == -INFINITY) ? 0.f : __expf(mi[u] - m) * oi[u];
        }
        out[(row0 + hh) * hd + d] = from_f32<T>(o / l_sh[hh]);
    }
    if (threadIdx.x == 0) p.counters[(size_t)s * nkv + kvh] = 0;
}

// attn_decode_<dtype>_<encoding>[_append]
#define ATTN_KERNEL(NAME, T, E, APPEND)                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                           \
        NAME(const __grid_constant__ AttnParams p) {                                     \
        attn_decode<T, E, APPEND>(p);                                                     \
    }
#define ATTN_KERNELS(SUF, T)                                                             \
    ATTN_KERNEL(attn_decode_##SUF##_dense, T, DenseKv<T>, false)                         \
    ATTN_KERNEL(attn_decode_##SUF##_dense_append, T, DenseKv<T>, true)                   \
    ATTN_KERNEL(attn_decode_##SUF##_kv4, T, Kv4, false)                                  \
    ATTN_KERNEL(attn_decode_##SUF##_kv4_append, T, Kv4, true)                            \
    ATTN_KERNEL(attn_decode_##SUF##_oaken, T, Oaken, false)                              \
    ATTN_KERNEL(attn_decode_##SUF##_oaken_append, T, Oaken, true)

ATTN_KERNELS(f32, float)
ATTN_KERNELS(f16, __half)
ATTN_KERNELS(bf16, __nv_bfloat16)
