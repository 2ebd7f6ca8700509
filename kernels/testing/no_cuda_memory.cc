// The CUDA half of the test memory in a build without CUDA.
#include "absl/status/status.h"
#include "kernels/testing/cuda_memory.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace cuda_memory {
namespace {

absl::Status NoCuda() {
  return absl::UnavailableError("this build has no CUDA: CUDA memory is unavailable");
}

}  // namespace

absl::Status Allocate(size_t, void**) { return NoCuda(); }
void Free(void*) {}
absl::Status AllocateHost(size_t, void**) { return NoCuda(); }
void FreeHost(void*) {}
absl::Status CopyToDevice(void*, const void*, size_t) { return NoCuda(); }
absl::Status CopyToHost(void*, const void*, size_t) { return NoCuda(); }
absl::Status CreateStream(Stream*) { return NoCuda(); }
void DestroyStream(Stream) {}
absl::Status Synchronize(Stream) { return NoCuda(); }

}  // namespace cuda_memory
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
