// Commit mode DEFERRED's Verify on CUDA: the check kernel (every Verify's
// checks, then its own: no two rows verifying from a block with tokens
// pending; each row takes its block's entry, the pending journal first when
// the table has one), then the recurrent kernel's kReplayVerify items: a
// row's pending tokens replayed, its checkpoint written once, its window
// verified, its records to the other buffer.
#ifndef SPECSTATE_KERNELS_DEFERRED_VERIFY_CUH_
#define SPECSTATE_KERNELS_DEFERRED_VERIFY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/cuda/pipelined_recurrent.cuh"
#include "kernels/common/cuda/recurrent_launch.cuh"
#include "kernels/common/cuda/verify_checks.cuh"
#include "kernels/deferred/pending.h"
#include "kernels/deferred/pending_journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// After the other checks (deferred_cpu.cc's TakePendingTokens, on one
// block): no two rows may verify from a block with pending tokens in the
// layer; then each row takes its block's entry and the table forgets it.
__device__ bool BlockTakePendingTokens(const VerifyArgs& a) {
  int32_t* const entries = deferred::PendingEntriesOf(a.pending, a.layer);
  const int32_t* const source = internal::VerifiedStateIndices(a);
  if (!internal::BlockChecker::OneUserABlock(
          a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
          [&](int n) { return source[n]; }, [&](int32_t b) { return entries[b] != 0; },
          [](int32_t b, int n) { return deferred::PendingSharedFault(b, n); })) {
    return false;
  }
  if (a.pending.journal != nullptr) {  // before the table or a checkpoint changes
    __shared__ int journaled;
    if (threadIdx.x == 0) journaled = 0;
    __syncthreads();
    for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
      if (internal::IsBlock(source[n]) && entries[source[n]] != 0) {
        deferred::PendingJournalList(a.pending, atomicAdd(&journaled, 1), source[n]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      deferred::PendingJournalMarkStarted(a.pending, kPendingVerify, journaled, a.layer, 0);
    }
    __syncthreads();
  }
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    a.replay_plan[n] = internal::IsBlock(source[n]) ? entries[source[n]] : 0;
  }
  __syncthreads();  // rows sharing a block (with nothing pending) read it before it is cleared
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    if (internal::IsBlock(source[n])) entries[source[n]] = 0;
  }
  return true;
}

__global__ void __launch_bounds__(kCheckThreads) DeferredVerifyCheckKernel(const VerifyArgs a) {
  LetDependentsLaunch();
  // The block knows whether it failed: no reload of its status to decide.
  bool passed = VerifyChecks(a);
  if (passed) passed = BlockTakePendingTokens(a);
  if (!passed && a.status_mirror != nullptr && threadIdx.x == 0) *a.status_mirror = *a.status;
}

absl::Status LaunchDeferredVerify(const VerifyArgs& a, cudaStream_t s) {
  DeferredVerifyCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Verify");
  }
  RecurrentLaunch p = VerifyLaunchOf(a);
  p.max_tokens = 2 * a.records.q;
  p.replay_plan = a.replay_plan;
  p.pending_buffer = deferred::PendingBufferWord(a.pending);
  p.records[0] = a.records;
  p.records[1] = a.records_alt;
  const size_t elem = DTypeSize(a.shape.act_dtype);
  p.async_inputs = p.async_inputs && RecordsAligned(a.records, a.shape, elem) &&
                   RecordsAligned(a.records_alt, a.shape, elem);
  return LaunchRecurrent<Mode::kReplayVerify>(a.shape, p, 1, s, "Verify");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_VERIFY_CUH_
