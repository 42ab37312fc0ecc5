// Tiled low-bit weights (src/formats/w2416.rs): the w2416 format (2-bit groups, 4-bit tiles,
// sparse f16 outliers, two-level scales) and the uniform int4 / int2 formats converted to
// the same tiles. A matmul for m <= 16 activation rows on f16 tensor cores with the
// dequantization in registers, and a dequantize kernel (for larger m: dequantize + cuBLAS).
// One token on sm_90 builds takes the GEMV in cuda/tiles_gemv.cu instead of tiles_mm.
//
// Layout (row-major; R = n / 32 row blocks, G = ceil(k / 64) tile columns (k even; a last
// partial tile holds zero weights past k, whose activations the kernel reads as 0), H = 4-bit tiles per
// block, S = ceil(G / 16), E = outliers per block):
//
//   codes   u32 [R][128 (G + H)]  per block, its tiles in column order; tile (b, g) starts at
//                                  word desc[b][g] & 0x7fffffff, 4-bit when bit 31 is set.
//   desc    u32 [R][G]
//   scales  two-level: u8  [R][G][lg 8][nb 4][sc, zc]      (64 bytes per tile)
//           plain:     f16 [R][SG][lg 8][nb 4][scale, zero] (SG = ceil(k / group))
//   supers  f16 [R][S][lg 8][nb 4]                          (two-level only)
//   entries u32 [R][E]  col | f16 bits(delta) << 16, sorted by row; row_end u32 [n]: one past
//                       the row's last entry in its block's list (row 0 of a block starts at 0)
//
// One tile = 32 rows x 64 columns, decoded by one warp. Lane l (lg = l / 4, t = l % 4) holds
// rows lg + 8 nb (nb 0..3) at columns 16 kc + 2 t + 8 hb + e (kc 0..3, hb, e 0..1): exactly
// the A fragments of 8 mma.m16n8k16 (16-row half mb = nb / 2, k-chunk kc; a0 a1 a2 a3 =
// (nb, hb) = (2 mb, 0), (2 mb + 1, 0), (2 mb, 1), (2 mb + 1, 1)):
//
//   2-bit tile (512 B):  lane l reads uint4 #l          word nb: (kc, hb, e) at bit 2 (2 kc + hb) + 16 e
//   4-bit tile (1024 B): lane l reads uint4 #l and #32+l: word 2 nb + kc / 2 of those 8 words,
//                                                        (kc, hb, e) at bit 4 (2 (kc % 2) + hb) + 16 e
//
//   One tile, which lanes hold what (each cell: the 4 lanes 4 lg .. 4 lg + 3; lane t of them
//   holds columns 2t, 2t+1, 2t+8, 2t+9 of each 16-column chunk kc):
//
//              columns:  0..15 (kc 0)  16..31 (kc 1)  32..47 (kc 2)  48..63 (kc 3)
//     row  0 + lg         lanes 4lg..   (n-block 0: word 0 of a 2-bit lane; words 0-1 of a 4-bit lane)
//     row  8 + lg         lanes 4lg..   (n-block 1: word 1;                 words 2-3)
//     row 16 + lg         lanes 4lg..   (n-block 2: word 2;                 words 4-5)
//     row 24 + lg         lanes 4lg..   (n-block 3: word 3;                 words 6-7)
//
// Matmul (tiles_mm): the weights are the mma's A operand, the activations its B (tokens are
// the 8 columns of an n-block: m <= 8 takes one mma per 16 rows x 16 columns). The lane's
// code rows lg + 8 nb are exactly the A fragments' rows (gid, gid + 8 of the 16-row half
// nb / 2), so the packed tiles are used as they are. A code pair becomes the f16x2 1024 + q
// by one shift and one lop3 (0x6400 | q), exact; the mma sums (1024 + q) x in f32 per tile
// and row, and the group's scale and zero are applied once per row and tile:
//   sum (q s + z) x = s * sum (1024 + q) x + (z - 1024 s) * sum x,
// with sum x from an mma of the activations with an all-ones A (once per column, shared by
// the row blocks), and s, z the f16 values the dequantize below rounds (two-level: the lane
// holding row nb = t decodes it, the others shuffle; plain: each lane reads its four rows).
// The matmul thus differs from the dequantized product by the f16 rounding of each weight
// (w = f16(q s + z) there) and by f32 rounding of sums whose terms are about 1024 |x| before
// 1024 s sum x is taken off again: the rounding error of a tile's sum grows by roughly
// 1024 / |q| against summing q x directly (2-bit more than 4-bit), to the order of 2^-13 of
// sum |x| per tile. Measured (bench, H200, 4096x4096 .. 4096x11008): the relative error
// against the f32 product of the dequantized weights is unchanged by the fold (2.7e-4 w2416,
// 2.1e-4 int4, as before it); the CUDA tests hold the kernel to the format's 5e-3.
// Dequantize (tiles_dequantize): a code pair becomes an f16x2 by one shift and one and/or
// (0x6400 | q = 1024 + q), one HSUB2 (exact) and one HFMA2 with the group's (scale, zero):
// w = f16(q * scale + zero), rounded once. Two-level scales: scale = f16(sc * ds * (1/maxq)),
// zero = f16(zc * scale / 8), in f32 without fused multiply-adds (the CPU reference's order).
//
// Work split (tiles_mm): a block of 4 warps owns two row blocks (plain: 2p and 2p + 1; SiLU·mul:
// gate block p and up block p + R/2; an odd last block is computed twice and stored once);
// warp w of cluster rank c takes tile columns c * 4 + w, + 4 * KS, ...; every warp decodes
// both row blocks' tiles of its column in straight-line code (their mma chains interleave).
// The asynchronous dequantization of the paper: each warp keeps TILES_STAGES columns in
// flight (cp.async into its own shared-memory ring: codes and scales; each warp stages the
// descriptors of its own columns, so no block-wide barrier precedes the first copies; a
// uniform format's are implied by the column, so its first copies wait on no load), and
// the next column's activations in registers, while the current column's codes become f16
// pairs, are multiplied, and its scales are decoded and applied. KS blocks (a thread-block
// cluster along x, KS 1..8, chosen by the host to fill one wave at the kernel's occupancy)
// split the columns; block rank 0 sums the others' partial results from their shared memory
// and writes y; the outliers are added into the partial sums first, spread over every warp
// of the cluster (lane = row; each warp loads its rows' ends before its main loop and copies
// its first TILES_OUT_PRE entries per row to shared memory after its first column, so that no
// register waits on them; their activations are read at the end: from x at m = 1, from xt
// above, one column's tokens contiguous). Deterministic:
// fixed summation order.
// Measured steps on the H200 (int4 / w2416 at m = 1, µs, 11008x4096; BENCHMARKS.md): dequantize
// + HFMA2 per code pair, weights as the B operand 22.3 / 28.3; weights as A, scales folded
// out of the inner loop 22.9 / 27.5; then one lop3 per pair and lean address arithmetic
// 18.5 / 23.2; then both tiles straight-line, 32-bit offsets, per-warp descriptors and
// prefetched outliers 18.0 / 22.7 (m = 16: 19.4 / 33.3, was 31.5 / 52.7); then only the m
// stored token rows reduced at the end, the cluster's remote loads issued at once 14.5 / 19.3
// (4096x4096: 11.8 / 13.5 -> 7.6 / 8.9, where the end was most of the time). Then the outlier
// entries staged after the first column (no prologue wait, no spills) and x gathered per
// token at m = 1: w2416 19.1 -> 17.3 (m = 16: 34.0 -> 31.2). Still latency-
// bound per warp (about 0.36 instructions issued per cycle and scheduler), not DRAM-bound; a
// two-stage ring at six blocks per SM helps 11008x4096 and loses elsewhere and end to end.
//
//   x  f16 [m, k], m <= 16 (MM = 8: m <= 8, one 8-token n-block; MM = 16: two; token rows past m
//      read row m - 1 and their results are never stored)
//   xt f16 [k][MM] (m > 1 with outliers; else unused): x transposed by tiles_xt, tokens past m 0
//   y  EPI 0: f16 [m, n]; EPI 1: f32 [m, n]; EPI 2: f16 [m, n / 2] = silu(gate) * up, rounded
//      as the unfused pair (gate and up to f16, silu(gate) to f16, the product to f16).
// Weights are read before pdl_wait (no kernel writes them); activations after.
#include "common.cuh"
#include "wgmma.cuh"

