// Asynchronous copies from global to shared memory (cp.async, sm_80+): a
// thread issues its copies, commits them as a group, and later waits for
// all but its newest kPending groups; a block barrier after the wait makes
// every thread's copies visible to the block.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_CP_ASYNC_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_CP_ASYNC_CUH_

#include <cuda_runtime.h>

namespace specstate {
namespace kernels {
namespace {

// 16 bytes, bypassing L1 (.cg: each byte is read once).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// 8 and 4 bytes (.ca: the only cache mode these sizes take).
__device__ __forceinline__ void CpAsync8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_CP_ASYNC_CUH_
