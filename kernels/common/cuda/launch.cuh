// How the CUDA kernels of every folder are launched: a call's first kernel
// is a single-block check kernel (kCheckThreads threads); the kernels after
// it are launched as its programmatic dependents (sm_90), start early and
// wait for it (WaitForPrerequisiteGrid) before they read what it wrote or
// write anything. A failed launch becomes "In <op>: CUDA kernel launch: ...".
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_LAUNCH_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda_status.h"

namespace specstate {
namespace kernels {
namespace {

constexpr int kCheckThreads = 1024;

// Programmatic dependent launch (sm_90): a call's kernels after the first
// are launched while the one before runs (LaunchDependent), start early, and
// wait for it (WaitForPrerequisiteGrid: its work done and visible) before
// they read what it wrote or write anything. Kernels launched plainly see
// both as no-ops.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void LetDependentsLaunch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Launches `kernel` as a programmatic dependent of the stream's last kernel.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(KernelArgs...), dim3 blocks, unsigned threads,
                            size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = blocks;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// A failed launch (or an earlier fault it reports), named like the kernels'
// other errors: "In Verify: CUDA kernel launch: <description> (<name>)".
inline absl::Status LaunchStatus(cudaError_t err, absl::string_view op) {
  if (err == cudaSuccess) return absl::OkStatus();
  return CudaStatus(err, absl::StrCat("In ", op, ": CUDA kernel launch"));
}

inline absl::Status Unsupported(absl::string_view op) {
  return absl::InvalidArgumentError(absl::StrCat("In ", op, ": unsupported dtype or head dim"));
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_LAUNCH_CUH_