using namespace lowbit;

#define TILES_NW 4
#define TILES_STAGES 3
// Outlier entries per row and block each warp copies to shared memory during its first column.
#define TILES_OUT_PRE 2

// A compile-time int as a value (to instantiate a generic lambda per constant).
template <int N>
struct TilesInt {
    static constexpr int value = N;
};

__device__ __forceinline__ uint4 ld_stream4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// Codes at bits (0, 16) of `bits` (already shifted and masked) -> f16x2 of q * s + z.
__device__ __forceinline__ uint32_t deq2(uint32_t bits, __half2 s, __half2 z) {
    uint32_t h = bits | 0x64006400u;
    __half2 v = __hsub2(*reinterpret_cast<__half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
    return h2_bits(__hfma2(v, s, z));
}

// One tile's data for one lane.
struct TileFrag {
    uint4 c0, c1;  // codes (c1: 4-bit tiles only)
    uint4 s;       // two-level: x, y = 8 bytes [nb][sc, zc]; z, w = 4 f16 super scales [nb].
                   // plain: 4 x (f16 scale, f16 zero) [nb].
    bool four;
};

struct TileSrc {
    const uint32_t* codes;    // block's stream
    const uint32_t* desc;     // block's descriptors
    const uint8_t* sc;        // two-level: block's scale codes
    const __half* sup;        // two-level: block's super scales
    const __half* plain;      // plain: block's (scale, zero)
    int group;                // plain scale group (columns)
};

template <bool TWO>
__device__ __forceinline__ void load_tile(TileFrag& f, const TileSrc& src, int g, int lane) {
    const uint32_t d = __ldg(src.desc + g);
    f.four = (d >> 31) != 0;
    const uint4* t = reinterpret_cast<const uint4*>(src.codes + (d & 0x7fffffffu));
    f.c0 = ld_stream4(t + lane);
    f.c1 = f.four ? ld_stream4(t + 32 + lane) : make_uint4(0, 0, 0, 0);
    const int lg = lane >> 2;
    if (TWO) {
        const uint2 a = __ldg(reinterpret_cast<const uint2*>(src.sc + (size_t)g * 64 + lg * 8));
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(src.sup + (size_t)(g / 16) * 32 + lg * 4));
        f.s = make_uint4(a.x, a.y, b.x, b.y);
    } else {
        const int sg = g * 64 / src.group;
        f.s = __ldg(reinterpret_cast<const uint4*>(src.plain + (size_t)sg * 64 + lg * 8));
    }
}

// (scale, zero) of n-block nb as f16x2 pairs.
template <bool TWO>
__device__ __forceinline__ void tile_scales(const TileFrag& f, int nb, __half2& s2, __half2& z2) {
    if (TWO) {
        const uint32_t scw = nb < 2 ? f.s.x : f.s.y;
        const uint32_t sc = (scw >> (16 * (nb & 1))) & 0xffu;
        const int zc = (int)(int8_t)((scw >> (16 * (nb & 1) + 8)) & 0xffu);
        const uint32_t dsw = nb < 2 ? f.s.z : f.s.w;
        const __half ds = __ushort_as_half((unsigned short)((dsw >> (16 * (nb & 1))) & 0xffffu));
        const float inv = f.four ? (1.0f / 15.0f) : (1.0f / 3.0f);
        const __half s = __float2half_rn(__fmul_rn(__fmul_rn((float)sc, __half2float(ds)), inv));
        const __half z = __float2half_rn(__fmul_rn(__fmul_rn((float)zc, __half2float(s)), 0.125f));
        s2 = __half2half2(s);
        z2 = __half2half2(z);
    } else {
        const uint32_t w = nb == 0 ? f.s.x : nb == 1 ? f.s.y : nb == 2 ? f.s.z : f.s.w;
        s2 = __half2half2(__ushort_as_half((unsigned short)(w & 0xffffu)));
        z2 = __half2half2(__ushort_as_half((unsigned short)(w >> 16)));
    }
}

// The B fragment (b0 | b1) of n-block nb, k-chunk kc, hb selecting b0 (0) or b1 (1).
template <bool FOUR>
__device__ __forceinline__ uint32_t tile_b(const TileFrag& f, int nb, int kc, int hb, __half2 s2, __half2 z2) {
    if (FOUR) {
        const int wi = 2 * nb + kc / 2;
        const uint32_t words[8] = {f.c0.x, f.c0.y, f.c0.z, f.c0.w, f.c1.x, f.c1.y, f.c1.z, f.c1.w};
        const int p = 2 * (kc & 1) + hb;
        return deq2((words[wi] >> (4 * p)) & 0x000f000fu, s2, z2);
    }
    const uint32_t words[4] = {f.c0.x, f.c0.y, f.c0.z, f.c0.w};
    const int p = 2 * kc + hb;
    return deq2((words[nb] >> (2 * p)) & 0x00030003u, s2, z2);
}

// (v & mask) | 0x64006400 in one lop3 (the constant in a register: a lop3 takes one immediate).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or_6400(uint32_t v) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(v), "n"(MASK), "r"(0x64006400u));
    return r;
}

// 1024 + q of the lane's code pair (nb, kc, hb) as f16x2 bits: one shift and one lop3 (the
// matmul folds the 1024 and the group's scale and zero out of the inner loop).
template <bool FOUR>
__device__ __forceinline__ uint32_t tile_q(const TileFrag& f, int nb, int kc, int hb) {
    if (FOUR) {
        const uint32_t words[8] = {f.c0.x, f.c0.y, f.c0.z, f.c0.w, f.c1.x, f.c1.y, f.c1.z, f.c1.w};
        return and_or_6400<0x000f000fu>(words[2 * nb + kc / 2] >> (4 * (2 * (kc & 1) + hb)));
    }
    const uint32_t words[4] = {f.c0.x, f.c0.y, f.c0.z, f.c0.w};
    return and_or_6400<0x00030003u>(words[nb] >> (2 * (2 * kc + hb)));
}

// The activations of tile column g as mma B fragments: bx[kc][nt] = (b0, b1) of token row
// xr[nt] (token 8 nt + gid, clamped to m - 1: the columns of C past m are computed from a
// repeated row and never stored) at columns 64 g + 16 kc + 2 t (+ 8); xr[nt] points at
// column 2 t of that row. Columns past k (the zero weights of a last, partial tile) read as 0.
template <int NT>
__device__ __forceinline__ void load_b(uint32_t (&bx)[4][NT][2], const uint32_t* const (&xr)[NT], int k, int g,
                                       int t) {
    if (g * 64 + 64 <= k) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                bx[kc][nt][0] = __ldg(xr[nt] + g * 32 + kc * 8);
                bx[kc][nt][1] = __ldg(xr[nt] + g * 32 + kc * 8 + 4);
            }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                const int col = g * 64 + kc * 16 + 2 * t;
                bx[kc][nt][0] = col < k ? __ldg(xr[nt] + g * 32 + kc * 8) : 0u;
                bx[kc][nt][1] = col + 8 < k ? __ldg(xr[nt] + g * 32 + kc * 8 + 4) : 0u;
            }
    }
}

// sx[nt][e] = the sum of tile column g's activations of token 8 nt + 2 t + e (an mma with
// an all-ones A: every row of C holds the column sums).
template <int NT>
__device__ __forceinline__ void column_sums(const uint32_t (&bx)[4][NT][2], float (&sx)[NT][2]) {
    const uint32_t ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) mma16816(c, ones, bx[kc][nt][0], bx[kc][nt][1]);
        sx[nt][0] = c[0];
        sx[nt][1] = c[1];
    }
}

