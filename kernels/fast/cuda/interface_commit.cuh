// FAST's Commit through the kernel interface on CUDA: the plan kernel (every
// commit's checks and plan, then FAST's: every layer's cursors and
// candidates, each written block's ring empty, one row a checkpoint block;
// then, with kept pools, the commit journal started), the conv compaction
// (kernels/common), kernels/fast/cuda's Commit along the checked plan,
// gated on its status, and the journal's finish.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_COMMIT_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_COMMIT_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/commit_plan.h"
#include "kernels/common/cuda/commit_journal.cuh"
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/fast/checks.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/from_interface.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// (cpu/interface_cpu.cc's RunCommit's checks, on one block: an item per row
// and layer, in the CPU's order.)
__device__ void FastCommitPlan(const CommitArgs& a, int64_t num_blocks) {
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  if (!internal::CheckCommitPlan<internal::BlockChecker>(a, ws, num_blocks)) return;
  if (!fast::CheckFastCommit<internal::BlockChecker>(
          a, ws, a.num_layers, [&](int l) { return a.device_layers[l].fast; })) {
    return;
  }
  if (a.journal.record != nullptr) {  // before the commit's first write
    BlockStartCommitJournal(a, ws.plan, [] {});
  }
}

__global__ void __launch_bounds__(kCheckThreads)
    FastCommitPlanKernel(const CommitArgs a, int64_t num_blocks) {
  LetDependentsLaunch();
  FastCommitPlan(a, num_blocks);
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

absl::Status LaunchFastInterfaceCommitKernels(const CommitArgs& a, cudaStream_t s) {
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  FastCommitPlanKernel<<<1, kCheckThreads, 0, s>>>(a, num_blocks);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Commit");
  }
  if (absl::Status st = common::LaunchConvCompactCuda(a, num_blocks, s); !st.ok()) return st;
  const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
  fast::FastCommitArgs f = fast::FastCommitArgsOf(a, layers.data());
  f.plan = internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks).plan;
  f.gate = a.status;
  return fast::RunFastCommitCuda(f, s);
}

absl::Status LaunchFastInterfaceCommit(const CommitArgs& a, cudaStream_t s) {
  const absl::Status st = LaunchFastInterfaceCommitKernels(a, s);
  if (!st.ok() || a.journal.record == nullptr) return st;
  return LaunchJournalFinish(a, NothingBeforeRecords{}, s);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_COMMIT_CUH_
