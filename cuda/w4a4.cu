// W4A4 on INT8 tensor cores: the activation quantizer (fused with the op before the
// matmul) and the GEMMs of `w4a4`, `fmpq` and `w4a4-rtn` (src/formats/w4a4.rs holds the
// formats and their CPU references; src/ops/w4a4.rs the launchers).
//
// Hopper runs `mma.sync .s4` emulated (50 TOPS, DESIGN.md §3), so 4-bit codes are stored
// packed and multiplied on INT8 tensor cores (`mma.sync.m16n8k32.s8.s8`).
//
// Blocks: k (a multiple of 32) is cut into blocks of 128 columns, the last one shorter
// (k = 576: four of 128 and one of 64). Block b spans [128 b, min(128 b + 128, k)); it is
// a *tail* block when 128 b >= kn (kn, a multiple of 128, ends the 4-bit activation
// region: activations of tail blocks are INT8, of the others INT4).
//
// Byte layouts (all row-major, contiguous):
//
//   activation  u8 [m, k]   signed codes, one per byte, in the layer's channel order
//                           (after its permutation): INT4 values in [-8, 7], INT8 in
//                           [-128, 127]. One byte per INT4 code on purpose: the multiply
//                           runs on INT8 operands, and the tensor is transient.
//               f32 [nb, m] scale of each (block, token): x ~ code * scale (block-major,
//                           so a tile's 128 tokens' scales are contiguous).
//               Both live in one buffer: codes first (m k bytes), then the scales.
//   w4          u8 [n, k4/2] 4-bit weight codes of columns [0, k4) (k4 = k - k8w), block
//                           by block; inside block b (nc = width / 32 chunks of 32
//                           columns, c0 = 128 b + 32 s for chunk s) the row's 16 nc bytes
//                           are nc u32 words per thread slot t (0..3), ordered [t][s]:
//
//                 word (t, s), byte j (0..3) = (q[c0 + 4t + j] << 4) | (q[c0 + 16 + 4t + j] & 0xF)
//
//                           so `word & 0xF0F0F0F0` is the m16n8k32 B fragment b0 of
//                           lane (row, t) and `(word << 4) & 0xF0F0F0F0` is b1, each byte
//                           16 times its code (COMET's trick: two instructions for eight
//                           codes; the x16 is taken out with the scale).
//   w8          u8 [n, k8w] 8-bit weight codes of the tail columns [k4, k) (`w4a4` only:
//                           its outlier channels), block by block, inside a block ordered
//                           [t][s][8 bytes]: bytes 0..3 = q[c0 + 4t + j], 4..7 =
//                           q[c0 + 16 + 4t + j] (b0 then b1).
//   sw          f16 [n, nb] weight scale of each (row, block), as stored; the kernels read
//                           sw_t f16 [nb, np] (np = n rounded up to 8, zero-padded), the
//                           same values transposed at load (16-byte copies of a tile's 128).
//   y           T [m, n]    y[i, r] = sum_b sa[i, b] sw[r, b] sum_{c in b} qa[i, c] qw[r, c]
//                           (the integer sum exact in int32, the scaling in f32 per block,
//                           then one rounding to T).
//
// Kernels (T in f32, f16, bf16):
//   w4a4_quant_T   one block per token (a warp per block of 128, at most 32): (add +) RMSNorm, SiLU·mul or nothing, gather
//                  through the permutation, absmax per block (or per row), codes + scales.
//   w4a4_skinny_T_m1  m <= 16 (one m16 tile; MT tiles in the template, measured slower
//                  than the tiled kernel above m = 16): a block per 8 weight rows, its 8 warps split the k
//                  blocks; weights read straight from global (16-byte loads), each warp's
//                  next SKINNY_DEPTH blocks of codes and scales in flight at once.
//   w4a4_gemm_T    large m, builds without wgmma: 128 x 128 tiles, 16 warps (32 x 32
//                  each), one k block and its scales per pipeline stage (3 stages of
//                  cp.async), ldmatrix on swizzled activations, int32 per block rescaled
//                  into f32 accumulators (int to float by the 2^23 trick: I2F is quarter
//                  rate on sm_90).
//   w4a4_wgmma_T_x1, _x2  large m on sm_90a: warpgroup MMA, 128 weight rows x 64 tokens,
//                  split-k where the grid is small (see "Warpgroup GEMM" below).
//   w4a4_tma_T     the largest m on sm_90a: TMA loads, a producer warp and two consumer
//                  warpgroups, 128 x 128 tiles (see "Warp-specialized GEMM" below).
// Launched with programmatic dependent launch (pdl_wait before reading what an earlier
// kernel wrote).
#include "common.cuh"
#include "wgmma.cuh"

using namespace lowbit;

