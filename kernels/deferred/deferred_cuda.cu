// Commit mode DEFERRED on the CUDA backend (deferred_cuda.h): the recurrent
// kernel's kReplayVerify instantiation and DEFERRED's check and plan
// kernels.
#include "kernels/deferred/commit.cuh"
#include "kernels/deferred/deferred_cuda.h"
#include "kernels/deferred/flush.cuh"
#include "kernels/deferred/pending_journal_done.cuh"
#include "kernels/deferred/verify.cuh"

namespace specstate {
namespace kernels {
namespace deferred {

absl::Status VerifyCuda(const VerifyArgs& a, cudaStream_t s) {
  const absl::Status st = LaunchDeferredVerify(a, s);
  if (!st.ok() || a.pending.journal == nullptr) return st;
  return LaunchPendingJournalDone(a.pending, s);
}

absl::Status CommitCuda(const CommitArgs& a, cudaStream_t s) { return LaunchDeferredCommit(a, s); }

absl::Status FlushCuda(const FlushArgs& a, cudaStream_t s) {
  const absl::Status st = LaunchDeferredFlush(a, s);
  // (A copy journals nothing: it changes neither the table nor a pool.)
  if (!st.ok() || a.pending.journal == nullptr || a.copy.data != nullptr) return st;
  return LaunchPendingJournalDone(a.pending, s);
}

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate
