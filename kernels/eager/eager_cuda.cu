// Commit mode EAGER on the CUDA backend (eager_cuda.h): the recurrent
// kernel's kVerify instantiation and EAGER's check and plan kernels.
#include "kernels/eager/commit.cuh"
#include "kernels/eager/eager_cuda.h"
#include "kernels/eager/verify.cuh"

namespace specstate {
namespace kernels {
namespace eager {

absl::Status VerifyCuda(const VerifyArgs& a, cudaStream_t s) { return LaunchEagerVerify(a, s); }

absl::Status CommitCuda(const CommitArgs& a, cudaStream_t s) { return LaunchEagerCommit(a, s); }

}  // namespace eager
}  // namespace kernels
}  // namespace specstate
