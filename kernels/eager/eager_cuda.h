// Commit mode EAGER on the CUDA backend (eager_cuda.cu): Verify and Commit,
// each its check kernel first and its work after, on the caller's stream,
// never synchronizing; a rejected call writes nothing (its status says
// why). The arguments must have passed the host checks (eager_checks.h,
// through kda_kernels.h's Validate*).
//
//   absl::Status s = eager::VerifyCuda(args, stream);  // device pointers
#ifndef SPECSTATE_KERNELS_EAGER_EAGER_CUDA_H_
#define SPECSTATE_KERNELS_EAGER_EAGER_CUDA_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace eager {

absl::Status VerifyCuda(const VerifyArgs& args, cudaStream_t stream);
// Then, with args.journal.record set, the commit journal's finish.
absl::Status CommitCuda(const CommitArgs& args, cudaStream_t stream);

}  // namespace eager
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_EAGER_EAGER_CUDA_H_