// One tile times one column of activations, weights as the mma's A operand (rows lg + 8 nb
// are exactly the A fragments' rows gid, gid + 8 of the two 16-row halves mb = nb / 2), so the
// C fragment of a half holds weight rows gid + 16 mb (c0, c1) and gid + 8 + 16 mb (c2, c3) for
// tokens 8 nt + 2 t + (0, 1). The mma runs on the raw 1024 + q (exact in f16); per row and
// tile, sum (q s + z) x = s * sum (1024 + q) x + (z - 1024 s) * sum x, with the group's f16
// scale and zero as the reference rounds them.
template <bool TWO, bool FOUR, int NT>
__device__ __forceinline__ void tile_fold_w(const TileFrag& f, const uint32_t (&bx)[4][NT][2],
                                            const float (&sx)[NT][2], float (&acc)[2][NT][4], int lane) {
    // Two-level: the four lanes of a row group hold the same four rows; lane t decodes row
    // nb = t's scale and zero, the others take theirs by a shuffle. Plain: read directly.
    float s_own = 0.f, w_own = 0.f;
    if (TWO) {
        __half2 s2, z2;
        tile_scales<TWO>(f, lane & 3, s2, z2);
        s_own = __low2float(s2);
        w_own = fmaf(-1024.f, s_own, __low2float(z2));
    }
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[nt][i] = 0.f;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
            const uint32_t a[4] = {tile_q<FOUR>(f, 2 * mb, kc, 0), tile_q<FOUR>(f, 2 * mb + 1, kc, 0),
                                   tile_q<FOUR>(f, 2 * mb, kc, 1), tile_q<FOUR>(f, 2 * mb + 1, kc, 1)};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma16816(c[nt], a, bx[kc][nt][0], bx[kc][nt][1]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float s, w;
            if (TWO) {
                const int src = (lane & ~3) | (2 * mb + h);
                s = __shfl_sync(0xffffffffu, s_own, src);
                w = __shfl_sync(0xffffffffu, w_own, src);
            } else {
                const uint32_t sz = mb == 0 ? (h == 0 ? f.s.x : f.s.y) : (h == 0 ? f.s.z : f.s.w);
                s = __half2float(__ushort_as_half((unsigned short)(sz & 0xffffu)));
                w = fmaf(-1024.f, s, __half2float(__ushort_as_half((unsigned short)(sz >> 16))));
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    acc[mb][nt][2 * h + e] = fmaf(w, sx[nt][e], fmaf(s, c[nt][2 * h + e], acc[mb][nt][2 * h + e]));
        }
    }
}

// A column's two tiles (row blocks 0 and 1) in straight-line code, so that their mma chains
// interleave; a tile's precision is the same for the whole warp: one switch per column.
template <bool TWO, int NT>
__device__ __forceinline__ void tile_pair(const TileFrag (&f)[2], const uint32_t (&bx)[4][NT][2],
                                          const float (&sx)[NT][2], float (&acc)[2][2][NT][4], int lane) {
    switch ((f[0].four ? 1 : 0) | (f[1].four ? 2 : 0)) {
    case 0:
        tile_fold_w<TWO, false, NT>(f[0], bx, sx, acc[0], lane);
        tile_fold_w<TWO, false, NT>(f[1], bx, sx, acc[1], lane);
        break;
    case 1:
        tile_fold_w<TWO, true, NT>(f[0], bx, sx, acc[0], lane);
        tile_fold_w<TWO, false, NT>(f[1], bx, sx, acc[1], lane);
        break;
    case 2:
        tile_fold_w<TWO, false, NT>(f[0], bx, sx, acc[0], lane);
        tile_fold_w<TWO, true, NT>(f[1], bx, sx, acc[1], lane);
        break;
    default:
        tile_fold_w<TWO, true, NT>(f[0], bx, sx, acc[0], lane);
        tile_fold_w<TWO, true, NT>(f[1], bx, sx, acc[1], lane);
    }
}

__device__ __forceinline__ TileSrc tile_src(const uint32_t* codes, const uint32_t* desc, const uint8_t* sc,
                                            const __half* sup, const __half* plain, int group, int rb, int G,
                                            int H, int k) {
    TileSrc s;
    s.codes = codes + (size_t)rb * 128 * (G + H);
    s.desc = desc + (size_t)rb * G;
    const int S = (G + 15) / 16, SG = (k + group - 1) / group;
    s.sc = sc ? sc + (size_t)rb * G * 64 : nullptr;
    s.sup = sup ? sup + (size_t)rb * S * 32 : nullptr;
    s.plain = plain ? plain + (size_t)rb * SG * 64 : nullptr;
    s.group = group;
    return s;
}

// One warp's ring of TILES_STAGES columns in flight: per stage and row block, the lane's
// code chunks (a 2-bit tile fills chunk 0) and its 16 bytes of scales.
struct RingStage {
    uint4 codes[2][2][32];  // [block][chunk][lane]: byte 1024 b + 512 c + 16 lane
    uint4 scales[2][32];    // [block][lane]:        byte 2048 + 512 b + 16 lane
};
static_assert(sizeof(RingStage) == 3072, "ring stage layout");
struct WarpRing {
    RingStage st[TILES_STAGES];
};

// What one lane copies of one row block's columns, as 32-bit offsets from the kernel's
// arguments: its code chunk of the block's stream (uint4 units, lane added) and its scale
// bytes (row group lg added).
struct LaneSrc {
    uint32_t codes;  // + tile offset (desc & 0x7fffffff) / 4
    uint32_t sc;     // two-level, bytes: + g * 64
    uint32_t sup;    // two-level, halves: + (g / 16) * 32
    uint32_t plain;  // plain, halves: + (g >> gshift) * 64 (a scale group is 2^gshift tiles)
};

__device__ __forceinline__ LaneSrc lane_src(int rb, int G, int H, int k, int group, int lane) {
    const int lg = lane >> 2, S = (G + 15) / 16, SG = (k + group - 1) / group;
    LaneSrc l;
    l.codes = (uint32_t)rb * 32u * (uint32_t)(G + H) + lane;
    l.sc = (uint32_t)rb * G * 64 + lg * 8;
    l.sup = (uint32_t)rb * S * 32 + lg * 4;
    l.plain = (uint32_t)rb * SG * 64 + lg * 8;
    return l;
}

__device__ __forceinline__ void cp_async16_sa(uint32_t sa, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem));
}

__device__ __forceinline__ void cp_async8_sa(uint32_t sa, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(sa), "l"(gmem));
}

// Issue the copies of column g (both row blocks; an odd last block repeats block 0) into the
// ring stage at shared address `stage` (the lane's 16 bytes added).
template <bool TWO>
__device__ __forceinline__ void issue_column(uint32_t stage, const LaneSrc (&src)[2], const uint32_t* desc_sh,
                                             const uint32_t* __restrict__ codes, const uint8_t* __restrict__ sc,
                                             const __half* __restrict__ sup, const __half* __restrict__ plain,
                                             int G, int g, int gshift) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
        const uint32_t d = desc_sh[b * G + g];
        const uint4* t = reinterpret_cast<const uint4*>(codes) + (src[b].codes + ((d & 0x7fffffffu) >> 2));
        const uint32_t cs = stage + 1024 * b;
        cp_async16_sa(cs, t);
        if (d >> 31) cp_async16_sa(cs + 512, t + 32);
        const uint32_t ss = stage + 2048 + 512 * b;
        if (TWO) {
            cp_async8_sa(ss, sc + (src[b].sc + g * 64));
            cp_async8_sa(ss + 8, sup + (src[b].sup + (g >> 4) * 32));
        } else {
            cp_async16_sa(ss, plain + (src[b].plain + (g >> gshift) * 64));
        }
    }
}

