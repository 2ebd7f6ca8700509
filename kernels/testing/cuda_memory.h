// The CUDA half of backend_memory.cc: cuda_memory.cc where the build has
// CUDA, no_cuda_memory.cc (every function UNAVAILABLE) where it has not.
#ifndef SPECSTATE_KERNELS_TESTING_CUDA_MEMORY_H_
#define SPECSTATE_KERNELS_TESTING_CUDA_MEMORY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace cuda_memory {

// cudaMalloc + cudaMemset(0).
absl::Status Allocate(size_t bytes, void** ptr);
void Free(void* ptr);
// cudaMallocHost: pinned host memory the device can write (unified addressing).
absl::Status AllocateHost(size_t bytes, void** ptr);
void FreeHost(void* ptr);
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
absl::Status CreateStream(Stream* stream);
void DestroyStream(Stream stream);
absl::Status Synchronize(Stream stream);

}  // namespace cuda_memory
}  // namespace testing
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_TESTING_CUDA_MEMORY_H_