namespace {

// Mirrors `W4a4Params` in src/ops/w4a4.rs (repr(C)).
struct GemmParams {
    const uint8_t* act;   // codes [m, k], then f32 scales [m, nb]
    const uint8_t* w4;    // [n, k4 / 2]
    const uint8_t* w8;    // [n, k8w] (null when k8w == 0)
    const __half* sw;     // sw_t [nb, np]
    void* y;              // [m, n] T
    float* ws;            // wgmma split-k: f32 partial tiles [tiles][splits][256 threads][BN / 2]
    uint32_t* counters;   // wgmma split-k: [tiles] arrivals, zero at launch (left zero)
    int m, n, k, kn, k8w, nb, np;
    int splits;           // wgmma: k blocks cut into this many ranges (gridDim.z)
};

// Mirrors `QuantParams` in src/ops/w4a4.rs (repr(C)).
struct QuantParams {
    const void* x;          // [m, k] (mode 3: [m, 2k], gate then up)
    const void* res;        // mode 2: [m, k]
    const void* gamma;      // modes 1, 2: [k]
    const uint32_t* perm;   // [k] (output channel j reads input channel perm[j]) or null
    void* sum;              // mode 2: [m, k] T, x + res
    uint8_t* act;           // codes [m, k], then f32 scales [m, nb]
    int m, k, kn, nb;
    int mode;               // 0 plain, 1 RMSNorm, 2 add + RMSNorm, 3 SiLU·mul
    int per_token;          // one absmax per row (replicated into every block's scale)
    float eps, clip4, clip8;
};

__device__ __forceinline__ void block_span(int b, int k, int& start, int& nc) {
    start = b * 128;
    nc = min(128, k - start) >> 5;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------
// Activation quantizer.

template <typename T>
__device__ __forceinline__ float quant_value(const QuantParams& p, const T* x, const T* s,
                                             const T* gamma, int row, int c, float inv) {
    switch (p.mode) {
        case 0:
            return to_f32(x[(size_t)row * p.k + c]);
        case 1:
            return to_f32(from_f32<T>(to_f32(x[(size_t)row * p.k + c]) * inv * to_f32(gamma[c])));
        case 2:
            return to_f32(from_f32<T>(to_f32(s[(size_t)row * p.k + c]) * inv * to_f32(gamma[c])));
        default: {
            const float g = to_f32(x[(size_t)row * 2 * p.k + c]);
            const float u = to_f32(x[(size_t)row * 2 * p.k + p.k + c]);
            const float sg = to_f32(from_f32<T>(g / (1.f + __expf(-g))));
            return to_f32(from_f32<T>(sg * u));
        }
    }
}

template <typename T>
__device__ void w4a4_quant(const QuantParams& p) {
    __shared__ float sh[32];
    pdl_trigger();
    pdl_wait();
    const int row = blockIdx.x;
    const T* x = static_cast<const T*>(p.x);
    const T* res = static_cast<const T*>(p.res);
    const T* gamma = static_cast<const T*>(p.gamma);
    T* sum = static_cast<T*>(p.sum);
    float inv = 0.f;
    if (p.mode == 1 || p.mode == 2) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < p.k; c += blockDim.x) {
            const size_t i = (size_t)row * p.k + c;
            float v = to_f32(x[i]);
            if (p.mode == 2) {
                const T s = from_f32<T>(v + to_f32(res[i]));
                sum[i] = s;
                v = to_f32(s);
            }
            ss += v * v;
        }
        ss = block_sum(ss, sh);  // its barriers also make `sum` visible to the block
        inv = rsqrtf(ss / (float)p.k + p.eps);
    }
    const T* s = sum;
    float row_max = 0.f;
    if (p.per_token) {
        for (int c = threadIdx.x; c < p.k; c += blockDim.x)
            row_max = fmaxf(row_max, fabsf(quant_value<T>(p, x, s, gamma, row, c, inv)));
        row_max = block_max(row_max, sh);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    uint8_t* codes = p.act + (size_t)row * p.k;
    float* scales = reinterpret_cast<float*>(p.act + (size_t)p.m * p.k) + row;
    for (int b = warp; b < p.nb; b += warps) {
        int start, nc;
        block_span(b, p.k, start, nc);
        float v[4];
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = 0.f;
            if (i < nc) {
                const int j = start + 32 * i + lane;
                const int c = p.perm ? (int)p.perm[j] : j;
                v[i] = quant_value<T>(p, x, s, gamma, row, c, inv);
                amax = fmaxf(amax, fabsf(v[i]));
            }
        }
        amax = p.per_token ? row_max : warp_max(amax);
        const bool tail = start >= p.kn;
        const float qmax = tail ? 127.f : 7.f;
        const float scale = __fdiv_rn(__fmul_rn(tail ? p.clip8 : p.clip4, amax), qmax);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i < nc) {
                float q = scale > 0.f ? rintf(__fdiv_rn(v[i], scale)) : 0.f;
                q = fminf(fmaxf(q, -qmax - 1.f), qmax);
                codes[start + 32 * i + lane] = (uint8_t)(int8_t)(int)q;
            }
        }
        if (lane == 0) scales[(size_t)b * p.m] = scale;
    }
}

// ---------------------------------------------------------------------------------------
// Skinny GEMM (decode sizes).

#define SKINNY_WARPS 8

// The B fragments of chunk s of lane (row, t)'s block: from 4-bit words, or 8-bit bytes.
struct BFrag {
    uint32_t w[8];  // 4-bit: w[s] for s < nc; 8-bit: w[2s], w[2s + 1]
};

__device__ __forceinline__ void load_b(const GemmParams& p, int row, int t, int start, int nc,
                                       bool w8, BFrag& f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f.w[i] = 0u;
    if (row >= p.n) return;
    if (!w8) {
        const int k4 = p.k - p.k8w;
        const uint8_t* src = p.w4 + (size_t)row * (k4 / 2) + start / 2 + t * nc * 4;
        if (nc == 4) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
            f.w[0] = v.x; f.w[1] = v.y; f.w[2] = v.z; f.w[3] = v.w;
        } else {
#pragma unroll
            for (int s = 0; s < 4; ++s)
                if (s < nc) f.w[s] = __ldg(reinterpret_cast<const uint32_t*>(src) + s);
        }
    } else {
        const int k4 = p.k - p.k8w;
        const uint8_t* src = p.w8 + (size_t)row * p.k8w + (start - k4) + t * nc * 8;
        if (nc == 4) {
            const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(src));
            const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(src) + 1);
            f.w[0] = v0.x; f.w[1] = v0.y; f.w[2] = v0.z; f.w[3] = v0.w;
            f.w[4] = v1.x; f.w[5] = v1.y; f.w[6] = v1.z; f.w[7] = v1.w;
        } else {
#pragma unroll
            for (int s = 0; s < 8; ++s)
                if (s < 2 * nc) f.w[s] = __ldg(reinterpret_cast<const uint32_t*>(src) + s);
        }
    }
}

__device__ __forceinline__ void b_regs(const BFrag& f, int s, bool w8, uint32_t& b0, uint32_t& b1) {
    if (!w8) {
        b0 = f.w[s] & 0xF0F0F0F0u;
        b1 = (f.w[s] << 4) & 0xF0F0F0F0u;
    } else {
        b0 = f.w[2 * s];
        b1 = f.w[2 * s + 1];
    }
}

// int32 to f32 in two full-rate ops (I2F runs at a quarter of the FP32 rate on sm_90):
// exact for |v| < 2^22, which every block sum here is (at most 2^21, with the x16).
__device__ __forceinline__ float i2f(int v) {
    return __int_as_float(v + 0x4B400000) - 12582912.f;
}

// Blocks a warp of the skinny kernel has in flight at once.
#define SKINNY_DEPTH 4

