// One-token matmul of tiled low-bit weights (w2416, and int4 / int2 converted to tiles):
// y = W x for m = 1, the decode step's shape. The weights' layout is cuda/tiles.cu's (and
// src/formats/w2416.rs's); in short, per 32-row block rb, G = ceil(k / 64) tile columns:
//
//   codes   u32 [R][128 (G + H)]  the block's tiles in column order, 512 B (2-bit) or 1024 B
//                                 (4-bit); tile (rb, g) at word desc[rb][g] & 0x7fffffff
//   desc    u32 [R][G]            bit 31: 4-bit (implied where every tile or none is 4-bit)
//   scales  two-level: u8 [R][G][32 rows][sc, zc] + f16 supers [R][S][32 rows] (S = ceil(G/16))
//           plain:     f16 [R][SG][32 rows][scale, zero] (SG = ceil(k / group))
//           (the 32 rows of a tile in the order lg 8 x nb 4: row lg + 8 nb at index 4 lg + nb)
//   entries u32 [R][E] col | f16(delta) << 16 sorted by row; row_end u32 [n]
//   perm    u32 [k / 2] or null: reordered weights' column order, column 2 i reads input
//           channel perm[i] & 0xffff and column 2 i + 1 channel perm[i] >> 16 (x and nw are
//           read through it where x is staged and where the outlier warps gather)
//
// A lane's 16 code bytes of a tile (lane l = 4 gid + t) hold rows gid + 8 nb, columns
// 16 kc + 8 hb + 2 t + e: 2-bit word nb has (kc, hb, e) at bit 2 j + 16 e with j = 2 kc + hb;
// 4-bit word 2 nb + kc / 2 at bit 4 p + 16 e with p = 2 (kc % 2) + hb. These are exactly the
// A fragments of mma.m16n8k16 (a0..a3 = (nb, hb) = (2 mb, 0), (2 mb + 1, 0), (2 mb, 1),
// (2 mb + 1, 1) of the 16-row half mb).
//
// Codes to f16 in one lop3 per pair, no shift for most: masking a pair's field in place and
// or-ing an exponent that gives the field's lowest bit the weight 1 makes the f16 pair
// base + q, exact, with base = 2^(10 - b) for a field at bit b < 10 of each half (2-bit
// fields j = 0..4: bases 1024, 256, 64, 16, 4; j = 5..7 after one shift of the word by 10:
// 1024, 256, 64; 4-bit p = 0, 1: 1024, 64; p = 2, 3 after a shift by 8). The bases depend
// only on the column, so the tile's sum of base * x is one number per column and precision:
// the mma chain of a tile gives sum((base + q) x), from which -sum(base x) (nS2 or nS4) is
// added to leave sum(q x); per row and tile y += s * sum(q x) + z * sum(x) with the group's
// f16 scale s and zero z as the dequantize rounds them (two-level: s = f16(sc ds / maxq),
// z = f16(zc s / 8)). The result differs from the dequantized product by f16 rounding of
// each weight and f32 rounding of sums of terms up to 1024 |x| (the tensor cores'
// accumulation), as tiles_mm's fold does.
// Lane l = 4 gid + t keeps row gid + 8 t (its C fragment holds rows gid + 8 nb for every nb,
// all token columns equal at m = 1): its 2 scale bytes are bytes 2 l .. 2 l + 1 of the tile's.
//
// Work split: pairs of row blocks (plain: 2 p and 2 p + 1, an odd last block computed twice
// and stored once; SiLU·mul: gate block p and up block p + R/2). A cluster of KS CTAs takes
// pairs cl, cl + NCL, cl + 2 NCL, ... (NCL clusters), each of its CTAs the chunk range of its
// rank (a chunk = GV_CH tile columns) of every one of them. Compute warp w of a CTA takes
// block w / 8 and the (w % 8)-th of P equal parts of the CTA's chunks (P = `parts` <= 8; the
// other compute warps idle); warps GV_WARPS and GV_WARPS + 1 the outliers of blocks 0 and 1
// (lane = row: the rank's KS-th of the row's run of entries, so that every lane works in
// every rank; entries and x read from global memory, 8 in flight, the next 8 entries loaded
// while this 8's x is gathered). Each compute
// warp streams its chunks, pair after pair, through its own ring of GV_STAGES stages: lane 0
// issues a chunk's codes and scales as bulk copies on the stage's mbarrier GV_STAGES chunks
// ahead, so the next chunks are in flight while this one is decoded and multiplied (the
// paper's asynchronous dequantization), across pair boundaries too. A pair's descriptors and
// super scales (and its outlier entries) are copied in by cp.async while the pair before it
// is computed (double-buffered where a CTA takes several pairs: the host then gives every
// computing warp at least GV_STAGES chunks of a pair, so the ring is never two pairs ahead).
// The first chunks are issued before pdl_wait (no kernel writes weights); then x is staged
// once per CTA in B-fragment order with its column sums. Partial rows are summed in a fixed
// order (parts, then outliers; then the cluster's ranks in rank order on rank 0, with one
// cluster barrier per pair): deterministic.
//
// Shared memory (dynamic, bytes; NB = 2 buffers where a CTA takes several pairs, else 1):
// ring [GV_WARPS][GV_STAGES][GV_STAGE] (a stage: codes GV_CH x 1024, scales GV_CH x 128),
// barriers u64 [GV_WARPS][GV_STAGES], xf u32 [C][32] (column c, lane t's 8 B-fragment words
// (kc, hb) at 8 t + 2 kc + hb), sums f32x4 [C] (sum x, -sum(base2 x), -sum(base4 x), 0),
// descriptors u32 [NB][2][C], super scales f16 [NB][GV_WARPS][SW][32] (each warp's groups);
// C = GV_CH x ceil(ceil(G / GV_CH) / KS), SW = C / (16 P) + 3.
//
//   x  f16 [1, k]; y EPI 0: f16 [1, n]; EPI 1: f32 [1, n]; EPI 2: f16 [1, n / 2] =
//   silu(gate) * up, rounded as the unfused pair.
//   nw f16 [k] or null: the input is rmsnorm(x) * nw (x then the residual stream): every CTA
//      sums x^2 over all of k itself (x is read from L2, 2k bytes) and stages
//      f16(x * rsqrt(mean + eps) * nw) for its columns, rounded as the separate norm kernel
//      rounds it (the mean may differ from it in the last bit: another summation order).
//   add f16 [n] or null (EPI 0 only): y = f16(f16(W x) + add), the residual added as
//      cuda/rms_norm.cu adds it.
#include "common.cuh"
#include "mbarrier.cuh"

