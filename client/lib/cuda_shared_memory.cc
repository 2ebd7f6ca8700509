// CUDA shared memory: cudaMalloc'd buffers exported by IPC handle, and the
// service's pools opened from theirs.
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "client/lib/shared_memory.h"
#include "keeper/fd_passing.h"
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

// Kept pools (a cuMemCreate allocation) imported from the descriptor the
// service hands out on ExportPools' pools_fd_socket, mapped read-write here.
struct VmmApi {
  using ImportFn = CUresult (*)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  using ReserveFn = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  using FreeFn = CUresult (*)(CUdeviceptr, size_t);
  using MapFn = CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                             unsigned long long);
  using UnmapFn = CUresult (*)(CUdeviceptr, size_t);
  using AccessFn = CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  using ReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
  ImportFn import = nullptr;
  ReserveFn reserve = nullptr;
  FreeFn free = nullptr;
  MapFn map = nullptr;
  UnmapFn unmap = nullptr;
  AccessFn access = nullptr;
  ReleaseFn release = nullptr;

  static absl::StatusOr<VmmApi> Load() {
    VmmApi api;
    const auto entry = [](const char* name, auto* fn) -> absl::Status {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult result;
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &result) !=
              cudaSuccess ||
          result != cudaDriverEntryPointSuccess || p == nullptr) {
        return absl::UnavailableError(absl::StrCat("the CUDA driver has no ", name));
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return absl::OkStatus();
    };
    absl::Status st = entry("cuMemImportFromShareableHandle", &api.import);
    if (st.ok()) st = entry("cuMemAddressReserve", &api.reserve);
    if (st.ok()) st = entry("cuMemAddressFree", &api.free);
    if (st.ok()) st = entry("cuMemMap", &api.map);
    if (st.ok()) st = entry("cuMemUnmap", &api.unmap);
    if (st.ok()) st = entry("cuMemSetAccess", &api.access);
    if (st.ok()) st = entry("cuMemRelease", &api.release);
    if (!st.ok()) return st;
    return api;
  }
};

class VmmPools final : public MappedPools {
 public:
  VmmPools(const v1::ExportPoolsResponse& d, VmmApi api, CUmemGenericAllocationHandle handle,
           CUdeviceptr base, size_t bytes)
      : api_(api), handle_(handle), base_(base), bytes_(bytes) {
    description_ = d;
  }
  ~VmmPools() override {
    api_.unmap(base_, bytes_);
    api_.free(base_, bytes_);
    api_.release(handle_);
  }
  char* base() const override { return reinterpret_cast<char*>(base_); }

 private:
  VmmApi api_;
  CUmemGenericAllocationHandle handle_;
  CUdeviceptr base_;
  size_t bytes_;
};

absl::StatusOr<std::unique_ptr<MappedPools>> MapVmmPools(const v1::ExportPoolsResponse& d,
                                                         int device) {
  absl::StatusOr<VmmApi> api = VmmApi::Load();
  if (!api.ok()) return api.status();
  absl::StatusOr<int> socket = keeper::ConnectSeqpacket(d.pools_fd_socket());
  if (!socket.ok()) return socket.status();
  absl::StatusOr<keeper::FdMessage> got = keeper::ReceiveWithFds(*socket, absl::Seconds(10));
  close(*socket);
  if (!got.ok()) {
    return absl::Status(got.status().code(), absl::StrCat("the pools' descriptor from ",
                                                          d.pools_fd_socket(), ": ",
                                                          got.status().message()));
  }
  if (got->fds.size() != 1) {
    keeper::CloseAll(&got->fds);
    return absl::DataLossError(absl::StrCat(d.pools_fd_socket(), " sent ", got->fds.size(),
                                            " descriptors, not the pools' one"));
  }
  const int fd = got->fds[0];
  const size_t bytes = d.pools_fd_bytes();
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = api->import(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);  // the imported handle holds the allocation
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemImportFromShareableHandle of the pools: error ",
                                            static_cast<int>(r)));
  }
  CUdeviceptr base = 0;
  r = api->reserve(&base, bytes, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = api->map(base, bytes, 0, handle, 0);
    if (r != CUDA_SUCCESS) api->free(base, bytes);
  }
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = api->access(base, bytes, &access, 1);
    if (r != CUDA_SUCCESS) {
      api->unmap(base, bytes);
      api->free(base, bytes);
    }
  }
  if (r != CUDA_SUCCESS) {
    api->release(handle);
    return absl::InternalError(absl::StrCat("mapping the imported pools (", bytes,
                                            " bytes): CUDA driver error ", static_cast<int>(r)));
  }
  return std::unique_ptr<MappedPools>(new VmmPools(d, *api, handle, base, bytes));
}

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
    if (!d.pools_fd_socket().empty()) {  // kept pools: the descriptor, not an IPC handle
      cudaSetDevice(device_);
      cudaFree(nullptr);  // the primary context, current: the driver calls need it
      return MapVmmPools(d, device_);
    }
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