template <bool TWO, int EPI, int MM>
__device__ void tiles_mm(const __half* __restrict__ x, const uint32_t* __restrict__ codes,
                         const uint32_t* __restrict__ desc, const uint8_t* __restrict__ sc,
                         const __half* __restrict__ sup, const __half* __restrict__ plain,
                         const uint32_t* __restrict__ entries, const uint32_t* __restrict__ row_end,
                         const __half* __restrict__ xt, void* y_out, int m, int n, int k, int H, int E, int group,
                         int ks) {
    pdl_trigger();
    // The rings while the columns stream; the partial sums after (same memory).
    __shared__ union Smem {
        WarpRing ring[TILES_NW];
        struct {
            float red[TILES_NW][2 * 16 * 32];
            float fin[2 * 16 * 32];
        } out;
    } sh;
    // The first TILES_OUT_PRE outlier entries of each lane's rows: [warp][block][j][lane].
    __shared__ uint32_t opre_sh[TILES_NW][2][TILES_OUT_PRE][32];
    // The descriptors of the two row blocks, [2][G] (dynamic: the host sizes it by k).
    extern __shared__ uint32_t desc_sh[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = (k + 63) / 64, R = n / 32;
    const int rank = blockIdx.x % ks, pair = blockIdx.x / ks;
    int rbs[2];
    if (EPI == 2) {
        rbs[0] = pair;
        rbs[1] = pair + R / 2;
    } else {
        rbs[0] = 2 * pair;
        rbs[1] = 2 * pair + 1;
    }
    const bool valid1 = rbs[1] < R;
    // An odd last row block: block 1 repeats block 0 (computed, never stored).
    // Each warp stages the descriptors of its own columns (no block-wide barrier before the
    // first copies are issued).
    const int stride = TILES_NW * ks, first = rank * TILES_NW + warp;
    LaneSrc src[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
        const int rb = b == 1 && !valid1 ? rbs[0] : rbs[b];
        src[b] = lane_src(rb, G, H, k, group, lane);
        // A uniform format (every tile 4-bit, or none) has its descriptors implied: no load
        // (the same values as src/formats/w2416.rs `descriptors` builds for such flags).
        for (int g = first + lane * stride; g < G; g += 32 * stride)
            desc_sh[b * G + g] = H == G   ? 0x80000000u | 256u * (uint32_t)g
                                 : H == 0 ? 128u * (uint32_t)g
                                          : __ldg(desc + (size_t)rb * G + g);
    }
    const int gshift = __ffs(group / 64) - 1;  // the host checks: group is 64 times a power of two
    __syncwarp();

    constexpr int NT = MM / 8;
    float acc[2][2][NT][4];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[b][mb][nt][i] = 0.f;

    // Weights stream in before pdl_wait (no kernel writes them).
    RingStage* ring = sh.ring[warp].st;
    const uint32_t ring_sa = (uint32_t)__cvta_generic_to_shared(ring) + 16 * lane;
#pragma unroll
    for (int s = 0; s < TILES_STAGES - 1; ++s) {
        const int g = first + s * stride;
        if (g < G) issue_column<TWO>(ring_sa + s * 3072, src, desc_sh, codes, sc, sup, plain, G, g, gshift);
        cp_async_commit();
    }
    // Outliers: lane = row; warp w of cluster rank c takes the row's entries c * NW + w,
    // + NW * KS, ... (independent loads spread over the cluster, a fixed split: the sums
    // stay deterministic). The row ends are loaded here and first used after the warp's
    // first column, where its first TILES_OUT_PRE entries are copied to shared memory
    // (cp.async: no register waits on them); x is gathered at the end.
    int o_beg[2] = {0, 0}, o_end[2] = {0, 0};
    if (E > 0) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            if (b == 1 && !valid1) continue;
            const int row = rbs[b] * 32 + lane;
            o_beg[b] = lane == 0 ? 0 : (int)__ldg(row_end + row - 1);
            o_end[b] = (int)__ldg(row_end + row);
        }
    }
    const int o_step = TILES_NW * ks;
    auto prefetch_outliers = [&]() {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            o_beg[b] += rank * TILES_NW + warp;
            const uint32_t* ent = entries + (size_t)rbs[b] * E;
#pragma unroll
            for (int j = 0; j < TILES_OUT_PRE; ++j) {
                const int e = o_beg[b] + j * o_step;
                const bool ok = e < o_end[b];
                // src-size 0 where the row has no such entry: the slot reads as 0 (no outlier).
                cp_async4_zfill((uint32_t)__cvta_generic_to_shared(&opre_sh[warp][b][j][lane]),
                                ok ? ent + e : entries, ok ? 4 : 0);
            }
        }
    };
    pdl_wait();
    const uint32_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
        xr[nt] = reinterpret_cast<const uint32_t*>(x + (size_t)min(8 * nt + (lane >> 2), m - 1) * k) + (lane & 3);
    uint32_t b_cur[4][NT][2], b_nxt[4][NT][2];
    if (first < G) load_b<NT>(b_cur, xr, k, first, lane & 3);
    // st: the ring stage of column g; si: the stage the column TILES_STAGES - 1 ahead goes to.
    for (int g = first, st = 0, si = TILES_STAGES - 1; g < G; g += stride) {
        const int gi = g + (TILES_STAGES - 1) * stride;
        if (gi < G) issue_column<TWO>(ring_sa + si * 3072, src, desc_sh, codes, sc, sup, plain, G, gi, gshift);
        cp_async_commit();
        const int gn = g + stride;
        if (gn < G) load_b<NT>(b_nxt, xr, k, gn, lane & 3);
        float sx[NT][2];
        column_sums<NT>(b_cur, sx);
        cp_async_wait<TILES_STAGES - 1>();
        TileFrag f[2];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            f[b].four = (desc_sh[b * G + g] >> 31) != 0;
            f[b].c0 = ring[st].codes[b][0][lane];
            f[b].c1 = f[b].four ? ring[st].codes[b][1][lane] : make_uint4(0, 0, 0, 0);
            f[b].s = ring[st].scales[b][lane];
        }
        tile_pair<TWO, NT>(f, b_cur, sx, acc, lane);
        if (E > 0 && g == first) prefetch_outliers();
        if (gn < G) {
#pragma unroll
            for (int kc = 0; kc < 4; ++kc)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    b_cur[kc][nt][0] = b_nxt[kc][nt][0];
                    b_cur[kc][nt][1] = b_nxt[kc][nt][1];
                }
        }
        st = st == TILES_STAGES - 1 ? 0 : st + 1;
        si = si == TILES_STAGES - 1 ? 0 : si + 1;
    }
    if (E > 0 && first >= G) prefetch_outliers();  // a warp without columns
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // every ring is drained before its memory holds partial sums

    // Partial sums: red[warp][b][token][weight row r], written and reduced only for the
    // m tokens that are stored (at m = 1 that is 64 of the 1024 entries: one per thread).
    float* red = sh.out.red[warp];
    const int gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int tok = 8 * nt + 2 * t + (i & 1), r = 16 * mb + gid + 8 * (i >> 1);
                    if (tok < m) red[(b * 16 + tok) * 32 + r] = acc[b][mb][nt][i];
                }
    __syncwarp();
    // Outliers (see the prologue): the lane's first entries from shared memory, the rest
    // from global memory. At m = 1 the entry's activation is one load from x; above, all
    // MM tokens' activations of its column are one or two 16-byte loads from xt (x
    // transposed by tiles_xt: gathering them from x's rows took 16 sectors per entry and a
    // third of the kernel's time at m = 16).
    if (E > 0) {
        auto outliers = [&](auto tokens) {
            constexpr int T = decltype(tokens)::value;  // 1: from x (m = 1); MM: from xt
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                if (b == 1 && !valid1) continue;
                const uint32_t* ent = entries + (size_t)rbs[b] * E;
                float part[T];
#pragma unroll
                for (int u = 0; u < T; ++u) part[u] = 0.f;
                auto add = [&](uint32_t v) {
                    const int col = (int)(v & 0xffffu);
                    const float dlt = __half2float(__ushort_as_half((unsigned short)(v >> 16)));
                    if (T == 1) {
                        part[0] += dlt * __half2float(x[col]);
                        return;
                    }
                    const uint4* p = reinterpret_cast<const uint4*>(xt + (size_t)col * T);
#pragma unroll
                    for (int q = 0; q < T / 8; ++q) {
                        const uint4 w = __ldg(p + q);
                        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[h]));
                            part[(8 * q + 2 * h) % T] += dlt * f.x;
                            part[(8 * q + 2 * h + 1) % T] += dlt * f.y;
                        }
                    }
                };
