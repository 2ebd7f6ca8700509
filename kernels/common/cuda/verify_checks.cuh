// Verify's checks on CUDA, every commit mode's (the first part of each
// mode's Verify check kernel): the prerequisites, each row's indices read
// once into the snapshot (or against the expected values), each row's
// window and block. As common/cpu's VerifyChecksCpu, on one block.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_VERIFY_CHECKS_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_VERIFY_CHECKS_CUH_

#include <climits>

#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/verify_rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// Whether every check passed (to every thread). The prerequisites and the
// caller's indices are loaded in one round (phase one of checks.h: each
// index once, into the snapshot or against the expected values); the
// barrier in resolving the prerequisites makes the snapshot visible to the
// whole block, and phase two checks it.
__device__ bool VerifyChecks(const VerifyArgs& a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  const internal::PrerequisiteLoads prerequisites = internal::LoadPrerequisites(a.prerequisites);
  internal::RowFault mismatch = internal::NoFault();
  int mismatch_row = INT_MAX;
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    const internal::RowFault f = internal::SnapshotVerifyRow(a, n, internal::LoadVerifyRow(a, n));
    if (f.problem != 0 && mismatch_row == INT_MAX) {
      mismatch = f;
      mismatch_row = n;
    }
  }
  // Its barrier orders the OK status before any fault's.
  if (!internal::BlockResolvePrerequisites(prerequisites, a.status)) return false;
  internal::VerifyRow unused;
  return internal::BlockCheckRows(a.num_rows, a.status, [&](int n) {
    return n == mismatch_row ? mismatch : internal::CheckVerifyRow(a, n, &unused);
  });
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_VERIFY_CHECKS_CUH_
