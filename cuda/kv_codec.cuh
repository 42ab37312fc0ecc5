// KV-cache encodings: how one (token, KV head) row of K or V is stored, read and written.
// Shared by the decode attention (decode_attention.cu: reads rows, quantizes the step's new
// row) and the prefill append / dequantize kernels (kv_quant.cu). The CPU references of
// every function here are in src/kv/{kv4,oaken}.rs and must stay bit-identical: every
// float operation that rounds is written with an explicit _rn intrinsic (no contraction
// into fma where the product is not exact).
//
// A quantized cache is one u8 tensor [2, b, nkv, max_len, rec]: K records, then V
// records; record (kv, s, h, j) at byte ((kv * b + s) * nkv + h) * max_len + j) * rec.
//
// kv4 (per-token asymmetric INT4, Atom / COMET), rec = hd/2 + 4 bytes:
//   bytes [0, hd/2)      codes, in the tensor-core order of kv4_element (below)
//   bytes [hd/2, +4)     f16 scale, f16 min       value = min + code * scale
//   code = clamp(rint((x - min) / scale), 0, 15), scale = f16((max - min) / 15), min = f16(min)
//
// oaken (Oaken's group-shift with the dense-and-sparse encoding), per layer and K / V four
// offline thresholds lo_o < lo_i < hi_i < hi_o (calibration quantiles). Each value is
//   outer  x >= hi_o or x <= lo_o      shifted: m = x - hi_o (x >= hi_o) or lo_o - x, >= 0
//   inner  lo_i < x < hi_i             not shifted
//   middle otherwise                    shifted: s = x - hi_i (x >= hi_i) or x - lo_i (<= 0)
// The values are cut into segments of min(64, hd) (by element index); each segment holds
// up to KV_SEG_CAP = 8 sparse entries, outer values first, then inner, each in index order.
// rec = hd/2 + 8 * nseg + 8 bytes (nseg = ceil(hd / 64)):
//   bytes [0, hd/2)              dense codes, every value a 4-bit code, in kv4's slot order
//                                (kv4_element / kv4_slot: the tensor-core attention's)
//   bytes [hd/2, +8 nseg)        sparse entries, 8 per segment, one byte each:
//                                bits 0-5 element index in the segment, bit 6 group (0 outer,
//                                1 inner), bit 7 extra bit; entries past the count are 0
//   bytes [hd/2 + 8 nseg, +8)    f16 mid_step, f16 mid_min, f16 outer_scale,
//                                u8 counts (segment 0 in bits 0-3, segment 1 in 4-7),
//                                u8 zc: the first middle code of the positive side
// Decoding slot d with 4-bit code c:
//   middle (no entry)   s = mid_min + c * mid_step;  x = s + (c >= zc ? hi_i : lo_i)
//   outer  (group 0)    m = c * outer_scale;         x = extra ? lo_o - m : hi_o + m
//   inner  (group 1)    q = c | extra << 4 (5 bits); x = lo_i + q * inner_step
// Middle codes carry the side in their order (codes below zc are the negative side), so
// middle is 4 bits with no side bit; outer and inner are 5 bits (4 dense + the entry's
// extra bit: outer's side, inner's high bit). mid_min <= 0: the middle range of a row
// always spans 0, zc is the first level >= 0, at least 1 where the row has negative-side
// values and at most 15 where it has positive-side ones. inner_step = (hi_i - lo_i) / 31
// is offline (the inner interval is fixed by the thresholds); mid and outer scales are
// per row.
// A segment with more outliers than entries demotes the rest to middle (outer values
// keep their full value and widen the row's middle range: nothing is clipped; inner ones
// become the middle level nearest their side's threshold, an error of at most
// hi_i - lo_i + mid_step).
#pragma once
#include "common.cuh"

namespace lowbit {

#define KV_SEG 64
#define KV_SEG_CAP 8

// Oaken's thresholds for one of K / V of a layer, and constants derived on the host.
struct KvThr {
    float outer_lo, inner_lo, inner_hi, outer_hi;
    float inner_step, inner_inv, inner_mid, pad;
};

__device__ __forceinline__ float warp_min(float v) { return -warp_max(-v); }

__device__ __forceinline__ float h_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float h_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
__device__ __forceinline__ uint32_t h_bits(float v) { return (uint32_t)__half_as_ushort(__float2half_rn(v)); }

// A dense row: hd values of T.
template <typename T> struct DenseKv {
    static constexpr int EPL = 16 / sizeof(T);  // values per lane chunk
    static constexpr int UNROLL = 4;             // chunks per lane in flight (attention)
    using Chunk = uint4;
    const uint8_t* base;  // this (sequence, KV head)'s row 0
    int rec, hd;
    __device__ __forceinline__ Chunk load(int j, int sub) const {
        return reinterpret_cast<const uint4*>(base + (size_t)j * rec)[sub];
    }
    __device__ __forceinline__ void unpack(const Chunk& c, int, float* out) const { unpack16<T>(c, out); }
};

// kv4 rows are read by the tensor-core attention (decode_attention.cu, hd 64 or 128), so
// their nibbles are stored in the order its mma fragments take them; slot s of a record
// (byte s / 2, low nibble for even s) holds element kv4_element(kv, hd, s):
//   K: four parts of hd/4 slots (part c = s / (hd/4): the lane with lane % 4 == c), each
//      hd/32 words of 8 nibbles; nibble n of word i is element
//      16 (2i + (n>>1 & 1)) + 2c + 8 (n & 1) + (n>>2 & 1)
//      so `lop3(w, 0x000f000f, 0x64006400)` and the 0x00f000f0 mask give the f16 pairs of
//      the B fragment of slice 2i (elements 2c, 2c+1 and 2c+8, 2c+9), and `w >> 8` those
//      of slice 2i + 1.
//   V: eight groups of hd/8 slots (group r = s / (hd/8): the lane with lane / 4 == r);
//      slot j of a group is column 8j + r, so one byte-interleave (prmt) of two keys'
//      words gives the B fragment pairs (V[k][d], V[k+1][d]) of the P·V mma.
__device__ __forceinline__ int kv4_element(int kv, int hd, int s) {
    if (kv == 0) {
        const int part = hd / 4, c = s / part, i = (s % part) / 8, n = s % 8;
        return 16 * (2 * i + ((n >> 1) & 1)) + 2 * c + 8 * (n & 1) + ((n >> 2) & 1);
    }
    const int group = hd / 8;
    return 8 * (s % group) + s / group;
}
// The slot of element d (the inverse of kv4_element).
__host__ __device__ __forceinline__ int kv4_slot(int kv, int hd, int d) {
    if (kv == 0) {
        const int slice = d >> 4, r = d & 15;
        const int n = (r >> 3) | (slice & 1) << 1 | (r & 1) << 2;
        return ((r & 7) >> 1) * (hd / 4) + 8 * (slice >> 1) + n;
    }
    return (d & 7) * (hd / 8) + (d >> 3);
}
// Pack codes[0, hd) (element order, shared memory) into a record's slots: one warp.
__device__ __forceinline__ void pack_slots(const uint8_t* codes, uint8_t* rec_out, int hd, int kv, int lane) {
    for (int b = lane; b < hd / 2; b += 32)
        rec_out[b] = (uint8_t)(codes[kv4_element(kv, hd, 2 * b)] | codes[kv4_element(kv, hd, 2 * b + 1)] << 4);
}

struct Kv4 {
    static constexpr bool SPARSE = false;
    // Resident blocks per SM of the tensor-core decode attention (its launch bounds).
    static constexpr int TC_BLOCKS = 4;
    __host__ __device__ static constexpr int rec_bytes(int hd) { return hd / 2 + 4; }
    __host__ __device__ static constexpr int meta(int hd) { return hd / 2; }  // f16 scale, f16 min
    // One warp writes row x (hd floats, shared memory) of K (kv 0) or V (kv 1) to record
    // `rec_out`; `codes` is hd bytes of shared memory for the codes in element order.
    __device__ static void quantize_warp(const float* x, uint8_t* rec_out, int hd, int kv, uint8_t* codes, int lane) {
        const int E = hd / 32;
        float v[4], mn = INFINITY, mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i < E) { v[i] = x[lane * E + i]; mn = fminf(mn, v[i]); mx = fmaxf(mx, v[i]); }
        }
        mn = warp_min(mn);
        mx = warp_max(mx);
        const uint32_t sb = h_bits(__fdiv_rn(__fsub_rn(mx, mn), 15.f)), mb = h_bits(mn);
        const float scale = h_lo(sb), m0 = h_lo(mb);
        const float inv = scale > 0.f ? __frcp_rn(scale) : 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < E) codes[lane * E + i] = (uint8_t)fminf(fmaxf(rintf(__fmul_rn(__fsub_rn(v[i], m0), inv)), 0.f), 15.f);
        __syncwarp();
        pack_slots(codes, rec_out, hd, kv, lane);
        if (lane == 0) *reinterpret_cast<uint32_t*>(rec_out + hd / 2) = sb | mb << 16;
        __syncwarp();
    }
    __device__ static void encode(const float* x, uint8_t* rec_out, int hd, int kv, const KvThr&, uint8_t* scratch, int lane) {
        quantize_warp(x, rec_out, hd, kv, scratch, lane);
    }
    // Record `rec` of K (kv 0) or V (kv 1) into out[0, hd): thread `t` of `nt` over bytes.
    __device__ static void decode(const uint8_t* rec, int hd, int kv, const KvThr&, float* out, int t, int nt) {
        const uint32_t m = *reinterpret_cast<const uint32_t*>(rec + hd / 2);
        const float scale = h_lo(m), mn = h_hi(m);
        for (int b = t; b < hd / 2; b += nt) {
            const uint32_t byte = rec[b];
            out[kv4_element(kv, hd, 2 * b)] = fmaf((float)(byte & 15u), scale, mn);
            out[kv4_element(kv, hd, 2 * b + 1)] = fmaf((float)(byte >> 4), scale, mn);
        }
    }
};