#pragma unroll
                for (int j = 0; j < TILES_OUT_PRE; ++j)
                    if (o_beg[b] + j * o_step < o_end[b]) add(opre_sh[warp][b][j][lane]);
                for (int e = o_beg[b] + TILES_OUT_PRE * o_step; e < o_end[b]; e += o_step) add(__ldg(ent + e));
#pragma unroll
                for (int u = 0; u < T; ++u)
                    if (u < m) red[(b * 16 + u) * 32 + lane] += part[u];
            }
        };
        if (m == 1) outliers(TilesInt<1>{});
        else outliers(TilesInt<MM>{});
    }
    __syncthreads();
    // Entry u of the 2 m 32 stored ones: (b, token i, row r) at red index (16 b + i) 32 + r.
    const int used = 2 * m * 32;
    auto red_index = [m](int u) {
        const int q = u >> 5, b = q >= m ? 1 : 0;  // q = b m + i
        return (16 * b + q - b * m) * 32 + (u & 31);
    };
    for (int u = threadIdx.x; u < used; u += blockDim.x) {
        const int idx = red_index(u);
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < TILES_NW; ++w) s += sh.out.red[w][idx];
        sh.out.red[0][idx] = s;
    }
    if (ks > 1) cluster_sync();
    else __syncthreads();
    float* fin = sh.out.fin;
    if (rank == 0) {
        // The other blocks' sums: every remote load issued before the first is used, then
        // added in rank order (deterministic).
        for (int u = threadIdx.x; u < used; u += blockDim.x) {
            const int idx = red_index(u);
            float v[8];
#pragma unroll
            for (int r = 1; r < 8; ++r) v[r] = ld_cluster(&sh.out.red[0][idx], (uint32_t)min(r, ks - 1));
            float s = sh.out.red[0][idx];
#pragma unroll
            for (int r = 1; r < 8; ++r)
                if (r < ks) s += v[r];
            fin[idx] = s;
        }
    }
    if (ks > 1) cluster_sync();
    if (rank != 0) return;
    __syncthreads();
    for (int u = threadIdx.x; u < used; u += blockDim.x) {
        const int idx = red_index(u);
        const int b = idx >> 9, i = (idx >> 5) & 15, r = idx & 31;
        if (EPI == 2) {
            if (b != 0) continue;
            const float gt = __half2float(__float2half_rn(fin[i * 32 + r]));
            const float up = __half2float(__float2half_rn(fin[(16 + i) * 32 + r]));
            const float sg = __half2float(__float2half_rn(gt / (1.f + __expf(-gt))));
            reinterpret_cast<__half*>(y_out)[(size_t)i * (n / 2) + rbs[0] * 32 + r] = __float2half_rn(sg * up);
        } else {
            if (b == 1 && !valid1) continue;
            // (a select, not rbs[b]: a run-time index would put rbs in local memory)
            const size_t o = (size_t)i * n + (b == 0 ? rbs[0] : rbs[1]) * 32 + r;
            const float v = fin[idx];
            if (EPI == 1) reinterpret_cast<float*>(y_out)[o] = v;
            else reinterpret_cast<__half*>(y_out)[o] = __float2half_rn(v);
        }
    }
}

#define TILES_MM(NAME, TWO, EPI, MM)                                                                          \
    extern "C" __global__ void __launch_bounds__(TILES_NW * 32, MM == 8 ? 5 : 3)                             \
        NAME(const __half* x, const uint32_t* codes, const uint32_t* desc, const uint8_t* sc, const __half* sup, \
             const __half* plain, const uint32_t* entries, const uint32_t* row_end, const __half* xt, void* y,    \
             int m, int n, int k, int H, int E, int group, int ks) {                                          \
        tiles_mm<TWO, EPI, MM>(x, codes, desc, sc, sup, plain, entries, row_end, xt, y, m, n, k, H, E, group,  \
                               ks);                                                                           \
    }

TILES_MM(tiles_mm_two_f16_m8, true, 0, 8)
TILES_MM(tiles_mm_two_f16_m16, true, 0, 16)
TILES_MM(tiles_mm_two_f32_m8, true, 1, 8)
TILES_MM(tiles_mm_two_f32_m16, true, 1, 16)
TILES_MM(tiles_mm_two_silu_m8, true, 2, 8)
TILES_MM(tiles_mm_two_silu_m16, true, 2, 16)
TILES_MM(tiles_mm_plain_f16_m8, false, 0, 8)
TILES_MM(tiles_mm_plain_f16_m16, false, 0, 16)
TILES_MM(tiles_mm_plain_f32_m8, false, 1, 8)
TILES_MM(tiles_mm_plain_f32_m16, false, 1, 16)
TILES_MM(tiles_mm_plain_silu_m8, false, 2, 8)
TILES_MM(tiles_mm_plain_silu_m16, false, 2, 16)

// x f16 [m, k] -> xt f16 [k][mt] (mt a multiple of 8 and >= m; tokens past m are zeros):
// each column's activations contiguous, for the outliers at m > 1 (tiles_mm's end phase and
// tiles_outliers_add). Thread i: column i / (mt / 8), tokens 8 (i % (mt / 8)) .. + 7 (the
// reads of one token row coalesce across the warp, the writes are 16 bytes each).
extern "C" __global__ void tiles_xt(const __half* __restrict__ x, __half* __restrict__ xt, int m, int k, int mt) {
    pdl_trigger();
    pdl_wait();
    const int chunks = mt / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)k * chunks) return;
    const int c = (int)(i / chunks), t0 = (int)(i % chunks) * 8;
    uint32_t v[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int t = t0 + 2 * h;
        const __half a = t < m ? x[(size_t)t * k + c] : __ushort_as_half(0);
        const __half b = t + 1 < m ? x[(size_t)(t + 1) * k + c] : __ushort_as_half(0);
        v[h] = h2_bits(__halves2half2(a, b));
    }
    *reinterpret_cast<uint4*>(xt + (size_t)c * mt + t0) = make_uint4(v[0], v[1], v[2], v[3]);
}

// x f16 [m, k] -> y f16 [m, k] in a reordered weight's column order: y[t, j] = x[t, perm(j)],
// perm u32 [k / 2] holding the channels of columns 2 i and 2 i + 1 in its low and high 16 bits
// (src/formats/w2416.rs, `input.order`), k even. Thread i: token i / (k / 2), columns 2 (i %
// (k / 2)) and + 1 (one 4-byte store; the reads are 2-byte gathers of a row that sits in L2).
// For every m > 1 path (the one-token GEMV reads through the order itself).
extern "C" __global__ void tiles_gather(const __half* __restrict__ x, const uint32_t* __restrict__ perm,
                                        __half* __restrict__ y, int m, int k) {
    pdl_trigger();
    const int kh = k / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * kh) return;
    const int t = (int)(i / kh), c = (int)(i % kh);
    const uint32_t p = __ldg(perm + c);
    pdl_wait();
    const __half* row = x + (size_t)t * k;
    reinterpret_cast<__half2*>(y + (size_t)t * k)[c] = __halves2half2(row[p & 0xffffu], row[p >> 16]);
}