template <typename T, int MT>
__device__ void w4a4_skinny(const GemmParams& p) {
    __shared__ float red[SKINNY_WARPS][MT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 8;
    const int k4 = p.k - p.k8w;
    const float* sa = reinterpret_cast<const float*>(p.act + (size_t)p.m * p.k);
    pdl_trigger();
    float acc[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    bool waited = false;
    for (int b0 = warp; b0 < p.nb; b0 += SKINNY_DEPTH * SKINNY_WARPS) {
        // Every block's codes and weight scales of this round in flight first (weights are
        // never written by a kernel: the first round loads before pdl_wait).
        BFrag f[SKINNY_DEPTH];
        int st[SKINNY_DEPTH], ncs[SKINNY_DEPTH];
        float w0[SKINNY_DEPTH], w1[SKINNY_DEPTH];
#pragma unroll
        for (int u = 0; u < SKINNY_DEPTH; ++u) {
            const int b = b0 + u * SKINNY_WARPS;
            st[u] = 0;
            ncs[u] = 0;
            w0[u] = w1[u] = 0.f;
            if (b < p.nb) {
                block_span(b, p.k, st[u], ncs[u]);
                const bool w8 = st[u] >= k4;
                load_b(p, row0 + g, t, st[u], ncs[u], w8, f[u]);
                const float fac = w8 ? 1.f : 0.0625f;
                // c0 even, np a multiple of 8: the pair is one aligned 4-byte word (padding 0).
                const int c0 = row0 + 2 * t;
                const float2 wv = __half22float2(
                    *reinterpret_cast<const __half2*>(p.sw + (size_t)b * p.np + c0));
                w0[u] = wv.x * fac;
                w1[u] = wv.y * fac;
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < SKINNY_DEPTH; ++u) {
            const int b = b0 + u * SKINNY_WARPS;
            if (ncs[u] == 0) continue;
            const bool w8 = st[u] >= k4;
            int ci[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) ci[i][j] = 0;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                if (s < ncs[u]) {
                    uint32_t b0r, b1r;
                    b_regs(f[u], s, w8, b0r, b1r);
                    const int col = st[u] + 32 * s + 4 * t;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const int r0 = mt * 16 + g, r1 = r0 + 8;
                        uint32_t a[4];
                        a[0] = r0 < p.m ? *reinterpret_cast<const uint32_t*>(p.act + (size_t)r0 * p.k + col) : 0u;
                        a[1] = r1 < p.m ? *reinterpret_cast<const uint32_t*>(p.act + (size_t)r1 * p.k + col) : 0u;
                        a[2] = r0 < p.m ? *reinterpret_cast<const uint32_t*>(p.act + (size_t)r0 * p.k + col + 16) : 0u;
                        a[3] = r1 < p.m ? *reinterpret_cast<const uint32_t*>(p.act + (size_t)r1 * p.k + col + 16) : 0u;
                        mma_s8(ci[mt], a, b0r, b1r);
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r0 = mt * 16 + g, r1 = r0 + 8;
                const float a0 = r0 < p.m ? sa[(size_t)b * p.m + r0] : 0.f;
                const float a1 = r1 < p.m ? sa[(size_t)b * p.m + r1] : 0.f;
                acc[mt][0] = fmaf(i2f(ci[mt][0]), a0 * w0[u], acc[mt][0]);
                acc[mt][1] = fmaf(i2f(ci[mt][1]), a0 * w1[u], acc[mt][1]);
                acc[mt][2] = fmaf(i2f(ci[mt][2]), a1 * w0[u], acc[mt][2]);
                acc[mt][3] = fmaf(i2f(ci[mt][3]), a1 * w1[u], acc[mt][3]);
            }
        }
    }
    if (!waited) pdl_wait();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][mt * 4 + j][lane] = acc[mt][j];
    __syncthreads();
    if (warp != 0) return;
    T* y = static_cast<T*>(p.y);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < SKINNY_WARPS; ++w) v += red[w][mt * 4 + j][lane];
            const int r = mt * 16 + g + (j >= 2 ? 8 : 0);
            const int c = row0 + 2 * t + (j & 1);
            if (r < p.m && c < p.n) y[(size_t)r * p.n + c] = from_f32<T>(v);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tiled GEMM (large m).

#define GEMM_BM 128
#define GEMM_BN 128
#define GEMM_STAGES 3
#define GEMM_THREADS 512               // 16 warps: 4 (m) x 4 (n), each 32 x 32
#define GEMM_A_BYTES (GEMM_BM * 128)   // 128 rows x 128 code bytes, swizzled
#define GEMM_B_BYTES (GEMM_BN * 128)   // 128 rows x up to 128 bytes (8-bit tail)
#define GEMM_SA_BYTES (GEMM_BM * 4)    // the rows' f32 activation scales
#define GEMM_SW_BYTES (GEMM_BN * 2)    // the rows' f16 weight scales
#define GEMM_STAGE_BYTES (GEMM_A_BYTES + GEMM_B_BYTES + GEMM_SA_BYTES + GEMM_SW_BYTES)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Block b's activation rows, weight rows and both rows' scales into a stage. A: row r's
// 16-byte chunk c at r * 128 + ((c ^ (r & 7)) * 16). B: the rows' bytes as stored (16 nc or
// 32 nc per row). Called with literal nc / w8 for whole blocks, so the loops unroll.
__device__ __forceinline__ void gemm_load_impl(const GemmParams& p, int b, int start, int nc,
                                               bool w8, uint8_t* stage, int m0, int n0) {
    const int k4 = p.k - p.k8w;
    uint8_t* sa = stage;
    uint8_t* sb = stage + GEMM_A_BYTES;
    const int a_chunks = 2 * nc;  // 16-byte chunks per activation row
#pragma unroll 2
    for (int i = threadIdx.x; i < GEMM_BM * a_chunks; i += GEMM_THREADS) {
        const int r = i / a_chunks, c = i % a_chunks;
        const int gr = m0 + r;
        const bool ok = gr < p.m;
        const uint8_t* src = p.act + (size_t)(ok ? gr : 0) * p.k + start + 16 * c;
        cp_async16(sa + r * 128 + ((c ^ (r & 7)) << 4), src, ok);
    }
    const int b_chunks = w8 ? 2 * nc : nc;
#pragma unroll 2
    for (int i = threadIdx.x; i < GEMM_BN * b_chunks; i += GEMM_THREADS) {
        const int r = i / b_chunks, c = i % b_chunks;
        const int gr = n0 + r;
        const bool ok = gr < p.n;
        const uint8_t* src = w8 ? p.w8 + (size_t)(ok ? gr : 0) * p.k8w + (start - k4) + 16 * c
                                : p.w4 + (size_t)(ok ? gr : 0) * (k4 / 2) + start / 2 + 16 * c;
        cp_async16(sb + r * (b_chunks * 16) + 16 * c, src, ok);
    }
    const int tid = threadIdx.x;
    if (tid < GEMM_BM) {
        const float* sact = reinterpret_cast<const float*>(p.act + (size_t)p.m * p.k);
        const bool ok = m0 + tid < p.m;
        cp_async4(stage + GEMM_A_BYTES + GEMM_B_BYTES + 4 * tid,
                  sact + (size_t)b * p.m + (ok ? m0 + tid : 0), ok);
    } else if (tid < GEMM_BM + GEMM_SW_BYTES / 16) {
        // n0 + 8j < np: the padded rows hold zeros.
        const int j = tid - GEMM_BM;
        const bool ok = n0 + 8 * j < p.np;
        cp_async16(stage + GEMM_A_BYTES + GEMM_B_BYTES + GEMM_SA_BYTES + 16 * j,
                   p.sw + (size_t)b * p.np + (ok ? n0 + 8 * j : 0), ok);
    }
}

__device__ __forceinline__ void gemm_load(const GemmParams& p, int b, uint8_t* stage, int m0,
                                          int n0) {
    int start, nc;
    block_span(b, p.k, start, nc);
    const bool w8 = start >= p.k - p.k8w;
    if (nc == 4 && !w8) gemm_load_impl(p, b, start, 4, false, stage, m0, n0);
    else if (nc == 4) gemm_load_impl(p, b, start, 4, true, stage, m0, n0);
    else gemm_load_impl(p, b, start, nc, w8, stage, m0, n0);
}

// One k block of the warp's 32 x 32 tile from a stage: int32 sums, then rescaled into acc.
// Called with literal nc / w8 for whole blocks.
__device__ __forceinline__ void gemm_step(const uint8_t* stage, int nc, bool w8,
                                          float (&acc)[2][4][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp & 3, wn = warp >> 2;
    const uint8_t* sa = stage;
    const uint8_t* sb = stage + GEMM_A_BYTES;
    const float* ssa = reinterpret_cast<const float*>(stage + GEMM_A_BYTES + GEMM_B_BYTES);
    const __half* ssw =
        reinterpret_cast<const __half*>(stage + GEMM_A_BYTES + GEMM_B_BYTES + GEMM_SA_BYTES);

    // B fragments for the whole block (one 16-byte read per n tile and whole 4-bit block).
    BFrag bf[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const int r = wn * 32 + nt * 8 + g;
        const int rb = w8 ? 32 * nc : 16 * nc;
        const uint8_t* src = sb + r * rb + t * (w8 ? 8 * nc : 4 * nc);
#pragma unroll
        for (int i = 0; i < 8; ++i) bf[nt].w[i] = 0u;
        if (nc == 4 && !w8) {
            const uint4 v = *reinterpret_cast<const uint4*>(src);
            bf[nt].w[0] = v.x; bf[nt].w[1] = v.y; bf[nt].w[2] = v.z; bf[nt].w[3] = v.w;
        } else if (nc == 4) {
            const uint4 v0 = reinterpret_cast<const uint4*>(src)[0];
            const uint4 v1 = reinterpret_cast<const uint4*>(src)[1];
            bf[nt].w[0] = v0.x; bf[nt].w[1] = v0.y; bf[nt].w[2] = v0.z; bf[nt].w[3] = v0.w;
            bf[nt].w[4] = v1.x; bf[nt].w[5] = v1.y; bf[nt].w[6] = v1.z; bf[nt].w[7] = v1.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < (w8 ? 2 * nc : nc)) bf[nt].w[i] = reinterpret_cast<const uint32_t*>(src)[i];
        }
    }

    int ci[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) ci[i][j][e] = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s < nc) {
            uint32_t a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int r = wm * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = 2 * s + (lane >> 4);
                ldmatrix_x4(a[mt], sa + r * 128 + ((c ^ (r & 7)) << 4));
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                uint32_t b0, b1;
                b_regs(bf[nt], s, w8, b0, b1);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_s8(ci[mt][nt], a[mt], b0, b1);
            }
        }
    }
    const float f = w8 ? 1.f : 0.0625f;
    float a_s[2][2], w_s[4][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a_s[mt][h] = ssa[wm * 32 + mt * 16 + g + 8 * h] * f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const float2 wv = __half22float2(
            *reinterpret_cast<const __half2*>(ssw + wn * 32 + nt * 8 + 2 * t));
        w_s[nt][0] = wv.x;
        w_s[nt][1] = wv.y;
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            acc[mt][nt][0] = fmaf(i2f(ci[mt][nt][0]), a_s[mt][0] * w_s[nt][0], acc[mt][nt][0]);
            acc[mt][nt][1] = fmaf(i2f(ci[mt][nt][1]), a_s[mt][0] * w_s[nt][1], acc[mt][nt][1]);
            acc[mt][nt][2] = fmaf(i2f(ci[mt][nt][2]), a_s[mt][1] * w_s[nt][0], acc[mt][nt][2]);
            acc[mt][nt][3] = fmaf(i2f(ci[mt][nt][3]), a_s[mt][1] * w_s[nt][1], acc[mt][nt][3]);
        }
}

