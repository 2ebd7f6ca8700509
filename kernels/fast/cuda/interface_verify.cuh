// FAST's Verify through the kernel interface on CUDA: the check kernel
// (every Verify's checks, then FAST's: each row's block has a cursor a
// Commit leaves and room in its ring for the window; no two rows verify
// from one block, their candidates would share its ring's slots), then
// kernels/fast/cuda's Verify gated on its status.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_VERIFY_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_VERIFY_CUH_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/cuda/verify_checks.cuh"
#include "kernels/fast/checks.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/from_interface.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// (cpu/interface_cpu.cc's RunVerify, on one block.)
__global__ void __launch_bounds__(kCheckThreads) FastVerifyCheckKernel(const VerifyArgs a) {
  LetDependentsLaunch();  // the Verify kernel waits for this one's end
  bool passed = VerifyChecks(a);
  if (passed) {
    passed = fast::CheckFastVerify<internal::BlockChecker>(
        a.fast, a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
        [&](int n) { return internal::VerifiedStateIndices(a)[n]; },
        [&](int n) {
          internal::VerifyRow row;
          internal::CheckVerifyRow(a, n, &row);  // passed above: reads the checked snapshot
          return row.tokens;
        });
  }
  if (!passed && a.status_mirror != nullptr && threadIdx.x == 0) *a.status_mirror = *a.status;
}

absl::Status LaunchFastInterfaceVerify(const VerifyArgs& a, cudaStream_t s) {
  FastVerifyCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Verify");
  }
  fast::FastVerifyArgs f = fast::FastVerifyArgsOf(a);
  f.gate = a.status;
  return fast::RunFastVerifyCuda(f, s, fast::ServedCheckpointOperands(a.shape));
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_VERIFY_CUH_
