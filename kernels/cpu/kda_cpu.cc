// The CPU backend: the kernel interface (kda_kernels.h) on host memory,
// run on the calling thread (the "stream" is ignored). It only forwards:
// the verbs every mode shares to kernels/common, each commit mode's to its
// folder (kernels/eager, kernels/deferred, kernels/fast), which run the
// same checks (kernels/checks) and per-token math (kernels/kda_math.h) as
// the CUDA backend's kernels, so both accept, reject and plan alike.
#include "absl/status/status.h"
#include "kernels/common/cpu/common_cpu.h"
#include "kernels/deferred/deferred_cpu.h"
#include "kernels/eager/eager_cpu.h"
#include "kernels/fast/cpu/interface_cpu.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {
namespace {

class CpuKernels final : public KdaKernels {
 public:
  Backend backend() const override { return Backend::kCpu; }

 protected:
  absl::Status LaunchStock(const StockArgs& a, Stream) const override {
    common::StockCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& a, Stream) const override {
    common::RecordStateBlocksCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchLoadParams(const LoadParamsArgs& a, Stream) const override {
    common::LoadParamsCpu(a);
    return absl::OkStatus();
  }

  absl::Status LaunchEagerVerify(const VerifyArgs& a, Stream) const override {
    eager::VerifyCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchEagerCommit(const CommitArgs& a, Stream) const override {
    eager::CommitCpu(a);
    return absl::OkStatus();
  }

  absl::Status LaunchDeferredVerify(const VerifyArgs& a, Stream) const override {
    deferred::VerifyCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchDeferredCommit(const CommitArgs& a, Stream) const override {
    deferred::CommitCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchDeferredFlush(const FlushArgs& a, Stream) const override {
    deferred::FlushCpu(a);
    return absl::OkStatus();
  }

  absl::Status LaunchFastVerify(const VerifyArgs& a, Stream) const override {
    fast::InterfaceVerifyCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchFastCommit(const CommitArgs& a, Stream) const override {
    fast::InterfaceCommitCpu(a);
    return absl::OkStatus();
  }
  absl::Status LaunchFastFlush(const FlushArgs& a, Stream) const override {
    fast::InterfaceFlushCpu(a);
    return absl::OkStatus();
  }
};

}  // namespace

const KdaKernels& CpuKdaKernels() {
  static const CpuKernels* const kernels = new CpuKernels();
  return *kernels;
}

}  // namespace kernels
}  // namespace specstate
