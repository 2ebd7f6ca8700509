// Linked instead of the CUDA backend when this build has no CUDA toolkit.
#include "absl/status/status.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {

absl::StatusOr<const KdaKernels*> CudaKdaKernels() {
  return absl::UnavailableError(
      "this build of SpecState has no CUDA backend (built without a CUDA toolkit; see "
      "docs/building.md)");
}

bool BuiltWithCuda() { return false; }

absl::Status CopyToHostOnStream(void*, const void*, uint64_t, Stream) {
  return absl::UnavailableError("this build of SpecState has no CUDA backend");
}

}  // namespace kernels
}  // namespace specstate
