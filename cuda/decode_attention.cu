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
// Two kernel families, both taking one AttnParams and ending in attn_finish (the merge of
// the key chunks). The generic one, per (run dtype T, APPEND), for dense rows: a lane
// reads a chunk of 16 bytes of a row. The tensor-core one for the packed caches, kv4 and
// oaken (attn_decode_tc, further down): mma over the raw codes with the per-key scales
// folded out, Oaken's sparse entries as corrections. Encodings and byte layouts:
// kv_codec.cuh.
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
// blocks per KV head (rounded up to a multiple of `cluster` in the grid), `chunk` (a host
// choice) bounding the keys per block. Each launch spreads the len = pos + 1 keys over
// those blocks: c = clamp(ceil(len / n_split), B, chunk) keys per block, B = the rows one
// round of loads covers (E::UNROLL rows per lane group: 32 for f16 at hd 128; for the
// packed caches one step of every warp, 64), so a short context keeps many blocks busy (129 keys: 5
// blocks of 32 per KV head, each loading all its rows before pdl_wait) and blocks past
// the last key exit at once.
//
// Work split in a block (ATTN_THREADS threads): K and V rows are read in chunks of EPL
// values, LPK = hd / EPL lanes per row, ATTN_THREADS / LPK rows at a time,
// E::UNROLL batches of loads issued before any is used. The first batch of K and V rows
// older than pos is loaded before `pdl_wait` (nothing in the step writes them, and pos
// is set before the step: see advance_pos in decode.cu), so at short contexts the whole
// chunk streams in while the QKV projection finishes.
// Limits (checked on the host): hd divides 128 and hd >= EPL (packed caches: hd 64 or
// 128); nh / nkv <= ATTN_MAX_G; chunk <= 256 for the generic kernel (any for the
// tensor-core one). Launched with programmatic dependent launch (pdl_wait, common.cuh).
#include "kv_codec.cuh"
#include "mma.cuh"

using namespace lowbit;

#define ATTN_MAX_G 8
#define ATTN_THREADS 128
#define ATTN_MERGE 16
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
    int hsplit;  // blocks sharing a KV head's query heads (grid y = nkv * hsplit): 1 but for
                 // the generic kernel at batch 1 in clusters
    float scale, pad;
    const uint8_t* kv_end;  // one past the cache's last byte (K and V)
    KvThr thr_k, thr_v;
};

// The end of every decode-attention block: `o_sh` [g, hd] holds the block's unnormalised
// output and m_sh, l_sh its per-head maximum and exp sum. One chunk: write the output. Up
// to `cluster` chunks: block 0 of the cluster merges the members' (m, l, o) through
// distributed shared memory. Otherwise: partials to global memory, and the last block of
// the (sequence, KV head) merges them all.
template <typename T>
__device__ void attn_finish(const AttnParams& p, float* o_sh, float* m_sh, float* l_sh, bool* last_sh,
                            int n_active, bool in_cluster) {
    // Block y of a sequence holds query heads y g .. y g + g - 1 (g = nh / (nkv hsplit)).
    const int split = blockIdx.x, y = blockIdx.y, s = blockIdx.z;
    const int nh = p.nh, hd = p.hd, n_split = p.n_split, g = nh / (p.nkv * p.hsplit);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    T* out = static_cast<T*>(p.out);
    const size_t row0 = (size_t)s * nh + (size_t)y * g;  // first query head of this block
    const size_t cnt = (size_t)s * gridDim.y + y;        // this block's merge counter
    if (n_active == 1) {
        for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x)
            out[row0 * hd + idx] = from_f32<T>(o_sh[idx] / l_sh[idx / hd]);
        return;
    }
    if (in_cluster) {
        // Block 0 reads every member's maxima and sums at once (one DSMEM round trip), one
        // thread per head weighs them in rank order, then each output element's loads are
        // all issued before the first is used. Same arithmetic, in the same order, as a
        // merge that reads member by member.
        __shared__ float mm_sh[ATTN_MAX_G][ATTN_MAX_CLUSTER], ww_sh[ATTN_MAX_G][ATTN_MAX_CLUSTER];
        __shared__ float ll_sh[ATTN_MAX_G];
        cluster_sync();
        if (split == 0) {
            if (threadIdx.x < g * ATTN_MAX_CLUSTER) {
                const int hh = threadIdx.x / ATTN_MAX_CLUSTER, r = threadIdx.x % ATTN_MAX_CLUSTER;
                mm_sh[hh][r] = r < n_active ? ld_cluster(&m_sh[hh], r) : -INFINITY;
                ww_sh[hh][r] = r < n_active ? ld_cluster(&l_sh[hh], r) : 0.f;
            }
            __syncthreads();
            if (threadIdx.x < g) {
                const int hh = threadIdx.x;
                float m = -INFINITY, l = 0.f;
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r) m = fmaxf(m, mm_sh[hh][r]);
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r) {
                    const float mi = mm_sh[hh][r];
                    const float w = (r < n_active && mi != -INFINITY) ? __expf(mi - m) : 0.f;
                    if (r < n_active && mi != -INFINITY) l += w * ww_sh[hh][r];
                    ww_sh[hh][r] = w;
                }
                ll_sh[hh] = l;
            }
            __syncthreads();
            for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
                const int hh = idx / hd;
                float oi[ATTN_MAX_CLUSTER];
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r) oi[r] = r < n_active ? ld_cluster(&o_sh[idx], r) : 0.f;
                float o = 0.f;
