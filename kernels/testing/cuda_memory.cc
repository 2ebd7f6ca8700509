// The CUDA half of the test memory: the CUDA runtime, synchronous copies.
#include "kernels/testing/cuda_memory.h"

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace cuda_memory {

absl::Status AllocateHost(size_t bytes, void** ptr) {
  *ptr = nullptr;
  return CudaStatus(cudaMallocHost(ptr, bytes), absl::StrCat("cudaMallocHost(", bytes, ")"));
}

void FreeHost(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

absl::Status Allocate(size_t bytes, void** ptr) {
  *ptr = nullptr;
  absl::Status s = CudaStatus(cudaMalloc(ptr, bytes), absl::StrCat("cudaMalloc(", bytes, ")"));
  if (!s.ok()) return s;
  s = CudaStatus(cudaMemset(*ptr, 0, bytes), "cudaMemset");
  if (!s.ok()) {
    cudaFree(*ptr);
    *ptr = nullptr;
  }
  return s;
}

void Free(void* ptr) { cudaFree(ptr); }

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

absl::Status CreateStream(Stream* stream) {
  cudaStream_t s = nullptr;
  const absl::Status status = CudaStatus(cudaStreamCreate(&s), "cudaStreamCreate");
  *stream = s;
  return status;
}

void DestroyStream(Stream stream) { cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

absl::Status Synchronize(Stream stream) {
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                  "cudaStreamSynchronize");
}

}  // namespace cuda_memory
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
