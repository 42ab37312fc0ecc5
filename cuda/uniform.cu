// Uniform asymmetric integer weights (int2 / int3 / int4, src/formats/uniform.rs): packing
// codes into words, and dequantizing packed weights to the run dtype (the reference
// forward dequantizes, then candle's matmul runs; the fast kernels come with the mixed
// 2/4/16-bit format).
//
// Layout (row-major, contiguous; b = bits in {2, 3, 4}; W = ceil(k * b / 32); G = ceil(k / 128)):
//   codes    [n, k]  u8    one code per weight, each < 2^b             (pack input)
//   qweight  [n, W]  u32   row r's codes as one bit string: code j in bits b*j .. b*j + b
//                          (LSB first), word i holding bits 32*i .. 32*i + 32, unused
//                          high bits of the last word zero. int3 codes may straddle two words.
//   scales   [n, G]  f16   per (row, group of 128 columns)
//   zeros    [n, G]  f16   the value code 0 stands for
//   out      [n, k]  T     w = q * scale + zero in f32 (no fused multiply-add, so the CPU
//                          reference matches bit for bit), rounded once to T in {f32, f16, bf16}
// Launched with programmatic dependent launch: nothing is read before pdl_wait.
#include "common.cuh"

using namespace lowbit;

#define UNIFORM_GROUP 128

// One thread per output word: gathers the (parts of) codes whose bits land in it.
extern "C" __global__ void uniform_pack(const uint8_t* __restrict__ codes, uint32_t* __restrict__ qweight,
                                        int n, int k, int bits, int words) {
    pdl_wait();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * words) return;
    const int r = (int)(t / words), wi = (int)(t % words);
    const uint8_t* c_rd = codes + (size_t)r * k;
    const int bit0 = wi * 32;
    const int j0 = bit0 / bits;
    const int j1 = min(k, (bit0 + 32 + bits - 1) / bits);
    uint32_t word = 0;
    for (int j = j0; j < j1; ++j) {
        const int shift = j * bits - bit0;  // in (-bits, 32)
        const uint32_t c = c_rd[j];
        word |= shift >= 0 ? (c << shift) : (c >> (-shift));
    }
    qweight[t] = word;
}

__device__ __forceinline__ uint32_t code_at(const uint32_t* row, int j, int bits) {
    const int bit = j * bits, w = bit >> 5, o = bit & 31;
    uint32_t v = row[w] >> o;
    if (o + bits > 32) v |= row[w + 1] << (32 - o);
    return v & ((1u << bits) - 1u);
}

// One thread per output element.
template <typename T>
__device__ void uniform_dequantize(const uint32_t* __restrict__ qweight, const __half* __restrict__ scales,
                                   const __half* __restrict__ zeros, T* __restrict__ out,
                                   int n, int k, int bits, int words) {
    pdl_wait();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * k) return;
    const int r = (int)(t / k), j = (int)(t % k);
    const int groups = (k + UNIFORM_GROUP - 1) / UNIFORM_GROUP;
    const int g = r * groups + j / UNIFORM_GROUP;
    const float q = (float)code_at(qweight + (size_t)r * words, j, bits);
    out[t] = from_f32<T>(__fadd_rn(__fmul_rn(q, __half2float(scales[g])), __half2float(zeros[g])));
}

#define DEQ(name, T)                                                                                          \
    extern "C" __global__ void name(const uint32_t* qweight, const __half* scales, const __half* zeros, T* out, \
                                    int n, int k, int bits, int words) {                                      \
        uniform_dequantize<T>(qweight, scales, zeros, out, n, k, bits, words);                                 \
    }
DEQ(uniform_dequantize_f32, float)
DEQ(uniform_dequantize_f16, __half)
DEQ(uniform_dequantize_bf16, __nv_bfloat16)
