#include "tests/bench/cuda_check.h"

namespace specstate {
namespace bench {
namespace {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
StreamValueFn wait_value32 = nullptr;
StreamValueFn write_value32 = nullptr;

StreamValueFn Entry(const char* name) {
  cudaDriverEntryPointQueryResult r;
  void* p = nullptr;
  CHECK_CUDA(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &r));
  if (p == nullptr) {
    std::fprintf(stderr, "the driver has no %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<StreamValueFn>(p);
}

}  // namespace

void LoadStreamValueOps() {
  wait_value32 = Entry("cuStreamWaitValue32");
  write_value32 = Entry("cuStreamWriteValue32");
}

void WaitGeq(cudaStream_t stream, const uint32_t* counter, uint32_t value) {
  if (wait_value32(stream, reinterpret_cast<CUdeviceptr>(counter), value,
                   CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuStreamWaitValue32 failed\n");
    std::exit(1);
  }
}

void Ring(cudaStream_t stream, uint32_t* counter, uint32_t value) {
  if (write_value32(stream, reinterpret_cast<CUdeviceptr>(counter), value, 0) != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuStreamWriteValue32 failed\n");
    std::exit(1);
  }
}

}  // namespace bench
}  // namespace specstate
