// Buffers in a kernel backend's memory, for tests.
//
// The kernels take raw pointers into the backend's memory: host memory for
// Backend::kCpu, device memory for Backend::kCuda. A BackendBuffer owns such
// a buffer, zero-initialized (the kernels' workspaces must start zeroed), and
// copies bytes in and out of it. Finish() waits for a stream and returns the
// DeviceStatus a call wrote.
//
//   absl::StatusOr<BackendBuffer> status = BackendBuffer::Allocate(backend, sizeof(DeviceStatus));
//   ... args.status = status->As<DeviceStatus>();
//   absl::Status s = kernels.Verify(args, stream.get());
//   absl::StatusOr<DeviceStatus> device = Finish(backend, stream.get(), args.status);
//   if (s.ok() && device.ok()) s = DeviceStatusToStatus(*device, "Verify");
//
// A build without CUDA answers UNAVAILABLE to every request for CUDA memory.
#ifndef SPECSTATE_KERNELS_TESTING_BACKEND_MEMORY_H_
#define SPECSTATE_KERNELS_TESTING_BACKEND_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device_status.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {
namespace testing {

// A zero-initialized buffer in one backend's memory, aligned to 256 bytes.
// Movable, not copyable; frees its memory when destroyed.
class BackendBuffer {
 public:
  // RESOURCE_EXHAUSTED when the memory is not there; UNAVAILABLE for
  // Backend::kCuda in a build without CUDA or on a machine without a device.
  static absl::StatusOr<BackendBuffer> Allocate(Backend backend, size_t bytes);

  BackendBuffer() = default;
  BackendBuffer(BackendBuffer&& other) noexcept;
  BackendBuffer& operator=(BackendBuffer&& other) noexcept;
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  ~BackendBuffer();

  Backend backend() const { return backend_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data_);
  }

  // Copies `bytes` bytes from host memory at `src` to this buffer at
  // `offset`. Synchronous. OUT_OF_RANGE when the range leaves the buffer.
  absl::Status Upload(const void* src, size_t bytes, size_t offset = 0);
  absl::Status Upload(const std::vector<uint8_t>& bytes, size_t offset = 0) {
    return Upload(bytes.data(), bytes.size(), offset);
  }

  // Copies `bytes` bytes at `offset` to host memory at `dst`. Synchronous.
  absl::Status Download(void* dst, size_t bytes, size_t offset = 0) const;

  // The whole buffer, in host memory.
  absl::StatusOr<std::vector<uint8_t>> ToHost() const;

 private:
  BackendBuffer(Backend backend, void* data, size_t size)
      : backend_(backend), data_(data), size_(size) {}
  void Release();

  Backend backend_ = Backend::kCpu;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A stream to enqueue calls on: null for the CPU backend (which runs on the
// calling thread), a new cudaStream_t for CUDA, destroyed with the object.
class BackendStream {
 public:
  static absl::StatusOr<BackendStream> Create(Backend backend);

  BackendStream() = default;
  BackendStream(BackendStream&& other) noexcept;
  BackendStream& operator=(BackendStream&& other) noexcept;
  BackendStream(const BackendStream&) = delete;
  BackendStream& operator=(const BackendStream&) = delete;
  ~BackendStream();

  Backend backend() const { return backend_; }
  Stream get() const { return stream_; }

 private:
  BackendStream(Backend backend, Stream stream) : backend_(backend), stream_(stream) {}
  void Release();

  Backend backend_ = Backend::kCpu;
  Stream stream_ = nullptr;
};

// Host memory the backend's kernels can write: a DeviceStatus mirror
// (VerifyArgs::status_mirror and the like). Pinned for CUDA.
class StatusMirror {
 public:
  static absl::StatusOr<StatusMirror> Allocate(Backend backend);

  StatusMirror() = default;
  StatusMirror(StatusMirror&& other) noexcept;
  StatusMirror& operator=(StatusMirror&& other) noexcept;
  StatusMirror(const StatusMirror&) = delete;
  StatusMirror& operator=(const StatusMirror&) = delete;
  ~StatusMirror();

  DeviceStatus* get() const { return status_; }

 private:
  StatusMirror(Backend backend, DeviceStatus* status) : backend_(backend), status_(status) {}
  void Release();

  Backend backend_ = Backend::kCpu;
  DeviceStatus* status_ = nullptr;
};

// Waits until `stream` has run everything enqueued on it, then returns the
// DeviceStatus at `status` (in the backend's memory). INTERNAL when the
// stream reports an error (a kernel that faulted, say).
absl::StatusOr<DeviceStatus> Finish(Backend backend, Stream stream, const DeviceStatus* status);

}  // namespace testing
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_TESTING_BACKEND_MEMORY_H_
