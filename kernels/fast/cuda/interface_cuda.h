// Commit mode FAST through the kernel interface on the CUDA backend
// (interface_cuda.cu): Verify, Commit and Flush, each its check kernel
// first, then kernels/fast/cuda's kernels gated on its status, on the
// caller's stream, never synchronizing. The arguments must have passed the
// host checks (interface_checks.h, through kda_kernels.h's Validate*).
//
//   absl::Status s = fast::InterfaceVerifyCuda(args, stream);  // device pointers
#ifndef SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_CUDA_H_
#define SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_CUDA_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

absl::Status InterfaceVerifyCuda(const VerifyArgs& args, cudaStream_t stream);
absl::Status InterfaceCommitCuda(const CommitArgs& args, cudaStream_t stream);
absl::Status InterfaceFlushCuda(const FlushArgs& args, cudaStream_t stream);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_CUDA_H_