template <typename T>
__device__ void w4a4_gemm(const GemmParams& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp & 3, wn = warp >> 2;
    const int m0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    const int k4 = p.k - p.k8w;
    pdl_trigger();
    pdl_wait();

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < p.nb) gemm_load(p, s, smem + s * GEMM_STAGE_BYTES, m0, n0);
        cp_async_commit();
    }
    for (int b = 0; b < p.nb; ++b) {
        cp_async_wait<GEMM_STAGES - 2>();
        __syncthreads();
        {
            const int bl = b + GEMM_STAGES - 1;
            if (bl < p.nb) gemm_load(p, bl, smem + (bl % GEMM_STAGES) * GEMM_STAGE_BYTES, m0, n0);
            cp_async_commit();
        }
        const uint8_t* stage = smem + (b % GEMM_STAGES) * GEMM_STAGE_BYTES;
        int start, nc;
        block_span(b, p.k, start, nc);
        const bool w8 = start >= k4;
        if (nc == 4 && !w8) gemm_step(stage, 4, false, acc);
        else if (nc == 4) gemm_step(stage, 4, true, acc);
        else gemm_step(stage, nc, w8, acc);
    }
    cp_async_wait<0>();

    T* y = static_cast<T*>(p.y);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = m0 + wm * 32 + mt * 16 + g + (e >= 2 ? 8 : 0);
                const int c = n0 + wn * 32 + nt * 8 + 2 * t + (e & 1);
                if (r < p.m && c < p.n) y[(size_t)r * p.n + c] = from_f32<T>(acc[mt][nt][e]);
            }
}


// ---------------------------------------------------------------------------------------
// Warpgroup GEMM (large m, sm_90a): wgmma.mma_async m64nBNk32 s8 with the weights as the
// register operand A (unpacked from 4 bits by two ops per word, the fragments of mma.sync's
// B are those of wgmma's A) and the activations as the shared-memory operand B (K-major,
// 128-byte swizzle: the layout gemm_load_impl writes). D = W · Xᵀ: thread (warp w of its
// warpgroup, g, t) holds the int32 sums of weight rows 16 w + g (+ 8) and tokens 8 j + 2 t
// (+ 1).
//
// CTA: 2 warpgroups (256 threads), 128 weight rows x BN = 64 tokens (128 measured no faster
// at m = 2048 and slower at 11008 x 4096; it spilled), stages of cp.async (a stage: BN x
// 128 activation bytes, 128 weight rows, both rows' scales). Two variants (DUAL):
//   one CTA per SM, 8 stages, two sets of int32 sums per thread: block b + 1 runs on the
//     tensor cores while block b is rescaled into the f32 accumulators (small grids);
//   two CTAs per SM, 4 stages, one set: the other CTA fills the gaps (large grids).
// Split-k (gridDim.z > 1, for grids too small to fill the GPU): CTA z takes a range of
// k blocks, writes its f32 tile to `ws`, and the last CTA of a tile to arrive sums them.

#define WG_THREADS 256

template <int BN>
struct WgTile {
    // Stages in flight (a step waits for the block loaded STAGES - 2 steps before): as
    // many as ~200 KiB of shared memory per SM hold.
    template <bool DUAL>
    static constexpr int stages() { return DUAL ? 8 : 4; }
    static constexpr int A = BN * 128;                       // activation codes, swizzled
    static constexpr int B = 128 * 128;                      // weight rows (8-bit tail: 128 B)
    static constexpr int SA = BN * 4;                        // activation scales (f32)
    static constexpr int SW = 128 * 2;                       // weight scales (f16)
    static constexpr int STAGE = (A + B + SA + SW + 1023) / 1024 * 1024;  // 1024-aligned (swizzle)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_n64(int (&d)[32], const uint32_t (&a)[4], uint64_t desc,
                                           int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}
#endif

template <int BN>
__device__ __forceinline__ void wgmma_block(int (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc,
                                            int accumulate) {
    static_assert(BN == 64, "wgmma_block: 64 tokens per CTA");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_n64(d, a, desc, accumulate);
#endif
}

// Block b (of the CTA's [.., hi)) into a stage: activations (BN rows, swizzled), weights
// (128 rows as stored: 16 nc bytes per row, 32 nc for 8-bit blocks), both rows' scales.
// Thread tid copies activation chunk tid % 8 of rows tid / 8 + 32 j, and (whole 4-bit
// blocks) weight chunk tid % 4 of rows tid / 4 + 64 j: a few adds per copy. 8-bit and
// short blocks (at most two per row) take a general path.
template <int BN>
__device__ __forceinline__ void wg_load(const GemmParams& p, int b, int hi, uint8_t* stage, int m0,
                                        int n0) {
    if (b >= hi) return;
    int start, nc;
    block_span(b, p.k, start, nc);
    const int k4 = p.k - p.k8w;
    const bool w8 = start >= k4;
    const int tid = threadIdx.x;
    {
        const int ar = tid >> 3, ac = tid & 7;
        const uint8_t* src = p.act + (size_t)(m0 + ar) * p.k + start + 16 * ac;
        uint8_t* dst = stage + ar * 128 + ((ac ^ (ar & 7)) << 4);  // 32 j keeps r & 7
        const bool in_block = ac < 2 * nc;  // chunks past the end: the weights there are zero
#pragma unroll
        for (int j = 0; j < BN / 32; ++j) {
            const bool ok = m0 + ar + 32 * j < p.m;
            if (in_block) cp_async16(dst + j * 32 * 128, ok ? src + (size_t)j * 32 * p.k : p.act, ok);
        }
    }
    uint8_t* sb = stage + WgTile<BN>::A;
    if (nc == 4 && !w8) {
        const int wr = tid >> 2, wc = tid & 3;
        const size_t stride = (size_t)(k4 / 2);
        const uint8_t* src = p.w4 + (size_t)(n0 + wr) * stride + start / 2 + 16 * wc;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool ok = n0 + wr + 64 * j < p.n;
            cp_async16(sb + (wr + 64 * j) * 64 + 16 * wc, ok ? src + j * 64 * stride : p.w4, ok);
        }
    } else {
        const int b_chunks = w8 ? 2 * nc : nc;
        const uint8_t* wbase = w8 ? p.w8 + (start - k4) : p.w4 + start / 2;
        const size_t wstride = w8 ? (size_t)p.k8w : (size_t)(k4 / 2);
        for (int i = tid; i < 128 * b_chunks; i += WG_THREADS) {
            const int r = i / b_chunks, c = i % b_chunks;
            const bool ok = n0 + r < p.n;
            cp_async16(sb + r * (b_chunks * 16) + 16 * c, wbase + (ok ? n0 + r : 0) * wstride + 16 * c, ok);
        }
    }
    uint8_t* scales = stage + WgTile<BN>::A + WgTile<BN>::B;
    if (tid < BN) {
        const float* sact = reinterpret_cast<const float*>(p.act + (size_t)p.m * p.k);
        const bool ok = m0 + tid < p.m;
        cp_async4(scales + 4 * tid, sact + (size_t)b * p.m + (ok ? m0 + tid : 0), ok);
    } else if (tid < BN + 16) {
        const int j = tid - BN;
        const bool ok = n0 + 8 * j < p.np;  // the padded rows hold zeros
        cp_async16(scales + WgTile<BN>::SA + 16 * j, p.sw + (size_t)b * p.np + (ok ? n0 + 8 * j : 0), ok);
    }
}

// Issue block b's wgmmas (one per 32 columns) into d; not waited for.
template <int BN>
__device__ __forceinline__ void wg_issue(const GemmParams& p, int b, const uint8_t* stage,
                                         int (&d)[BN / 2]) {
    int start, nc;
    block_span(b, p.k, start, nc);
    const bool w8 = start >= p.k - p.k8w;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = warp * 16 + g;  // weight row in the CTA tile (warpgroup 1: warps 4..7)
    const uint8_t* sb = stage + WgTile<BN>::A;
    // The row's words of slot t: 4-bit w[s] (nc of them), 8-bit w[2s], w[2s + 1] (2 nc).
    const int words = w8 ? 2 * nc : nc;
    const int rb = 4 * words * 4;  // row bytes
    uint32_t a[4][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(sb + (r0 + 8 * h) * rb + t * 4 * words);
        uint32_t w[8];
        if (words == 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(src);
            w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
            w[4] = w[5] = w[6] = w[7] = 0u;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) w[i] = i < words ? src[i] : 0u;
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            a[s][h] = w8 ? w[2 * s] : w[s] & 0xF0F0F0F0u;
            a[s][h + 2] = w8 ? w[2 * s + 1] : (w[s] << 4) & 0xF0F0F0F0u;
        }
    }
    wgmma_fence();
    fence_regs(d);
    // Always four: past a short block's end the weight fragments are zero (whatever the
    // stage holds there), and straight-line wgmmas stay asynchronous.
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma_block<BN>(d, a[s], smem_desc(stage + 32 * s), s > 0);
    wgmma_commit();
    fence_regs(d);
}

// Block b's int32 sums times both scales into acc (stage b still holds the scales).
template <int BN>
__device__ __forceinline__ void wg_rescale(const GemmParams& p, int b, const uint8_t* stage,
                                           const int (&d)[BN / 2], float (&acc)[BN / 2]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = warp * 16 + g;
    const float* ssa = reinterpret_cast<const float*>(stage + WgTile<BN>::A + WgTile<BN>::B);
    const __half* ssw = reinterpret_cast<const __half*>(stage + WgTile<BN>::A + WgTile<BN>::B +
                                                        WgTile<BN>::SA);
    const bool w8 = b * 128 >= p.k - p.k8w;
    const float f = w8 ? 1.f : 0.0625f;
    const float w0 = __half2float(ssw[r0]) * f, w1 = __half2float(ssw[r0 + 8]) * f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const float2 s = *reinterpret_cast<const float2*>(ssa + 8 * j + 2 * t);
        acc[4 * j + 0] = fmaf(i2f(d[4 * j + 0]), w0 * s.x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(i2f(d[4 * j + 1]), w0 * s.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(i2f(d[4 * j + 2]), w1 * s.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(i2f(d[4 * j + 3]), w1 * s.y, acc[4 * j + 3]);
    }
}

// The CTA's k blocks are lo + i, i in [0, cnt); block i sits in stage i % STAGES.
struct WgRange {
    int lo, cnt;
};

// Make block i + 1's stage visible to the tensor cores and refill the stage block i - 1
// used (its wgmmas and scale reads are done) with block i + STAGES - 1.
template <int BN, int N>
__device__ __forceinline__ void wg_advance(const GemmParams& p, WgRange r, int i, uint8_t* smem,
                                           int m0, int n0) {
    constexpr int S = WgTile<BN>::STAGE;
    cp_async_wait<N - 3>();  // block i + 1 landed (this thread's copies)
    fence_proxy_async();
    __syncthreads();  // everyone's copies; everyone done with block i - 1's stage
    wg_load<BN>(p, r.lo + i + N - 1, r.lo + r.cnt, smem + ((i + N - 1) % N) * S, m0, n0);
    cp_async_commit();
}

// The split-k reduction: every CTA of a tile but the last writes its partial sums and
// leaves (false); the last adds the others' into `acc` (true).
template <int BN>
__device__ __forceinline__ bool wg_reduce(const GemmParams& p, float (&acc)[BN / 2]) {
    __shared__ uint32_t arrived;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* mine = p.ws + (((size_t)tile * p.splits + blockIdx.z) * WG_THREADS + threadIdx.x) * (BN / 2);
#pragma unroll
    for (int i = 0; i < BN / 2; i += 4)
        *reinterpret_cast<float4*>(mine + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) arrived = atomicAdd(p.counters + tile, 1u);
    __syncthreads();
    if (arrived != (uint32_t)p.splits - 1) return false;
    __threadfence();
    for (int z = 0; z < p.splits; ++z) {
        if (z == (int)blockIdx.z) continue;
        const float* other = p.ws + (((size_t)tile * p.splits + z) * WG_THREADS + threadIdx.x) * (BN / 2);
#pragma unroll
        for (int i = 0; i < BN / 2; i += 4) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(other + i));
            acc[i] += v.x; acc[i + 1] += v.y; acc[i + 2] += v.z; acc[i + 3] += v.w;
        }
    }
    if (threadIdx.x == 0) p.counters[tile] = 0;  // zero again for the next launch
    return true;
}

template <typename T, int BN, bool DUAL>
__device__ void w4a4_wgmma(const GemmParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) uint8_t smem_raw[];
    // The 128-byte swizzle is a function of address bits 4..9: stages start on 1 KiB.
    uint8_t* smem = smem_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    constexpr int S = WgTile<BN>::STAGE, N = WgTile<BN>::template stages<DUAL>();
    const int m0 = blockIdx.y * BN, n0 = blockIdx.x * 128;
    WgRange r;
    r.lo = (int)(((long long)p.nb * blockIdx.z) / p.splits);
    r.cnt = (int)(((long long)p.nb * (blockIdx.z + 1)) / p.splits) - r.lo;
    pdl_trigger();
    pdl_wait();
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

#pragma unroll 1
    for (int s = 0; s < N - 1; ++s) {
        wg_load<BN>(p, r.lo + s, r.lo + r.cnt, smem + s * S, m0, n0);
        cp_async_commit();
    }
    if constexpr (DUAL) {
        int c0[BN / 2], c1[BN / 2];
        cp_async_wait<N - 2>();
        fence_proxy_async();
        __syncthreads();
        // Block i + 1 goes to the tensor cores before block i is rescaled. Straight-line
        // pairs (c0 holds even blocks, c1 odd ones), so that ptxas sees every read of a set
        // after the wait that completes it and keeps the wgmmas asynchronous.
        wg_issue<BN>(p, r.lo, smem, c0);
        int i = 0;
        for (; i + 2 < r.cnt; i += 2) {
            wg_advance<BN, N>(p, r, i, smem, m0, n0);
            wg_issue<BN>(p, r.lo + i + 1, smem + ((i + 1) % N) * S, c1);
            wgmma_wait<1>();
            fence_regs(c0);
            wg_rescale<BN>(p, r.lo + i, smem + (i % N) * S, c0, acc);
            wg_advance<BN, N>(p, r, i + 1, smem, m0, n0);
            wg_issue<BN>(p, r.lo + i + 2, smem + ((i + 2) % N) * S, c0);
            wgmma_wait<1>();
            fence_regs(c1);
            wg_rescale<BN>(p, r.lo + i + 1, smem + ((i + 1) % N) * S, c1, acc);
        }
        if (i + 1 < r.cnt) {
            wg_advance<BN, N>(p, r, i, smem, m0, n0);
            wg_issue<BN>(p, r.lo + i + 1, smem + ((i + 1) % N) * S, c1);
            wgmma_wait<1>();
            fence_regs(c0);
            wg_rescale<BN>(p, r.lo + i, smem + (i % N) * S, c0, acc);
            wgmma_wait<0>();
            fence_regs(c1);
            wg_rescale<BN>(p, r.lo + i + 1, smem + ((i + 1) % N) * S, c1, acc);
        } else {
            wgmma_wait<0>();
            fence_regs(c0);
            wg_rescale<BN>(p, r.lo + i, smem + (i % N) * S, c0, acc);
        }
    } else {
        int c[BN / 2];
#pragma unroll 1
        for (int i = 0; i < r.cnt; ++i) {
            cp_async_wait<N - 2>();  // block i landed (this thread's copies)
            fence_proxy_async();
            __syncthreads();  // everyone's copies; everyone done with block i - 1's stage
            wg_load<BN>(p, r.lo + i + N - 1, r.lo + r.cnt, smem + ((i + N - 1) % N) * S, m0, n0);
            cp_async_commit();
            wg_issue<BN>(p, r.lo + i, smem + (i % N) * S, c);
            wgmma_wait<0>();
            fence_regs(c);
            wg_rescale<BN>(p, r.lo + i, smem + (i % N) * S, c, acc);
        }
    }
    cp_async_wait<0>();
    if (p.splits > 1 && !wg_reduce<BN>(p, acc)) return;
    __syncthreads();  // every stage read: the tile is staged through them

    // Epilogue: the tile transposed through shared memory ([token][row], rows padded by 16
    // bytes so the four t of a warp hit distinct banks), then 16-byte rows of y.
    constexpr int CH = 16 / sizeof(T);  // elements per 16-byte chunk
    constexpr int LD = 128 + CH;
    T* tile = reinterpret_cast<T*>(smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            tile[(8 * j + 2 * t + (e & 1)) * LD + warp * 16 + g + (e >= 2 ? 8 : 0)] =
                from_f32<T>(acc[4 * j + e]);
    __syncthreads();
    T* y = static_cast<T*>(p.y);
    const bool vec = p.n % CH == 0;
    for (int c = threadIdx.x; c < BN * (128 / CH); c += WG_THREADS) {
        const int ti = c / (128 / CH), tr = (c % (128 / CH)) * CH;
        const int gi = m0 + ti, gr = n0 + tr;
        if (gi >= p.m || gr >= p.n) continue;
        const T* src = tile + ti * LD + tr;
        T* dst = y + (size_t)gi * p.n + gr;
        if (vec && gr + CH <= p.n) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < CH && gr + e < p.n; ++e) dst[e] = src[e];
        }
    }
