// Causal attention of a prompt chunk (seq query tokens per sequence, at cache rows
// pos .. pos + seq - 1) over the KV rows 0 .. pos + seq - 1, in one launch
// (FlashAttention-2's loop): scores, masks and softmax stay in registers, nothing of size
// seq x len is written. RoPE of the queries is done here, from the projection as it
// comes. Grouped-query aware (query head h reads KV head h / (nh / nkv)).
//
// Work split: a block of PF_WARPS warps takes PF_BM = 16 * PF_WARPS query rows of one
// (sequence, query head); each warp 16 rows. Keys stream through shared memory in tiles
// of PF_BN, double-buffered with cp.async (tile t + 1 in flight while t is computed).
// Per tile a warp computes S = Q Kᵀ (mma m16n8k16, f32 accumulators; Q fragments held in
// registers for the whole loop, K fragments by ldmatrix), masks it where the tile crosses
// the diagonal or the padding, updates the running max / sum in log2 units (one ex2 per
// score), and adds P V (P re-used from the accumulators as the A fragments, V fragments
// by ldmatrix.trans). Tiles past a warp's last query are skipped; blocks with the most
// keys run first (blockIdx.x reversed).
//
// Layouts (T in {f16, bf16}; HD in {64, 128}):
//   qkv   [b, seq, (nh + 2 nkv) HD] T   fused projection; its q heads are rotated here at
//                                      RoPE position pos + i - pads[s] (0 if negative),
//                                      tables cos / sin [max_pos, HD/2] f32, "rotate half"
//                                      pairs (e, e + HD/2), then scaled by `scale`, in f32,
//                                      and rounded to T once
//   k, v  element (s, kh, j, e) at s k_bs + kh k_hs + j HD + e (v: v_bs, v_hs) of T:
//                                      rows j < pos + seq valid, K already rotated (the
//                                      cache's rows; 16-byte aligned rows, checked on the host)
//   pads  [b] u32                      left padding: query at row p = pos + i sees key j
//                                      iff j <= p and (j >= pads[s] or j == p)
//   out   [b, seq, nh HD] T            softmax(q kᵀ) v per query head, the layout the
//                                      output projection takes
// Shared memory (dynamic, 16-byte pad per row: conflict-free ldmatrix): Q [PF_BM][HD + 8]
// (re-used to stage the output), K and V [2][PF_BN][HD + 8] each: 87 040 bytes at HD 128
// for f16, two blocks per SM. Launched with programmatic dependent launch (pdl_wait).
#include "mma.cuh"

using namespace lowbit;

#define PF_WARPS 4
#define PF_BM (16 * PF_WARPS)
#define PF_BN 64
#define PF_LOG2E 1.4426950408889634f

struct PrefillParams {
    const void* qkv;
    const float* cos;
    const float* sin;
    const uint32_t* pads;
    const void* k;
    const void* v;
    void* out;
    long long k_bs, k_hs, v_bs, v_hs;
    int seq, nh, nkv, pos;
    float scale;
    int pad_;
};

