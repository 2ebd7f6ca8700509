// The TMA's bulk copies from global to shared memory (cp.async.bulk, sm_90+)
// and the mbarrier that counts their bytes: one thread arms the barrier
// with the bytes it expects (MbarArriveExpectTx), any threads issue copies
// that complete on it (BulkCopyToShared), and the readers wait for the
// barrier's phase (MbarWait). A barrier serves one batch of copies a
// phase; its phases alternate parity 0, 1, 0, ...
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_BULK_COPY_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_BULK_COPY_CUH_

#include <cstdint>

#include <cuda_runtime.h>

namespace specstate {
namespace kernels {
namespace {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `arrivals` arrivals complete a phase (with the bytes expected).
__device__ __forceinline__ void MbarInit(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)),
               "r"(arrivals)
               : "memory");
}

// After MbarInit, before the async proxy (the copies) may signal the barrier.
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's earlier shared-memory accesses (and those a barrier
// made visible to it) before its later bulk copies' writes: a buffer the
// block wrote or read through ordinary loads and stores is refilled by the
// TMA only after them.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival, and `bytes` more to come from copies in this phase.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Until the phase of parity `parity` has completed (its arrivals and bytes).
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// `src` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void BulkCopyToShared(void* dst, const void* src, uint32_t bytes,
                                                 uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];\n" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_BULK_COPY_CUH_
