// The commit journal on CUDA (common/journal.h), for the modes that keep it
// (all three): listed and marked started by the commit's plan kernel
// before its first write (BlockStartCommitJournal), recorded and marked
// committed by a kernel after its last (JournalFinishKernel).
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_COMMIT_JOURNAL_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_COMMIT_JOURNAL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// In the plan kernel, once its checks passed (every thread of the block):
// each row's blocks listed, list_more() (what the mode lists besides), then
// the record marked started.
template <typename ListMore>
__device__ void BlockStartCommitJournal(const CommitArgs& a, const CommitPlanRow* plan,
                                        ListMore list_more) {
  __syncthreads();
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    internal::JournalListRow(a, plan[i], i);
  }
  list_more();
  __syncthreads();
  if (threadIdx.x == 0) internal::JournalMarkStarted(a.journal, a.num_rows);
  __syncthreads();
}

// After the commit's last write (plain stream order, no programmatic
// dependency): before_records() (DEFERRED: its pending journal closed), the
// listed blocks' records, then "committed". Does nothing when the record
// does not hold this commit, started (its checks failed).
template <typename BeforeRecords>
__global__ void __launch_bounds__(kCheckThreads)
    JournalFinishKernel(const CommitJournal j, const BeforeRecords before_records,
                        int64_t num_blocks) {
  if (!internal::JournalOpenFor(j)) return;  // the same for every thread
  before_records();
  const uint64_t sequence = j.record->commits + 1;
  const int rows = internal::JournalRows(j);
  for (int e = threadIdx.x; e < 2 * rows; e += blockDim.x) {
    internal::JournalRecordEntry(j, num_blocks, e, j.step, sequence);
  }
  __syncthreads();
  if (threadIdx.x == 0) internal::JournalMarkCommitted(j, sequence);
}

// Nothing before the journal's records (EAGER and FAST keep no pending
// journal).
struct NothingBeforeRecords {
  __device__ void operator()() const {}
};

template <typename BeforeRecords>
absl::Status LaunchJournalFinish(const CommitArgs& a, const BeforeRecords& before_records,
                                 cudaStream_t s) {
  JournalFinishKernel<<<1, kCheckThreads, 0, s>>>(a.journal, before_records,
                                                  a.layers[0].state.num_blocks);
  return LaunchStatus(cudaGetLastError(), "Commit");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_COMMIT_JOURNAL_CUH_