using namespace lowbit;

#define GV_WARPS 16
#define GV_PARTS 8
#define GV_THREADS (32 * (GV_WARPS + 2))
#define GV_CH 4
#define GV_STAGES 2
#define GV_STAGE (GV_CH * 1024 + GV_CH * 128)
#define GV_SC_OFF (GV_CH * 1024)
// A chunk's tiles share one super scale (a super group is 16 tiles).
static_assert(16 % GV_CH == 0, "GV_CH must divide 16");

// (v & MASK) | OR in one lop3.
template <uint32_t MASK, uint32_t OR>
__device__ __forceinline__ uint32_t gv_field(uint32_t v) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(v), "n"(MASK), "r"(OR));
    return r;
}

// 2-bit pair j (0..7) of word w (h = w >> 10) as f16x2 base + q.
template <int J>
__device__ __forceinline__ uint32_t q2(uint32_t w, uint32_t h) {
    constexpr int P = J < 5 ? J : J - 5;
    constexpr uint32_t E = (uint32_t)(25 - 2 * P) << 10;
    return gv_field<0x00030003u << (2 * P), E | (E << 16)>(J < 5 ? w : h);
}

// 4-bit pair p (0..3) of word w (h = w >> 8) as f16x2 base + q.
template <int P>
__device__ __forceinline__ uint32_t q4(uint32_t w, uint32_t h) {
    constexpr uint32_t E = (P & 1) ? 0x54005400u : 0x64006400u;
    return gv_field<(P & 1) ? 0x00f000f0u : 0x000f000fu, E>(P < 2 ? w : h);
}