// y f16 [m, n] += the sparse outliers' products, after tiles_gemm (m > 16). Block: row block
// blockIdx.x (lane = row), tokens 8 blockIdx.y .. + 7; warp s takes the row's entries s,
// s + 8, ... (each entry's 8 activations one 16-byte load from xt f16 [k][mt]); the eight
// partial sums are added in warp order (deterministic). y is rounded twice (the GEMM's f16
// sum, then with the outliers added in f32), within the format's tolerance of the reference.
#define TILES_ADD_SPLITS 8
extern "C" __global__ void __launch_bounds__(32 * TILES_ADD_SPLITS)
    tiles_outliers_add(const __half* __restrict__ xt, const uint32_t* __restrict__ entries,
                       const uint32_t* __restrict__ row_end, __half* __restrict__ y, int m, int n, int E, int mt) {
    __shared__ float part_sh[TILES_ADD_SPLITS][8][32];
    pdl_trigger();
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    const int rb = blockIdx.x, row = rb * 32 + lane, t0 = blockIdx.y * 8;
    // Entries and row ends are weights (no kernel writes them): read before pdl_wait.
    const int beg = lane == 0 ? 0 : (int)__ldg(row_end + row - 1), end = (int)__ldg(row_end + row);
    const uint32_t* ent = entries + (size_t)rb * E;
    pdl_wait();
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int e = beg + s; e < end; e += TILES_ADD_SPLITS) {
        const uint32_t v = __ldg(ent + e);
        const float dlt = __half2float(__ushort_as_half((unsigned short)(v >> 16)));
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(xt + (size_t)(v & 0xffffu) * mt + t0));
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[h]));
            part[2 * h] += dlt * f.x;
            part[2 * h + 1] += dlt * f.y;
        }
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) part_sh[s][u][lane] = part[u];
    __syncthreads();
    // Warp u adds token t0 + u over the splits in order.
    const int u = s;
    if (u >= 8 || t0 + u >= m) return;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TILES_ADD_SPLITS; ++j) sum += part_sh[j][u][lane];
    const size_t o = (size_t)(t0 + u) * n + row;
    y[o] = __float2half_rn(__half2float(y[o]) + sum);
}

// An f16 pair (bits v) stored as two T at dst.
template <typename T>
__device__ __forceinline__ void store_pair(uint8_t* dst, uint32_t v) {
    const __half2 h = *reinterpret_cast<const __half2*>(&v);
    T* d = reinterpret_cast<T*>(dst);
    d[0] = from_f32<T>(__low2float(h));
    d[1] = from_f32<T>(__high2float(h));
}
template <>
__device__ __forceinline__ void store_pair<__half>(uint8_t* dst, uint32_t v) {
    *reinterpret_cast<uint32_t*>(dst) = v;
}

// Dequantize: one warp per tile, w [n, k] T = f16(q * scale + zero) (outliers not added).
// The tile's codes and scales are loaded before pdl_wait (weights: no kernel writes them)
// and decoded in registers (fragment order); each element pair goes to the warp's tile in
// shared memory, whose 16-byte chunks are XOR-swizzled by the row (chunk c of row r at
// c ^ (r & 7)), so that both the pair writes (8 rows x 4 lanes per chunk column) and the
// chunk reads (8 lanes per row) are free of bank conflicts; then the tile goes out as
// 16-byte chunks of w's rows, 8 (f16, bf16) or 16 (f32) lanes per row segment, where k
// keeps the rows 16-byte aligned (else element by element).
template <bool TWO, typename T>
__device__ void tiles_dequantize(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ desc,
                                 const uint8_t* __restrict__ sc, const __half* __restrict__ sup,
                                 const __half* __restrict__ plain, T* __restrict__ w, int n, int k, int H,
                                 int group) {
    constexpr int RB = 64 * (int)sizeof(T);  // bytes of a tile row
    constexpr int CH = RB / 16;               // its 16-byte chunks
    constexpr int EPC = 16 / (int)sizeof(T);  // elements per chunk
    __shared__ __align__(16) uint8_t tile_sh[4][32 * RB];
    pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = (k + 63) / 64, R = n / 32;
    const long long tile = (long long)blockIdx.x * (blockDim.x / 32) + warp;
    const bool live = tile < (long long)R * G;
    const int rb = live ? (int)(tile / G) : 0, g = live ? (int)(tile % G) : 0;
    TileFrag f;
    if (live) {
        const TileSrc src = tile_src(codes, desc, sc, sup, plain, group, rb, G, H, k);
        load_tile<TWO>(f, src, g, lane);
    }
    pdl_wait();
    if (!live) return;
    uint8_t* sh = tile_sh[warp];
    const int lg = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {
        __half2 s2, z2;
        tile_scales<TWO>(f, nb, s2, z2);
        const int r = lg + 8 * nb;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
#pragma unroll
            for (int hb = 0; hb < 2; ++hb) {
                const uint32_t v = f.four ? tile_b<true>(f, nb, kc, hb, s2, z2) : tile_b<false>(f, nb, kc, hb, s2, z2);
                const int byte = (kc * 16 + 2 * t + 8 * hb) * (int)sizeof(T);
                uint8_t* dst = sh + r * RB + ((((byte >> 4) ^ (r & 7))) << 4) + (byte & 15);
                store_pair<T>(dst, v);
            }
    }
    __syncwarp();
    const int cols = min(64, k - g * 64);  // even
    const bool vec = k % EPC == 0;
    T* row0 = w + (size_t)rb * 32 * k + (size_t)g * 64;
#pragma unroll 4
    for (int i = lane; i < 32 * CH; i += 32) {
        const int r = i / CH, ch = i % CH, c0 = ch * EPC;
        if (c0 >= cols) continue;
        const uint8_t* s = sh + r * RB + ((ch ^ (r & 7)) << 4);
        T* dst = row0 + (size_t)r * k + c0;
        if (vec && c0 + EPC <= cols) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(s);
        } else {
            for (int e = 0; e < EPC && c0 + e < cols; ++e) dst[e] = reinterpret_cast<const T*>(s)[e];
        }
    }
}

// Outliers onto a dequantized weight: one warp per row, lane j takes the row's entries j,
// j + 32, ... (positions are distinct; unused entries, delta exactly 0, write nothing).
template <typename T>
__device__ void tiles_add_outliers(const uint32_t* __restrict__ entries, const uint32_t* __restrict__ row_end,
                                   T* __restrict__ w, int n, int k, int E) {
    pdl_trigger();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (row >= n) return;
    const int rb = (int)(row / 32), rr = (int)(row % 32);
    const int start = rr == 0 ? 0 : (int)row_end[row - 1], end = (int)row_end[row];
    for (int e = start + lane; e < end; e += 32) {
        const uint32_t v = entries[(size_t)rb * E + e];
        if ((v >> 16) == 0) continue;
        const size_t o = (size_t)row * k + (v & 0xffffu);
        w[o] = from_f32<T>(to_f32(w[o]) + __half2float(__ushort_as_half((unsigned short)(v >> 16))));
    }
}

#define TILES_DEQ(SUF, T)                                                                                       \
    extern "C" __global__ void tiles_dequantize_two_##SUF(const uint32_t* codes, const uint32_t* desc,          \
                                                          const uint8_t* sc, const __half* sup,                 \
                                                          const __half* plain, T* w, int n, int k, int H,       \
                                                          int group) {                                          \
        tiles_dequantize<true, T>(codes, desc, sc, sup, plain, w, n, k, H, group);                              \
    }                                                                                                           \
    extern "C" __global__ void tiles_dequantize_plain_##SUF(const uint32_t* codes, const uint32_t* desc,        \
                                                            const uint8_t* sc, const __half* sup,               \
                                                            const __half* plain, T* w, int n, int k, int H,     \
                                                            int group) {                                        \
        tiles_dequantize<false, T>(codes, desc, sc, sup, plain, w, n, k, H, group);                             \
    }                                                                                                           \
    extern "C" __global__ void tiles_add_outliers_##SUF(const uint32_t* entries, const uint32_t* row_end, T* w, \
                                                        int n, int k, int E) {                                  \
        tiles_add_outliers<T>(entries, row_end, w, n, k, E);                                                    \
    }

