// Memory a scheduler shares with specstated, on either backend: buffers it
// allocates and registers as regions, and the service's exported pools
// mapped into this process.
//
// CPU backend: POSIX shared memory (shm_open + mmap); CUDA backend:
// cudaMalloc'd buffers exported with cudaIpcGetMemHandle, and the pools
// opened with cudaIpcOpenMemHandle. Copy* move bytes between host memory and
// that memory (a memcpy on the CPU backend).
//
//   auto memory = SharedMemory::Create(v1::CPU).value();
//   auto buffer = memory->Allocate(1 << 20).value();
//   session->RegisterBuffer("acts", *buffer);
#ifndef SPECSTATE_CLIENT_LIB_SHARED_MEMORY_H_
#define SPECSTATE_CLIENT_LIB_SHARED_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace client {

namespace v1 = ::specstate::v1;

// A buffer other processes can map. Freed (and its shm name unlinked) on
// destruction.
class SharedBuffer {
 public:
  virtual ~SharedBuffer() = default;
  virtual void* data() const = 0;
  virtual uint64_t byte_size() const = 0;
  // Fills kind (shm_name / cuda_ipc_handle), device, offset and size.
  virtual void Describe(v1::RegisterRegionRequest* request) const = 0;
};

// The service's pools mapped here (unmapped on destruction).
class MappedPools {
 public:
  virtual ~MappedPools() = default;
  virtual char* base() const = 0;
  // Layer `layer`'s pool of `kind` ("recurrent" or "conv"), block 0.
  absl::StatusOr<char*> Pool(int layer, const std::string& kind) const;
  const v1::ExportPoolsResponse& description() const { return description_; }

 protected:
  v1::ExportPoolsResponse description_;
};

// A CUDA interprocess event of this process (CUDA backend only).
class IpcEvent {
 public:
  virtual ~IpcEvent() = default;
  // The 64-byte cudaIpcEventHandle_t to put in a request's IpcEvent.handle.
  virtual std::string handle() const = 0;
  // Records the event after everything this process has done on the device.
  virtual absl::Status Record() = 0;
  // Waits (on the host) for the service's record of it.
  virtual absl::Status Synchronize() = 0;
};

class SharedMemory {
 public:
  // CPU or CUDA (device 0 unless given). UNAVAILABLE for CUDA in a build or on
  // a machine without it. CUDA: Allocate, MapPools and CreateIpcEvent make
  // `device` the calling thread's current device (and leave it so), so work
  // the thread then launches on the default stream, IpcEvent::Record
  // included, runs there: a thread that drives one device (the simulator's
  // worker of one tensor-parallel rank) needs nothing else.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(v1::Backend backend, int device = 0);
  virtual ~SharedMemory() = default;

  virtual v1::Backend backend() const = 0;
  virtual absl::StatusOr<std::unique_ptr<SharedBuffer>> Allocate(uint64_t bytes) = 0;
  virtual absl::StatusOr<std::unique_ptr<MappedPools>> MapPools(
      const v1::ExportPoolsResponse& pools) = 0;

  // UNIMPLEMENTED on the CPU backend (it orders work with doorbells).
  virtual absl::StatusOr<std::unique_ptr<IpcEvent>> CreateIpcEvent() = 0;

  // host <-> shared memory (device memory on CUDA). Synchronous.
  virtual absl::Status CopyIn(void* dst, const void* host, uint64_t bytes) = 0;
  virtual absl::Status CopyOut(void* host, const void* src, uint64_t bytes) = 0;
};

}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_LIB_SHARED_MEMORY_H_