#pragma unroll
                for (int r = 0; r < ATTN_MAX_CLUSTER; ++r)
                    if (r < n_active && mm_sh[hh][r] != -INFINITY) o += ww_sh[hh][r] * oi[r];
                out[row0 * hd + idx] = from_f32<T>(o / ll_sh[hh]);
            }
        }
        cluster_sync();
        return;
    }
    float* part_o = p.part_o;
    float* part_ml = p.part_ml;
    for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
        const int hh = idx / hd, d = idx % hd;
        const size_t row = (row0 + hh) * n_split + split;
        part_o[row * hd + d] = o_sh[idx];
        if (d == 0) { part_ml[row * 2] = m_sh[hh]; part_ml[row * 2 + 1] = l_sh[hh]; }
    }

    // The last block of this (sequence, KV head) to get here merges every chunk.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t ticket = atomicAdd(&p.counters[cnt], 1u);
        *last_sh = ticket == (uint32_t)(n_active - 1);
    }
    __syncthreads();
    if (!*last_sh) return;
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
    if (threadIdx.x == 0) p.counters[cnt] = 0;
}


// grid (n_split, nkv * hsplit, b), block ATTN_THREADS, dynamic smem
// (g*hd + g*chunk + ATTN_THREADS*EPL*g) floats, g = nh / (nkv * hsplit): with hsplit > 1
// (batch 1 in clusters, short caches) a KV head's query heads are split over hsplit blocks,
// each reading the head's keys (from L2) for its own g heads; the first of them appends
// (CANDLE_LOWBIT_ATTN_HSPLIT forces a number, 1 for off: see src/ops/decode_cuda.rs).
template <typename T, typename E, bool APPEND>
__device__ void attn_decode(const AttnParams& p) {
    constexpr int EPL = E::EPL, UNROLL = E::UNROLL;
    using Chunk = typename E::Chunk;
    extern __shared__ float sh[];
    __shared__ float m_sh[ATTN_MAX_G], l_sh[ATTN_MAX_G];
    __shared__ __align__(16) T knew_sh[128], vnew_sh[128];
    __shared__ bool last_sh;
    pdl_trigger();
    // Before pdl_wait only what no kernel of this step writes: pos and pads (set by the
    // previous step's advance_pos, which does not trigger early, or by host copies) and
    // the cache rows before the new one.
    // Block y: KV head y / hsplit, query heads y g .. y g + g - 1 of the sequence.
    const int split = blockIdx.x, kvh = blockIdx.y / p.hsplit, s = blockIdx.z;
    const int nh = p.nh, nkv = p.nkv, hd = p.hd, chunk = p.chunk, n_split = p.n_split;
    const int g = nh / (nkv * p.hsplit);
    const bool writes = blockIdx.y % p.hsplit == 0;  // of a KV head's blocks, the one that appends
    const int lpk = hd / EPL;               // lanes per K/V row
    const int rows_per_pass = ATTN_THREADS / lpk;
    const int len = (int)p.pos[0] + 1, j_new = len - 1;  // j_new: the current token's row
    // keys per block
    const int c = min(chunk, max(rows_per_pass * UNROLL, (len + n_split - 1) / n_split));
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
    const E kc{p.k + head_off, p.rec, hd};
    const E vc{p.v + head_off, p.rec, hd};
    // The first UNROLL rows per lane group of K and V, older rows only.
    Chunk k_first[UNROLL], v_first[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int t = u * rows_per_pass + grp, j = start + t;
        const bool old = t < n && j != j_new;
        if (old) { k_first[u] = kc.load(j, sub); v_first[u] = vc.load(j, sub); }
        else { k_first[u] = Chunk{}; v_first[u] = Chunk{}; }
    }
    pdl_wait();  // qkv comes from the previous kernel

    const T* row_gl_rd = static_cast<const T*>(p.qkv) + (size_t)s * (nh + 2 * nkv) * hd;
    {
        const T* q_gl_rd = row_gl_rd + (size_t)blockIdx.y * g * hd;
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
                if (writes) {  // the KV head's other blocks use their own copy: no race
                    k_out[j] = knew_sh[j];
                    k_out[j + half] = knew_sh[j + half];
                    v_out[j] = vnew_sh[j];
                    v_out[j + half] = vnew_sh[j + half];
                }
            } else {
                knew_sh[j] = k_out[j];
                knew_sh[j + half] = k_out[j + half];
                vnew_sh[j] = v_out[j];
                vnew_sh[j + half] = v_out[j + half];
            }
        }
    }
    __syncthreads();
    const uint4* knew4 = reinterpret_cast<const uint4*>(knew_sh);
    const uint4* vnew4 = reinterpret_cast<const uint4*>(vnew_sh);
    // Row j_new from shared memory.
    auto new_k = [&](Chunk& dst) { dst = knew4[sub]; };
    auto new_v = [&](Chunk& dst) { dst = vnew4[sub]; };

    // Scores: LPK lanes per key, partial dots reduced with shuffles inside the lane group.
    for (int base = 0; base < n; base += rows_per_pass * UNROLL) {
        Chunk kv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp, j = start + t;
            if (base == 0) kv[u] = k_first[u];
            else if (t < n && j != j_new) kv[u] = kc.load(j, sub);
            else kv[u] = Chunk{};
            if (t < n && j == j_new) new_k(kv[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
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
    for (int base = 0; base < n; base += rows_per_pass * UNROLL) {
        Chunk vv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * rows_per_pass + grp, j = start + t;
            if (base == 0) vv[u] = v_first[u];
            else if (t < n && j != j_new) vv[u] = vc.load(j, sub);
            else vv[u] = Chunk{};
            if (t < n && j == j_new) new_v(vv[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
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

    // This block's unnormalised output, summed over the lane groups, into q_sh (free
    // since the scores).
    for (int idx = threadIdx.x; idx < g * hd; idx += blockDim.x) {
        const int hh = idx / hd, d = idx % hd;
        float o = 0.f;
        for (int u = 0; u < rows_per_pass; ++u) o += r_sh[(u * g + hh) * hd + d];
        q_sh[idx] = o;
    }
    __syncthreads();
    attn_finish<T>(p, q_sh, m_sh, l_sh, &last_sh, n_active, in_cluster);
}

// ---------------------------------------------------------------------------------------
// kv4 (and Oaken, below) on tensor cores (hd 64 or 128). Per warp, steps of 16 keys: S = Q·Kᵀ with
// mma.m16n8k16 (rows: the g query heads of the KV head, padded to 16; n: 8 keys; k: hd)
// on the raw 4-bit codes, each key's scale and min folded in afterwards
// (s = scale·(q·c) + min·Σq); online softmax per head; O += (P·diag(v_scale))·C_v with the
// V codes as the B operand and Σ p·v_min added per head at the end. Codes become f16 by
// lop3 into the 0x6400 exponent (no per-element conversion); kv4_element (kv_codec.cuh)
// gives the nibble order that makes every fragment one or two instructions away from the
// loaded words. Four warps share a block's chunk of keys (steps interleaved) and merge in
// shared memory; blocks merge as in the generic kernel (attn_finish). Each warp streams
// its steps through its own ring of TC_STAGES shared-memory stages (cp.async, 16-byte
// copies of the records as they lie): TC_STAGES - 1 steps are in flight while one is
// computed, without holding registers (the records are 68 or 36 bytes, so a lane's
// fragment words are not 16-byte aligned in global memory; in shared memory each is one
// 32-bit load).
#define TC_WARPS 4
#define TC_STEP 16
#define TC_STAGES 4
// The tensor-core kernel's scores are in log2 units (q scaled by log2 e): ex2 is one MUFU.
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// f16 pairs of nibbles (0, 4) and (1, 5) of w, exact: (w & mask) | 0x6400 is 1024 + n
// (or 1024 + 16 n for the high nibbles).
__device__ __forceinline__ uint32_t nib_lo(uint32_t w) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "r"(0x000f000fu), "r"(0x64006400u));
    const __half2 h = __hsub2(*reinterpret_cast<__half2*>(&r), __half2half2(__ushort_as_half(0x6400)));
    return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t nib_hi(uint32_t w) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "r"(0x00f000f0u), "r"(0x64006400u));
    const __half2 h = __hfma2(*reinterpret_cast<__half2*>(&r), __float2half2_rn(0.0625f), __float2half2_rn(-64.f));
    return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
__device__ __forceinline__ uint32_t half2_bits(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// One warp's ring stage: the K and V records of one step's TC_STEP keys, copied as they
// lie in global memory in 16-byte chunks from the boundary at or before the first key's
// record (the `lead` bytes before it, the end of the row before, come along unused).
// Chunks past the step's last valid key are zero, and the one holding its end comes
// whole: the records of keys >= end in a stage are zero, stale or the next rows' bytes,
// so the kernel masks every value it takes from them. A record is 4-byte aligned (rec
// is), so every fragment word is one 32-bit shared load.
template <int REC_> struct TcStage {
    static constexpr int REC = REC_, BYTES = TC_STEP * REC + 16, CHUNKS = BYTES / 16;
    uint8_t k[BYTES], v[BYTES];
};

__device__ __forceinline__ uint32_t lds32(uint32_t sa) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(sa));
    return v;
}
__device__ __forceinline__ uint32_t lds8(uint32_t sa) {
    uint32_t v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(sa));
    return v;
}

// One warp's walk through its ring: what stays fixed over its steps. A warp's steps are
// TC_WARPS * TC_STEP keys apart, STEP_BYTES (a multiple of 16) in global memory, so the
// lead is the same for all of them.
template <int REC> struct TcRing {
    using S = TcStage<REC>;
    static constexpr int STEP_BYTES = TC_WARPS * TC_STEP * S::REC;
    const uint8_t* src[2];  // K, V: the 16-byte boundary at or before step 0's first record
    int lead[2];            // bytes from there to that record
    uint32_t stage0;        // shared address of this warp's stage 0, plus 16 * lane
    int lane16;
    __device__ __forceinline__ void init(const uint8_t* kb, const uint8_t* vb, int k0_first, S* ring, int lane) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint8_t* a = (h ? vb : kb) + (size_t)k0_first * S::REC;
            lead[h] = (int)((uintptr_t)a & 15u);
            src[h] = a - lead[h];
        }
        lane16 = 16 * lane;
        stage0 = (uint32_t)__cvta_generic_to_shared(ring) + lane16;
    }
    // Copies of step i (its first `keys` keys valid) into stage i % TC_STAGES: whole
    // chunks, the one holding the end of the last valid record included, the chunks after
    // it zero. EXACT (a step that ends within 16 bytes of the cache's end): nothing past
    // the last valid byte is read; that chunk's valid words (records are 4-byte aligned)
    // come in 4-byte copies (the rest of it is left as it was: masked).
    template <bool EXACT> __device__ __forceinline__ void issue(int i, int keys) const {
        const uint32_t d = stage0 + (uint32_t)(i % TC_STAGES) * (uint32_t)sizeof(S);
        constexpr int J = (S::CHUNKS + 31) / 32;  // chunks per lane (the last one: some lanes)
        if constexpr (!EXACT) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint8_t* g = src[h] + (size_t)i * STEP_BYTES + lane16;
                const int rem = lead[h] + keys * S::REC - lane16;  // valid bytes from this lane's first chunk
#pragma unroll
                for (int j = 0; j < J; ++j)
                    if (j < S::CHUNKS / 32 || lane16 + 512 * j < 16 * S::CHUNKS)
                        cp_async16_zfill(d + h * S::BYTES + 512 * j, rem > 512 * j ? g + 512 * j : src[h],
                                         rem > 512 * j ? 16 : 0);
            }
        } else {
            // Rare (once per cache end): kept small, not unrolled.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll 1
                for (int j = 0; j < J; ++j) {
                    if (j >= S::CHUNKS / 32 && lane16 + 512 * j >= 16 * S::CHUNKS) continue;
                    const uint8_t* g = src[h] + (size_t)i * STEP_BYTES + lane16 + 512 * j;
                    const uint32_t sa = d + h * S::BYTES + 512 * j;
                    const int n = lead[h] + keys * S::REC - lane16 - 512 * j;  // valid bytes from g
                    if (n >= 16 || n <= 0) {
                        cp_async16_zfill(sa, n > 0 ? g : src[h], n > 0 ? 16 : 0);
                    } else {
#pragma unroll 1
                        for (int w = 0; 4 * w < n; ++w) cp_async4(sa + 4 * w, g + 4 * w);
                    }
                }
            }
        }
    }
    // Shared address of the first record of step i's K (h 0) or V (h 1), minus 16 * lane.
    __device__ __forceinline__ uint32_t rows(int i, int h) const {
        return stage0 - lane16 + (uint32_t)(i % TC_STAGES) * (uint32_t)sizeof(S) + h * S::BYTES + lead[h];
    }
};