TILES_DEQ(f32, float)
TILES_DEQ(f16, __half)
TILES_DEQ(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------
// Large m (tiles_gemm, sm_90a builds): warpgroup MMA, wgmma.mma_async m64nBNk16 f16 -> f32,
// with the weights dequantized to f16 in registers as the A operand and the activations as
// the shared-memory operand B (K-major: a stage's [BN tokens][64 columns] f16 is 128 bytes
// per token row, 128-byte swizzle). D = W · Xᵀ; the result is transposed through shared
// memory and written as y f16 [m, n].
//
// CTA: 2 warpgroups (256 threads), 4 row blocks (128 weight rows) x BN tokens (64 or 128,
// the host's choice for the grid); one tile column (64 k) per stage:
//
//   stage  [0, 128 BN)            activations, token row r at 128 r, 16-byte chunk c at
//                                 (c ^ (r & 7)) * 16 (columns past k and tokens past m: zeros)
//          [128 BN, + 4096)       row block b's tile at 1024 b, as stored (2-bit: 512 bytes)
//          [.., + 512)            row block b's scales at 128 b: two-level 64 bytes of scale
//                                 codes then 64 of super scales; plain 128 bytes (scale, zero)
//
// Warp w (0..7) takes row block b = 2 (w / 4) + (w % 4) / 2 and its 16-row half mb = w % 2:
// exactly wgmma's A rows 16 (w % 4) .. + 15 of warpgroup w / 4, in mma.m16n8k16's A layout,
// which is how a tile's half is packed (lane rows lg + 16 mb + 8 nbl). Each code pair becomes
// f16(q * scale + zero) as the dequantize kernel rounds it (deq2), so the GEMM is the f16
// product of the dequantized weight with f32 accumulation. The next stage is dequantized
// while the current stage's wgmmas run (two fragment sets), the copies run STAGES - 1 ahead.
// Sparse outliers are added by tiles_outliers_add after it, from x transposed by tiles_xt
// (gathering the activation columns in this kernel's epilogue made it 5x slower, measured).
template <int BN>
struct TgTile {
    static constexpr int X = BN * 128;
    static constexpr int W = 4 * 1024;
    static constexpr int S = 4 * 128;
    static constexpr int STAGE = (X + W + S + 1023) / 1024 * 1024;
    // One CTA per SM at BN = 128 (64 f32 sums per thread), two at BN = 64.
    static constexpr int STAGES = BN == 128 ? 6 : 4;
};

struct TgArgs {
    const __half* x;
    const uint32_t* codes;
    const uint8_t* sc;
    const __half* sup;
    const __half* plain;
    int m, n, k, G, H, R, S, SG, gshift;
};

// Copies of tile column g into `stage` (shared address): thread tid takes activation chunk
// tid % 8 of token rows tid / 8 + 32 j, weight chunk tid % 64 of row block tid / 64, and
// (tid < 32) scale chunk tid % 8 of row block tid / 8.
template <bool TWO, int BN>
__device__ __forceinline__ void tg_load(const TgArgs& p, int g, uint32_t stage, const uint32_t* desc_sh, int m0,
                                        int rb0) {
    const int tid = threadIdx.x;
    {
        const int r = tid >> 3, c = tid & 7;
        const int col = g * 64 + 8 * c;
#pragma unroll
        for (int j = 0; j < BN / 32; ++j) {
            const int row = r + 32 * j;
            const bool ok = col < p.k && m0 + row < p.m;
            const __half* src = ok ? p.x + (size_t)(m0 + row) * p.k + col : p.x;
            cp_async16_zfill(stage + row * 128 + ((c ^ (row & 7)) << 4), src, ok ? 16 : 0);
        }
    }
    {
        const int b = tid >> 6, c = tid & 63;
        const int rb = rb0 + b;
        if (rb < p.R) {
            const uint32_t d = desc_sh[b * p.G + g];
            if (c < 32 || (d >> 31))
                cp_async16_sa(stage + TgTile<BN>::X + 1024 * b + 16 * c,
                              reinterpret_cast<const uint4*>(p.codes) +
                                  ((size_t)rb * 32 * (p.G + p.H) + ((d & 0x7fffffffu) >> 2) + c));
        }
    }
    if (tid < 32) {
        const int b = tid >> 3, c = tid & 7;
        const int rb = rb0 + b;
        if (rb < p.R) {
            const uint32_t dst = stage + TgTile<BN>::X + TgTile<BN>::W + 128 * b + 16 * c;
            if (TWO) {
                const uint8_t* src =
                    c < 4 ? p.sc + ((size_t)rb * p.G + g) * 64 + 16 * c
                          : reinterpret_cast<const uint8_t*>(p.sup + ((size_t)rb * p.S + (g >> 4)) * 32) + 16 * (c - 4);
                cp_async16_sa(dst, src);
            } else {
                cp_async16_sa(dst, p.plain + ((size_t)rb * p.SG + (g >> p.gshift)) * 64 + 8 * c);
            }
        }
    }
}

// The warp's A fragments of one stage: a[kc] for the 16 columns 16 kc .. + 15 of its half mb
// of the tile at `tw` (scales at `ts`), dequantized to f16.
template <bool TWO, bool FOUR>
__device__ __forceinline__ void tg_frags(uint32_t (&a)[4][4], const uint8_t* tw, const uint8_t* ts, int mb,
                                         int lane) {
    const int lg = lane >> 2;
    uint32_t w[4];
    if (FOUR) {
        const uint4 v = *reinterpret_cast<const uint4*>(tw + 16 * (32 * mb + lane));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(tw + 16 * lane + 8 * mb);
        w[0] = v.x; w[1] = v.y; w[2] = 0u; w[3] = 0u;
    }
    __half2 s2[2], z2[2];
    if (TWO) {
        const uint32_t scw = *reinterpret_cast<const uint32_t*>(ts + 8 * lg + 4 * mb);
        const uint32_t dsw = *reinterpret_cast<const uint32_t*>(ts + 64 + 8 * lg + 4 * mb);
        const float inv = FOUR ? (1.0f / 15.0f) : (1.0f / 3.0f);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t sc = (scw >> (16 * h)) & 0xffu;
            const int zc = (int)(int8_t)((scw >> (16 * h + 8)) & 0xffu);
            const __half ds = __ushort_as_half((unsigned short)((dsw >> (16 * h)) & 0xffffu));
            const __half s = __float2half_rn(__fmul_rn(__fmul_rn((float)sc, __half2float(ds)), inv));
            const __half z = __float2half_rn(__fmul_rn(__fmul_rn((float)zc, __half2float(s)), 0.125f));
            s2[h] = __half2half2(s);
            z2[h] = __half2half2(z);
        }
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(ts + 16 * lg + 8 * mb);
        s2[0] = __half2half2(__ushort_as_half((unsigned short)(v.x & 0xffffu)));
        z2[0] = __half2half2(__ushort_as_half((unsigned short)(v.x >> 16)));
        s2[1] = __half2half2(__ushort_as_half((unsigned short)(v.y & 0xffffu)));
        z2[1] = __half2half2(__ushort_as_half((unsigned short)(v.y >> 16)));
    }
#pragma unroll
    for (int kc = 0; kc < 4; ++kc)
#pragma unroll
        for (int hb = 0; hb < 2; ++hb)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t bits = FOUR ? (w[2 * h + kc / 2] >> (4 * (2 * (kc & 1) + hb))) & 0x000f000fu
                                           : (w[h] >> (2 * (2 * kc + hb))) & 0x00030003u;
                a[kc][2 * hb + h] = deq2(bits, s2[h], z2[h]);
            }
}

template <bool TWO, int BN>
__device__ __forceinline__ void tg_dequant(uint32_t (&a)[4][4], const uint8_t* stage, const uint32_t* desc_sh,
                                           int G, int g, int lb, int mb, int lane) {
    const uint8_t* tw = stage + TgTile<BN>::X + 1024 * lb;
    const uint8_t* ts = stage + TgTile<BN>::X + TgTile<BN>::W + 128 * lb;
    if (desc_sh[lb * G + g] >> 31) tg_frags<TWO, true>(a, tw, ts, mb, lane);
    else tg_frags<TWO, false>(a, tw, ts, mb, lane);
}

template <int BN>
__device__ __forceinline__ void tg_mma(float (&acc)[BN / 2], const uint32_t (&a)[4][4], const uint8_t* stage) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        if constexpr (BN == 128) wgmma_f16_rs_n128(acc, a[kc], smem_desc(stage + 32 * kc), 1);
        else wgmma_f16_rs_n64(acc, a[kc], smem_desc(stage + 32 * kc), 1);
    }
