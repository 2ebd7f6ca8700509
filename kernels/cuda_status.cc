#include "kernels/cuda_status.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace kernels {

// The table. A code tells the caller what it can do, so errors are grouped
// by who can fix them:
//
// RESOURCE_EXHAUSTED: out of device (or pinned host) memory, or of a
//   bounded driver resource. The request may succeed with less, or later.
// INVALID_ARGUMENT: the runtime refused a value, pointer, handle or device
//   ordinal it was given. Where the service cannot check them itself, those
//   come from the caller: a scheduler's IPC memory or event handle, a
//   region's device, a request whose sizes no kernel launch can take (the
//   CUDA launchers return cudaErrorInvalidValue for a grid or token window
//   past what they support). The rest is checked on the host first.
// UNAVAILABLE: no usable device or driver (none installed, too old, a stub,
//   all busy). As everywhere in the project that finds no GPU (and as the
//   CPU fallback of `--backend=auto` expects): the machine, not the request.
// INTERNAL: the rest. A launch the kernels configured wrongly, a driver
//   failure, and the sticky errors: those the runtime documents as leaving
//   "the process in an inconsistent state" (a kernel's illegal address or
//   instruction, a launch failure or timeout, a device-side assert,
//   uncorrectable ECC or NVLink errors, a contained error), after which
//   every CUDA call fails until the process restarts. Nothing the caller
//   sent explains them. Which failure is sticky the service learns from the
//   runtime itself (its reaper in server/device/cuda_device.cc), not from a list.
absl::StatusCode CudaStatusCode(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return absl::StatusCode::kOk;

    case cudaErrorMemoryAllocation:
    case cudaErrorTooManyPeers:
    case cudaErrorMpsMaxClientsReached:
    case cudaErrorMpsMaxConnectionsReached:
      return absl::StatusCode::kResourceExhausted;

    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice:
    // cudaIpcOpenMemHandle of a handle that names no mappable allocation.
    case cudaErrorMapBufferObjectFailed:
      return absl::StatusCode::kInvalidArgument;

    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorSystemNotReady:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
      return absl::StatusCode::kUnavailable;

    default:
      return absl::StatusCode::kInternal;
  }
}

std::string DescribeCudaError(cudaError_t error) {
  // Both work without a driver or a device (tables in the runtime).
  const char* name = cudaGetErrorName(error);
  const char* description = cudaGetErrorString(error);
  if (name == nullptr || std::strncmp(name, "cuda", 4) != 0) {  // "unrecognized error code"
    return absl::StrCat(description != nullptr ? description : "unrecognized error code",
                        " (cudaError ", static_cast<int>(error), ")");
  }
  return absl::StrCat(description, " (", name, ")");
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(CudaStatusCode(error), absl::StrCat(what, ": ", DescribeCudaError(error)));
}

}  // namespace kernels
}  // namespace specstate