struct Oaken {
    static constexpr bool SPARSE = true;
    // As Kv4's: 3 (166 registers). Measured (H200, hd 128): 4 blocks (128 registers, spills,
    // and 3 ring stages to fit the shared memory) ran 5-20 % slower.
    static constexpr int TC_BLOCKS = 3;
    __host__ __device__ static constexpr int nseg(int hd) { return (hd + KV_SEG - 1) / KV_SEG; }
    __host__ __device__ static constexpr int seg_len(int hd) { return hd < KV_SEG ? hd : KV_SEG; }
    __host__ __device__ static constexpr int rec_bytes(int hd) { return hd / 2 + 8 * nseg(hd) + 8; }
    // f16 mid_step, f16 mid_min (the word kv4 has its scale and min in), then f16
    // outer_scale, u8 counts, u8 zc.
    __host__ __device__ static constexpr int meta(int hd) { return hd / 2 + 8 * nseg(hd); }
    // Record `rec` of K (kv 0) or V (kv 1) into out[0, hd): thread `t` of `nt` over values.
    __device__ static void decode(const uint8_t* rec, int hd, int kv, const KvThr& thr, float* out, int t, int nt) {
        const int sl = seg_len(hd);
        const uint32_t m0 = *reinterpret_cast<const uint32_t*>(rec + meta(hd));
        const uint32_t m1 = *reinterpret_cast<const uint32_t*>(rec + meta(hd) + 4);
        const float mstep = h_lo(m0), mmin = h_hi(m0), oscale = h_lo(m1);
        const uint32_t zc = m1 >> 24;
        for (int d = t; d < hd; d += nt) {
            const int slot = kv4_slot(kv, hd, d), seg = d / sl;
            const uint32_t code = (rec[slot >> 1] >> (4 * (slot & 1))) & 15u;
            // code * mstep is exact (4-bit code, f16 step): the fma equals the CPU's mul + add.
            float x = __fadd_rn(fmaf((float)code, mstep, mmin), code >= zc ? thr.inner_hi : thr.inner_lo);
            const int cnt = min((int)((m1 >> (16 + 4 * seg)) & 15u), KV_SEG_CAP);
            for (int k = 0; k < cnt; ++k) {  // the last entry for d wins, as on the CPU
                const uint32_t e = rec[hd / 2 + seg * KV_SEG_CAP + k];
                if ((int)(e & 63u) != d - seg * sl) continue;
                const uint32_t ex = e >> 7;
                if ((e >> 6) & 1u) {
                    x = __fadd_rn(__fmul_rn((float)(code | ex << 4), thr.inner_step), thr.inner_lo);
                } else {
                    const float m = (float)code * oscale;
                    x = ex ? __fsub_rn(thr.outer_lo, m) : __fadd_rn(thr.outer_hi, m);
                }
            }
            out[d] = x;
        }
    }
    // One warp writes row x (hd floats, shared memory) of K (kv 0) or V (kv 1) to record
    // `rec_out`; `codes` is hd bytes of shared memory for the codes in element order.
    __device__ static void encode(const float* x, uint8_t* rec_out, int hd, int kv, const KvThr& t, uint8_t* codes, int lane) {
        const int E = hd / 32, sl = seg_len(hd), lps = sl / E, seg = lane / lps, ls = lane % lps;
        float v[4];
        int cls[4];  // 0 middle, 1 outer, 2 inner
        int no = 0, ni = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            cls[i] = 0;
            if (i < E) {
                v[i] = x[lane * E + i];
                const bool outer = v[i] >= t.outer_hi || v[i] <= t.outer_lo;
                const bool inner = !outer && v[i] > t.inner_lo && v[i] < t.inner_hi;
                cls[i] = outer ? 1 : inner ? 2 : 0;
                no += outer;
                ni += inner;
            }
        }
        // Ranks in the segment: outer values in index order, then inner ones.
        int po = no, pi = ni;
        for (int o = 1; o < lps; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, po, o), b = __shfl_up_sync(0xffffffffu, pi, o);
            if (ls >= o) { po += a; pi += b; }
        }
        const int last = seg * lps + lps - 1;
        const int tot_o = __shfl_sync(0xffffffffu, po, last), tot_i = __shfl_sync(0xffffffffu, pi, last);
        po -= no;
        pi -= ni;
        int rank[4];
        bool sel[4];
        float s[4];
        bool pos_side[4];
        float mlo = 0.f, mhi = 0.f, omax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            rank[i] = 0;
            sel[i] = false;
            s[i] = 0.f;
            pos_side[i] = false;
            if (i >= E) continue;
            if (cls[i] == 1) rank[i] = po++;
            else if (cls[i] == 2) rank[i] = tot_o + pi++;
            sel[i] = cls[i] != 0 && rank[i] < KV_SEG_CAP;
            if (sel[i]) {
                if (cls[i] == 1) omax = fmaxf(omax, v[i] >= t.outer_hi ? __fsub_rn(v[i], t.outer_hi) : __fsub_rn(t.outer_lo, v[i]));
                continue;
            }
            if (cls[i] == 2) {
                pos_side[i] = v[i] >= t.inner_mid;
                s[i] = 0.f;
            } else {
                pos_side[i] = v[i] >= t.inner_hi;
                s[i] = __fsub_rn(v[i], pos_side[i] ? t.inner_hi : t.inner_lo);
            }
            mlo = fminf(mlo, s[i]);
            mhi = fmaxf(mhi, s[i]);
        }
        mlo = warp_min(mlo);
        mhi = warp_max(mhi);
        omax = warp_max(omax);
        const uint32_t stb = h_bits(__fdiv_rn(__fsub_rn(mhi, mlo), 15.f)), mnb = h_bits(mlo);
        const uint32_t osb = h_bits(__fdiv_rn(omax, 15.f));
        const float step = h_lo(stb), mn = h_lo(mnb), os = h_lo(osb);
        const float inv = step > 0.f ? __frcp_rn(step) : 0.f, oinv = os > 0.f ? __frcp_rn(os) : 0.f;
        int zc = 16;  // the first middle level whose s is >= 0, leaving each side a level
        for (int q = 15; q >= 0; --q)
            if (fmaf((float)q, step, mn) >= 0.f) zc = q;
        bool any_neg = false, any_pos = false;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i < E && !sel[i]) { any_neg |= !pos_side[i]; any_pos |= pos_side[i]; }
        }
        any_neg = __any_sync(0xffffffffu, any_neg);
        any_pos = __any_sync(0xffffffffu, any_pos);
        if (any_neg) zc = max(zc, 1);
        if (any_pos) zc = min(zc, 15);
        int c[4];
        uint8_t* entries = rec_out + hd / 2 + seg * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c[i] = 0;
            if (i >= E) continue;
            if (!sel[i]) {
                int q = (int)fminf(fmaxf(rintf(__fmul_rn(__fsub_rn(s[i], mn), inv)), 0.f), 15.f);
                q = pos_side[i] ? min(max(q, zc), 15) : max(min(q, zc - 1), 0);
                c[i] = q;
                continue;
            }
            uint32_t extra;
            if (cls[i] == 1) {
                const bool hi = v[i] >= t.outer_hi;
                const float m = hi ? __fsub_rn(v[i], t.outer_hi) : __fsub_rn(t.outer_lo, v[i]);
                c[i] = (int)fminf(rintf(__fmul_rn(m, oinv)), 15.f);
                extra = hi ? 0u : 1u;
            } else {
                const int q5 = (int)fminf(fmaxf(rintf(__fmul_rn(__fsub_rn(v[i], t.inner_lo), t.inner_inv)), 0.f), 31.f);
                c[i] = q5 & 15;
                extra = (uint32_t)(q5 >> 4);
            }
            const uint32_t p = (uint32_t)((lane * E + i) % sl);
            entries[rank[i]] = (uint8_t)(p | (cls[i] == 2 ? 1u : 0u) << 6 | extra << 7);
        }
        const int cnt = min(KV_SEG_CAP, tot_o + tot_i);
        if (ls >= cnt && ls < KV_SEG_CAP) entries[ls] = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < E) codes[lane * E + i] = (uint8_t)c[i];
        __syncwarp();
        pack_slots(codes, rec_out, hd, kv, lane);
        const int cnt1 = __shfl_sync(0xffffffffu, cnt, (lps < 32) ? lps : 0);
        if (lane == 0) {
            uint32_t* mw = reinterpret_cast<uint32_t*>(rec_out + meta(hd));
            mw[0] = stb | mnb << 16;
            mw[1] = osb | (uint32_t)cnt << 16 | (uint32_t)(nseg(hd) > 1 ? cnt1 : 0) << 20 | (uint32_t)zc << 24;
        }
        __syncwarp();
    }
};

// Rotate one K pair for RoPE exactly as the CPU reference does (no fma contraction).
__device__ __forceinline__ void rope_pair_rn(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}

}  // namespace lowbit