#else
    __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

// ---------------------------------------------------------------------------------------
// Warp-specialized GEMM (large m, sm_90a): TMA loads into a ring of stages tracked by
// mbarriers, a producer warp, and two consumer warpgroups that take turns on the tensor cores.
//
// CTA: 288 threads: warps 0..3 and 4..7 are consumer warpgroups 0 and 1 (weight rows 0..63
// and 64..127 of the CTA's 128), warp 8 the producer; 128 weight rows x 128 tokens per CTA.
// Stage (TMA_STAGE bytes, 1 KiB aligned for the swizzle):
//   +0      activation codes [128 tokens][128 B], 128-byte swizzle (the `act` tensor map;
//           tokens past m and columns past k read as zeros)
//   +16384  weight codes of the block as stored: [128 rows][64 B] (4-bit, `w4` map) or
//           [128 rows][128 B] (8-bit tail, `w8` map); bytes past a row's end are zeros
//   +32768  f32 [128] activation scales of the tokens (the producer warp's loads)
//   +33280  f16 [128] weight scales of the rows (the `sw` map over sw_t)
// Barriers: full[s] (the producer's expect-tx arrival and its 32 lanes' after their scale
// stores: 33 arrivals plus the TMA bytes), empty[s] (the 8 consumer warps, after their
// wgmmas and scale reads of the stage). Consumer warpgroup c issues block i's wgmmas
// (m64n128k32 s8: A = its 64 rows' weights unpacked in registers, B = the stage's
// activations) only after the other finished its own (named barriers 1 and 2 pass the
// turn), so one warpgroup's rescale runs in the shadow of the other's tensor-core work.
// Split-k and the epilogue as in the warpgroup GEMM above (named barrier 3: the 256
// consumer threads).

#define TMA_THREADS 288
#define TMA_STAGES 6
#define TMA_STAGE 33792
#define TMA_W 16384
#define TMA_SA 32768
#define TMA_SW 33280

// A CUtensorMap (128 opaque bytes, built by cuTensorMapEncodeTiled on the host).
struct __align__(128) TensorMap {
    unsigned long long v[16];
};

// Mirrors `TmaParams` in src/ops/w4a4_cuda.rs (repr(C)).
struct TmaParams {
    TensorMap act;  // u8 [m, k] codes: box 128 x 128, 128-byte swizzle
    TensorMap w4;   // u8 [n, k4 / 2]: box 64 bytes x 128 rows
    TensorMap w8;   // u8 [n, k8w]: box 128 x 128 (k8w == 0: a copy of w4's, never used)
    TensorMap sw;   // f16 sw_t [nb, np]: box 128 x 1
    GemmParams g;
};

__device__ __forceinline__ void tma_2d(void* dst, const TensorMap* map, int c0, int c1, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_n128(int (&d)[64], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}
#endif

// The split-k reduction of the warp-specialized GEMM (consumer threads only; see wg_reduce).
__device__ __forceinline__ bool tma_reduce(const GemmParams& p, float (&acc)[64]) {
    __shared__ uint32_t arrived;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x, ct = threadIdx.x;
    float* mine = p.ws + (((size_t)tile * p.splits + blockIdx.z) * 256 + ct) * 64;
#pragma unroll
    for (int i = 0; i < 64; i += 4)
        *reinterpret_cast<float4*>(mine + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    __threadfence();
    bar_sync(3, 256);
    if (ct == 0) arrived = atomicAdd(p.counters + tile, 1u);
    bar_sync(3, 256);
    if (arrived != (uint32_t)p.splits - 1) return false;
    __threadfence();
    for (int z = 0; z < p.splits; ++z) {
        if (z == (int)blockIdx.z) continue;
        const float* other = p.ws + (((size_t)tile * p.splits + z) * 256 + ct) * 64;
#pragma unroll
        for (int i = 0; i < 64; i += 4) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(other + i));
            acc[i] += v.x; acc[i + 1] += v.y; acc[i + 2] += v.z; acc[i + 3] += v.w;
        }
    }
    if (ct == 0) p.counters[tile] = 0;  // zero again for the next launch
    return true;
}