template <typename T, int HD>
__device__ __forceinline__ void prefill_attention(const PrefillParams& p) {
    constexpr int LD = HD + 8;                     // shared row stride, elements
    constexpr int KS = HD / 16;                    // k steps of Q Kᵀ
    constexpr int NO = HD / 8;                     // n tiles of the output
    constexpr int CPR = HD * (int)sizeof(T) / 16;  // 16-byte chunks per row
    constexpr int EPV = 16 / (int)sizeof(T);       // elements per 16-byte vector
    constexpr int NT = PF_WARPS * 32;
    extern __shared__ __align__(16) uint8_t pf_smem[];
    T* qs = reinterpret_cast<T*>(pf_smem);
    T* ksm = qs + PF_BM * LD;
    T* vsm = ksm + 2 * PF_BN * LD;
    const uint32_t qs_a = (uint32_t)__cvta_generic_to_shared(qs);
    const uint32_t ks_a = (uint32_t)__cvta_generic_to_shared(ksm);
    const uint32_t vs_a = (uint32_t)__cvta_generic_to_shared(vsm);

    pdl_trigger();
    pdl_wait();  // qkv, the cache rows and the tables come from earlier kernels

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * PF_BM;
    const int h = blockIdx.y, s = blockIdx.z;
    const int kh = h / (p.nh / p.nkv);
    const int pos = p.pos, seq = p.seq;
    const int pad = (int)p.pads[s];
    const int row_w = (p.nh + 2 * p.nkv) * HD;
    const T* qkv = reinterpret_cast<const T*>(p.qkv) + (size_t)s * seq * row_w + (size_t)h * HD;
    const T* kg = reinterpret_cast<const T*>(p.k) + s * p.k_bs + kh * p.k_hs;
    const T* vg = reinterpret_cast<const T*>(p.v) + s * p.v_bs + kh * p.v_hs;
    const int kv_end = pos + min(q0 + PF_BM, seq);  // keys 0 .. kv_end - 1 can be seen
    const int n_tiles = (kv_end + PF_BN - 1) / PF_BN;

    auto load_kv = [&](int t, int buf) {
        const int j0 = t * PF_BN;
#pragma unroll
        for (int c = tid; c < PF_BN * CPR; c += NT) {
            const int r = c / CPR, cc = c % CPR, j = j0 + r;
            const bool ok = j < kv_end;
            const size_t off = (size_t)(ok ? j : 0) * HD + cc * EPV;
            const uint32_t so = (uint32_t)(((buf * PF_BN + r) * LD + cc * EPV) * sizeof(T));
            cp_async16_zfill(ks_a + so, kg + off, ok ? 16 : 0);
            cp_async16_zfill(vs_a + so, vg + off, ok ? 16 : 0);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    // Q rows q0 .. q0 + PF_BM - 1: rotate, scale, round to T into shared memory.
    {
        constexpr int HALF = HD / 2, VPR = HALF / EPV;
        for (int c = tid; c < PF_BM * VPR; c += NT) {
            const int r = c / VPR, e0 = (c % VPR) * EPV, i = q0 + r;
            float a[EPV], b[EPV], x0[EPV], x1[EPV];
            if (i < seq) {
                const T* qr = qkv + (size_t)i * row_w;
                unpack16<T>(*reinterpret_cast<const uint4*>(qr + e0), a);
                unpack16<T>(*reinterpret_cast<const uint4*>(qr + e0 + HALF), b);
                const int rp = max(pos + i - pad, 0);
                const float* cr = p.cos + (size_t)rp * HALF + e0;
                const float* sr = p.sin + (size_t)rp * HALF + e0;
#pragma unroll
                for (int e = 0; e < EPV; ++e) {
                    const float cs = cr[e], sn = sr[e];
                    x0[e] = (a[e] * cs - b[e] * sn) * p.scale;
                    x1[e] = (b[e] * cs + a[e] * sn) * p.scale;
                }
            } else {
#pragma unroll
                for (int e = 0; e < EPV; ++e) x0[e] = x1[e] = 0.f;
            }
            *reinterpret_cast<uint4*>(qs + r * LD + e0) = pack16<T>(x0);
            *reinterpret_cast<uint4*>(qs + r * LD + e0 + HALF) = pack16<T>(x1);
        }
    }
    __syncthreads();
    uint32_t qa[KS][4];
#pragma unroll
    for (int k = 0; k < KS; ++k) {
        const int row = warp * 16 + (lane & 15), col = k * 16 + (lane >> 4) * 8;
        ldsm_x4(qs_a + (uint32_t)((row * LD + col) * sizeof(T)), qa[k][0], qa[k][1], qa[k][2], qa[k][3]);
    }

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    const int wq0 = q0 + warp * 16;                    // the warp's first query row
    const int w_last = pos + min(wq0 + 15, seq - 1);   // its last query's cache row
    const int g = lane >> 2, t4 = lane & 3;

    for (int t = 0; t < n_tiles; ++t) {
        if (t + 1 < n_tiles) {
            load_kv(t + 1, (t + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int j0 = t * PF_BN;
        if (wq0 < seq && j0 <= w_last) {
            const uint32_t kb = ks_a + (uint32_t)((t & 1) * PF_BN * LD * sizeof(T));
            const uint32_t vb = vs_a + (uint32_t)((t & 1) * PF_BN * LD * sizeof(T));
            float sc[PF_BN / 8][4];
#pragma unroll
            for (int n = 0; n < PF_BN / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
            for (int k = 0; k < KS; ++k) {
#pragma unroll
                for (int np = 0; np < PF_BN / 16; ++np) {
                    const int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
                    const int col = k * 16 + ((lane >> 3) & 1) * 8;
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(kb + (uint32_t)((key * LD + col) * sizeof(T)), b0, b1, b2, b3);
                    mma_16816<T>(sc[2 * np], qa[k], b0, b1);
                    mma_16816<T>(sc[2 * np + 1], qa[k], b2, b3);
                }
            }
            // Mask where the tile reaches past the warp's first query or into the padding.
            const bool masked = j0 + PF_BN - 1 > pos + wq0 || j0 < pad;
#pragma unroll
            for (int n = 0; n < PF_BN / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = sc[n][e] * PF_LOG2E;
                    if (masked) {
                        const int j = j0 + n * 8 + 2 * t4 + (e & 1), pq = pos + wq0 + g + (e >> 1) * 8;
                        if (!(j <= pq && (j >= pad || j == pq))) x = -INFINITY;
                    }
                    sc[n][e] = x;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < PF_BN / 8; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[r], mx);
                const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing seen yet
                const float alpha = ex2(m_run[r] - m_use);
                m_run[r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < PF_BN / 8; ++n) {
                    sc[n][2 * r] = ex2(sc[n][2 * r] - m_use);
                    sc[n][2 * r + 1] = ex2(sc[n][2 * r + 1] - m_use);
                    sum += sc[n][2 * r] + sc[n][2 * r + 1];
                }
                l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
                for (int n = 0; n < NO; ++n) {
                    o[n][2 * r] *= alpha;
                    o[n][2 * r + 1] *= alpha;
                }
            }
#pragma unroll
            for (int kk = 0; kk < PF_BN / 16; ++kk) {
                const uint32_t pa[4] = {
                    pack2<T>(sc[2 * kk][0], sc[2 * kk][1]), pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                    pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
                const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int np = 0; np < NO / 2; ++np) {
                    const int col = np * 16 + (lane >> 4) * 8;
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_trans(vb + (uint32_t)((key * LD + col) * sizeof(T)), b0, b1, b2, b3);
                    mma_16816<T>(o[2 * np], pa, b0, b1);
                    mma_16816<T>(o[2 * np + 1], pa, b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with buffer t & 1 before tile t + 2 refills it
    }

    // Normalise, stage the warp's 16 rows in its part of the Q tile, store 16-byte vectors.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* srow = qs + (warp * 16 + g + 8 * r) * LD;
#pragma unroll
        for (int n = 0; n < NO; ++n)
            *reinterpret_cast<uint32_t*>(srow + n * 8 + 2 * t4) = pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
    __syncwarp();
    T* out = reinterpret_cast<T*>(p.out);
#pragma unroll
    for (int c = lane; c < 16 * CPR; c += 32) {
        const int r = c / CPR, cc = c % CPR, i = wq0 + r;
        if (i < seq)
            *reinterpret_cast<uint4*>(out + ((size_t)s * seq + i) * p.nh * HD + (size_t)h * HD + cc * EPV) =
                *reinterpret_cast<const uint4*>(qs + (warp * 16 + r) * LD + cc * EPV);
    }
}

#define PF_KERNEL(SUF, T, HD)                                                                            \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32, 2)                                       \
        attn_prefill_##SUF##_h##HD(const __grid_constant__ PrefillParams p) {                            \
        prefill_attention<T, HD>(p);                                                                     \
    }

PF_KERNEL(f16, __half, 64)
PF_KERNEL(f16, __half, 128)
PF_KERNEL(bf16, __nv_bfloat16, 64)
PF_KERNEL(bf16, __nv_bfloat16, 128)