#endif
}

__device__ __forceinline__ void fence_frags(uint32_t (&a)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_regs(a[i]);
}

// Split-k (gridDim.z = splits > 1, where the row blocks x token tiles alone leave SMs idle):
// CTA z takes tile columns [G z / splits, G (z + 1) / splits); each writes its f32 sums to
// ws [tiles][splits][BN / 8][256 threads] float4 (a warp's stores contiguous), and the last to arrive at the tile's counter adds
// all of them in z order (deterministic), zeroes the counter for the next launch, and stores.
template <int BN>
__device__ __forceinline__ bool tg_reduce(float (&acc)[BN / 2], float* ws, uint32_t* counters, int splits) {
    __shared__ uint32_t arrived;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x, z = blockIdx.z;
    constexpr size_t STRIDE = 256 * (BN / 8);  // float4 per split
    float4* base = reinterpret_cast<float4*>(ws) + (size_t)tile * splits * STRIDE + threadIdx.x;
    float4* mine = base + (size_t)z * STRIDE;
#pragma unroll
    for (int i = 0; i < BN / 2; i += 4) __stcg(mine + 64 * i, make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) arrived = atomicAdd(counters + tile, 1u);
    __syncthreads();
    if (arrived != (uint32_t)splits - 1) return false;
    __threadfence();
    // Every partial (this CTA's own included) read back from L2 and added in z order.
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float4* part = base + (size_t)s * STRIDE;
#pragma unroll
        for (int i = 0; i < BN / 2; i += 4) {
            const float4 v = __ldcg(part + 64 * i);
            acc[i] += v.x; acc[i + 1] += v.y; acc[i + 2] += v.z; acc[i + 3] += v.w;
        }
    }
    if (threadIdx.x == 0) counters[tile] = 0;
    return true;
}

template <bool TWO, int BN>
__device__ void tiles_gemm(const __half* __restrict__ x, const uint32_t* __restrict__ codes,
                           const uint32_t* __restrict__ desc, const uint8_t* __restrict__ sc,
                           const __half* __restrict__ sup, const __half* __restrict__ plain,
                           __half* __restrict__ y, float* __restrict__ ws, uint32_t* __restrict__ counters, int m,
                           int n, int k, int H, int group, int splits) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) uint8_t smem_raw[];
    // The 128-byte swizzle is a function of address bits 4..9: stages start on 1 KiB.
    uint8_t* smem = smem_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    constexpr int SZ = TgTile<BN>::STAGE, N = TgTile<BN>::STAGES;
    TgArgs p;
    p.x = x; p.codes = codes; p.sc = sc; p.sup = sup; p.plain = plain;
    p.m = m; p.n = n; p.k = k; p.G = (k + 63) / 64; p.H = H; p.R = n / 32;
    p.S = (p.G + 15) / 16; p.SG = (k + group - 1) / group; p.gshift = __ffs(group / 64) - 1;
    const int G = p.G;
    // This CTA's tile columns [c0, c0 + C).
    const int c0 = (int)(((long long)G * blockIdx.z) / splits);
    const int C = (int)(((long long)G * (blockIdx.z + 1)) / splits) - c0;
    uint32_t* desc_sh = reinterpret_cast<uint32_t*>(smem + N * SZ);
    const int rb0 = blockIdx.x * 4, m0 = blockIdx.y * BN;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    pdl_trigger();
    // The four row blocks' descriptors (a uniform format's implied, as in tiles_mm).
    for (int i = threadIdx.x; i < 4 * G; i += blockDim.x) {
        const int b = i / G, g = i % G, rb = rb0 + b;
        desc_sh[i] = rb >= p.R ? 0u
                     : H == G  ? 0x80000000u | 256u * (uint32_t)g
                     : H == 0  ? 128u * (uint32_t)g
                               : __ldg(desc + (size_t)rb * G + g);
    }
    __syncthreads();
    pdl_wait();
#pragma unroll 1
    for (int s = 0; s < N - 1; ++s) {
        if (s < C) tg_load<TWO, BN>(p, c0 + s, sbase + s * SZ, desc_sh, m0, rb0);
        cp_async_commit();
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lb = 2 * (warp >> 2) + ((warp & 3) >> 1), mb = warp & 1;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    // Two fragment sets in straight-line pairs (no copies). Column i's wgmmas are issued
    // behind column i - 1's (the tensor cores never drain between columns); waiting for all
    // but the newest group then frees column i - 1's fragments and stage, so column i + 1 is
    // dequantized into those registers while column i runs.
    uint32_t a0[4][4], a1[4][4];
    cp_async_wait<N - 2>();
    fence_proxy_async();
    __syncthreads();
    tg_dequant<TWO, BN>(a0, smem, desc_sh, G, c0, lb, mb, lane);
    wgmma_fence();
    auto step = [&](uint32_t (&cur)[4][4], uint32_t (&nxt)[4][4], int i) {
        tg_mma<BN>(acc, cur, smem + (i % N) * SZ);
        wgmma_commit();
        wgmma_wait<1>();  // column i - 1's wgmmas are done: nxt and its stage are free
        fence_frags(nxt);
        if (i + 1 < C) {
            cp_async_wait<N - 3>();  // column i + 1 landed (this thread's copies)
            fence_proxy_async();
            __syncthreads();  // everyone's copies; every warpgroup done with column i - 1's stage
            const int gi = i + N - 1;
            if (gi < C) tg_load<TWO, BN>(p, c0 + gi, sbase + (gi % N) * SZ, desc_sh, m0, rb0);
            cp_async_commit();
            tg_dequant<TWO, BN>(nxt, smem + ((i + 1) % N) * SZ, desc_sh, G, c0 + i + 1, lb, mb, lane);
            wgmma_fence();  // nxt written before the wgmmas that read it
        }
    };
#pragma unroll 1
    for (int i = 0; i < C; i += 2) {
        step(a0, a1, i);
        if (i + 1 < C) step(a1, a0, i + 1);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    fence_frags(a0);
    fence_frags(a1);
    cp_async_wait<0>();
    if (splits > 1 && !tg_reduce<BN>(acc, ws, counters, splits)) return;
    __syncthreads();  // every stage read: the tile is staged through them

    const int g = lane >> 2, t = lane & 3;
    // The tile transposed through shared memory ([token][row], rows padded by 16 bytes so the
    // four t of a warp hit distinct banks), then 16-byte rows of y (n is a multiple of 32).
    constexpr int LD = 128 + 8;
    __half* tile = reinterpret_cast<__half*>(smem);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            tile[(8 * j + 2 * t + (e & 1)) * LD + warp * 16 + g + (e >= 2 ? 8 : 0)] = __float2half_rn(acc[4 * j + e]);
    __syncthreads();
    const int n0 = rb0 * 32;
    for (int c = threadIdx.x; c < BN * 16; c += blockDim.x) {
        const int ti = c >> 4, tr = (c & 15) * 8;
        const int gi = m0 + ti, gr = n0 + tr;
        if (gi >= m || gr >= n) continue;
        *reinterpret_cast<uint4*>(y + (size_t)gi * n + gr) = *reinterpret_cast<const uint4*>(tile + ti * LD + tr);
    }
#else
    __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

#define TILES_GEMM(NAME, TWO, BN, CTAS)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, CTAS)                                                   \
        NAME(const __half* x, const uint32_t* codes, const uint32_t* desc, const uint8_t* sc, const __half* sup, \
             const __half* plain, __half* y, float* ws, uint32_t* counters, int m, int n, int k, int H,        \
             int group, int splits) {                                                                         \
        tiles_gemm<TWO, BN>(x, codes, desc, sc, sup, plain, y, ws, counters, m, n, k, H, group, splits);      \
    }

TILES_GEMM(tiles_gemm_two_bn64, true, 64, 2)
TILES_GEMM(tiles_gemm_two_bn128, true, 128, 1)
TILES_GEMM(tiles_gemm_plain_bn64, false, 64, 2)
TILES_GEMM(tiles_gemm_plain_bn128, false, 128, 1)