// c += a b (mma.m16n8k16, f16 operands, f32 accumulators); not volatile, so the two row
// halves' chains can interleave.
__device__ __forceinline__ void gv_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// k-chunk KC of one row half (words wa, wb: rows gid, gid + 8 of the half; ha, hb their
// shifted copies): its A fragment as base + q pairs, then the mma. 2-bit: pairs j = 2 KC
// (columns + 0) and 2 KC + 1 (+ 8) of words nb; 4-bit: pairs p = 2 (KC % 2) and + 1 of words
// 2 nb + KC / 2 (the caller passes those).
template <int KC>
__device__ __forceinline__ void gv_chunk2(float (&c)[4], uint32_t wa, uint32_t ha, uint32_t wb, uint32_t hb,
                                          const uint32_t (&bx)[8]) {
    gv_mma(c, q2<2 * KC>(wa, ha), q2<2 * KC>(wb, hb), q2<2 * KC + 1>(wa, ha), q2<2 * KC + 1>(wb, hb), bx[2 * KC],
           bx[2 * KC + 1]);
}
template <int KC>
__device__ __forceinline__ void gv_chunk4(float (&c)[4], uint32_t wa, uint32_t ha, uint32_t wb, uint32_t hb,
                                          const uint32_t (&bx)[8]) {
    constexpr int P = 2 * (KC & 1);
    gv_mma(c, q4<P>(wa, ha), q4<P>(wb, hb), q4<P + 1>(wa, ha), q4<P + 1>(wb, hb), bx[2 * KC], bx[2 * KC + 1]);
}

