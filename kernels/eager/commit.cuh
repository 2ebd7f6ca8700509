// EAGER's Commit on CUDA: the plan kernel (every commit's checks and plan,
// the commit journal started, each row's replay indices), the conv
// compaction, the replay of every row and layer (kernels/common), then the
// commit journal's finish.
#ifndef SPECSTATE_KERNELS_EAGER_COMMIT_CUH_
#define SPECSTATE_KERNELS_EAGER_COMMIT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/commit_plan.h"
#include "kernels/common/cuda/commit_journal.cuh"
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// Checks, plans and writes the replay indices of a commit.
__device__ void EagerCommitPlan(const CommitArgs& a, int64_t num_blocks) {
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  if (!internal::CheckCommitPlan<internal::BlockChecker>(a, ws, num_blocks)) return;
  if (a.journal.record != nullptr) {  // before the commit's first write
    BlockStartCommitJournal(a, ws.plan, [] {});
  }
  const int q = a.spec_query_len;
  for (int item = threadIdx.x; item < a.num_rows * (q + 1); item += blockDim.x) {
    const int i = item / (q + 1);
    ws.replay_indices[item] = internal::ReplayIndex(ws.plan[i], q, item % (q + 1));
  }
}

__global__ void __launch_bounds__(kCheckThreads)
    EagerCommitPlanKernel(const CommitArgs a, int64_t num_blocks) {
  LetDependentsLaunch();
  EagerCommitPlan(a, num_blocks);
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

absl::Status LaunchEagerCommitKernels(const CommitArgs& a, cudaStream_t s) {
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  EagerCommitPlanKernel<<<1, kCheckThreads, 0, s>>>(a, num_blocks);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Commit");
  }
  const absl::Status st = common::LaunchConvCompactCuda(a, num_blocks, s);
  return st.ok() ? common::LaunchReplayRowsCuda(a, num_blocks, s) : st;
}

absl::Status LaunchEagerCommit(const CommitArgs& a, cudaStream_t s) {
  const absl::Status st = LaunchEagerCommitKernels(a, s);
  if (!st.ok() || a.journal.record == nullptr) return st;
  return LaunchJournalFinish(a, NothingBeforeRecords{}, s);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_EAGER_COMMIT_CUH_
