// Commit mode DEFERRED's pending journal closed on CUDA: after a Verify's
// or a Flush's last write, when the table keeps a journal.
#ifndef SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_DONE_CUH_
#define SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_DONE_CUH_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/deferred/pending_journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// After a Verify's or a Flush's last write (plain stream order): the
// pending journal is idle again.
__global__ void PendingJournalDoneKernel(const PendingBlocks p) {
  deferred::PendingJournalMarkDone(p);
}

absl::Status LaunchPendingJournalDone(const PendingBlocks& p, cudaStream_t s) {
  PendingJournalDoneKernel<<<1, 1, 0, s>>>(p);
  return LaunchStatus(cudaGetLastError(), "pending journal");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_DONE_CUH_
