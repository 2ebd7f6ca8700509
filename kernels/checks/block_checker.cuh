// The CUDA backend's runner of the shared device checks (kernels/checks/):
// every thread of one block (a call's first kernel is a single-block check
// kernel), the lowest failing row reported as on the CPU. BlockChecker
// offers cpu_checker.h's calls, so a sequence of checks written once
// (CheckCommitPlan, a mode's own) runs alike on both backends. Every thread
// of the block calls each of them and gets the same answer.
//
//   if (!BlockChecker::Rows(a.num_rows, a.status, [&](int n) { return CheckX(a, n); })) return;
#ifndef SPECSTATE_KERNELS_CHECKS_BLOCK_CHECKER_CUH_
#define SPECSTATE_KERNELS_CHECKS_BLOCK_CHECKER_CUH_

#include <climits>
#include <cstdint>

#include "kernels/checks/prerequisites.h"
#include "kernels/checks/rows.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {
namespace {

// Runs check(x) over items 0 .. count - 1; the fault of the lowest failing
// item goes to `status`, reported for row row_of(x). Returns (to every
// thread) whether all items passed.
template <typename Check, typename RowOf>
__device__ bool BlockCheckItems(int count, DeviceStatus* status, Check check, RowOf row_of) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  __syncthreads();
  RowFault fault = NoFault();
  int fault_item = INT_MAX;
  for (int x = threadIdx.x; x < count; x += blockDim.x) {
    const RowFault f = check(x);
    if (f.problem != 0) {
      fault = f;
      fault_item = x;
      break;  // items grow with the loop: this is the thread's lowest
    }
  }
  if (fault_item != INT_MAX) atomicMin(&lowest, fault_item);
  __syncthreads();
  const int result = lowest;
  if (fault_item != INT_MAX && fault_item == result) {
    *status = StatusFromFault(fault, row_of(fault_item), -1);
  }
  __syncthreads();
  return result == INT_MAX;
}

// Runs check(n) over all rows; the fault of the lowest failing row goes to
// `status`. Returns (to every thread) whether all rows passed.
template <typename Check>
__device__ bool BlockCheckRows(int num_rows, DeviceStatus* status, Check check) {
  return BlockCheckItems(num_rows, status, check, [](int n) { return n; });
}

// One row a block, where it matters (cpu_checker.h's OneUserABlock, on one
// block): the lowest row using a block (block_of(n); null blocks skipped)
// owns it, and the lowest other row using a block for which guarded(block)
// holds is the fault fault(block, n), reported against the owner. (FAST:
// every block; DEFERRED Verify: blocks with tokens pending.) `owner` is
// zero on entry and on return.
template <typename BlockOf, typename Guarded, typename Fault>
__device__ bool BlockCheckOneUserABlock(int num_rows, int32_t* owner, DeviceStatus* status,
                                        BlockOf block_of, Guarded guarded, Fault fault) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) atomicMax(&owner[b], OwnerTag(n));
  }
  __syncthreads();
  int fault_row = INT_MAX, other_row = -1;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (!IsBlock(b) || !guarded(b)) continue;
    const int user = OwnerRow(__ldcg(&owner[b]));
    if (user != n) {
      fault_row = n;  // rows grow with the loop: this is the thread's lowest
      other_row = user;
      break;
    }
  }
  if (fault_row != INT_MAX) atomicMin(&lowest, fault_row);
  __syncthreads();
  const int failed = lowest;
  if (fault_row != INT_MAX && fault_row == failed) {
    *status = StatusFromFault(fault(block_of(fault_row), fault_row), fault_row, other_row);
  }
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) owner[b] = 0;
  }
  __syncthreads();
  return failed == INT_MAX;
}

// A thread's share of the prerequisites, loaded into registers: each
// dependent round of global loads costs a check kernel about half a
// microsecond, so every load of the checks is issued before any is used.
struct PrerequisiteLoads {
  // Thread 0's: the cancellation, else the input fault (which no device
  // memory can raise: the word is for the CPU backend; read for symmetry).
  RowFault cancelled = NoFault();
  int lowest_failed = INT_MAX;  // this thread's statuses
};

__device__ PrerequisiteLoads LoadPrerequisites(const Prerequisites& p) {
  PrerequisiteLoads loads;
  if (threadIdx.x == 0) {
    loads.cancelled = CheckCancelled(p);
    if (loads.cancelled.problem == 0) loads.cancelled = CheckInputFault(p.input_fault);
  }
  for (int i = threadIdx.x; i < p.count; i += blockDim.x) {
    if (p.statuses[i].failed != 0) {
      loads.lowest_failed = i;
      break;  // i grows with the loop: this is the thread's lowest
    }
  }
  return loads;
}

