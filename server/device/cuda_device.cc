// The CUDA device: one non-blocking stream carries all work in submission
// order; waits and signals are stream operations (cuStreamWaitValue32 and
// cuStreamWriteValue32 on doorbells, cudaStreamWaitEvent and cudaEventRecord
// on interprocess events), so no host thread waits on the GPU on the hot
// path. Three threads: the RPC thread only queues a checked Work (Submit), so
// an ASYNC call is answered without paying for the CUDA API calls (about
// 50 us a Verify on the H200); the submitter issues them in queue order; the
// reaper waits for each Work's completion event and then runs its `done`
// (releases regions, reads back device statuses).
//
// The driver API functions come from cudaGetDriverEntryPointByVersion: the
// binary does not link libcuda, so it starts (and serves on the CPU
// backend) on machines without an NVIDIA driver.
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "server/device/device.h"
#include "server/base/log.h"
#include "server/engine/phase_profile.h"

namespace specstate {
namespace server {
namespace {

using kernels::CudaStatus;

#define SPECSTATE_CUDA_RETURN(expr, what)                                     \
  do {                                                                        \
    const cudaError_t specstate_err = (expr);                                 \
    if (specstate_err != cudaSuccess) return CudaStatus(specstate_err, what); \
  } while (0)

using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using GetLoadingModeFn = CUresult (*)(CUmoduleLoadingMode*);
// Virtual memory management: the pools as a cuMemCreate allocation that a
// POSIX file descriptor names, so a keeper can hold it across restarts.
using MemCreateFn = CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                                 unsigned long long);
using MemReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
using MemAddressReserveFn = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                         unsigned long long);
using MemAddressFreeFn = CUresult (*)(CUdeviceptr, size_t);
using MemMapFn = CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                              unsigned long long);
using MemUnmapFn = CUresult (*)(CUdeviceptr, size_t);
using MemSetAccessFn = CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
using MemGetGranularityFn = CUresult (*)(size_t*, const CUmemAllocationProp*,
                                         CUmemAllocationGranularity_flags);
using MemExportFn = CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                 unsigned long long);
using MemImportFn = CUresult (*)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);

// Makes `device` current for the scope and restores the caller's device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      changed_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

class IpcRegion final : public MappedRegion {
 public:
  IpcRegion(int device, void* base, uint64_t offset, uint64_t size)
      : device_(device), base_(base), offset_(offset), size_(size) {}
  // Opening one handle twice gives the same mapping (the driver counts its
  // opens), so the allocation's base in this process names the allocation.
  void SetAllocation(uint64_t allocation_base) { allocation_base_ = allocation_base; }
  MemoryObject object() const override {
    return MemoryObject{MemoryObject::kCudaAllocation, allocation_base_, 0};
  }
  uint64_t object_offset() const override {
    return reinterpret_cast<uint64_t>(base_) - allocation_base_ + offset_;
  }
  ~IpcRegion() override {
    ScopedDevice scoped(device_);
    cudaIpcCloseMemHandle(base_);
  }
  void* data() const override { return static_cast<char*>(base_) + offset_; }
  uint64_t byte_size() const override { return size_; }
  absl::string_view kind() const override { return "cuda_ipc"; }

 private:
  int device_;
  void* base_;
  uint64_t offset_;
  uint64_t size_;
  uint64_t allocation_base_ = 0;
};

// cudaMallocAsync'd copies of inline tensors, freed in stream order after
// the work that reads them.
class StreamScratch final : public Scratch {
 public:
  explicit StreamScratch(cudaStream_t stream) : stream_(stream) {}
  ~StreamScratch() override {
    for (void* p : buffers_) cudaFreeAsync(p, stream_);
  }
  absl::StatusOr<void*> Upload(const void* host, uint64_t bytes) override {
    void* p = nullptr;
    SPECSTATE_CUDA_RETURN(cudaMallocAsync(&p, bytes == 0 ? 4 : bytes, stream_),
                          "cudaMallocAsync for an inline tensor");
    buffers_.push_back(p);
    SPECSTATE_CUDA_RETURN(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, stream_),
                          "cudaMemcpyAsync of an inline tensor");
    return p;
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> buffers_;
};

