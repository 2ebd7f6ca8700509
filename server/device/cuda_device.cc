// The CUDA device's creation and teardown, the regions it maps from clients
// (CUDA IPC), interprocess events and health (cuda_device_internal.h says
// where the rest is).
#include <unistd.h>

#include <cstring>
#include <utility>

#include "server/base/log.h"

#include "server/device/cuda_device_internal.h"

namespace specstate {
namespace server {
namespace cuda_internal {
namespace {

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

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CudaDevice::Create(int ordinal, absl::Duration submit_spin) {
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

CudaDevice::~CudaDevice() {
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

absl::StatusOr<std::unique_ptr<MappedRegion>> CudaDevice::MapShm(absl::string_view, uint64_t,
                                                     uint64_t) {
  return absl::InvalidArgumentError(
      "this service runs the CUDA backend: register regions by cuda_ipc_handle, not shm_name");
}

absl::StatusOr<std::unique_ptr<MappedRegion>> CudaDevice::MapCudaIpc(absl::string_view handle, int device,
                                                         uint64_t offset_bytes,
                                                         uint64_t byte_size) {
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

absl::StatusOr<void*> CudaDevice::OpenIpcEvent(absl::string_view handle) {
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

CudaDevice::Health CudaDevice::CheckHealth() const {
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

absl::Status CudaDevice::Init() {
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

}  // namespace cuda_internal

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal,
                                                         absl::Duration submit_spin) {
  return cuda_internal::CudaDevice::Create(ordinal, submit_spin);
}

}  // namespace server
}  // namespace specstate