// Oaken (E::SPARSE) on the same kernel. Its dense codes are in kv4's slot order and go
// through the same mma with the row's mid_step and mid_min + inner_lo as scale and min.
// The middle group's jump over the inner interval (codes >= zc decode gap = inner_hi -
// inner_lo higher) is a second mma over the masks c >= zc (one hge2 per code pair), scaled
// by the layer's gap: s = step·(q·c) + gap·(q·m) + base·Σq. The sparse entries are
// corrections: two lanes per key walk the key's record (half of its entries each) and take,
// per entry, delta = its value - the middle decode of its code (what the mma counted).
// K: Σ_h q_h·delta into the key's scores (through shared memory to the lanes holding
// them), before the softmax. V: each delta written (f16) to the warp's zeroed tile ΔV
// [TC_STEP keys, HD] (a (key, element) has at most one entry), then O += ΔVᵀ·Pᵀ by one mma
// per m-tile (ldmatrix.trans), in the running output's scale: no atomics, any g.
// This lane's PER entries of an Oaken record in shared memory (`rec`: K for KV 0, V for
// KV 1): hd 128, segment `sub`'s 8; hd 64, entries 4 sub .. 4 sub + 3. Out: element d[k],
// delta[k] (0 past the segment's count, or for a masked key `ok` false: its record may be
// stale bytes) and the valid ones as bits. kslot: shared address of the K slot table.
template <int HD, int KV, int PER>
__device__ __forceinline__ uint32_t oaken_entries(uint32_t rec, const KvThr& t, int sub, bool ok, uint32_t kslot,
                                                  int (&d)[PER], float (&delta)[PER]) {
    constexpr int NSEG = Oaken::nseg(HD), META = Oaken::meta(HD);
    static_assert(PER == 4 * NSEG, "entries per lane");
    const uint32_t m0 = lds32(rec + META), m1 = lds32(rec + META + 4);
    const float step = h_lo(m0), base = h_hi(m0) + t.inner_lo, os = h_lo(m1), gap = t.inner_hi - t.inner_lo;
    const float lo_i16 = fmaf(16.f, t.inner_step, t.inner_lo);  // inner codes with the extra bit
    const uint32_t zc = m1 >> 24;
    const int seg = NSEG == 2 ? sub : 0;
    int cnt = min((int)((m1 >> (16 + 4 * seg)) & 15u), KV_SEG_CAP) - (NSEG == 2 ? 0 : 4 * sub);
    if (!ok) cnt = 0;
    const uint32_t eoff = HD / 2 + (NSEG == 2 ? 8 * sub : 4 * sub);
    uint32_t ew[PER / 4];
#pragma unroll
    for (int w = 0; w < PER / 4; ++w) ew[w] = lds32(rec + eoff + 4 * w);
    uint32_t valid = 0;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const uint32_t e = (ew[k >> 2] >> (8 * (k & 3))) & 0xffu;
        const int dd = (int)(e & 63u) | (seg * KV_SEG);
        const uint32_t slot = KV == 0 ? lds8(kslot + dd) : (uint32_t)((dd & 7) * (HD / 8) + (dd >> 3));
        const uint32_t c = (lds8(rec + (slot >> 1)) >> ((slot & 1u) << 2)) & 15u;
        const float fc = (float)c;
        const float xm = fmaf(fc, step, base) + (c >= zc ? gap : 0.f);  // what the mma counted
        const bool ex = e & 128u;
        const float xi = fmaf(fc, t.inner_step, ex ? lo_i16 : t.inner_lo);
        const float xo = fmaf(fc, ex ? -os : os, ex ? t.outer_lo : t.outer_hi);
        d[k] = dd;
        delta[k] = k < cnt ? ((e & 64u) ? xi : xo) - xm : 0.f;
        valid |= (k < cnt ? 1u : 0u) << k;
    }
    return valid;
}

