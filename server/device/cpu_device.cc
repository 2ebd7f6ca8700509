// The CPU device: host memory, shared memory for everything shared with
// clients, and one worker thread that runs submitted work in order, the way
// a CUDA stream would. Doorbells are 32-bit counters in shared memory: the
// worker polls a wait's counter and writes a signal's.
//
// Clients cannot kill it by truncating shared memory: the pools are a
// sealed memfd (F_SEAL_SHRINK: nobody can shrink it; clients open it as
// /proc/<pid>/fd/<n>), and client regions are watched by the
// TruncationGuard (a truncated region reads as zeros and fails its calls).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/device/device.h"
#include "server/device/truncation_guard.h"

namespace specstate {
namespace server {
namespace {

absl::Status ErrnoError(absl::string_view what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  if (err == ENOMEM || err == ENOSPC) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

// A mapping of a whole shared-memory object; the region starts `offset` in.
class ShmRegion final : public MappedRegion {
 public:
  ShmRegion(void* base, uint64_t mapped, uint64_t offset, uint64_t size, MemoryObject object,
            int watch)
      : base_(base), mapped_(mapped), offset_(offset), size_(size), object_(object),
        watch_(watch) {}
  ~ShmRegion() override {
    TruncationGuard::Unwatch(watch_);
    munmap(base_, mapped_);
  }
  bool faulted() const override { return TruncationGuard::Faulted(watch_); }
  void* data() const override { return static_cast<char*>(base_) + offset_; }
  uint64_t byte_size() const override { return size_; }
  absl::string_view kind() const override { return "shm"; }
  MemoryObject object() const override { return object_; }
  uint64_t object_offset() const override { return offset_; }

 private:
  void* base_;
  uint64_t mapped_;
  uint64_t offset_;
  uint64_t size_;
  MemoryObject object_;
  int watch_;
};

MemoryObject ObjectOf(const struct stat& st) {
  return MemoryObject{MemoryObject::kShm, static_cast<uint64_t>(st.st_dev),
                      static_cast<uint64_t>(st.st_ino)};
}

class HostScratch final : public Scratch {
 public:
  absl::StatusOr<void*> Upload(const void* host, uint64_t bytes) override {
    buffers_.emplace_back(static_cast<const char*>(host), static_cast<const char*>(host) + bytes);
    return static_cast<void*>(buffers_.back().data());
  }

 private:
  std::deque<std::string> buffers_;
};

uint32_t LoadAcquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void StoreRelease(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class CpuDevice final : public Device {
 public:
  CpuDevice() : worker_([this] { Run(); }) {}

  ~CpuDevice() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    for (const KeptMemory& k : kept_) {
      munmap(k.data, k.bytes);
      close(k.fd);
    }
    for (void* p : allocations_) std::free(p);
  }

  kernels::Backend kind() const override { return kernels::Backend::kCpu; }
  int ordinal() const override { return 0; }
  const kernels::KdaKernels& kernels() const override { return kernels::CpuKdaKernels(); }

  absl::StatusOr<uint64_t> FreeBytes() const override {
    // MemAvailable, and /dev/shm's free space for the exported pools.
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    uint64_t kb = 0;
    std::string unit;
    uint64_t available = 0;
    while (meminfo >> key >> kb >> unit) {
      if (key == "MemAvailable:") available = kb * 1024;
    }
    if (available == 0) return absl::InternalError("cannot read MemAvailable from /proc/meminfo");
    // Kept pools not yet handed to the engine are already here: the engine
    // counts them among what it needs.
    return available + (kept_pools_ && !exported_taken_ ? exported_bytes_ : 0);
  }

  // A sealed memfd: its size is fixed for everyone (F_SEAL_SHRINK and
  // F_SEAL_GROW), so no client that maps it can make the service's accesses
  // fault. Clients open it by path, /proc/<pid>/fd/<n>.
  absl::StatusOr<void*> AllocateExported(uint64_t bytes) override {
    if (kept_pools_) {
      if (exported_taken_) return absl::FailedPreconditionError("the pools are allocated once");
      if (bytes > exported_bytes_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the kept pools hold ", exported_bytes_, " bytes, the layout needs ", bytes));
      }
      exported_taken_ = true;
      return exported_;
    }
    absl::StatusOr<KeptMemory> kept = AllocateKept(bytes, /*pools=*/true);
    if (!kept.ok()) return kept.status();
    kept_pools_ = false;  // an ordinary allocation: nobody else holds it
    exported_taken_ = true;
    return kept->data;
  }

  absl::StatusOr<KeptMemory> AllocateKept(uint64_t bytes, bool pools) override {
    if (pools && exported_ != nullptr) {
      return absl::FailedPreconditionError("the pools are allocated once");
    }
    const int fd = memfd_create(pools ? "specstate-pools" : "specstate-header",
                                MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return ErrnoError("memfd_create for the pools", errno);
    // posix_fallocate reserves the pages now, so too little memory for the
    // layout fails here, not with SIGBUS later.
    int err = ftruncate(fd, static_cast<off_t>(bytes)) == 0
                  ? posix_fallocate(fd, 0, static_cast<off_t>(bytes))
                  : errno;
    if (err == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      err = errno;
    }
    if (err != 0) {
      close(fd);
      return ErrnoError(absl::StrCat("reserving ", bytes, " bytes of shared memory for the pools"),
                        err);
    }
    return MapKept(fd, bytes, pools);
  }

  absl::StatusOr<KeptMemory> AttachKept(int fd, uint64_t bytes, bool pools) override {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoError("fstat of kept memory", err);
    }
    // Only a sealed memfd of at least the size: nobody can resize it under
    // the service (an unsealed file could be truncated: SIGBUS).
    const int seals = fcntl(fd, F_GET_SEALS);
    const int needed = F_SEAL_SHRINK | F_SEAL_GROW;
    if (seals < 0 || (seals & needed) != needed) {
      close(fd);
      return absl::FailedPreconditionError(
          "the kept memory is not a sealed memfd (F_SEAL_SHRINK | F_SEAL_GROW): not the CPU "
          "backend's pools");
    }
    if (static_cast<uint64_t>(st.st_size) < bytes) {
      close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          "the kept memory has ", st.st_size, " bytes, ", bytes, " are needed"));
    }
    if (pools && exported_ != nullptr) {
      close(fd);
      return absl::FailedPreconditionError("the pools are allocated once");
    }
    return MapKept(fd, static_cast<uint64_t>(st.st_size), pools);
  }

