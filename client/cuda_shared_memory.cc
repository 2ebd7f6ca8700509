// CUDA shared memory: cudaMalloc'd buffers exported by IPC handle, and the
// service's pools opened from theirs.
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/shared_memory.h"
#include "kernels/cuda_status.h"

namespace specstate {
namespace client {
namespace {

using kernels::CudaStatus;

class CudaBuffer final : public SharedBuffer {
 public:
  CudaBuffer(int device, void* data, uint64_t bytes, std::string handle)
      : device_(device), data_(data), bytes_(bytes), handle_(std::move(handle)) {}
  ~CudaBuffer() override { cudaFree(data_); }
  void* data() const override { return data_; }
  uint64_t byte_size() const override { return bytes_; }
  void Describe(v1::RegisterRegionRequest* r) const override {
    r->set_cuda_ipc_handle(handle_);
    r->set_device(device_);
    r->set_offset_bytes(0);
    r->set_byte_size(bytes_);
  }

 private:
  int device_;
  void* data_;
  uint64_t bytes_;
  std::string handle_;
};

class CudaPools final : public MappedPools {
 public:
  CudaPools(const v1::ExportPoolsResponse& d, void* base) : base_(base) { description_ = d; }
  ~CudaPools() override { cudaIpcCloseMemHandle(base_); }
  char* base() const override { return static_cast<char*>(base_); }

 private:
  void* base_;
};

class CudaIpcEvent final : public IpcEvent {
 public:
  CudaIpcEvent(cudaEvent_t event, std::string handle) : event_(event), handle_(std::move(handle)) {}
  ~CudaIpcEvent() override { cudaEventDestroy(event_); }
  std::string handle() const override { return handle_; }
  absl::Status Record() override {
    return CudaStatus(cudaEventRecord(event_, nullptr), "cudaEventRecord");
  }
  absl::Status Synchronize() override {
    return CudaStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  cudaEvent_t event_;
  std::string handle_;
};

class CudaSharedMemory final : public SharedMemory {
 public:
  explicit CudaSharedMemory(int device) : device_(device) {}
  v1::Backend backend() const override { return v1::CUDA; }

  absl::StatusOr<std::unique_ptr<SharedBuffer>> Allocate(uint64_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    absl::Status st = CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc");
    if (!st.ok()) return st;
    st = CudaStatus(cudaMemset(p, 0, bytes), "cudaMemset");
    // Zeroed before the service can map it and read it.
    if (st.ok()) st = CudaStatus(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
    cudaIpcMemHandle_t handle;
    if (st.ok()) st = CudaStatus(cudaIpcGetMemHandle(&handle, p), "cudaIpcGetMemHandle");
    if (!st.ok()) {
      cudaFree(p);
      return st;
    }
    return std::unique_ptr<SharedBuffer>(new CudaBuffer(
        device_, p, bytes, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
  }

  absl::StatusOr<std::unique_ptr<MappedPools>> MapPools(const v1::ExportPoolsResponse& d) override {
    if (d.cuda_ipc_handle().size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::FailedPreconditionError(
          "the service exports its pools by shared-memory name: this client uses CUDA");
    }
    cudaSetDevice(device_);
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, d.cuda_ipc_handle().data(), sizeof(handle));
    void* base = nullptr;
    absl::Status st =
        CudaStatus(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                   "cudaIpcOpenMemHandle of the pools");
    if (!st.ok()) return st;
    return std::unique_ptr<MappedPools>(new CudaPools(d, base));
  }

  absl::StatusOr<std::unique_ptr<IpcEvent>> CreateIpcEvent() override {
    cudaSetDevice(device_);
    cudaEvent_t event = nullptr;
    absl::Status st = CudaStatus(
        cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
    if (!st.ok()) return st;
    cudaIpcEventHandle_t handle;
    st = CudaStatus(cudaIpcGetEventHandle(&handle, event), "cudaIpcGetEventHandle");
    if (!st.ok()) {
      cudaEventDestroy(event);
      return st;
    }
    return std::unique_ptr<IpcEvent>(new CudaIpcEvent(
        event, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
  }

  absl::Status CopyIn(void* dst, const void* host, uint64_t bytes) override {
    absl::Status st =
        CudaStatus(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    // From pageable memory cudaMemcpy may return before the DMA lands; another
    // process (the service) must see the bytes once we return.
    return st.ok() ? CudaStatus(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize") : st;
  }
  absl::Status CopyOut(void* host, const void* src, uint64_t bytes) override {
    return CudaStatus(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }

 private:
  int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemory>> CreateCudaSharedMemory(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::UnavailableError("no CUDA device is available to this client");
  }
  return std::unique_ptr<SharedMemory>(new CudaSharedMemory(device));
}

}  // namespace client
}  // namespace specstate
