// EAGER's Verify on CUDA: the check kernel (every Verify's checks), then the
// recurrent kernel's kVerify items: each row's outputs from its checkpoint
// and its window's records, no state written.
#ifndef SPECSTATE_KERNELS_EAGER_VERIFY_CUH_
#define SPECSTATE_KERNELS_EAGER_VERIFY_CUH_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/cuda/pipelined_recurrent.cuh"
#include "kernels/common/cuda/recurrent_launch.cuh"
#include "kernels/common/cuda/verify_checks.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

__global__ void __launch_bounds__(kCheckThreads) EagerVerifyCheckKernel(const VerifyArgs a) {
  LetDependentsLaunch();
  // The block knows whether it failed: no reload of its status to decide.
  const bool passed = VerifyChecks(a);
  if (!passed && a.status_mirror != nullptr && threadIdx.x == 0) *a.status_mirror = *a.status;
}

absl::Status LaunchEagerVerify(const VerifyArgs& a, cudaStream_t s) {
  EagerVerifyCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Verify");
  }
  return LaunchRecurrent<Mode::kVerify>(a.shape, VerifyLaunchOf(a), 1, s, "Verify");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_EAGER_VERIFY_CUH_