  std::string ExportName() const override { return export_path_; }
  std::string ExportHandle() const override { return ""; }
  MemoryObject ExportedObject() const override { return exported_object_; }

  absl::StatusOr<void*> AllocateDevice(uint64_t bytes) override { return AllocateHost(bytes); }

  absl::StatusOr<void*> AllocateHost(uint64_t bytes) override {
    void* p = std::calloc(1, bytes == 0 ? 1 : bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    allocations_.push_back(p);
    return p;
  }

  absl::Status CopyToDevice(void* device, const void* host, uint64_t bytes) override {
    return SubmitAndWait([&](kernels::Stream) {
      std::memcpy(device, host, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status CopyFromDevice(void* host, const void* device, uint64_t bytes) override {
    return SubmitAndWait([&](kernels::Stream) {
      std::memcpy(host, device, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status CopyOnStream(void* dst, const void* src, uint64_t bytes, kernels::Stream) override {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status ZeroOnStream(void* dst, uint64_t bytes, kernels::Stream) override {
    std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(absl::string_view shm_name,
                                                       uint64_t offset_bytes,
                                                       uint64_t byte_size) override {
    const std::string name(shm_name);
    if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos ||
        name.size() > 255) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm_name \"", name, "\" must be a POSIX shared-memory name: \"/\" then up to 254 "
          "characters without \"/\""));
    }
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) return ErrnoError(absl::StrCat("shm_open(", name, ")"), errno);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoError(absl::StrCat("fstat(", name, ")"), err);
    }
    const uint64_t real = static_cast<uint64_t>(st.st_size);
    if (offset_bytes > real || byte_size > real - offset_bytes) {
      close(fd);
      return absl::OutOfRangeError(absl::StrCat("region of ", byte_size, " bytes at offset ",
                                                offset_bytes, " does not fit in ", name, " (",
                                                real, " bytes)"));
    }
    if (ObjectOf(st) == exported_object_) {
      close(fd);
      return absl::InvalidArgumentError(
          "it is the service's own pools: map them from ExportPools, never register them");
    }
    void* p = mmap(nullptr, real, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return ErrnoError(absl::StrCat("mmap(", name, ")"), errno);
    absl::StatusOr<int> watch = TruncationGuard::Watch(p, real);
    if (!watch.ok()) {
      munmap(p, real);
      return watch.status();
    }
    return std::unique_ptr<MappedRegion>(
        new ShmRegion(p, real, offset_bytes, byte_size, ObjectOf(st), *watch));
  }

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapCudaIpc(absl::string_view, int, uint64_t,
                                                           uint64_t) override {
    return absl::InvalidArgumentError(
        "this service runs the CPU backend: register regions by shm_name, not cuda_ipc_handle");
  }

  absl::StatusOr<void*> OpenIpcEvent(absl::string_view) override {
    return absl::InvalidArgumentError(
        "interprocess events need the CUDA backend; the CPU backend orders work with doorbells");
  }

  absl::Status Submit(Work work) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return absl::UnavailableError("the service is shutting down");
      queue_.push_back(std::move(work));
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  bool DoorbellsInDeviceMemory() const override { return false; }

  const uint32_t* input_fault_word() const override { return TruncationGuard::FaultWord(); }

  // The CPU has no sticky errors; the worker is stalled while it waits.
  Health CheckHealth() const override {
    Health h;
    std::lock_guard<std::mutex> lock(mu_);
    if (waiting_since_ != absl::InfiniteFuture()) {
      h.stalled = absl::Now() - waiting_since_;
      h.stalled_on = "a doorbell";
    }
    return h;
  }

 private:
  // Polls a doorbell: spins briefly, then sleeps with a growing pause (up to
  // 100 us), until it rings, its wait is cancelled, a region faulted (its
  // counter may be one: it would read zero forever) or the device stops.
  absl::Status WaitFor(const WaitOp& wait) {
    int spins = 0;
    auto pause = std::chrono::microseconds(1);
    while (LoadAcquire(wait.counter) < wait.value) {
      if (wait.cancellation != nullptr && wait.cancellation->cancelled.load()) {
        return absl::CancelledError("a wait of this call was cancelled before its doorbell rang");
      }
      if (LoadAcquire(TruncationGuard::FaultWord()) != 0) {
        return absl::DataLossError("a region was truncated by its owner while this call waited");
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return absl::UnavailableError("the service is shutting down");
      }
      if (++spins < 64) continue;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(100));
    }
    return absl::OkStatus();
  }

  // Maps `fd` (taken over) whole; the pools also become the exported object.
  absl::StatusOr<KeptMemory> MapKept(int fd, uint64_t bytes, bool pools) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return ErrnoError("mmap of kept memory", err);
    }
    std::lock_guard<std::mutex> lock(mu_);
    kept_.push_back(KeptMemory{p, bytes, fd});
    if (pools) {
      struct stat st;
      if (fstat(fd, &st) == 0) exported_object_ = ObjectOf(st);
      export_path_ = absl::StrCat("/proc/", getpid(), "/fd/", fd);
      exported_ = p;
      exported_bytes_ = bytes;
      kept_pools_ = true;
    }
    return kept_.back();
  }

  void Run() {
    for (;;) {
      Work work;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status status = absl::OkStatus();
      for (const WaitOp& wait : work.waits) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          waiting_since_ = absl::Now();
        }
        status = WaitFor(wait);
        {
          std::lock_guard<std::mutex> lock(mu_);
          waiting_since_ = absl::InfiniteFuture();
        }
        if (!status.ok()) {
          // The step's later calls, already queued, run nothing.
          if (wait.cancel_word != nullptr) StoreRelease(wait.cancel_word, wait.cancel_value);
          break;
        }
      }
      if (status.ok()) {
        HostScratch scratch;
        status = work.launch(nullptr, scratch);
      }
      for (const Readback& r : work.readbacks) std::memcpy(r.host, r.device, r.bytes);
      // Signal even after a failure: the caller's stream must not wait forever;
      // the failure reaches it through the session's next call.
      for (const SignalOp& signal : work.signals) StoreRelease(signal.counter, signal.value);
      if (work.done) work.done(status);
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  absl::Time waiting_since_ = absl::InfiniteFuture();  // the worker's current wait
  bool stopping_ = false;
  std::vector<void*> allocations_;
  std::vector<KeptMemory> kept_;  // memfds mapped: the pools, and kept bookkeeping
  void* exported_ = nullptr;
  uint64_t exported_bytes_ = 0;
  bool kept_pools_ = false;      // the pools came from AllocateKept / AttachKept
  bool exported_taken_ = false;  // AllocateExported returned them
  std::string export_path_;
  MemoryObject exported_object_;
  std::thread worker_;  // last: starts after the members it uses
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateCpuDevice() {
  absl::Status guarded = TruncationGuard::Install();
  if (!guarded.ok()) return guarded;
  return std::unique_ptr<Device>(new CpuDevice());
}

}  // namespace server
}  // namespace specstate
