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
//
// The class is private to server/device: cuda_device.cc (creation, regions,
// events, health), cuda_memory.cc (allocations, copies, kept memory),
// cuda_submission.cc (the submitter) and cuda_reaper.cc (the reaper).
#ifndef SPECSTATE_SERVER_DEVICE_CUDA_DEVICE_INTERNAL_H_
#define SPECSTATE_SERVER_DEVICE_CUDA_DEVICE_INTERNAL_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/cuda_status.h"
#include "server/device/device.h"

#define SPECSTATE_CUDA_RETURN(expr, what)                                     \
  do {                                                                        \
    const cudaError_t specstate_err = (expr);                                 \
    if (specstate_err != cudaSuccess) return CudaStatus(specstate_err, what); \
  } while (0)

namespace specstate {
namespace server {
namespace cuda_internal {

using kernels::CudaStatus;

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

class CudaDevice final : public Device {
 public:
  static absl::StatusOr<std::unique_ptr<Device>> Create(int ordinal, absl::Duration submit_spin);

  ~CudaDevice() override;

  kernels::Backend kind() const override { return kernels::Backend::kCuda; }
  bool mps_client() const override { return mps_client_; }
  int ordinal() const override { return ordinal_; }
  const kernels::KdaKernels& kernels() const override { return kernels_; }

  absl::StatusOr<uint64_t> FreeBytes() const override;

  absl::StatusOr<void*> AllocateExported(uint64_t bytes) override;

  // Kept memory: cuMemCreate with a POSIX file descriptor handle, mapped
  // read-write for this device, zeroed.
  absl::StatusOr<KeptMemory> AllocateKept(uint64_t bytes, bool pools) override;

  absl::StatusOr<KeptMemory> AttachKept(int fd, uint64_t bytes, bool pools) override;

  int ExportFd() const override { return export_fd_; }
  uint64_t ExportFdBytes() const override { return export_fd_ < 0 ? 0 : exported_bytes_; }

  std::string ExportName() const override { return ""; }
  std::string ExportHandle() const override { return export_handle_; }
  MemoryObject ExportedObject() const override {
    return MemoryObject{MemoryObject::kCudaAllocation, reinterpret_cast<uint64_t>(exported_), 0};
  }

  absl::StatusOr<void*> AllocateDevice(uint64_t bytes) override;

  absl::StatusOr<void*> AllocateHost(uint64_t bytes) override;

  absl::Status CopyToDevice(void* device, const void* host, uint64_t bytes) override;

  absl::Status CopyFromDevice(void* host, const void* device, uint64_t bytes) override;

  absl::Status CopyOnStream(void* dst, const void* src, uint64_t bytes,
                            kernels::Stream stream) override;

  absl::Status ZeroOnStream(void* dst, uint64_t bytes, kernels::Stream stream) override;

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(absl::string_view, uint64_t,
                                                       uint64_t) override;

  absl::StatusOr<std::unique_ptr<MappedRegion>> MapCudaIpc(absl::string_view handle, int device,
                                                           uint64_t offset_bytes,
                                                           uint64_t byte_size) override;

  absl::StatusOr<void*> OpenIpcEvent(absl::string_view handle) override;

  // Queues `work` for the submitter: what can fail here was checked before.
  // Work that waits on or records an interprocess event is on the stream
  // before this returns: cudaStreamWaitEvent and cudaEventRecord bind to the
  // event's record at the time of the call, and the caller records (or
  // synchronizes on) the event again as soon as its RPC returns. Doorbells
  // carry their value, so their work needs no such wait.
  absl::Status Submit(Work work) override;

  bool DoorbellsInDeviceMemory() const override { return true; }

  // Sticky: the context failed running work (an illegal address, say); no
  // call can succeed again. Stalled: the oldest work issued on the stream
  // and not yet finished (its waits, or its kernels).
  Health CheckHealth() const override;

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

  void SubmitLoop();

  // Issues one Work on the stream: waits, launch, signals, readbacks and the
  // completion event the reaper waits for. A failure to enqueue reaches
  // the caller through `done`, as a device failure does.
  void Enqueue(Work work, std::chrono::steady_clock::time_point queued);

  // A cuMemCreate allocation mapped here.
  struct Vmm {
    CUmemGenericAllocationHandle handle = 0;
    CUdeviceptr address = 0;
    uint64_t bytes = 0;
    int fd = -1;
  };

  absl::Status Cu(CUresult r, absl::string_view what) const;

  // The driver's virtual memory management entry points, once.
  absl::Status LoadVmm();

  CUmemAllocationProp VmmProp() const;

  // `bytes` rounded up to the allocation granularity (the same on every
  // start on this device, so a kept allocation is mapped at its full size).
  absl::StatusOr<uint64_t> VmmSize(uint64_t bytes);

  // Reserves an address range for `v`, maps it read-write for this device,
  // and keeps it (released with the device). The pools: cudaIpcGetMemHandle
  // if the driver covers cuMemCreate memory, else its descriptor for
  // ExportPools' pools_fd_socket.
  absl::StatusOr<KeptMemory> MapVmm(Vmm v, bool pools);

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
  absl::Status Zero(void* p, uint64_t bytes);

  absl::Status Init();

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

  void ReturnEvent(cudaEvent_t e);

  cudaEvent_t TakeEvent();

  // Ends waits whose doorbell will never ring (their session ended) by
  // writing the awaited value from a side stream, which the blocked stream
  // does not hold up. The step's cancellation word goes first (the writes
  // are ordered, each after a memory barrier): the released call's check
  // kernel then fails, and nothing of it or of its step runs on inputs that
  // were never written.
  void ReleaseCancelledWaits() override;

  // Completes the in-flight works a batch at a time: the works up to and
  // including the next one that ends a batch, once its event has completed.
  void Reap();

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

}  // namespace cuda_internal
}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_DEVICE_CUDA_DEVICE_INTERNAL_H_
