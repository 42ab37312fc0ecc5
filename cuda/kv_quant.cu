// Quantized KV caches outside the decode attention: the prefill append (RoPE on K, then
// encode K and V rows into the cache) and the dequantize used by prefill attention and the
// tests. The encodings and the cache's byte layout: kv_codec.cuh.
//
//   qkv    [b, seq, (nh + 2 nkv) hd] T   fused projection; rows pos..pos+seq are written
//   cos/sin [max_pos, hd/2] f32           RoPE tables (position pos + i - pads[s])
//   cache  u8 [2, b, nkv, max_len, rec]  K records then V records
//   out    [2, b, nkv, len, hd] T         (dequantize) rows 0..len of every head
#include "kv_codec.cuh"

using namespace lowbit;

struct AppendParams {
    const void* qkv;
    const float* cos;
    const float* sin;
    const uint32_t* pos;
    const uint32_t* pads;
    uint8_t* k;
    uint8_t* v;
    int b, seq, nh, nkv, hd, max_len, rec, rotate_k;  // rotate_k 0: K encoded before RoPE
    KvThr thr_k, thr_v;
};

// grid (seq, b, nkv), block 64: warp 0 encodes the K row (rotated), warp 1 the V row.
template <typename T, typename E>
__device__ void kv_append(const AppendParams& p) {
    __shared__ float x_sh[2][128];
    __shared__ uint8_t codes_sh[2][128];
    pdl_trigger();
    pdl_wait();
    const int i = blockIdx.x, s = blockIdx.y, kvh = blockIdx.z;
    const int hd = p.hd, half = hd / 2, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = (int)p.pos[0] + i, rpos = max(row - (int)p.pads[s], 0);
    const T* x = static_cast<const T*>(p.qkv) + ((size_t)s * p.seq + i) * (p.nh + 2 * p.nkv) * hd;
    if (warp == 0) {
        const T* k = x + (size_t)(p.nh + kvh) * hd;
        for (int j = lane; j < half; j += 32) {
            const float c = p.cos[(size_t)rpos * half + j], sn = p.sin[(size_t)rpos * half + j];
            float y0 = to_f32(k[j]), y1 = to_f32(k[j + half]);
            if (p.rotate_k) rope_pair_rn(to_f32(k[j]), to_f32(k[j + half]), c, sn, y0, y1);
            x_sh[0][j] = to_f32(from_f32<T>(y0));
            x_sh[0][j + half] = to_f32(from_f32<T>(y1));
        }
    } else {
        const T* v = x + (size_t)(p.nh + p.nkv + kvh) * hd;
        for (int j = lane; j < hd; j += 32) x_sh[1][j] = to_f32(v[j]);
    }
    __syncwarp();
    const size_t off = (((size_t)s * p.nkv + kvh) * p.max_len + row) * p.rec;
    if (warp == 0) E::encode(x_sh[0], p.k + off, hd, 0, p.thr_k, codes_sh[0], lane);
    else E::encode(x_sh[1], p.v + off, hd, 1, p.thr_v, codes_sh[1], lane);
}

struct DequantParams {
    const uint8_t* cache;
    void* out;
    int b, nkv, hd, max_len, len, rec;
    KvThr thr_k, thr_v;
};

// A block per row at a time (threads over its values). Rows: [2, b, nkv, len].
template <typename T, typename E>
__device__ void kv_dequantize(const DequantParams& p) {
    __shared__ float row_sh[128];
    pdl_trigger();
    pdl_wait();
    const size_t rows = (size_t)2 * p.b * p.nkv * p.len;
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int j = (int)(r % p.len);
        const size_t head = r / p.len;  // (kv * b + s) * nkv + h
        const int kv = head >= (size_t)p.b * p.nkv ? 1 : 0;
        E::decode(p.cache + (head * p.max_len + j) * p.rec, p.hd, kv, kv ? p.thr_v : p.thr_k, row_sh, threadIdx.x, blockDim.x);
        __syncthreads();
        T* o = static_cast<T*>(p.out) + r * p.hd;
        for (int d = threadIdx.x; d < p.hd; d += blockDim.x) o[d] = from_f32<T>(row_sh[d]);
        __syncthreads();
    }
}

#define KV_QUANT_KERNELS(SUF, T, ENC, E)                                                          \
    extern "C" __global__ void __launch_bounds__(64) kv_append_##SUF##_##ENC(const __grid_constant__ AppendParams p) { \
        kv_append<T, E>(p);                                                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) kv_dequantize_##SUF##_##ENC(const __grid_constant__ DequantParams p) { \
        kv_dequantize<T, E>(p);                                                                   \
    }

KV_QUANT_KERNELS(f32, float, kv4, Kv4)
KV_QUANT_KERNELS(f16, __half, kv4, Kv4)
KV_QUANT_KERNELS(bf16, __nv_bfloat16, kv4, Kv4)
KV_QUANT_KERNELS(f32, float, oaken, Oaken)
KV_QUANT_KERNELS(f16, __half, oaken, Oaken)
KV_QUANT_KERNELS(bf16, __nv_bfloat16, oaken, Oaken)
