// Commit mode DEFERRED's Commit on CUDA: the plan kernel (every commit's
// checks and plan, DEFERRED's own checks, both journals started, then the
// deferral: the replay list and the new pending entries), the conv
// compaction, the replay of the list (kernels/common), then the commit
// journal's finish, which closes the pending journal.
#ifndef SPECSTATE_KERNELS_DEFERRED_COMMIT_CUH_
#define SPECSTATE_KERNELS_DEFERRED_COMMIT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/commit_plan.h"
#include "kernels/common/cuda/commit_journal.cuh"
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/deferred/pending.h"
#include "kernels/deferred/pending_journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// After the commit's checks (deferred_cpu.cc's DeferCommit, on one block):
// the replay list (what the previous commit left pending that no Verify
// took; the rows that are not deferred), then the deferred rows' pending
// entries, in the records buffer this step's Verify calls wrote.
__device__ void BlockDeferCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int q = a.spec_query_len;
  const int L = a.num_layers;
  const int32_t buffer = *deferred::PendingBufferWord(p);  // the previous commit's records
  const int32_t listed = *deferred::PendingListSize(p);
  int32_t* const list = deferred::PendingList(p);
  __shared__ int jobs, newly_listed;
  if (threadIdx.x == 0) jobs = newly_listed = 0;
  __syncthreads();
  for (int x = threadIdx.x; x < listed * L; x += blockDim.x) {
    const int32_t block = list[x / L];
    const int l = x % L;
    const int32_t entry = atomicExch(&deferred::PendingEntriesOf(p, l)[block], 0);
    if (entry != 0) {
      a.jobs.jobs[atomicAdd(&jobs, 1)] =
          deferred::PendingJob(l, block, deferred::UnpackPending(entry), q);
    }
  }
  for (int x = threadIdx.x; x < a.num_rows * L; x += blockDim.x) {
    const int i = x / L;
    if (internal::CommitsAnything(plan[i]) && !deferred::DefersCommit(plan[i])) {
      a.jobs.jobs[atomicAdd(&jobs, 1)] = deferred::CommitJob(x % L, plan[i], i, 1 - buffer, q);
    }
  }
  __syncthreads();  // the old list and entries are read before the new ones are written
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    if (deferred::DefersCommit(plan[i])) list[atomicAdd(&newly_listed, 1)] = plan[i].source;
  }
  for (int x = threadIdx.x; x < a.num_rows * L; x += blockDim.x) {
    const CommitPlanRow& row = plan[x / L];
    if (deferred::DefersCommit(row)) {
      deferred::PendingEntriesOf(p, x % L)[row.source] =
          deferred::PackPending(x / L, 1 - buffer, row.commit_len);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *deferred::PendingListSize(p) = newly_listed;
    *deferred::PendingBufferWord(p) = 1 - buffer;
    *a.jobs.count = jobs;
  }
}

// With kept pools, before the commit's first write (deferred_cpu.cc's
// ListDeferredCommit, on one block): the pending journal lists the old
// pending list and every block a row writes, and is marked started.
__device__ void BlockListDeferredCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int listed = *deferred::PendingListSize(p);
  const int32_t* const list = deferred::PendingList(p);
  __shared__ int journaled;
  if (threadIdx.x == 0) journaled = listed;
  for (int j = threadIdx.x; j < listed; j += blockDim.x) {
    deferred::PendingJournalList(p, j, list[j]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    internal::ForEachCommitWrite(a, plan[i], i, [&](int32_t b, CheckedField, int32_t, int32_t) {
      deferred::PendingJournalList(p, atomicAdd(&journaled, 1), b);
    });
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    deferred::PendingJournalMarkStarted(p, kPendingCommit, journaled, -1, a.journal.step);
  }
}

// Checks and plans a commit, lists and starts its journals, defers.
__device__ void DeferredCommitPlan(const CommitArgs& a, int64_t num_blocks) {
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  if (!internal::CheckCommitPlan<internal::BlockChecker>(a, ws, num_blocks)) return;
  // DEFERRED's own checks come first: a commit whose checks fail leaves
  // the journals alone.
  if (!internal::BlockChecker::Rows(a.num_rows, a.status, [&](int i) {
        return deferred::CheckDeferredCommitRow(a, ws.plan[i], i);
      })) {
    return;
  }
  if (a.journal.record != nullptr) {  // before the commit's first write
    BlockStartCommitJournal(a, ws.plan, [&] {
      if (a.pending.journal != nullptr) BlockListDeferredCommit(a, ws.plan);
    });
  }
  BlockDeferCommit(a, ws.plan);
}

__global__ void __launch_bounds__(kCheckThreads)
    DeferredCommitPlanKernel(const CommitArgs a, int64_t num_blocks) {
  LetDependentsLaunch();
  DeferredCommitPlan(a, num_blocks);
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

// Before the commit journal's records: the pending journal closed.
struct ClosePendingJournal {
  PendingBlocks pending;
  __device__ void operator()() const {
    if (pending.journal != nullptr && threadIdx.x == 0) deferred::PendingJournalMarkDone(pending);
  }
};

absl::Status LaunchDeferredCommitKernels(const CommitArgs& a, cudaStream_t s) {
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  DeferredCommitPlanKernel<<<1, kCheckThreads, 0, s>>>(a, num_blocks);
  // A commit without rows still materializes what the previous one left
  // pending.
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return LaunchStatus(err, "Commit");
  }
  if (a.num_rows > 0) {
    if (absl::Status st = common::LaunchConvCompactCuda(a, num_blocks, s); !st.ok()) return st;
  }
  return common::LaunchReplayListCuda(a.shape, a.spec_query_len, a.num_layers, a.layers,
                                      a.device_layers, a.jobs, a.status, s, "Commit",
                                      /*usually_empty=*/a.block_table.data == nullptr);
}

absl::Status LaunchDeferredCommit(const CommitArgs& a, cudaStream_t s) {
  const absl::Status st = LaunchDeferredCommitKernels(a, s);
  if (!st.ok() || a.journal.record == nullptr) return st;
  return LaunchJournalFinish(a, ClosePendingJournal{a.pending}, s);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_COMMIT_CUH_
