// Linked instead of cuda_shared_memory.cc in builds without CUDA.
#include "client/lib/shared_memory.h"

namespace specstate {
namespace client {

absl::StatusOr<std::unique_ptr<SharedMemory>> CreateCudaSharedMemory(int) {
  return absl::UnavailableError("this client was built without CUDA");
}

}  // namespace client
}  // namespace specstate