// sum((base + q) x) of the lane's row (gid + 8 t) of one tile: two mma chains (row halves mb,
// rows nb = 2 mb and 2 mb + 1), interleaved; the lane's own row picked out of its C fragments.
template <bool FOUR>
__device__ __forceinline__ float gv_tile(uint4 c0, uint4 c1, const uint32_t (&bx)[8], int t) {
    float c[2][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[mb][i] = 0.f;
    if (FOUR) {
        const uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        uint32_t h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = w[i] >> 8;
        // Words of row nb, k-chunk kc: 2 nb + kc / 2.
#define GV_CHUNK4(KC)                                                                              \
    for (int mb = 0; mb < 2; ++mb)                                                                 \
        gv_chunk4<KC>(c[mb], w[4 * mb + KC / 2], h[4 * mb + KC / 2], w[4 * mb + 2 + KC / 2],        \
                      h[4 * mb + 2 + KC / 2], bx);
        GV_CHUNK4(0) GV_CHUNK4(1) GV_CHUNK4(2) GV_CHUNK4(3)
#undef GV_CHUNK4
    } else {
        const uint32_t w[4] = {c0.x, c0.y, c0.z, c0.w};
        const uint32_t h[4] = {w[0] >> 10, w[1] >> 10, w[2] >> 10, w[3] >> 10};
#define GV_CHUNK2(KC) \
    for (int mb = 0; mb < 2; ++mb) gv_chunk2<KC>(c[mb], w[2 * mb], h[2 * mb], w[2 * mb + 1], h[2 * mb + 1], bx);
        GV_CHUNK2(0) GV_CHUNK2(1) GV_CHUNK2(2) GV_CHUNK2(3)
#undef GV_CHUNK2
    }
    // Row gid + 8 t: C row gid (c0) or gid + 8 (c2) of half t / 2.
    const float lo = (t & 1) ? c[0][2] : c[0][0], hi = (t & 1) ? c[1][2] : c[1][0];
    return (t & 2) ? hi : lo;
}

// The f16 scale and zero of the lane's row for a two-level tile, as the dequantize rounds them.
__device__ __forceinline__ void gv_two_scales(uint32_t sz, float ds, bool four, float& s, float& z) {
    const float scf = (float)(sz & 0xffu), zcf = (float)(int)(int8_t)(sz >> 8);
    const float inv = four ? (1.0f / 15.0f) : (1.0f / 3.0f);
    s = __half2float(__float2half_rn(__fmul_rn(__fmul_rn(scf, ds), inv)));
    z = __half2float(__float2half_rn(__fmul_rn(__fmul_rn(zcf, s), 0.125f)));
}

template <bool TWO, int EPI>
__device__ void tiles_gemv(const __half* __restrict__ x, const uint32_t* __restrict__ codes,
                           const uint32_t* __restrict__ desc, const uint8_t* __restrict__ sc,
                           const __half* __restrict__ sup, const __half* __restrict__ plain,
                           const uint32_t* __restrict__ entries, const uint32_t* __restrict__ row_end,
                           const uint32_t* __restrict__ perm, const __half* __restrict__ nw, const __half* __restrict__ add, float eps,
                           void* y_out, int n, int k, int H, int E, int group, int ks, int parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    pdl_trigger();
    extern __shared__ __align__(16) uint8_t gv_smem[];
    __shared__ float red_sh[2][GV_WARPS + 2][32];  // [pair & 1][w][row]: compute, then outlier warps
    __shared__ float fin_sh[2][2][32];              // [pair & 1][block][row]: the CTA's sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int G = (k + 63) / 64, R = n / 32, NC = (G + GV_CH - 1) / GV_CH, S16 = (G + 15) / 16;
    const int NP = EPI == 2 ? R / 2 : (R + 1) / 2, NCL = gridDim.x / ks;
    const int rank = blockIdx.x % ks, cl = blockIdx.x / ks;
    const int npc = (NP - cl + NCL - 1) / NCL;  // pairs of this cluster
    const int NB = NCL < NP ? 2 : 1;
    const int cc0 = NC * rank / ks, cc1 = NC * (rank + 1) / ks;  // this CTA's chunks
    const int C = GV_CH * ((NC + ks - 1) / ks), cg0 = GV_CH * cc0;
    const int SW = C / (16 * parts) + 3;
    uint8_t* ring_all = gv_smem;
    uint64_t* bar_all = reinterpret_cast<uint64_t*>(gv_smem + GV_WARPS * GV_STAGES * GV_STAGE);
    uint32_t* xf = reinterpret_cast<uint32_t*>(bar_all + GV_WARPS * GV_STAGES);
    float4* sums = reinterpret_cast<float4*>(xf + C * 32);
    uint32_t* desc_sh = reinterpret_cast<uint32_t*>(sums + C);  // [NB][2][C]
    __half* sup_sh = reinterpret_cast<__half*>(desc_sh + NB * 2 * C);  // [NB][GV_WARPS][SW][32]
    // Row blocks of this cluster's j-th pair, block b (an odd last block: block 0 again).
    auto rb_of = [&](int j, int bb) -> int {
        const int p = cl + j * NCL;
        const int r0 = EPI == 2 ? p : 2 * p, r1 = EPI == 2 ? p + R / 2 : 2 * p + 1;
        return bb == 0 || r1 >= R ? r0 : r1;
    };

    // Compute warp: block b, part q of the CTA's chunks, columns [wg0, wg1) of every pair.
    const int b = (warp / GV_PARTS) & 1, q = warp % GV_PARTS;
    const bool computes = warp < GV_WARPS && q < parts;
    const int ch0 = cc0 + (cc1 - cc0) * q / parts, ch1 = cc0 + (cc1 - cc0) * (q + 1) / parts;
    const int nch = computes ? ch1 - ch0 : 0, wg0 = GV_CH * ch0, wg1 = min(GV_CH * ch1, G);
    const int NI = npc * nch;  // chunks of this warp over all its pairs
    uint8_t* ring = ring_all + warp * GV_STAGES * GV_STAGE;
    uint64_t* bar = bar_all + warp * GV_STAGES;
    const int gshift = __ffs(group / 64) - 1;  // plain: a scale group is 2^gshift tiles
    const int SG = (k + group - 1) / group;
    // This warp's descriptors and super scales of pair j (buffer j & (NB - 1), NB being 1 or
    // 2), by absolute column / super group.
    auto desc_of = [&](int j) -> uint32_t* { return desc_sh + ((j & (NB - 1)) * 2 + b) * C - cg0; };
    auto sup_of = [&](int j) -> __half* { return sup_sh + (((j & (NB - 1)) * GV_WARPS + warp) * SW - wg0 / 16) * 32; };
    // Pair j's descriptors (computed where every tile or none is 4-bit) and super scales into
    // its buffer, by cp.async (one group).
    auto stage_meta = [&](int j) {
        const int rb = rb_of(j, b);
        uint32_t* dw = desc_of(j);
        for (int g = wg0 + lane; g < wg1; g += 32) {
            if (H == G) dw[g] = 0x80000000u | 256u * (uint32_t)g;
            else if (H == 0) dw[g] = 128u * (uint32_t)g;
            else cp_async4(smem_u32(dw + g), desc + (size_t)rb * G + g);
        }
        if (TWO && lane < 16) {
            __half* sw = sup_of(j);
            for (int sg = wg0 / 16; sg <= (wg1 - 1) / 16; ++sg)
                cp_async4(smem_u32(sw + sg * 32 + 2 * lane), sup + ((size_t)rb * S16 + sg) * 32 + 2 * lane);
        }
        cp_async_commit();
    };
    // The next chunk to issue is chunk ic of pair ij (chunk ij * nch + ic of the warp's run):
    // counted, not divided out of the chunk's index, which would cost two integer divisions
    // per chunk in the loop.
    int ij = 0, ic = 0;
    // That chunk into stage si: the codes of its columns (one contiguous run of the block's
    // stream) and their scales, by lane 0; then the next chunk is the one after it.
    auto issue = [&](int si) {
        const int j = ij, rb = rb_of(j, b);
        const int g = wg0 + GV_CH * ic, ge = min(g + GV_CH, wg1);
        if (++ic == nch) {
            ic = 0;
            ++ij;
        }
        const uint32_t* dw = desc_of(j);
        const uint32_t o0 = dw[g] & 0x7fffffffu, dl = dw[ge - 1];
        const uint32_t cbytes = 4u * ((dl & 0x7fffffffu) + ((dl >> 31) ? 256u : 128u) - o0);
        const int s0 = g >> gshift;
        const uint32_t sbytes = TWO ? 64u * (uint32_t)(ge - g) : 128u * (uint32_t)(((ge - 1) >> gshift) - s0 + 1);
        const void* ssrc = TWO ? (const void*)(sc + ((size_t)rb * G + g) * 64)
                               : (const void*)(plain + ((size_t)rb * SG + s0) * 64);
        if (lane == 0) {
            uint8_t* st = ring + si * GV_STAGE;
            mbar_expect_tx(&bar[si], (int)(cbytes + sbytes));
            bulk_g2s(st, codes + (size_t)rb * 128 * (G + H) + o0, cbytes, &bar[si]);
            bulk_g2s(st + GV_SC_OFF, ssrc, sbytes, &bar[si]);
        }
    };
    // Outlier warps: lane = row of block ob of pair j; its run of the block's entries, the
    // rank's KS-th of it.
    const int ob = warp - GV_WARPS;
    const bool outl = ob >= 0 && E > 0;
    auto row_run = [&](int j, int& lo, int& hi) {
        const int row = rb_of(j, ob) * 32 + lane;
        const int beg = lane == 0 ? 0 : (int)__ldg(row_end + row - 1), end = (int)__ldg(row_end + row);
        lo = beg + (end - beg) * rank / ks;
        hi = beg + (end - beg) * (rank + 1) / ks;
    };
    int o_lo = 0, o_hi = 0, n_lo = 0, n_hi = 0;

    // Prologue, weights only (before pdl_wait): pair 0's descriptors and super scales,
    // barriers, the first chunks; the outliers' first row runs and entries.
    if (computes && nch > 0) {
        stage_meta(0);
        if (lane == 0) {
            for (int s = 0; s < GV_STAGES; ++s) mbar_init(&bar[s], 1);
            fence_mbar_init();
        }
        cp_async_wait<0>();
        __syncwarp();
        for (int i = 0; i < min(GV_STAGES, NI); ++i) issue(i);  // stage i: chunk i of pair 0
    } else if (outl) {
        row_run(0, o_lo, o_hi);
    }

    // x of this CTA's columns in B-fragment order, and its column sums. Thread i: column
    // i / 8, 8-column run s = i % 8 (= 2 kc + hb, base2 / base4 of its pairs).
    pdl_wait();
    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
    // With nw: the norm's scale from all of x (k even: 2 values per 4-byte load).
    float inv = 1.f;
    if (nw != nullptr) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < k / 2; i += GV_THREADS) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(x32 + i));
            ss += f.x * f.x + f.y * f.y;
        }
        ss = warp_sum(ss);
        if (lane == 0) red_sh[0][warp][0] = ss;
        __syncthreads();
        ss = 0.f;