__device__ __forceinline__ uint32_t hge_mask(uint32_t c, __half2 z) {
    const __half2 r = __hge2(*reinterpret_cast<const __half2*>(&c), z);
    return *reinterpret_cast<const uint32_t*>(&r);
}

// grid (n_split, nkv, b), block TC_WARPS * 32, dynamic smem g*HD floats (q_sh) and then
// max(TC_WARPS*g*HD floats, TC_WARPS * TC_STAGES stages): the warps' rings, which the
// warps' outputs (and, before the first copy of the block holding the new row, its
// rows to encode) reuse. Oaken adds, after them: the warps' score corrections
// [TC_WARPS, TC_STEP, ATTN_MAX_G] f32, their ΔV tiles [TC_WARPS, TC_STEP, TC_DV(HD)] f16 (rows
// padded by 16 bytes: conflict-free ldmatrix) and the K slot of each element [HD] u8.
#define TC_DV(HD) ((HD) + 8)
template <typename T, int HD, bool APPEND, typename E>
__device__ void attn_decode_tc(const AttnParams& p) {
    constexpr bool SPARSE = E::SPARSE;
    constexpr int KS = HD / 16, MT = HD / 16, KW = HD / 32, VW = HD / 64;
    constexpr int REC = E::rec_bytes(HD), META = E::meta(HD);
    constexpr int RING_FLOATS = TC_WARPS * TC_STAGES * (int)sizeof(TcStage<REC>) / 4;
    extern __shared__ float sh[];
    __shared__ float m_sh[ATTN_MAX_G], l_sh[ATTN_MAX_G];
    __shared__ float wm_sh[TC_WARPS][ATTN_MAX_G], wl_sh[TC_WARPS][ATTN_MAX_G];
    __shared__ uint8_t codes_sh[2][128];
    __shared__ bool last_sh;
    pdl_trigger();
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int nh = p.nh, nkv = p.nkv, g = nh / nkv;
    const int len = (int)p.pos[0] + 1, j_new = len - 1;
    const int c = min(p.chunk, max(TC_WARPS * TC_STEP, (len + p.n_split - 1) / p.n_split));
    const int start = split * c, n_active = (len + c - 1) / c;
    const bool in_cluster = p.cluster > 0 && n_active > 1 && n_active <= p.cluster;
    if (start >= len) {
        if (!in_cluster || split >= p.cluster) return;
        if (threadIdx.x < ATTN_MAX_G) { m_sh[threadIdx.x] = -INFINITY; l_sh[threadIdx.x] = 0.f; }
        cluster_sync();
        cluster_sync();
        return;
    }
    const int end = min(start + c, len);
    const bool has_new = j_new < end;
    const int pad = (int)p.pads[s];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, qr = lane >> 2, qc = lane & 3;
    float* q_sh = sh;               // [g, HD]; then the block's output
    float* wo_sh = q_sh + g * HD;   // [TC_WARPS, g, HD]: the warps' outputs (after the rings)
    // Oaken's scratch after the rings (this warp's parts; the K slot table is the block's).
    float* ox_sh = wo_sh + max(TC_WARPS * g * HD, RING_FLOATS);
    float* xs_sh = ox_sh + warp * TC_STEP * ATTN_MAX_G;
    __half* dv_sh = reinterpret_cast<__half*>(ox_sh + TC_WARPS * TC_STEP * ATTN_MAX_G) + warp * TC_STEP * TC_DV(HD);
    uint8_t* kslot_sh = reinterpret_cast<uint8_t*>(ox_sh + TC_WARPS * TC_STEP * ATTN_MAX_G) + TC_WARPS * TC_STEP * TC_DV(HD) * 2;
    const uint32_t kslot_sa = (uint32_t)__cvta_generic_to_shared(kslot_sh);
    constexpr int DV_CHUNKS = TC_STEP * TC_DV(HD) * 2 / 16;  // 16-byte chunks of a ΔV tile
    auto zero_dv = [&]() {
        for (int c16 = lane; c16 < DV_CHUNKS; c16 += 32) reinterpret_cast<uint4*>(dv_sh)[c16] = make_uint4(0u, 0u, 0u, 0u);
    };
    const size_t head_off = ((size_t)s * nkv + kvh) * (size_t)p.max_len * REC;
    const uint8_t* kb = p.k + head_off;
    const uint8_t* vb = p.v + head_off;
    constexpr int half = HD / 2;
    const int rpos = max(j_new - pad, 0);
    const int jr = (threadIdx.x % HD) % half;
    const float rc = p.cos[(size_t)rpos * half + jr], rs = p.sin[(size_t)rpos * half + jr];
    // This warp's steps: keys k0_first + i * TC_WARPS * TC_STEP.
    const int k0_first = start + warp * TC_STEP;
    const int n_steps = k0_first < end ? (end - k0_first + TC_WARPS * TC_STEP - 1) / (TC_WARPS * TC_STEP) : 0;
    auto k0_of = [&](int i) { return k0_first + i * TC_WARPS * TC_STEP; };
    auto keys_of = [&](int i) { return min(TC_STEP, end - k0_of(i)); };
    TcRing<REC> ring;
    ring.init(kb, vb, k0_first, reinterpret_cast<TcStage<REC>*>(wo_sh) + warp * TC_STAGES, lane);
    // The step, if any, whose whole last chunk could reach past the cache's end.
    const int exact_step = n_steps > 0 && vb + (size_t)end * REC + 16 > p.kv_end ? n_steps - 1 : -1;
    auto issue = [&](int i) {
        if (i == exact_step) ring.template issue<true>(i, keys_of(i));
        else ring.template issue<false>(i, keys_of(i));
    };
    // The first TC_STAGES - 1 steps in flight; before pdl_wait where the block does not
    // hold the new row (the older rows are not written by this step's kernels).
    auto prologue = [&]() {
#pragma unroll
        for (int i = 0; i < TC_STAGES - 1; ++i) {
            if (i < n_steps) issue(i);
            cp_async_commit();
        }
    };
    if (!has_new) prologue();
    pdl_wait();  // qkv comes from the previous kernel
    const T* row_gl_rd = static_cast<const T*>(p.qkv) + (size_t)s * (nh + 2 * nkv) * HD;
    {
        const T* q_gl_rd = row_gl_rd + (size_t)kvh * g * HD;
        for (int idx = threadIdx.x; idx < g * HD; idx += blockDim.x) {
            const int hh = idx / HD, d = idx % HD;
            const float x0 = to_f32(q_gl_rd[hh * HD + jr]), x1 = to_f32(q_gl_rd[hh * HD + jr + half]);
            q_sh[idx] = (d < half ? x0 * rc - x1 * rs : x1 * rc + x0 * rs) * (p.scale * LOG2E);
        }
    }
    if (APPEND && has_new) {
        float* xk = wo_sh;
        float* xv = wo_sh + HD;
        const int j = threadIdx.x;
        if (j < half) {
            const T* k_gl_rd1 = row_gl_rd + (size_t)(nh + kvh) * HD;
            const T* v_gl_rd1 = row_gl_rd + (size_t)(nh + nkv + kvh) * HD;
            float y0, y1;
            rope_pair_rn(to_f32(k_gl_rd1[j]), to_f32(k_gl_rd1[j + half]), rc, rs, y0, y1);
            xk[j] = to_f32(from_f32<T>(y0));
            xk[j + half] = to_f32(from_f32<T>(y1));
            xv[j] = to_f32(v_gl_rd1[j]);
            xv[j + half] = to_f32(v_gl_rd1[j + half]);
        }
        __syncthreads();
        if (warp == 0) E::encode(xk, p.k + head_off + (size_t)j_new * REC, HD, 0, p.thr_k, codes_sh[0], lane);
        if (warp == 1) E::encode(xv, p.v + head_off + (size_t)j_new * REC, HD, 1, p.thr_v, codes_sh[1], lane);
    }
    if constexpr (SPARSE) {
        for (int d = threadIdx.x; d < HD; d += blockDim.x) kslot_sh[d] = (uint8_t)kv4_slot(0, HD, d);
        zero_dv();
    }
    __syncthreads();  // q_sh written; the new row's record written and xk, xv read
    if (has_new) prologue();
    // Q fragments: row qr (a head of the group; rows >= g and 8..15 are zero), columns
    // 2qc, 2qc+1 (a0) and 2qc+8, 2qc+9 (a2) of each slice of 16; and Σq of the f16 q.
    uint32_t qa[KS][2];
    float qsum = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        qa[ks][0] = qa[ks][1] = 0u;
        if (qr < g) {
            const float* q = q_sh + qr * HD + 16 * ks + 2 * qc;
            const __half2 x0 = __floats2half2_rn(q[0], q[1]), x1 = __floats2half2_rn(q[8], q[9]);
            qa[ks][0] = *reinterpret_cast<const uint32_t*>(&x0);
            qa[ks][1] = *reinterpret_cast<const uint32_t*>(&x1);
            const float2 f0 = __half22float2(x0), f1 = __half22float2(x1);
            qsum += (f0.x + f0.y) + (f1.x + f1.y);
        }
    }
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);

    // Oᵀ [HD, heads] in m-tiles of 16 rows: acc[m] holds rows 16m + qr (+ 8), heads 2qc, 2qc+1.
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
    float m_run = -INFINITY, l_run = 0.f, pm_run = 0.f;
    // This lane's fragment words, as byte offsets from a stage's first record.
    const uint32_t off_k = qr * REC + qc * (HD / 8), off_m = 2 * qc * REC + META, off_v = 2 * qc * REC + qr * (HD / 16);
    for (int i = 0; i < n_steps; ++i) {
        if (i + TC_STAGES - 1 < n_steps) issue(i + TC_STAGES - 1);
        cp_async_commit();
        cp_async_wait<TC_STAGES - 1>();
        __syncwarp();  // every lane's copies of step i are in
        const int k0 = k0_of(i);
        const uint32_t ks_ = ring.rows(i, 0), vs_ = ring.rows(i, 1);
        // K codes of keys k0 + qr, k0 + 8 + qr (part qc); K scales of the score fragment's
        // keys k0 + 8t + 2qc + i; V codes and scales of keys k0 + 2qc + {0, 1, 8, 9} (group qr).
        uint32_t kw[2][KW], km[2][2], vw[4][VW], vm[4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
            for (int w = 0; w < KW; ++w) kw[t][w] = lds32(ks_ + off_k + 8 * t * REC + 4 * w);
#pragma unroll
            for (int e = 0; e < 2; ++e) km[t][e] = lds32(ks_ + off_m + (8 * t + e) * REC);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int r = (u & 1) + 8 * (u >> 1);
#pragma unroll
            for (int w = 0; w < VW; ++w) vw[u][w] = lds32(vs_ + off_v + r * REC + 4 * w);
            vm[u] = lds32(vs_ + off_m + r * REC);
        }
        // Oaken: zc of the K fragments' keys (k0 + 8t + qr) and of the V words' keys, as f16.
        __half2 kz[2], vz[2];
        if constexpr (SPARSE) {
            __half zv[4];
#pragma unroll
            for (int t = 0; t < 2; ++t) kz[t] = __half2half2(__uint2half_rn(lds32(ks_ + (8 * t + qr) * REC + META + 4) >> 24));
#pragma unroll
            for (int u = 0; u < 4; ++u) zv[u] = __uint2half_rn(lds32(vs_ + off_m + ((u & 1) + 8 * (u >> 1)) * REC + 4) >> 24);
            vz[0] = __halves2half2(zv[0], zv[1]);
            vz[1] = __halves2half2(zv[2], zv[3]);
        } else {
            __syncwarp();  // stage i is read: the next step's copies may reuse it
        }
        const int jk = lane >> 1, sub = lane & 1;  // Oaken: this lane's key and half of its entries
        const bool okk = k0 + jk < end && (k0 + jk >= pad || k0 + jk == j_new);
        // Scores of keys k0 + 8t + 2qc + i for head qr.
        float sc[2][4], sm[2][4];  // sm: Oaken's masks c >= zc
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
            sm[t][0] = sm[t][1] = sm[t][2] = sm[t][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const uint32_t w = (ks & 1) ? kw[t][ks / 2] >> 8 : kw[t][ks / 2];
                const uint32_t b0 = nib_lo(w), b1 = nib_hi(w);
                mma_f16_16816(sc[t], qa[ks][0], 0u, qa[ks][1], 0u, b0, b1);
                if constexpr (SPARSE) mma_f16_16816(sm[t], qa[ks][0], 0u, qa[ks][1], 0u, hge_mask(b0, kz[t]), hge_mask(b1, kz[t]));
            }
        }
        // Oaken's entries: K's summed per head into xs_sh[jk]; V's deltas into ΔV row jk.
        if constexpr (SPARSE) {
            constexpr int PER = 4 * Oaken::nseg(HD);
            int dk[PER], dvi[PER];
            float xk[PER], xv[PER];
            oaken_entries<HD, 0, PER>(ks_ + jk * REC, p.thr_k, sub, okk, kslot_sa, dk, xk);
            const uint32_t vval = oaken_entries<HD, 1, PER>(vs_ + jk * REC, p.thr_v, sub, okk, kslot_sa, dvi, xv);
#pragma unroll
            for (int k = 0; k < PER; ++k)
                if ((vval >> k) & 1u) dv_sh[jk * TC_DV(HD) + dvi[k]] = __float2half_rn(xv[k]);
#pragma unroll 1
            for (int h = 0; h < g; ++h) {
                const float* qh = q_sh + h * HD;
                float cq = 0.f;
#pragma unroll
                for (int k = 0; k < PER; ++k) cq = fmaf(qh[dk[k]], xk[k], cq);
                cq += __shfl_xor_sync(0xffffffffu, cq, 1);
                if (sub == 0) xs_sh[jk * ATTN_MAX_G + h] = cq;
            }
            __syncwarp();  // stage i is read; xs_sh and ΔV are written
        }
        // Keys k0 + 8t + 2qc + e, u = 2t + e: the same keys as the V words vw[u], vm[u].
        float sv[4], mloc = -INFINITY;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int t = u >> 1, e = u & 1, key = k0 + 8 * t + 2 * qc + e;
            const bool ok = key < end && (key >= pad || key == j_new);
            if constexpr (SPARSE) {
                const float xs = qr < g ? xs_sh[(8 * t + 2 * qc + e) * ATTN_MAX_G + qr] : 0.f;
                const float base = h_hi(km[t][e]) + p.thr_k.inner_lo, gap = p.thr_k.inner_hi - p.thr_k.inner_lo;
                sv[u] = ok ? fmaf(h_lo(km[t][e]), sc[t][e], fmaf(gap, sm[t][e], fmaf(base, qsum, xs))) : -INFINITY;
            } else {
                sv[u] = ok ? fmaf(h_lo(km[t][e]), sc[t][e], h_hi(km[t][e]) * qsum) : -INFINITY;
            }
            vm[u] = ok ? vm[u] : 0u;  // a stale record's scales could be inf or NaN
            mloc = fmaxf(mloc, sv[u]);
        }
        mloc = fmaxf(mloc, __shfl_xor_sync(0xffffffffu, mloc, 1));
        mloc = fmaxf(mloc, __shfl_xor_sync(0xffffffffu, mloc, 2));
        const float m_new = fmaxf(m_run, mloc);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // every key so far masked
        const float alpha = ex2(m_run - m_use);  // 1 where the maximum did not grow, 0 at the start
        float pv[4], psum = 0.f, pmin = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            pv[u] = ex2(sv[u] - m_use);
            psum += pv[u];
            pmin += pv[u] * (SPARSE ? h_hi(vm[u]) + p.thr_v.inner_lo : h_hi(vm[u]));
        }
        l_run = l_run * alpha + psum;
        pm_run = pm_run * alpha + pmin;
        m_run = m_new;
        // Oᵀ += C_vᵀ · (P·diag(v_scale))ᵀ: A the V codes (rows: columns d of V, cols: the
        // step's keys), B this thread's probabilities as they are (head qr, keys 2qc + i).
        // (Skipped, warp-uniformly, where no head's maximum grew: alpha is then 1.)
        const bool rescale = __any_sync(0xffffffffu, alpha != 1.f);
        if (rescale) {
            const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * qc), al1 = __shfl_sync(0xffffffffu, alpha, 8 * qc + 4);
