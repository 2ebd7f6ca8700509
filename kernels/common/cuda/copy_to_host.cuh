// The copy of device memory to pinned host memory with a kernel
// (kda_kernels.h, CopyToHostOnStream: a copy-engine operation right ahead of
// a stream wait delayed the wait's release).
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_COPY_TO_HOST_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_COPY_TO_HOST_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/cuda/launch.cuh"

namespace specstate {
namespace kernels {
namespace {

// Grid-stride: a readback is a few kilobytes on the hot path (a step's
// indices, a commit's plan), megabytes only for ReadState. Whole words when
// both ends are aligned.
__global__ void __launch_bounds__(256)
    CopyToHostKernel(char* dst, const char* src, uint64_t bytes) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t first = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 4 == 0) {
    for (uint64_t i = first; i < bytes / 4; i += stride) {
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
  } else {
    for (uint64_t i = first; i < bytes; i += stride) dst[i] = src[i];
  }
}

absl::Status LaunchCopyToHost(void* host, const void* device, uint64_t bytes, cudaStream_t s) {
  if (bytes == 0) return absl::OkStatus();
  if (host == nullptr || device == nullptr) {
    return absl::InvalidArgumentError("CopyToHostOnStream: a null pointer");
  }
  const uint64_t blocks = std::min<uint64_t>((bytes / 4 + 255) / 256, 256);
  CopyToHostKernel<<<static_cast<unsigned>(std::max<uint64_t>(blocks, 1)), 256, 0, s>>>(
      static_cast<char*>(host), static_cast<const char*>(device), bytes);
  return LaunchStatus(cudaGetLastError(), "CopyToHostOnStream");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_COPY_TO_HOST_CUH_