#pragma unroll
        for (int w = 0; w < GV_WARPS + 2; ++w) ss += red_sh[0][w][0];
        inv = rsqrtf(ss / (float)k + eps);
    }
    // The input value v of channel ch (normed where asked), as f32.
    auto xin = [&](int ch, float v) -> float {
        return nw == nullptr ? v : __half2float(__float2half_rn(v * inv * __half2float(__ldg(nw + ch))));
    };
    const unsigned short* x16 = reinterpret_cast<const unsigned short*>(x);
    for (int i0 = 0; i0 < 8 * C; i0 += GV_THREADS) {
        const int i = i0 + threadIdx.x, c = i >> 3, s = i & 7;
        float sub = 0.f;
        if (c < C) {
#pragma unroll
            for (int tt = 0; tt < 4; ++tt) {
                const int col = 64 * (cg0 + c) + 8 * s + 2 * tt;
                float2 f = make_float2(0.f, 0.f);
                if (col < k) {
                    int c0 = col, c1 = col + 1;
                    uint32_t v;
                    if (perm != nullptr) {
                        const uint32_t pw = __ldg(perm + col / 2);
                        c0 = (int)(pw & 0xffffu);
                        c1 = (int)(pw >> 16);
                        v = (uint32_t)__ldg(x16 + c0) | ((uint32_t)__ldg(x16 + c1) << 16);
                    } else {
                        v = __ldg(x32 + col / 2);
                    }
                    f = __half22float2(*reinterpret_cast<const __half2*>(&v));
                    f = make_float2(xin(c0, f.x), xin(c1, f.y));
                }
                const __half2 hv = __floats2half2_rn(f.x, f.y);
                xf[32 * c + 8 * tt + s] = *reinterpret_cast<const uint32_t*>(&hv);
                sub += f.x + f.y;
            }
        }
        float s0 = sub, s2 = (float)(1024 >> (2 * (s < 5 ? s : s - 5))) * sub, s4 = (s & 1 ? 64.f : 1024.f) * sub;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            s2 += __shfl_xor_sync(0xffffffffu, s2, o);
            s4 += __shfl_xor_sync(0xffffffffu, s4, o);
        }
        if (c < C && s == 0) sums[c] = make_float4(s0, -s2, -s4, 0.f);
    }
    __syncthreads();

    const uint4* xq0 = reinterpret_cast<const uint4*>(xf + 8 * t) - 8 * cg0;  // column g at + 8 g
    const float4* sm0 = sums - cg0;
    for (int j = 0; j < npc; ++j) {
        if (computes && nch == 0) {
            red_sh[j & 1][warp][(lane >> 2) + 8 * t] = 0.f;
        } else if (computes) {
            if (NB == 2 && j + 1 < npc) stage_meta(j + 1);  // waited for at pair j + 1's first issue
            const uint32_t* dw = desc_of(j);
            const __half* sw = sup_of(j);
            float res = 0.f;
            for (int c = 0; c < nch; ++c) {
                const int i = j * nch + c, si = (uint32_t)i % GV_STAGES;  // unsigned: no sign fixups
                mbar_wait(&bar[si], ((uint32_t)i / GV_STAGES) & 1);
                const uint8_t* st = ring + si * GV_STAGE;
                const int g = wg0 + GV_CH * c, ge = min(g + GV_CH, wg1);
                const uint32_t o0 = dw[g] & 0x7fffffffu;
                const float ds = TWO ? __half2float(sw[((uint32_t)g / 16) * 32 + lane]) : 0.f;
#pragma unroll
                for (int jj = 0; jj < GV_CH; ++jj) {
                    const int gj = g + jj;
                    if (gj >= ge) break;
                    const uint32_t d = dw[gj];
                    const bool four = (d >> 31) != 0;
                    const uint8_t* tp = st + 4u * ((d & 0x7fffffffu) - o0) + 16 * lane;
                    const uint4 c0 = *reinterpret_cast<const uint4*>(tp);
                    const uint4 xa = xq0[8 * gj], xb = xq0[8 * gj + 1];
                    const uint32_t bx[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                    const float4 sm = sm0[gj];
                    float sv, zv;
                    if (TWO) {
                        const uint32_t u = reinterpret_cast<const uint16_t*>(st + GV_SC_OFF + 64 * jj)[lane];
                        gv_two_scales(u, ds, four, sv, zv);
                    } else {
                        const uint32_t u = reinterpret_cast<const uint32_t*>(
                            st + GV_SC_OFF + 128 * ((gj >> gshift) - (g >> gshift)))[lane];
                        sv = __half2float(__ushort_as_half((unsigned short)(u & 0xffffu)));
                        zv = __half2float(__ushort_as_half((unsigned short)(u >> 16)));
                    }
                    const float v = four ? gv_tile<true>(c0, *reinterpret_cast<const uint4*>(tp + 512), bx, t) + sm.z
                                         : gv_tile<false>(c0, c0, bx, t) + sm.y;
                    res = fmaf(zv, sm.x, fmaf(sv, v, res));
                }
                __syncwarp();
                if (i + GV_STAGES < NI) {  // chunk i + GV_STAGES, into this chunk's stage
                    if (ic == 0) {  // the next pair's first chunk: its descriptors
                        cp_async_wait<0>();
                        __syncwarp();
                    }
                    if (lane == 0) fence_proxy_async();
                    issue(si);
                }
            }
            red_sh[j & 1][warp][(lane >> 2) + 8 * t] = res;
        } else if (outl && (ob == 0 || rb_of(j, 1) != rb_of(j, 0))) {
            // Outliers: lane = row, its run of entries in order, eight in flight.
            if (j + 1 < npc) row_run(j + 1, n_lo, n_hi);
            const uint32_t* ent = entries + (size_t)rb_of(j, ob) * E;
            float part = 0.f;
            uint32_t v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = o_lo + u < o_hi ? __ldg(ent + o_lo + u) : 0u;
            for (int e0 = o_lo; e0 < o_hi; e0 += 8) {
                float xv[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int col = (int)(v[u] & 0xffffu);
                    const int ch = perm == nullptr ? col : (int)((__ldg(perm + col / 2) >> (16 * (col & 1))) & 0xffffu);
                    xv[u] = e0 + u < o_hi ? xin(ch, __half2float(__ldg(x + ch))) : 0.f;
                }
                uint32_t nv[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) nv[u] = e0 + 8 + u < o_hi ? __ldg(ent + e0 + 8 + u) : 0u;
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    part = fmaf(__half2float(__ushort_as_half((unsigned short)(v[u] >> 16))), xv[u], part);
                    v[u] = nv[u];
                }
            }
            red_sh[j & 1][warp][lane] = part;
            o_lo = n_lo;
            o_hi = n_hi;
        } else if (ob >= 0) {
            red_sh[j & 1][warp][lane] = 0.f;
            if (outl && j + 1 < npc) row_run(j + 1, n_lo, n_hi);
            o_lo = n_lo;
            o_hi = n_hi;
        }
        __syncthreads();
        // The pair's sums: parts in order, then the outliers.
        if (threadIdx.x < 64) {
            const int bb = threadIdx.x >> 5, r = threadIdx.x & 31;
            float s = 0.f;
            for (int qq = 0; qq < parts; ++qq) s += red_sh[j & 1][GV_PARTS * bb + qq][r];
            fin_sh[j & 1][bb][r] = s + red_sh[j & 1][GV_WARPS + bb][r];
        }
        if (ks > 1) cluster_sync();
        else __syncthreads();
        if (rank == 0 && threadIdx.x < 32) {
            float tot[2];
            // Every remote load issued before the first is used, then added in rank order.
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                float v[8];
#pragma unroll
                for (int r = 1; r < 8; ++r) v[r] = r < ks ? ld_cluster(&fin_sh[j & 1][bb][lane], (uint32_t)r) : 0.f;
                float s = fin_sh[j & 1][bb][lane];
#pragma unroll
                for (int r = 1; r < 8; ++r)
                    if (r < ks) s += v[r];
                tot[bb] = s;
            }
            const int r0 = rb_of(j, 0), r1 = rb_of(j, 1);
            if (EPI == 2) {
                const float gt = __half2float(__float2half_rn(tot[0]));
                const float up = __half2float(__float2half_rn(tot[1]));
                const float sg = __half2float(__float2half_rn(gt / (1.f + __expf(-gt))));
                reinterpret_cast<__half*>(y_out)[r0 * 32 + lane] = __float2half_rn(sg * up);
            } else {
#pragma unroll
                for (int bb = 0; bb < 2; ++bb) {
                    if (bb == 1 && r1 == r0) continue;
                    const int o = (bb ? r1 : r0) * 32 + lane;
                    if (EPI == 1) {
                        reinterpret_cast<float*>(y_out)[o] = tot[bb];
                    } else {
                        float yv = tot[bb];
                        if (add != nullptr) yv = __half2float(__float2half_rn(yv)) + __half2float(add[o]);
                        reinterpret_cast<__half*>(y_out)[o] = __float2half_rn(yv);
                    }
                }
            }
        }
    }
    // No block leaves while rank 0 may still read its shared memory (the last pair's sums).
    if (ks > 1) cluster_sync();
#else
    __trap();  // built for an architecture without bulk copies: the host never launches this
#endif
}

#define TILES_GEMV(NAME, TWO, EPI)                                                                            \
    extern "C" __global__ void __launch_bounds__(GV_THREADS, 1)                                               \
        NAME(const __half* x, const uint32_t* codes, const uint32_t* desc, const uint8_t* sc, const __half* sup, \
             const __half* plain, const uint32_t* entries, const uint32_t* row_end, const uint32_t* perm,          \
             const __half* nw, const __half* add, float eps, void* y, int n, int k, int H, int E, int group, int ks, \
             int parts) {                                                                                     \
        tiles_gemv<TWO, EPI>(x, codes, desc, sc, sup, plain, entries, row_end, perm, nw, add, eps, y, n, k, H, E,  \
                             group, ks, parts);                                                               \
    }

TILES_GEMV(tiles_gemv_two_f16, true, 0)
TILES_GEMV(tiles_gemv_two_f32, true, 1)
TILES_GEMV(tiles_gemv_two_silu, true, 2)
TILES_GEMV(tiles_gemv_plain_f16, false, 0)
TILES_GEMV(tiles_gemv_plain_f32, false, 1)
TILES_GEMV(tiles_gemv_plain_silu, false, 2)