template <typename T>
__device__ void w4a4_tma(const TmaParams& P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const GemmParams& p = P.g;
    extern __shared__ __align__(128) uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    __shared__ __align__(8) uint64_t full[TMA_STAGES], empty[TMA_STAGES];
    constexpr int N = TMA_STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = blockIdx.y * 128, n0 = blockIdx.x * 128;
    const int k4 = p.k - p.k8w;
    const int lo = (int)(((long long)p.nb * blockIdx.z) / p.splits);
    const int cnt = (int)(((long long)p.nb * (blockIdx.z + 1)) / p.splits) - lo;
    if (threadIdx.x == 0) {
        for (int s = 0; s < N; ++s) {
            mbar_init(&full[s], 33);
            mbar_init(&empty[s], 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    pdl_trigger();
    pdl_wait();

    if (warp == 8) {  // the producer
        const float* sact = reinterpret_cast<const float*>(p.act + (size_t)p.m * p.k);
        for (int i = 0; i < cnt; ++i) {
            const int s = i % N, b = lo + i;
            if (i >= N) mbar_wait(&empty[s], (i / N - 1) & 1);
            uint8_t* st = smem + s * TMA_STAGE;
            const int start = b * 128;
            const bool w8 = start >= k4;
            if (lane == 0) {
                mbar_expect_tx(&full[s], 16384 + (w8 ? 16384 : 8192) + 256);
                tma_2d(st, &P.act, start, m0, &full[s]);
                if (w8) tma_2d(st + TMA_W, &P.w8, start - k4, n0, &full[s]);
                else tma_2d(st + TMA_W, &P.w4, start / 2, n0, &full[s]);
                tma_2d(st + TMA_SW, &P.sw, n0, b, &full[s]);
            }
            float* ssa = reinterpret_cast<float*>(st + TMA_SA);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int tok = m0 + lane + 32 * j;
                ssa[lane + 32 * j] = tok < p.m ? __ldg(sact + (size_t)b * p.m + tok) : 0.f;
            }
            mbar_arrive(&full[s]);  // release: this lane's scale stores
        }
        return;
    }

    // Consumers: warpgroup c, warp cw of it; rows r0 and r0 + 8 of the CTA tile.
    const int c = warp >> 2, g = lane >> 2, t = lane & 3;
    const int r0 = 64 * c + 16 * (warp & 3) + g;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    int d[64];
#pragma unroll 1
    for (int i = 0; i < cnt; ++i) {
        const int s = i % N, b = lo + i;
        const uint8_t* st = smem + s * TMA_STAGE;
        int start, nc;
        block_span(b, p.k, start, nc);
        const bool w8 = start >= k4;
        mbar_wait(&full[s], (i / N) & 1);
        // The A fragments (as wg_issue; rows 64 B apart for 4-bit blocks, 128 for 8-bit).
        const int words = w8 ? 2 * nc : nc, rb = w8 ? 128 : 64;
        uint32_t a[4][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t* src = reinterpret_cast<const uint32_t*>(st + TMA_W + (r0 + 8 * h) * rb + t * 4 * words);
            uint32_t w[8];
            if (words == 4) {
                const uint4 v = *reinterpret_cast<const uint4*>(src);
                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
                w[4] = w[5] = w[6] = w[7] = 0u;
            } else if (words == 8) {
                const uint4 v = *reinterpret_cast<const uint4*>(src), u = *reinterpret_cast<const uint4*>(src + 4);
                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
                w[4] = u.x; w[5] = u.y; w[6] = u.z; w[7] = u.w;
            } else {
#pragma unroll
                for (int q = 0; q < 8; ++q) w[q] = q < words ? src[q] : 0u;
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                a[q][h] = w8 ? w[2 * q] : w[q] & 0xF0F0F0F0u;
                a[q][h + 2] = w8 ? w[2 * q + 1] : (w[q] << 4) & 0xF0F0F0F0u;
            }
        }
        // Wait for the turn on the tensor cores (warpgroup 0 starts).
        if (c == 1 || i > 0) bar_sync(1 + c, 256);
        wgmma_fence();
        fence_regs(d);
#pragma unroll
        for (int q = 0; q < 4; ++q) wgmma_n128(d, a[q], smem_desc(st + 32 * q), q > 0);
        wgmma_commit();
        fence_regs(d);
        wgmma_wait<0>();
        fence_regs(d);
        // Pass the turn (warpgroup 1's last block has no one to pass it to).
        if (c == 0 || i + 1 < cnt) bar_arrive(2 - c, 256);
        // Rescale block i into acc.
        const float* ssa = reinterpret_cast<const float*>(st + TMA_SA);
        const __half* ssw = reinterpret_cast<const __half*>(st + TMA_SW);
        const float f = w8 ? 1.f : 0.0625f;
        const float w0 = __half2float(ssw[r0]) * f, w1 = __half2float(ssw[r0 + 8]) * f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float2 sv = *reinterpret_cast<const float2*>(ssa + 8 * j + 2 * t);
            acc[4 * j + 0] = fmaf(i2f(d[4 * j + 0]), w0 * sv.x, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(i2f(d[4 * j + 1]), w0 * sv.y, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(i2f(d[4 * j + 2]), w1 * sv.x, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(i2f(d[4 * j + 3]), w1 * sv.y, acc[4 * j + 3]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    if (p.splits > 1 && !tma_reduce(p, acc)) return;
    bar_sync(3, 256);  // every stage consumed: the tile is staged through them

    constexpr int CH = 16 / sizeof(T);
    constexpr int LD = 128 + CH;
    T* tile = reinterpret_cast<T*>(smem);
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            tile[(8 * j + 2 * t + (e & 1)) * LD + r0 + (e >= 2 ? 8 : 0)] = from_f32<T>(acc[4 * j + e]);
    bar_sync(3, 256);
    T* y = static_cast<T*>(p.y);
    const bool vec = p.n % CH == 0;
    for (int q = threadIdx.x; q < 128 * (128 / CH); q += 256) {
        const int ti = q / (128 / CH), tr = (q % (128 / CH)) * CH;
        const int gi = m0 + ti, gr = n0 + tr;
        if (gi >= p.m || gr >= p.n) continue;
        const T* src = tile + ti * LD + tr;
        T* dst = y + (size_t)gi * p.n + gr;
        if (vec && gr + CH <= p.n) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < CH && gr + e < p.n; ++e) dst[e] = src[e];
        }
    }
#else
    __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

}  // namespace

#define W4A4_KERNELS(SUF, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) w4a4_quant_##SUF(                      \
        const __grid_constant__ QuantParams p) {                                              \
        w4a4_quant<T>(p);                                                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) w4a4_skinny_##SUF##_m1(                \
        const __grid_constant__ GemmParams p) {                                               \
        w4a4_skinny<T, 1>(p);                                                                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(512, 1) w4a4_gemm_##SUF(                    \
        const __grid_constant__ GemmParams p) {                                               \
        w4a4_gemm<T>(p);                                                                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) w4a4_wgmma_##SUF##_x1(              \
        const __grid_constant__ GemmParams p) {                                               \
        w4a4_wgmma<T, 64, true>(p);                                                           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2) w4a4_wgmma_##SUF##_x2(              \
        const __grid_constant__ GemmParams p) {                                               \
        w4a4_wgmma<T, 64, false>(p);                                                          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TMA_THREADS, 1) w4a4_tma_##SUF(             \
        const __grid_constant__ TmaParams p) {                                                \
        w4a4_tma<T>(p);                                                                       \
    }

W4A4_KERNELS(f32, float)
W4A4_KERNELS(f16, __half)
W4A4_KERNELS(bf16, __nv_bfloat16)
