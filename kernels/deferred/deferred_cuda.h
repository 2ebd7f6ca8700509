// Commit mode DEFERRED on the CUDA backend (deferred_cuda.cu): Verify,
// Commit and Flush, each its check kernel first and its work after, on the
// caller's stream, never synchronizing; a rejected call writes nothing (its
// status says why). Each keeps the journals the table keeps (the pending
// journal closed after a Verify or Flush; the commit journal's finish after
// a Commit). The arguments must have passed the host checks
// (deferred_checks.h, through kda_kernels.h's Validate*).
//
//   absl::Status s = deferred::VerifyCuda(args, stream);  // device pointers
#ifndef SPECSTATE_KERNELS_DEFERRED_DEFERRED_CUDA_H_
#define SPECSTATE_KERNELS_DEFERRED_DEFERRED_CUDA_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace deferred {

absl::Status VerifyCuda(const VerifyArgs& args, cudaStream_t stream);
absl::Status CommitCuda(const CommitArgs& args, cudaStream_t stream);
absl::Status FlushCuda(const FlushArgs& args, cudaStream_t stream);

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_DEFERRED_CUDA_H_