#pragma unroll
            for (int m = 0; m < MT; ++m) { acc[m][0] *= al0; acc[m][1] *= al1; acc[m][2] *= al0; acc[m][3] *= al1; }
        }
        const uint32_t pb0 = half2_bits(pv[0] * h_lo(vm[0]), pv[1] * h_lo(vm[1]));
        const uint32_t pb1 = half2_bits(pv[2] * h_lo(vm[2]), pv[3] * h_lo(vm[3]));
        const float gap_v = p.thr_v.inner_hi - p.thr_v.inner_lo;
        const uint32_t pg0 = half2_bits(pv[0] * gap_v, pv[1] * gap_v), pg1 = half2_bits(pv[2] * gap_v, pv[3] * gap_v);
#pragma unroll
        for (int w = 0; w < VW; ++w) {
            const uint32_t za[2] = {prmt(vw[0][w], vw[1][w], 0x5410), prmt(vw[0][w], vw[1][w], 0x7632)};
            const uint32_t zb[2] = {prmt(vw[2][w], vw[3][w], 0x5410), prmt(vw[2][w], vw[3][w], 0x7632)};
#pragma unroll
            for (int mm = 0; mm < 4; ++mm) {  // m-tile 4w + mm: V columns j = 2mm, 2mm + 1 of word w
                const uint32_t a = za[mm >> 1] >> (8 * (mm & 1)), b = zb[mm >> 1] >> (8 * (mm & 1));
                const uint32_t a0 = nib_lo(a), a1 = nib_hi(a), a2 = nib_lo(b), a3 = nib_hi(b);
                mma_f16_16816(acc[4 * w + mm], a0, a1, a2, a3, pb0, pb1);
                if constexpr (SPARSE)
                    mma_f16_16816(acc[4 * w + mm], hge_mask(a0, vz[0]), hge_mask(a1, vz[0]), hge_mask(a2, vz[1]),
                                  hge_mask(a3, vz[1]), pg0, pg1);
            }
        }
        if constexpr (SPARSE) {
            // O += ΔVᵀ·Pᵀ: matrix q of lane l's ldmatrix is keys 8 (q >> 1) .., elements 16 m + 8 (q & 1) ..
            const uint32_t pp0 = half2_bits(pv[0], pv[1]), pp1 = half2_bits(pv[2], pv[3]);
            const int q4 = lane >> 3;
            const uint32_t dv_row = (uint32_t)__cvta_generic_to_shared(dv_sh) +
                                    2u * (uint32_t)(((lane & 7) + 8 * (q4 >> 1)) * TC_DV(HD) + 8 * (q4 & 1));
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                uint32_t r0, r1, r2, r3;
                ldsm_x4_trans(dv_row + 32u * m, r0, r1, r2, r3);
                mma_f16_16816(acc[m], r0, r1, r2, r3, pp0, pp1);
            }
            __syncwarp();  // every lane has read xs_sh and ΔV
            zero_dv();
        }
    }
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    pm_run += __shfl_xor_sync(0xffffffffu, pm_run, 1);
    pm_run += __shfl_xor_sync(0xffffffffu, pm_run, 2);
    cp_async_wait<0>();  // only empty groups are left; none may land after the rings are reused
    __syncthreads();     // every warp is past its reads of q_sh and of its ring
    const float pm0 = __shfl_sync(0xffffffffu, pm_run, 8 * qc), pm1 = __shfl_sync(0xffffffffu, pm_run, 8 * qc + 4);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const int d = 16 * m + qr;
        if (2 * qc < g) {
            wo_sh[(warp * g + 2 * qc) * HD + d] = acc[m][0] + pm0;
            wo_sh[(warp * g + 2 * qc) * HD + d + 8] = acc[m][2] + pm0;
        }
        if (2 * qc + 1 < g) {
            wo_sh[(warp * g + 2 * qc + 1) * HD + d] = acc[m][1] + pm1;
            wo_sh[(warp * g + 2 * qc + 1) * HD + d + 8] = acc[m][3] + pm1;
        }
    }
    if (qr < g && qc == 0) { wm_sh[warp][qr] = m_run; wl_sh[warp][qr] = l_run; }
    __syncthreads();
    float* o_sh = q_sh;
    for (int idx = threadIdx.x; idx < g * HD; idx += blockDim.x) {
        const int hh = idx / HD, d = idx % HD;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) m = fmaxf(m, wm_sh[w][hh]);
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) {
            if (wm_sh[w][hh] == -INFINITY) continue;
            const float e = ex2(wm_sh[w][hh] - m);
            o += e * wo_sh[(w * g + hh) * HD + d];
            l += e * wl_sh[w][hh];
        }
        o_sh[idx] = o;
        if (d == 0) { m_sh[hh] = m * LN2; l_sh[hh] = l; }  // attn_finish merges natural-log maxima
    }
    __syncthreads();
    attn_finish<T>(p, o_sh, m_sh, l_sh, &last_sh, n_active, in_cluster);
}

