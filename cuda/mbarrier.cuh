// Shared-memory barriers (mbarrier) and bulk copies into shared memory (sm_90), shared by
// the W4A4 warp-specialized GEMM and the tiles GEMV. A barrier initialised for `count`
// arrivals completes a phase when they have arrived and every byte announced by
// `mbar_expect_tx` has landed; `mbar_wait(b, parity)` spins until the phase of that parity
// is complete (phases alternate 0, 1, 0, ...). Only launched on sm_90+ builds.
#pragma once
#include <stdint.h>

namespace lowbit {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}

// Makes barrier initialisations visible to the other threads and to the async proxy (bulk
// copies and TMA), before any of them uses the barriers.
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier generic-proxy accesses of shared memory before later
// async-proxy ones (a bulk copy into a buffer just read, a wgmma reading one just written).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival that also announces `bytes` still to land through copies tracked by `b`.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* b, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nMBAR_WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra MBAR_WAIT_%=;\n}\n" ::"r"(smem_u32(b)),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned) by the
// bulk-copy engine, completing on barrier `b`'s transaction count.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(b))
        : "memory");
}

}  // namespace lowbit
