#include "client/lib/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace client {

absl::StatusOr<char*> MappedPools::Pool(int layer, const std::string& kind) const {
  for (const v1::PoolView& p : description_.pools()) {
    if (p.layer() == layer && p.kind() == kind) return base() + p.offset_bytes();
  }
  return absl::NotFoundError(absl::StrCat("the service exports no ", kind, " pool for layer ", layer));
}

namespace {

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

class ShmBuffer final : public SharedBuffer {
 public:
  ShmBuffer(std::string name, void* data, uint64_t bytes)
      : name_(std::move(name)), data_(data), bytes_(bytes) {}
  ~ShmBuffer() override {
    munmap(data_, bytes_);
    shm_unlink(name_.c_str());
  }
  void* data() const override { return data_; }
  uint64_t byte_size() const override { return bytes_; }
  void Describe(v1::RegisterRegionRequest* r) const override {
    r->set_shm_name(name_);
    r->set_offset_bytes(0);
    r->set_byte_size(bytes_);
  }

 private:
  std::string name_;
  void* data_;
  uint64_t bytes_;
};

class ShmPools final : public MappedPools {
 public:
  ShmPools(const v1::ExportPoolsResponse& d, void* base, uint64_t bytes) : base_(base), bytes_(bytes) {
    description_ = d;
  }
  ~ShmPools() override { munmap(base_, bytes_); }
  char* base() const override { return static_cast<char*>(base_); }

 private:
  void* base_;
  uint64_t bytes_;
};

class HostSharedMemory final : public SharedMemory {
 public:
  v1::Backend backend() const override { return v1::CPU; }

  absl::StatusOr<std::unique_ptr<SharedBuffer>> Allocate(uint64_t bytes) override {
    // pid, then a per-process random tag (pids repeat across containers and
    // sandboxes sharing /dev/shm), then a counter.
    static const uint32_t tag = std::random_device()();
    static std::atomic<uint64_t> counter{0};
    const std::string name =
        absl::StrCat("/specstate-client-", getpid(), "-", absl::Hex(tag), "-", counter++);
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return Errno(absl::StrCat("shm_open(", name, ")"));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const absl::Status st = Errno("ftruncate");
      close(fd);
      shm_unlink(name.c_str());
      return st;
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      shm_unlink(name.c_str());
      return Errno("mmap");
    }
    return std::unique_ptr<SharedBuffer>(new ShmBuffer(name, p, bytes));
  }

  absl::StatusOr<std::unique_ptr<MappedPools>> MapPools(const v1::ExportPoolsResponse& d) override {
    if (d.shm_path().empty()) {
      return absl::FailedPreconditionError(
          "the service exports its pools by CUDA IPC handle: this client uses the CPU backend");
    }
    const int fd = open(d.shm_path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return Errno(absl::StrCat("open(", d.shm_path(), ") of the service's pools"));
    void* p = mmap(nullptr, d.allocation_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return Errno(absl::StrCat("mmap(", d.shm_path(), ")"));
    return std::unique_ptr<MappedPools>(new ShmPools(d, p, d.allocation_bytes()));
  }

  absl::StatusOr<std::unique_ptr<IpcEvent>> CreateIpcEvent() override {
    return absl::UnimplementedError(
        "interprocess events need the CUDA backend; the CPU backend orders work with doorbells");
  }

  absl::Status CopyIn(void* dst, const void* host, uint64_t bytes) override {
    std::memcpy(dst, host, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOut(void* host, const void* src, uint64_t bytes) override {
    std::memcpy(host, src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemory>> CreateCudaSharedMemory(int device);

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(v1::Backend backend,
                                                                   int device) {
  if (backend == v1::CPU) return std::unique_ptr<SharedMemory>(new HostSharedMemory());
  if (backend == v1::CUDA) return CreateCudaSharedMemory(device);
  return absl::InvalidArgumentError(
      absl::StrCat("no shared memory for backend ", v1::Backend_Name(backend)));
}

}  // namespace client
}  // namespace specstate