class CudaDevice final : public Device {
 public:
  static absl::StatusOr<std::unique_ptr<Device>> Create(int ordinal, absl::Duration submit_spin) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      return absl::UnavailableError(absl::StrCat(
          "no CUDA device is available (",
          err != cudaSuccess ? kernels::DescribeCudaError(err) : "0 devices", ")"));
    }
    if (ordinal < 0 || ordinal >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ", ordinal, " does not exist (", count, " CUDA devices)"));
    }
    auto kernels = kernels::CudaKdaKernels();
    if (!kernels.ok()) return kernels.status();
    std::unique_ptr<CudaDevice> device(new CudaDevice(ordinal, **kernels, submit_spin));
    absl::Status st = device->Init();
    if (!st.ok()) return st;
    return std::unique_ptr<Device>(std::move(device));
  }

  ~CudaDevice() override {
    {  // the submitter drains its queue first, then the reaper its events
      std::lock_guard<std::mutex> lock(queue_mu_);
      submit_stopping_ = true;
    }
    queue_cv_.notify_all();
    if (submitter_.joinable()) submitter_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    ScopedDevice scoped(ordinal_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (auto& [handle, event] : ipc_events_) cudaEventDestroy(event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (void* p : device_allocations_) cudaFree(p);
    for (void* p : host_allocations_) cudaFreeHost(p);
    for (const Vmm& v : kept_) {
      mem_unmap_(v.address, v.bytes);
      mem_address_free_(v.address, v.bytes);
      mem_release_(v.handle);
      close(v.fd);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  kernels::Backend kind() const override { return kernels::Backend::kCuda; }
  bool mps_client() const override { return mps_client_; }
  int ordinal() const override { return ordinal_; }
  const kernels::KdaKernels& kernels() const override { return kernels_; }

  absl::StatusOr<uint64_t> FreeBytes() const override {
    ScopedDevice scoped(ordinal_);
    size_t free = 0, total = 0;
    SPECSTATE_CUDA_RETURN(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    // Kept pools not yet handed to the engine are already allocated: the
    // engine counts them among what it needs.
    return uint64_t{free} + (kept_pools_ && !exported_taken_ ? exported_bytes_ : 0);
  }

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
    if (exported_ != nullptr) return absl::FailedPreconditionError("the pools are allocated once");
    ScopedDevice scoped(ordinal_);
    void* p = nullptr;
    SPECSTATE_CUDA_RETURN(cudaMalloc(&p, bytes), absl::StrCat("cudaMalloc of ", bytes,
                                                              " bytes for the pools"));
    device_allocations_.push_back(p);
    absl::Status zeroed = Zero(p, bytes);
    if (!zeroed.ok()) return zeroed;
    cudaIpcMemHandle_t handle;
    SPECSTATE_CUDA_RETURN(cudaIpcGetMemHandle(&handle, p), "cudaIpcGetMemHandle of the pools");
    export_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    exported_ = p;
    return p;
  }

  // Kept memory: cuMemCreate with a POSIX file descriptor handle, mapped
  // read-write for this device, zeroed.
  absl::StatusOr<KeptMemory> AllocateKept(uint64_t bytes, bool pools) override {
    if (pools && exported_ != nullptr) {
      return absl::FailedPreconditionError("the pools are allocated once");
    }
    absl::Status st = LoadVmm();
    if (!st.ok()) return st;
    ScopedDevice scoped(ordinal_);
    const CUmemAllocationProp prop = VmmProp();
    absl::StatusOr<uint64_t> size = VmmSize(bytes);
    if (!size.ok()) return size.status();
    Vmm v;
    v.bytes = *size;
    st = Cu(mem_create_(&v.handle, v.bytes, &prop, 0),
            absl::StrCat("cuMemCreate of ", v.bytes, " bytes (POSIX file descriptor handle)"));
    if (!st.ok()) return st;
    int fd = -1;
    st = Cu(mem_export_(&fd, v.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
    if (!st.ok()) {
      mem_release_(v.handle);
      return st;
    }
    v.fd = fd;
    absl::StatusOr<KeptMemory> kept = MapVmm(v, pools);
    if (!kept.ok()) return kept;
    st = Zero(kept->data, kept->bytes);
    if (!st.ok()) return st;
    return kept;
  }

  absl::StatusOr<KeptMemory> AttachKept(int fd, uint64_t bytes, bool pools) override {
    absl::Status st = LoadVmm();
    if (st.ok() && pools && exported_ != nullptr) {
      st = absl::FailedPreconditionError("the pools are allocated once");
    }
    absl::StatusOr<uint64_t> size = st.ok() ? VmmSize(bytes) : absl::StatusOr<uint64_t>(st);
    if (!size.ok()) {
      close(fd);
      return size.status();
    }
    ScopedDevice scoped(ordinal_);
    Vmm v;
    v.bytes = *size;
    v.fd = fd;
    st = Cu(mem_import_(&v.handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle of the kept memory");
    if (!st.ok()) {
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat(st.message(), ": not a CUDA allocation's descriptor (kept by the CPU "
                                     "backend?)"));
    }
    // Mapping more than the allocation holds fails: a smaller one is refused here.
    return MapVmm(v, pools);
  }

  int ExportFd() const override { return export_fd_; }
  uint64_t ExportFdBytes() const override { return export_fd_ < 0 ? 0 : exported_bytes_; }

  std::string ExportName() const override { return ""; }
  std::string ExportHandle() const override { return export_handle_; }
  MemoryObject ExportedObject() const override {
    return MemoryObject{MemoryObject::kCudaAllocation, reinterpret_cast<uint64_t>(exported_), 0};
  }

  absl::StatusOr<void*> AllocateDevice(uint64_t bytes) override {
    ScopedDevice scoped(ordinal_);
    void* p = nullptr;
    SPECSTATE_CUDA_RETURN(cudaMalloc(&p, bytes == 0 ? 4 : bytes),
                          absl::StrCat("cudaMalloc of ", bytes, " bytes"));
    {
      std::lock_guard<std::mutex> lock(mu_);
      device_allocations_.push_back(p);
    }
    absl::Status zeroed = Zero(p, bytes);
    if (!zeroed.ok()) return zeroed;
    return p;
  }

  absl::StatusOr<void*> AllocateHost(uint64_t bytes) override {
    ScopedDevice scoped(ordinal_);
    void* p = nullptr;
    SPECSTATE_CUDA_RETURN(cudaMallocHost(&p, bytes == 0 ? 4 : bytes),
                          absl::StrCat("cudaMallocHost of ", bytes, " bytes"));
    std::memset(p, 0, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    host_allocations_.push_back(p);
    return p;
  }

  absl::Status CopyToDevice(void* device, const void* host, uint64_t bytes) override {
    return SubmitAndWait([=](kernels::Stream s) {
      const auto stream = static_cast<cudaStream_t>(s);
      return CudaStatus(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream),
                        "cudaMemcpyAsync");
    });
  }

  absl::Status CopyFromDevice(void* host, const void* device, uint64_t bytes) override {
    return SubmitAndWait([=](kernels::Stream s) {
      const auto stream = static_cast<cudaStream_t>(s);
      return CudaStatus(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
                        "cudaMemcpyAsync");
    });
  }

  absl::Status CopyOnStream(void* dst, const void* src, uint64_t bytes,
                            kernels::Stream stream) override {
    SPECSTATE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                          static_cast<cudaStream_t>(stream)),
                          "cudaMemcpyAsync");
    return absl::OkStatus();
  }

  absl::Status ZeroOnStream(void* dst, uint64_t bytes, kernels::Stream stream) override {
    SPECSTATE_CUDA_RETURN(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)),
                          "cudaMemsetAsync");
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(absl::string_view, uint64_t,
                                                       uint64_t) override {
    return absl::InvalidArgumentError(
        "this service runs the CUDA backend: register regions by cuda_ipc_handle, not shm_name");
  }

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapCudaIpc(absl::string_view handle, int device,
                                                           uint64_t offset_bytes,
                                                           uint64_t byte_size) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc_handle has ", handle.size(), " bytes; a cudaIpcMemHandle_t has ",
          sizeof(cudaIpcMemHandle_t),
          " (torch's expandable segments give handles that cannot be opened: see "
          "client/python/README.md)"));
    }
    if (device != ordinal_) {
      return absl::InvalidArgumentError(absl::StrCat("region is on device ", device,
                                                     ", the service runs on device ", ordinal_));
    }
    if (handle == export_handle_) {
      return absl::InvalidArgumentError(
          "cuda_ipc_handle is the service's own pools: map them from ExportPools, never register "
          "them as a region (no call may write the pools through a client's tensor)");
    }
    ScopedDevice scoped(ordinal_);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* base = nullptr;
    SPECSTATE_CUDA_RETURN(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle");
    auto* ipc = new IpcRegion(ordinal_, base, offset_bytes, byte_size);
    std::unique_ptr<MappedRegion> region(ipc);
    // The real size of what the handle names, not what the client claims.
    CUdeviceptr alloc_base = 0;
    size_t alloc_size = 0;
    if (get_address_range_(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(base)) !=
        CUDA_SUCCESS) {
      return absl::InternalError("cuMemGetAddressRange failed on an opened IPC handle");
    }
    ipc->SetAllocation(static_cast<uint64_t>(alloc_base));
    const uint64_t available =
        alloc_size - (reinterpret_cast<CUdeviceptr>(base) - alloc_base);
    if (offset_bytes > available || byte_size > available - offset_bytes) {
      return absl::OutOfRangeError(absl::StrCat("region of ", byte_size, " bytes at offset ",
                                                offset_bytes, " does not fit in the ",
                                                available, "-byte allocation the handle names"));
    }
    return region;
  }

  absl::StatusOr<void*> OpenIpcEvent(absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("event handle has ", handle.size(),
                                                     " bytes; a cudaIpcEventHandle_t has ",
                                                     sizeof(cudaIpcEventHandle_t)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ipc_events_.find(std::string(handle));
    if (it != ipc_events_.end()) return static_cast<void*>(it->second);
    ScopedDevice scoped(ordinal_);
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t event = nullptr;
    SPECSTATE_CUDA_RETURN(cudaIpcOpenEventHandle(&event, h), "cudaIpcOpenEventHandle");
    ipc_events_.emplace(std::string(handle), event);
    return static_cast<void*>(event);
  }

  // Queues `work` for the submitter: what can fail here was checked before.
  // Work that waits on or records an interprocess event is on the stream
  // before this returns: cudaStreamWaitEvent and cudaEventRecord bind to the
  // event's record at the time of the call, and the caller records (or
  // synchronizes on) the event again as soon as its RPC returns. Doorbells
  // carry their value, so their work needs no such wait.
  absl::Status Submit(Work work) override {
    bool uses_events = false;
    for (const WaitOp& w : work.waits) uses_events |= w.kind == WaitOp::Kind::kEvent;
    for (const SignalOp& s : work.signals) uses_events |= s.kind == SignalOp::Kind::kEvent;
    auto enqueued = uses_events ? std::make_shared<absl::Notification>() : nullptr;
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (submit_stopping_) return absl::UnavailableError("the service is shutting down");
      submit_queue_.push_back(Queued{std::move(work), std::chrono::steady_clock::now(), enqueued});
      queued_.fetch_add(1, std::memory_order_release);
      wake = submitter_sleeping_;
    }
    // A spinning submitter sees the queue itself: no futex call on the RPC path.
    if (wake) queue_cv_.notify_one();
    if (enqueued != nullptr) enqueued->WaitForNotification();
    return absl::OkStatus();
  }

  bool DoorbellsInDeviceMemory() const override { return true; }

  // Sticky: the context failed running work (an illegal address, say); no
  // call can succeed again. Stalled: the oldest work issued on the stream
  // and not yet finished (its waits, or its kernels).
  Health CheckHealth() const override {
    Health h;
    std::lock_guard<std::mutex> lock(mu_);
    h.sticky_error = sticky_error_;
    std::chrono::steady_clock::time_point oldest = reaping_since_;
    if (!in_flight_.empty() && in_flight_.front().enqueued < oldest) {
      oldest = in_flight_.front().enqueued;
    }
    if (oldest != std::chrono::steady_clock::time_point::max()) {
      h.stalled = absl::FromChrono(std::chrono::steady_clock::now() - oldest);
      h.stalled_on = "work issued on the stream (a doorbell or event wait, or a kernel)";
    }
    return h;
  }

 private:
  struct Queued {
    Work work;
    std::chrono::steady_clock::time_point queued;
    std::shared_ptr<absl::Notification> enqueued;  // when Submit waits for the issue
  };

  // How long the submitter polls an empty queue before it sleeps
  // (ServiceConfig.submit_spin_us): a step's calls arrive tens of
  // microseconds apart, and waking a sleeping thread costs the RPC thread a
  // futex call and the call a scheduler wake-up.
  const std::chrono::microseconds submit_spin_;
  // The most works one completion event ends (a step is about one per layer).
  static constexpr int kMaxBatchWorks = 64;
  int works_since_event_ = 0;  // the submitter's

  void SubmitLoop() {
    cudaSetDevice(ordinal_);  // the submitter's own thread
    for (;;) {
      Queued item;
      const auto spin_until = std::chrono::steady_clock::now() + submit_spin_;
      while (queued_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
      }
      {
        std::unique_lock<std::mutex> lock(queue_mu_);
        submitter_sleeping_ = true;
        queue_cv_.wait(lock, [&] { return submit_stopping_ || !submit_queue_.empty(); });
        submitter_sleeping_ = false;
        if (submit_queue_.empty()) return;  // stopping, nothing left
        item = std::move(submit_queue_.front());
        submit_queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      Enqueue(std::move(item.work), item.queued);
      if (item.enqueued != nullptr) item.enqueued->Notify();
    }
  }

  // Issues one Work on the stream: waits, launch, signals, readbacks and the
  // completion event the reaper waits for. A failure to enqueue reaches
  // the caller through `done`, as a device failure does.
  void Enqueue(Work work, std::chrono::steady_clock::time_point queued) {
    // SPECSTATE_PROFILE=1: where the submitter's time per work goes.
    static PhaseProfile profile("CUDA submit", {"waits", "launch", "signals+readbacks",
                                                "completion+bookkeeping"});
    PhaseProfile::Timer timer(profile);
    const auto t1 = std::chrono::steady_clock::now();
    absl::Status launched = absl::OkStatus();
    for (const WaitOp& wait : work.waits) {
      if (wait.cancellation != nullptr && wait.cancellation->cancelled.load()) {
        // Its session ended before the wait reached the stream: never block
        // on it, and run nothing of this call.
        launched = absl::CancelledError("a wait of this call was cancelled before its doorbell rang");
        // In stream order: the step's later calls, already queued, run nothing.
        if (wait.cancel_word != nullptr) {
          write_value32_(stream_, reinterpret_cast<CUdeviceptr>(wait.cancel_word),
                         wait.cancel_value, 0);
        }
        break;
      }
      if (wait.kind == WaitOp::Kind::kDoorbell) {
        if (wait_value32_(stream_, reinterpret_cast<CUdeviceptr>(wait.counter), wait.value,
                          CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
          launched = absl::InternalError("cuStreamWaitValue32 failed");
          break;
        }
        PendingWait pending;
        pending.work_id = next_work_id_;
        pending.counter = wait.counter;
        pending.value = wait.value;
        pending.cancellation = wait.cancellation;
        pending.cancel_word = wait.cancel_word;
        pending.cancel_value = wait.cancel_value;
        {
          std::lock_guard<std::mutex> lock(mu_);
          pending_waits_.push_back(pending);
        }
        // The session may have ended between the check above and now, after
        // its release scanned pending_waits_: release this wait then.
        if (wait.cancellation != nullptr && wait.cancellation->cancelled.load()) {
          ReleaseCancelledWaits();
        }
      } else {
        launched = CudaStatus(
            cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(wait.event), 0),
            "cudaStreamWaitEvent");
        if (!launched.ok()) break;
      }
    }
    timer.Mark();
    if (launched.ok()) {
      StreamScratch scratch(stream_);
      launched = work.launch(stream_, scratch);
    }
    timer.Mark();
    const auto t2 = std::chrono::steady_clock::now();
    // Signal even after a failure: the caller's stream must not wait forever;
    // the failure reaches it through the session's next call.
    for (const SignalOp& signal : work.signals) {
      if (signal.kind == SignalOp::Kind::kDoorbell) {
        write_value32_(stream_, reinterpret_cast<CUdeviceptr>(signal.counter), signal.value, 0);
      } else {
        cudaEventRecord(static_cast<cudaEvent_t>(signal.event), stream_);
      }
    }
    // After the signals: the readbacks copy service memory (snapshots, plans)
    // for `done` only, so the caller's stream need not wait for them. By a
    // kernel: a copy-engine copy here would delay the release of the next
    // work's doorbell wait (about 8 us, H200 timeline).
    for (const Readback& r : work.readbacks) {
      const absl::Status copied = kernels::CopyToHostOnStream(r.host, r.device, r.bytes, stream_);
      if (!copied.ok() && launched.ok()) launched = copied;
    }
    timer.Mark();
    // A completion event only on the last work queued so far: the works
    // before it in a burst (a step's calls) end earlier in stream order, and
    // its event tells the reaper that all of them are done. Each
    // blocking-sync event costs the stream an interrupt and about 1.8 us
    // before the next handoff (handoff_bench, H200). At least one every
    // kMaxBatchWorks, so that a queue that never empties still has its
    // calls answered and their regions released.
    const bool ends_batch = queued_.load(std::memory_order_acquire) == 0 ||
                            ++works_since_event_ >= kMaxBatchWorks;
    if (ends_batch) works_since_event_ = 0;
    cudaEvent_t completion = nullptr;
    if (ends_batch) {
      completion = TakeEvent();
      const cudaError_t record =
          completion == nullptr ? cudaErrorMemoryAllocation : cudaEventRecord(completion, stream_);
      if (record != cudaSuccess) {
        // Nothing marks the batch's end on the stream: the reaper fails its
        // works in order, without an event (never here: Submit may be
        // waiting for this thread with the engine's lock held).
        if (completion != nullptr) ReturnEvent(completion);
        completion = nullptr;
        launched = CudaStatus(record, "recording a completion event");
        LogError(launched.ToString());
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.push_back(InFlight{next_work_id_, completion, ends_batch,
                                    std::move(work.done), launched,
                                    std::chrono::steady_clock::now()});
      if (ends_batch) ++batch_ends_;
    }
    ++next_work_id_;
    timer.Mark();
    if (TraceEnabled()) {
      const auto us = [](auto a, auto b) {
        return std::chrono::duration<double, std::micro>(b - a).count();
      };
      const auto t3 = std::chrono::steady_clock::now();
      LogInfo(absl::StrCat("trace: submit ", next_work_id_ - 1, ": queued ", us(queued, t1),
                           " us, waits+launch ", us(t1, t2), " us, signals+readbacks+record ",
                           us(t2, t3), " us"));
    }
    cv_.notify_all();
  }

  // A cuMemCreate allocation mapped here.
  struct Vmm {
    CUmemGenericAllocationHandle handle = 0;
    CUdeviceptr address = 0;
    uint64_t bytes = 0;
    int fd = -1;
  };

  absl::Status Cu(CUresult r, absl::string_view what) const {
    if (r == CUDA_SUCCESS) return absl::OkStatus();
    const char* name = nullptr;
    if (get_error_string_ == nullptr || get_error_string_(r, &name) != CUDA_SUCCESS) name = nullptr;
    return absl::InternalError(
        absl::StrCat(what, " failed: CUDA driver error ", static_cast<int>(r),
                     name != nullptr ? absl::StrCat(" (", name, ")") : std::string()));
  }

  // The driver's virtual memory management entry points, once.
  absl::Status LoadVmm() {
    if (mem_create_ != nullptr) return absl::OkStatus();
    absl::Status st = Entry("cuMemRelease", &mem_release_);
    if (st.ok()) st = Entry("cuMemAddressReserve", &mem_address_reserve_);
    if (st.ok()) st = Entry("cuMemAddressFree", &mem_address_free_);
    if (st.ok()) st = Entry("cuMemMap", &mem_map_);
    if (st.ok()) st = Entry("cuMemUnmap", &mem_unmap_);
    if (st.ok()) st = Entry("cuMemSetAccess", &mem_set_access_);
    if (st.ok()) st = Entry("cuMemGetAllocationGranularity", &mem_granularity_);
    if (st.ok()) st = Entry("cuMemExportToShareableHandle", &mem_export_);
    if (st.ok()) st = Entry("cuMemImportFromShareableHandle", &mem_import_);
    if (st.ok()) Entry("cuGetErrorString", &get_error_string_).IgnoreError();
    if (st.ok()) st = Entry("cuMemCreate", &mem_create_);  // last: marks them loaded
    return st;
  }

  CUmemAllocationProp VmmProp() const {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal_;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
  }

  // `bytes` rounded up to the allocation granularity (the same on every
  // start on this device, so a kept allocation is mapped at its full size).
  absl::StatusOr<uint64_t> VmmSize(uint64_t bytes) {
    const CUmemAllocationProp prop = VmmProp();
    size_t granularity = 0;
    absl::Status st = Cu(mem_granularity_(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                         "cuMemGetAllocationGranularity");
    if (!st.ok()) return st;
    if (granularity == 0) granularity = 2 << 20;
    return (std::max<uint64_t>(bytes, 1) + granularity - 1) / granularity * granularity;
  }

  // Reserves an address range for `v`, maps it read-write for this device,
  // and keeps it (released with the device). The pools: cudaIpcGetMemHandle
  // if the driver covers cuMemCreate memory, else its descriptor for
  // ExportPools' pools_fd_socket.
  absl::StatusOr<KeptMemory> MapVmm(Vmm v, bool pools) {
    absl::Status st = Cu(mem_address_reserve_(&v.address, v.bytes, 0, 0, 0), "cuMemAddressReserve");
    if (st.ok()) {
      st = Cu(mem_map_(v.address, v.bytes, 0, v.handle, 0),
              absl::StrCat("cuMemMap of ", v.bytes, " bytes"));
      if (!st.ok()) mem_address_free_(v.address, v.bytes);
    }
    if (st.ok()) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = ordinal_;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      st = Cu(mem_set_access_(v.address, v.bytes, &access, 1), "cuMemSetAccess");
      if (!st.ok()) {
        mem_unmap_(v.address, v.bytes);
        mem_address_free_(v.address, v.bytes);
      }
    }
    if (!st.ok()) {
      mem_release_(v.handle);
      close(v.fd);
      return absl::FailedPreconditionError(st.message());
    }
    void* p = reinterpret_cast<void*>(v.address);
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept_.push_back(v);
    }
    if (pools) {
      exported_ = p;
      exported_bytes_ = v.bytes;
      kept_pools_ = true;
      // Clients import the descriptor (it holds the allocation, whatever
      // happens to this process); a CUDA IPC handle too where the driver
      // covers cuMemCreate memory, for clients that only know those.
      export_fd_ = v.fd;
      cudaIpcMemHandle_t handle;
      if (cudaIpcGetMemHandle(&handle, p) == cudaSuccess) {
        export_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      } else {
        cudaGetLastError();  // not sticky: clear it
      }
    }
    return KeptMemory{p, v.bytes, v.fd};
  }

  struct InFlight {
    uint64_t work_id;
    cudaEvent_t completion;  // set on the work that ends a batch, unless its record failed
    bool ends_batch;
    std::function<void(absl::Status)> done;
    absl::Status launched;
    std::chrono::steady_clock::time_point enqueued;
  };

  struct PendingWait {
    uint64_t work_id;
    uint32_t* counter;
    uint32_t value;
    std::shared_ptr<WaitCancellation> cancellation;
    uint32_t* cancel_word;
    uint32_t cancel_value;
  };

  CudaDevice(int ordinal, const kernels::KdaKernels& kernels, absl::Duration submit_spin)
      : submit_spin_(std::chrono::microseconds(absl::ToInt64Microseconds(submit_spin))),
        ordinal_(ordinal),
        kernels_(kernels) {}

  // Zeroes on the service's stream and waits (set-up only). cudaMemset would
  // run on the legacy default stream, which the non-blocking stream_ does not
  // wait for: a table uploaded on stream_ right after could be zeroed again.
  absl::Status Zero(void* p, uint64_t bytes) {
    return SubmitAndWait([=](kernels::Stream s) {
      const auto stream = static_cast<cudaStream_t>(s);
      return CudaStatus(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync");
    });
  }

  absl::Status Init() {
    ScopedDevice scoped(ordinal_);
    // The kernels are built as sm_90 machine code plus compute_90 PTX
    // (bazel/cuda.bzl): newer GPUs JIT the PTX, older ones have no kernel
    // image and would fail at the first launch; say so at start instead.
    int major = 0, minor = 0;
    SPECSTATE_CUDA_RETURN(
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal_),
        "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMajor)");
    SPECSTATE_CUDA_RETURN(
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal_),
        "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMinor)");
    if (major < 9) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device ", ordinal_, " has compute capability ", major, ".", minor,
          "; this build's kernels need 9.0 or newer (sm_90 code, compute_90 PTX for newer GPUs)"));
    }
    SPECSTATE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                          "cudaStreamCreate");
    SPECSTATE_CUDA_RETURN(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking),
                          "cudaStreamCreate");
    absl::Status st = Entry("cuStreamWaitValue32", &wait_value32_);
    if (st.ok()) st = Entry("cuStreamWriteValue32", &write_value32_);
    if (st.ok()) st = Entry("cuMemGetAddressRange", &get_address_range_);
    GetLoadingModeFn get_loading_mode = nullptr;
    if (st.ok()) st = Entry("cuModuleGetLoadingMode", &get_loading_mode);
    if (!st.ok()) return st;
    // See kernels::UseEagerCudaModuleLoading(): a kernel loaded on first
    // launch while the stream waits on a client's doorbell can deadlock.
    CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
    if (get_loading_mode(&mode) == CUDA_SUCCESS && mode == CU_MODULE_LAZY_LOADING) {
      return absl::FailedPreconditionError(
          "CUDA lazy module loading is on (CUDA_MODULE_LOADING=LAZY): the first launch of a "
          "kernel could deadlock behind a doorbell wait; start with CUDA_MODULE_LOADING=EAGER "
          "(specstated sets it itself; an embedding process must call "
          "kernels::UseEagerCudaModuleLoading() before its first CUDA call)");
    }
    int mps = 0;
    SPECSTATE_CUDA_RETURN(cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, ordinal_),
                          "cudaDeviceGetAttribute(cudaDevAttrMpsEnabled)");
    mps_client_ = mps != 0;
    reaper_ = std::thread([this] { Reap(); });
    submitter_ = std::thread([this] { SubmitLoop(); });
    return absl::OkStatus();
  }

  template <typename Fn>
  absl::Status Entry(const char* name, Fn* fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult result;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &result);
    if (err != cudaSuccess || result != cudaDriverEntryPointSuccess || p == nullptr) {
      return absl::UnavailableError(absl::StrCat("the CUDA driver has no ", name));
    }
    *fn = reinterpret_cast<Fn>(p);
    return absl::OkStatus();
  }

  void ReturnEvent(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_events_.push_back(e);
  }

  cudaEvent_t TakeEvent() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    // Blocking sync: the reaper sleeps in cudaEventSynchronize instead of spinning.
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync) !=
        cudaSuccess) {
      return nullptr;
    }
    return e;
  }

  // Ends waits whose doorbell will never ring (their session ended) by
  // writing the awaited value from a side stream, which the blocked stream
  // does not hold up. The step's cancellation word goes first (the writes
  // are ordered, each after a memory barrier): the released call's check
  // kernel then fails, and nothing of it or of its step runs on inputs that
  // were never written.
  void ReleaseCancelledWaits() override {
    ScopedDevice scoped(ordinal_);
    std::vector<PendingWait> cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = pending_waits_.begin(); it != pending_waits_.end();) {
        if (it->cancellation != nullptr && it->cancellation->cancelled.load()) {
          cancelled.push_back(*it);
          it = pending_waits_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const PendingWait& w : cancelled) {
      if (w.cancel_word != nullptr) {
        write_value32_(side_stream_, reinterpret_cast<CUdeviceptr>(w.cancel_word), w.cancel_value,
                       0);
      }
      write_value32_(side_stream_, reinterpret_cast<CUdeviceptr>(w.counter), w.value, 0);
    }
  }

  // Completes the in-flight works a batch at a time: the works up to and
  // including the next one that ends a batch, once its event has completed.
  void Reap() {
    cudaSetDevice(ordinal_);  // the reaper's own thread
    for (;;) {
      std::vector<InFlight> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || batch_ends_ > 0; });
        if (in_flight_.empty()) return;  // stopping, nothing left
        while (!in_flight_.empty()) {
          batch.push_back(std::move(in_flight_.front()));
          in_flight_.pop_front();
          if (batch.back().ends_batch) {
            --batch_ends_;
            break;
          }
        }
      }
      // A stream blocked on a doorbell of an ended session is released by
      // ReleaseCancelledWaits(), which the service calls when the session ends.
      const InFlight& last = batch.back();
      {
        std::lock_guard<std::mutex> lock(mu_);
        reaping_since_ = batch.front().enqueued;
      }
      absl::Status batch_failure;
      if (last.completion != nullptr) {
        // The device failed while running this work (or earlier work): its
        // statuses were not copied back, so they must not be read as OK.
        const cudaError_t synced = cudaEventSynchronize(last.completion);
        batch_failure =
            CudaStatus(synced, "the device failed while running this call (cudaEventSynchronize)");
        // A kernel's fault poisons the context: every later call fails too.
        if (synced != cudaSuccess && cudaPeekAtLastError() != cudaSuccess) {
          std::lock_guard<std::mutex> lock(mu_);
          if (sticky_error_.ok()) sticky_error_ = batch_failure;
        }
      } else if (last.ends_batch) {
        // Its event could not be recorded: nothing tells when the batch ended.
        batch_failure = absl::InternalError(
            absl::StrCat("no completion event marks the end of this call on the stream: ",
                         last.launched.message()));
      }
      for (InFlight& item : batch) {
        if (!batch_failure.ok() && item.launched.ok()) {
          item.launched = batch_failure;
          LogError(item.launched.ToString());
        }
        if (TraceEnabled()) {
          LogInfo(absl::StrCat("trace: work ", item.work_id, " done ",
                               std::chrono::duration<double, std::micro>(
                                   std::chrono::steady_clock::now() - item.enqueued)
                                   .count(),
                               " us after it was enqueued"));
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (item.completion != nullptr) free_events_.push_back(item.completion);
          for (auto it = pending_waits_.begin(); it != pending_waits_.end();) {
            it = it->work_id == item.work_id ? pending_waits_.erase(it) : it + 1;
          }
        }
        if (item.done) item.done(item.launched);
      }
      std::lock_guard<std::mutex> lock(mu_);
      reaping_since_ = std::chrono::steady_clock::time_point::max();
    }
  }

  const int ordinal_;
  bool mps_client_ = false;  // set by Init()
  const kernels::KdaKernels& kernels_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;
  WaitValue32Fn wait_value32_ = nullptr;
  WriteValue32Fn write_value32_ = nullptr;
  GetAddressRangeFn get_address_range_ = nullptr;
  void* exported_ = nullptr;
  std::string export_handle_;
  // Kept memory (AllocateKept / AttachKept) and the driver's VMM functions.
  std::vector<Vmm> kept_;
  uint64_t exported_bytes_ = 0;
  bool kept_pools_ = false;
  bool exported_taken_ = false;
  int export_fd_ = -1;
  MemCreateFn mem_create_ = nullptr;
  MemReleaseFn mem_release_ = nullptr;
  MemAddressReserveFn mem_address_reserve_ = nullptr;
  MemAddressFreeFn mem_address_free_ = nullptr;
  MemMapFn mem_map_ = nullptr;
  MemUnmapFn mem_unmap_ = nullptr;
  MemSetAccessFn mem_set_access_ = nullptr;
  MemGetGranularityFn mem_granularity_ = nullptr;
  MemExportFn mem_export_ = nullptr;
  MemImportFn mem_import_ = nullptr;
  GetErrorStringFn get_error_string_ = nullptr;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Queued> submit_queue_;
  bool submit_stopping_ = false;
  bool submitter_sleeping_ = false;  // guarded by queue_mu_: Submit must wake it
  std::atomic<size_t> queued_{0};    // submit_queue_.size(), for the spin without the lock
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<InFlight> in_flight_;
  // When the batch the reaper waits for was issued (max: none).
  std::chrono::steady_clock::time_point reaping_since_ = std::chrono::steady_clock::time_point::max();
  absl::Status sticky_error_;
  int batch_ends_ = 0;  // works in in_flight_ that end a batch
  uint64_t next_work_id_ = 0;  // the submitter's
  std::vector<PendingWait> pending_waits_;
  std::vector<cudaEvent_t> free_events_;
  std::unordered_map<std::string, cudaEvent_t> ipc_events_;
  std::vector<void*> device_allocations_;
  std::vector<void*> host_allocations_;
  std::thread reaper_;
  std::thread submitter_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal,
                                                         absl::Duration submit_spin) {
  return CudaDevice::Create(ordinal, submit_spin);
}

}  // namespace server
}  // namespace specstate