// False (to every thread, with the status written) when a prerequisite failed.
__device__ bool BlockResolvePrerequisites(const PrerequisiteLoads& loads, DeviceStatus* status) {
  __shared__ int lowest_failed;
  __shared__ bool cancelled;
  if (threadIdx.x == 0) {
    lowest_failed = INT_MAX;
    cancelled = loads.cancelled.problem != 0;
    if (cancelled) *status = StatusFromFault(loads.cancelled, -1, -1);
  }
  __syncthreads();
  if (cancelled) return false;
  if (loads.lowest_failed != INT_MAX) atomicMin(&lowest_failed, loads.lowest_failed);
  __syncthreads();
  const int failed = lowest_failed;
  if (failed != INT_MAX && threadIdx.x == 0) {
    *status = StatusFromFault(MakeFault(CheckedField::kPrerequisites,
                                        CheckProblem::kPrerequisiteFailed, failed, -1, 0, 0),
                              -1, -1);
  }
  __syncthreads();
  return failed == INT_MAX;
}

__device__ bool BlockCheckPrerequisites(const Prerequisites& p, DeviceStatus* status) {
  return BlockResolvePrerequisites(LoadPrerequisites(p), status);
}

// The cross-row pass of checks.h on one block. `owner` is zero on entry and on return.
template <typename Writes, typename Reads>
__device__ bool BlockCheckCrossRow(int num_rows, int32_t* owner, DeviceStatus* status,
                                   Writes writes, Reads reads) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    writes(n,
           [&](int32_t b, CheckedField, int32_t, int32_t) { atomicMax(&owner[b], OwnerTag(n)); });
  }
  __syncthreads();
  RowFault fault = NoFault();
  int fault_row = INT_MAX;
  int other_row = -1;
  for (int n = threadIdx.x; n < num_rows && fault_row == INT_MAX; n += blockDim.x) {
    writes(n, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
      const int other = OwnerRow(__ldcg(&owner[b]));
      if (fault_row == INT_MAX && other != n) {
        fault = MakeFault(field, CheckProblem::kDuplicateWrite, index, col, b, 0);
        fault_row = n;
        other_row = other;
      }
    });
    reads(n, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
      const int32_t tag = __ldcg(&owner[b]);
      if (fault_row == INT_MAX && tag != 0 && OwnerRow(tag) != n) {
        fault = MakeFault(field, CheckProblem::kWriteOfRead, index, col, b, 0);
        fault_row = n;
        other_row = OwnerRow(tag);
      }
    });
  }
  if (fault_row != INT_MAX) atomicMin(&lowest, fault_row);
  __syncthreads();
  const int result = lowest;
  if (fault_row != INT_MAX && fault_row == result) {
    *status = StatusFromFault(fault, fault_row, other_row);
  }
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    writes(n, [&](int32_t b, CheckedField, int32_t, int32_t) { owner[b] = 0; });
  }
  __syncthreads();
  return result == INT_MAX;
}

// Copies the call's final status to its host mirror. Every thread of the
// block calls it, after the checks (which return block-uniformly).
// The status mirror's contract (kda_args.h): written only when a check failed.
__device__ void BlockPublishStatus(const DeviceStatus* status, DeviceStatus* mirror) {
  __syncthreads();
  if (mirror != nullptr && threadIdx.x == 0 && status->failed != 0) *mirror = *status;
}

struct BlockChecker {
  static __device__ void Start(DeviceStatus* status) {
    if (threadIdx.x == 0) *status = OkStatus();
    __syncthreads();
  }
  static __device__ bool Prerequisites(const Prerequisites& p, DeviceStatus* status) {
    return BlockCheckPrerequisites(p, status);
  }
  template <typename Check, typename RowOf>
  static __device__ bool Items(int count, DeviceStatus* status, Check check, RowOf row_of) {
    return BlockCheckItems(count, status, check, row_of);
  }
  template <typename Check>
  static __device__ bool Rows(int num_rows, DeviceStatus* status, Check check) {
    return BlockCheckRows(num_rows, status, check);
  }
  // The input fault is the CPU backend's (device memory cannot raise it):
  // LoadPrerequisites reads it with the prerequisites.
  template <typename Load>
  static __device__ bool LoadedRows(int num_rows, const uint32_t*, DeviceStatus* status,
                                    Load load) {
    return BlockCheckRows(num_rows, status, load);
  }
  template <typename Writes, typename Reads>
  static __device__ bool CrossRow(int num_rows, int32_t* owner, DeviceStatus* status, Writes writes,
                                  Reads reads) {
    return BlockCheckCrossRow(num_rows, owner, status, writes, reads);
  }
  template <typename BlockOf, typename Guarded, typename Fault>
  static __device__ bool OneUserABlock(int num_rows, int32_t* owner, DeviceStatus* status,
                                       BlockOf block_of, Guarded guarded, Fault fault) {
    return BlockCheckOneUserABlock(num_rows, owner, status, block_of, guarded, fault);
  }
};

}  // namespace
}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_BLOCK_CHECKER_CUH_
