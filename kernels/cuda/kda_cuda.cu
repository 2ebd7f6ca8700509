// The CUDA backend (sm_90): the kernel interface (kda_kernels.h) on device
// memory and a CUDA stream. It only forwards: the verbs every mode shares
// to kernels/common, each commit mode's to its folder (kernels/eager,
// kernels/deferred, kernels/fast), whose launchers enqueue the call's
// kernels on the stream and never synchronize.
//
// Every call starts with a single-block check kernel (the values it checks
// live in device memory); the kernels that follow read its DeviceStatus
// first and return at once when it failed, so a rejected call writes nothing.
// One kernel template, PipelinedRecurrentKernel
// (kernels/common/cuda/pipelined_recurrent.cuh), is the stock spec-path
// kernel, RecoverSSM verify and the commit's replay: all run the per-token
// math of kernels/kda_math.h with the same thread layout and reduction
// order, so verify's outputs equal the stock kernel's and the replayed
// states equal the stock kernel's stored states bit for bit.
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/cuda_status.h"
#include "kernels/deferred/deferred_cuda.h"
#include "kernels/eager/eager_cuda.h"
#include "kernels/fast/cuda/interface_cuda.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {
namespace {

cudaStream_t Cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

class CudaKernels final : public KdaKernels {
 public:
  Backend backend() const override { return Backend::kCuda; }

 protected:
  absl::Status LaunchStock(const StockArgs& a, Stream s) const override {
    return common::LaunchStockCuda(a, Cuda(s));
  }
  absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& a, Stream s) const override {
    return common::LaunchRecordStateBlocksCuda(a, Cuda(s));
  }
  absl::Status LaunchLoadParams(const LoadParamsArgs& a, Stream s) const override {
    return common::LaunchLoadParamsCuda(a, Cuda(s));
  }

  absl::Status LaunchEagerVerify(const VerifyArgs& a, Stream s) const override {
    return eager::VerifyCuda(a, Cuda(s));
  }
  absl::Status LaunchEagerCommit(const CommitArgs& a, Stream s) const override {
    return eager::CommitCuda(a, Cuda(s));
  }

  absl::Status LaunchDeferredVerify(const VerifyArgs& a, Stream s) const override {
    return deferred::VerifyCuda(a, Cuda(s));
  }
  absl::Status LaunchDeferredCommit(const CommitArgs& a, Stream s) const override {
    return deferred::CommitCuda(a, Cuda(s));
  }
  absl::Status LaunchDeferredFlush(const FlushArgs& a, Stream s) const override {
    return deferred::FlushCuda(a, Cuda(s));
  }

  absl::Status LaunchFastVerify(const VerifyArgs& a, Stream s) const override {
    return fast::InterfaceVerifyCuda(a, Cuda(s));
  }
  absl::Status LaunchFastCommit(const CommitArgs& a, Stream s) const override {
    return fast::InterfaceCommitCuda(a, Cuda(s));
  }
  absl::Status LaunchFastFlush(const FlushArgs& a, Stream s) const override {
    return fast::InterfaceFlushCuda(a, Cuda(s));
  }
};

}  // namespace

absl::Status CopyToHostOnStream(void* host, const void* device, uint64_t bytes, Stream stream) {
  return common::CopyToHostCuda(host, device, bytes, Cuda(stream));
}

absl::StatusOr<const KdaKernels*> CudaKdaKernels() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device is available (",
                     err != cudaSuccess ? DescribeCudaError(err) : "no devices", ")"));
  }
  static const CudaKernels* const kernels = new CudaKernels();
  return kernels;
}

bool BuiltWithCuda() { return true; }

}  // namespace kernels
}  // namespace specstate
