// Linked instead of cuda_device.cc when this build has no CUDA toolkit.
#include "server/device/device.h"

namespace specstate {
namespace server {

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int, absl::Duration) {
  return absl::UnavailableError("this build of specstated has no CUDA backend");
}

}  // namespace server
}  // namespace specstate
