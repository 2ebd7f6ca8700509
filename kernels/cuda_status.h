// CUDA runtime errors as absl::Status: one table of codes for the service,
// the client, the kernels, their tests and the benchmarks.
//
// The message names the call, then the runtime's description and the
// error's name; the code says what the caller can do about it (the table in
// cuda_status.cc says why each group gets its code):
//
//   absl::Status s = CudaStatus(cudaMemcpyAsync(...), "cudaMemcpyAsync");
//   // INTERNAL: "cudaMemcpyAsync: an illegal memory access was encountered
//   //            (cudaErrorIllegalAddress)"
//
// Only where the build has CUDA (the target exists when CUDA_ENABLED); the
// header compiles with nvcc (kernels/cuda/*.cu) and with the host compiler.
#ifndef SPECSTATE_KERNELS_CUDA_STATUS_H_
#define SPECSTATE_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace specstate {
namespace kernels {

// OK for cudaSuccess; otherwise CudaStatusCode(error) with the message
// "<what>: <description> (<cudaErrorName>)". `what` names the call.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// The code CudaStatus gives `error` (kOk for cudaSuccess).
absl::StatusCode CudaStatusCode(cudaError_t error);

// "<description> (<cudaErrorName>)", e.g. "out of memory
// (cudaErrorMemoryAllocation)"; for codes this runtime does not know, their
// number: "unrecognized error code (cudaError 12345)".
std::string DescribeCudaError(cudaError_t error);

}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CUDA_STATUS_H_
