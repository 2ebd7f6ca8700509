// Host buffers of one size (Device::AllocateHost: pinned on CUDA, so the
// device's copies into them stay asynchronous), reused across calls: a call
// that reads back from the device takes one and gives it back once its work
// is done. Buffers are kept, never freed (the device owns its host
// allocations until it goes), so a pool holds at most as many as were ever
// in use at once.
//
//   HostBufferPool pool(device, bytes);
//   absl::StatusOr<char*> buffer = pool.Take();   // the device's error, if any
//   ...                                           // work that reads back into it
//   pool.GiveBack(*buffer);                       // in the work's done callback
#ifndef SPECSTATE_SERVER_DEVICE_HOST_BUFFER_POOL_H_
#define SPECSTATE_SERVER_DEVICE_HOST_BUFFER_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/device.h"

namespace specstate {
namespace server {

class HostBufferPool {
 public:
  HostBufferPool(Device& device, uint64_t bytes) : device_(device), bytes_(bytes) {}
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  uint64_t bytes() const { return bytes_; }

  // A free buffer of bytes() bytes, or a new one.
  absl::StatusOr<char*> Take() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        char* buffer = free_.back();
        free_.pop_back();
        return buffer;
      }
    }
    absl::StatusOr<void*> p = device_.AllocateHost(bytes_);
    if (!p.ok()) return p.status();
    return static_cast<char*>(*p);
  }

  // `buffer` (from Take) is free again.
  void GiveBack(char* buffer) {
    absl::MutexLock lock(&mu_);
    free_.push_back(buffer);
  }

 private:
  Device& device_;
  const uint64_t bytes_;
  absl::Mutex mu_;
  std::vector<char*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_DEVICE_HOST_BUFFER_POOL_H_