// attn_decode_<dtype>_<kv4|oaken>_h<HD>[_append]
// (E::TC_BLOCKS resident blocks per SM bound the registers.)
#define ATTN_TC_KERNEL1(SUF, T, HD, ENC, E)                                               \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, E::TC_BLOCKS)            \
        attn_decode_##SUF##_##ENC##_h##HD(const __grid_constant__ AttnParams p) {         \
        attn_decode_tc<T, HD, false, E>(p);                                               \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, E::TC_BLOCKS)            \
        attn_decode_##SUF##_##ENC##_h##HD##_append(const __grid_constant__ AttnParams p) { \
        attn_decode_tc<T, HD, true, E>(p);                                                \
    }
#define ATTN_TC_KERNEL(SUF, T, HD)        \
    ATTN_TC_KERNEL1(SUF, T, HD, kv4, Kv4) \
    ATTN_TC_KERNEL1(SUF, T, HD, oaken, Oaken)
ATTN_TC_KERNEL(f32, float, 64)
ATTN_TC_KERNEL(f32, float, 128)
ATTN_TC_KERNEL(f16, __half, 64)
ATTN_TC_KERNEL(f16, __half, 128)
ATTN_TC_KERNEL(bf16, __nv_bfloat16, 64)
ATTN_TC_KERNEL(bf16, __nv_bfloat16, 128)

// attn_decode_<dtype>_<encoding>[_append]
#define ATTN_KERNEL(NAME, T, E, APPEND)                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                           \
        NAME(const __grid_constant__ AttnParams p) {                                     \
        attn_decode<T, E, APPEND>(p);                                                     \
    }
#define ATTN_KERNELS(SUF, T)                                                             \
    ATTN_KERNEL(attn_decode_##SUF##_dense, T, DenseKv<T>, false)                         \
    ATTN_KERNEL(attn_decode_##SUF##_dense_append, T, DenseKv<T>, true)

ATTN_KERNELS(f32, float)
ATTN_KERNELS(f16, __half)
ATTN_KERNELS(bf16, __nv_bfloat16)
