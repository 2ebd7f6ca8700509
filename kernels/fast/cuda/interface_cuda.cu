// Commit mode FAST through the kernel interface on the CUDA backend
// (interface_cuda.h): FAST's check and plan kernels.
#include "kernels/fast/cuda/interface_commit.cuh"
#include "kernels/fast/cuda/interface_cuda.h"
#include "kernels/fast/cuda/interface_flush.cuh"
#include "kernels/fast/cuda/interface_verify.cuh"

namespace specstate {
namespace kernels {
namespace fast {

absl::Status InterfaceVerifyCuda(const VerifyArgs& a, cudaStream_t s) {
  return LaunchFastInterfaceVerify(a, s);
}

absl::Status InterfaceCommitCuda(const CommitArgs& a, cudaStream_t s) {
  return LaunchFastInterfaceCommit(a, s);
}

absl::Status InterfaceFlushCuda(const FlushArgs& a, cudaStream_t s) {
  return LaunchFastInterfaceFlush(a, s);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
