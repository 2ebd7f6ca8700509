// The CUDA device's memory: the exported pools, the service's own device and
// pinned host allocations, copies, and kept memory (cuMemCreate allocations
// with POSIX file descriptors, so that the pools outlive the process).
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "server/device/cuda_device_internal.h"

namespace specstate {
namespace server {
namespace cuda_internal {

absl::StatusOr<uint64_t> CudaDevice::FreeBytes() const {
  ScopedDevice scoped(ordinal_);
  size_t free = 0, total = 0;
  SPECSTATE_CUDA_RETURN(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  // Kept pools not yet handed to the engine are already allocated: the
  // engine counts them among what it needs.
  return uint64_t{free} + (kept_pools_ && !exported_taken_ ? exported_bytes_ : 0);
}

absl::StatusOr<void*> CudaDevice::AllocateExported(uint64_t bytes) {
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

absl::StatusOr<CudaDevice::KeptMemory> CudaDevice::AllocateKept(uint64_t bytes, bool pools) {
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

absl::StatusOr<CudaDevice::KeptMemory> CudaDevice::AttachKept(int fd, uint64_t bytes, bool pools) {
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

absl::StatusOr<void*> CudaDevice::AllocateDevice(uint64_t bytes) {
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

absl::StatusOr<void*> CudaDevice::AllocateHost(uint64_t bytes) {
  ScopedDevice scoped(ordinal_);
  void* p = nullptr;
  SPECSTATE_CUDA_RETURN(cudaMallocHost(&p, bytes == 0 ? 4 : bytes),
                        absl::StrCat("cudaMallocHost of ", bytes, " bytes"));
  std::memset(p, 0, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  host_allocations_.push_back(p);
  return p;
}

absl::Status CudaDevice::CopyToDevice(void* device, const void* host, uint64_t bytes) {
  return SubmitAndWait([=](kernels::Stream s) {
    const auto stream = static_cast<cudaStream_t>(s);
    return CudaStatus(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream),
                      "cudaMemcpyAsync");
  });
}

absl::Status CudaDevice::CopyFromDevice(void* host, const void* device, uint64_t bytes) {
  return SubmitAndWait([=](kernels::Stream s) {
    const auto stream = static_cast<cudaStream_t>(s);
    return CudaStatus(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
                      "cudaMemcpyAsync");
  });
}

absl::Status CudaDevice::CopyOnStream(void* dst, const void* src, uint64_t bytes,
                          kernels::Stream stream) {
  SPECSTATE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                        static_cast<cudaStream_t>(stream)),
                        "cudaMemcpyAsync");
  return absl::OkStatus();
}

absl::Status CudaDevice::ZeroOnStream(void* dst, uint64_t bytes, kernels::Stream stream) {
  SPECSTATE_CUDA_RETURN(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)),
                        "cudaMemsetAsync");
  return absl::OkStatus();
}

absl::Status CudaDevice::Cu(CUresult r, absl::string_view what) const {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  if (get_error_string_ == nullptr || get_error_string_(r, &name) != CUDA_SUCCESS) name = nullptr;
  return absl::InternalError(
      absl::StrCat(what, " failed: CUDA driver error ", static_cast<int>(r),
                   name != nullptr ? absl::StrCat(" (", name, ")") : std::string()));
}

absl::Status CudaDevice::LoadVmm() {
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

CUmemAllocationProp CudaDevice::VmmProp() const {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

absl::StatusOr<uint64_t> CudaDevice::VmmSize(uint64_t bytes) {
  const CUmemAllocationProp prop = VmmProp();
  size_t granularity = 0;
  absl::Status st = Cu(mem_granularity_(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                       "cuMemGetAllocationGranularity");
  if (!st.ok()) return st;
  if (granularity == 0) granularity = 2 << 20;
  return (std::max<uint64_t>(bytes, 1) + granularity - 1) / granularity * granularity;
}

absl::StatusOr<CudaDevice::KeptMemory> CudaDevice::MapVmm(Vmm v, bool pools) {
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

absl::Status CudaDevice::Zero(void* p, uint64_t bytes) {
  return SubmitAndWait([=](kernels::Stream s) {
    const auto stream = static_cast<cudaStream_t>(s);
    return CudaStatus(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync");
  });
}

}  // namespace cuda_internal
}  // namespace server
}  // namespace specstate
