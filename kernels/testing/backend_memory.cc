#include "kernels/testing/backend_memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/testing/cuda_memory.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

constexpr size_t kAlignment = 256;

absl::Status CheckRange(size_t offset, size_t bytes, size_t size) {
  if (offset > size || bytes > size - offset) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + bytes,
                                              ") leave the buffer of ", size, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BackendBuffer> BackendBuffer::Allocate(Backend backend, size_t bytes) {
  // Zero-byte buffers still get a distinct, valid address.
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  const size_t alloc = rounded == 0 ? kAlignment : rounded;
  void* data = nullptr;
  if (backend == Backend::kCpu) {
    data = std::aligned_alloc(kAlignment, alloc);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    std::memset(data, 0, alloc);
  } else {
    absl::Status s = cuda_memory::Allocate(alloc, &data);
    if (!s.ok()) return s;
  }
  return BackendBuffer(backend, data, bytes);
}

BackendBuffer::BackendBuffer(BackendBuffer&& other) noexcept
    : backend_(other.backend_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

BackendBuffer& BackendBuffer::operator=(BackendBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    backend_ = other.backend_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

BackendBuffer::~BackendBuffer() { Release(); }

void BackendBuffer::Release() {
  if (data_ == nullptr) return;
  if (backend_ == Backend::kCpu) {
    std::free(data_);
  } else {
    cuda_memory::Free(data_);
  }
  data_ = nullptr;
  size_ = 0;
}

absl::Status BackendBuffer::Upload(const void* src, size_t bytes, size_t offset) {
  absl::Status s = CheckRange(offset, bytes, size_);
  if (!s.ok() || bytes == 0) return s;
  char* dst = static_cast<char*>(data_) + offset;
  if (backend_ == Backend::kCpu) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return cuda_memory::CopyToDevice(dst, src, bytes);
}

absl::Status BackendBuffer::Download(void* dst, size_t bytes, size_t offset) const {
  absl::Status s = CheckRange(offset, bytes, size_);
  if (!s.ok() || bytes == 0) return s;
  const char* src = static_cast<const char*>(data_) + offset;
  if (backend_ == Backend::kCpu) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return cuda_memory::CopyToHost(dst, src, bytes);
}

absl::StatusOr<std::vector<uint8_t>> BackendBuffer::ToHost() const {
  std::vector<uint8_t> bytes(size_);
  absl::Status s = Download(bytes.data(), bytes.size());
  if (!s.ok()) return s;
  return bytes;
}

absl::StatusOr<BackendStream> BackendStream::Create(Backend backend) {
  if (backend == Backend::kCpu) return BackendStream(backend, nullptr);
  Stream stream = nullptr;
  absl::Status s = cuda_memory::CreateStream(&stream);
  if (!s.ok()) return s;
  return BackendStream(backend, stream);
}

BackendStream::BackendStream(BackendStream&& other) noexcept
    : backend_(other.backend_), stream_(std::exchange(other.stream_, nullptr)) {}

BackendStream& BackendStream::operator=(BackendStream&& other) noexcept {
  if (this != &other) {
    Release();
    backend_ = other.backend_;
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

BackendStream::~BackendStream() { Release(); }

void BackendStream::Release() {
  if (backend_ == Backend::kCuda && stream_ != nullptr) cuda_memory::DestroyStream(stream_);
  stream_ = nullptr;
}

absl::StatusOr<StatusMirror> StatusMirror::Allocate(Backend backend) {
  if (backend == Backend::kCpu) return StatusMirror(backend, new DeviceStatus());
  void* p = nullptr;
  absl::Status s = cuda_memory::AllocateHost(sizeof(DeviceStatus), &p);
  if (!s.ok()) return s;
  return StatusMirror(backend, static_cast<DeviceStatus*>(p));
}

StatusMirror::StatusMirror(StatusMirror&& other) noexcept
    : backend_(other.backend_), status_(other.status_) {
  other.status_ = nullptr;
}

StatusMirror& StatusMirror::operator=(StatusMirror&& other) noexcept {
  if (this != &other) {
    Release();
    backend_ = other.backend_;
    status_ = other.status_;
    other.status_ = nullptr;
  }
  return *this;
}

StatusMirror::~StatusMirror() { Release(); }

void StatusMirror::Release() {
  if (status_ == nullptr) return;
  if (backend_ == Backend::kCpu) {
    delete status_;
  } else {
    cuda_memory::FreeHost(status_);
  }
  status_ = nullptr;
}

absl::StatusOr<DeviceStatus> Finish(Backend backend, Stream stream, const DeviceStatus* status) {
  DeviceStatus result;
  std::memset(&result, 0, sizeof(result));
  if (status == nullptr) return absl::InvalidArgumentError("Finish: status is null");
  if (backend == Backend::kCpu) {
    std::memcpy(&result, status, sizeof(result));
    return result;
  }
  absl::Status s = cuda_memory::Synchronize(stream);
  if (s.ok()) s = cuda_memory::CopyToHost(&result, status, sizeof(result));
  if (!s.ok()) return s;
  return result;
}

}  // namespace testing
}  // namespace kernels
}  // namespace specstate
