// The CPU backend's runner of the shared device checks (kernels/checks/):
// one thread, rows in order. CpuChecker and BlockChecker
// (block_checker.cuh) offer the same calls, so a sequence of checks written
// once (CheckCommitPlan, a mode's own) runs alike on both backends.
//
//   if (!CpuChecker::Rows(a.num_rows, a.status, [&](int n) { return CheckX(a, n); })) return;
#ifndef SPECSTATE_KERNELS_CHECKS_CPU_CHECKER_H_
#define SPECSTATE_KERNELS_CHECKS_CPU_CHECKER_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/checks/prerequisites.h"
#include "kernels/checks/rows.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

struct CpuChecker {
  // The call's status starts OK.
  static void Start(DeviceStatus* status) { *status = OkStatus(); }

  // False (with the status written) when a prerequisite failed.
  static bool Prerequisites(const Prerequisites& p, DeviceStatus* status) {
    const RowFault f = CheckPrerequisites(p);
    if (f.problem == 0) return true;
    *status = StatusFromFault(f, -1, -1);
    return false;
  }

  // False (with the status written) when loading the inputs faulted.
  static bool InputsIntact(const uint32_t* input_fault, DeviceStatus* status) {
    const RowFault f = CheckInputFault(input_fault);
    if (f.problem == 0) return true;
    *status = StatusFromFault(f, -1, -1);
    return false;
  }

  // Runs check(x) for items 0 .. count - 1 and writes the fault of the
  // lowest failing item to `status`, reported for row row_of(x). Returns
  // whether every item passed.
  template <typename Check, typename RowOf>
  static bool Items(int count, DeviceStatus* status, Check check, RowOf row_of) {
    for (int x = 0; x < count; ++x) {
      const RowFault f = check(x);
      if (f.problem != 0) {
        *status = StatusFromFault(f, row_of(x), -1);
        return false;
      }
    }
    return true;
  }

  // Items, one a row.
  template <typename Check>
  static bool Rows(int num_rows, DeviceStatus* status, Check check) {
    return Items(num_rows, status, check, [](int n) { return n; });
  }

  // load(n) for every row first (each of the caller's values read once),
  // then whether reading them faulted (input_fault), then the lowest
  // failing row's fault.
  template <typename Load>
  static bool LoadedRows(int num_rows, const uint32_t* input_fault, DeviceStatus* status,
                         Load load) {
    std::vector<RowFault> faults(num_rows);
    for (int n = 0; n < num_rows; ++n) faults[n] = load(n);
    if (!InputsIntact(input_fault, status)) return false;
    return Rows(num_rows, status, [&](int n) { return faults[n]; });
  }

  // The cross-row pass (rows.h): no block written by two rows, none written
  // by one row and read by another. `owner` is all zero on entry and on
  // return.
  template <typename Writes, typename Reads>
  static bool CrossRow(int num_rows, int32_t* owner, DeviceStatus* status, Writes writes,
                       Reads reads) {
    for (int n = 0; n < num_rows; ++n) {
      writes(n, [&](int32_t block, CheckedField, int32_t, int32_t) {
        owner[block] = std::max(owner[block], OwnerTag(n));
      });
    }
    bool ok = true;
    for (int n = 0; n < num_rows && ok; ++n) {
      writes(n, [&](int32_t block, CheckedField field, int32_t index, int32_t col) {
        const int other = OwnerRow(owner[block]);
        if (ok && other != n) {
          *status = StatusFromFault(
              MakeFault(field, CheckProblem::kDuplicateWrite, index, col, block, 0), n, other);
          ok = false;
        }
      });
      reads(n, [&](int32_t block, CheckedField field, int32_t index, int32_t col) {
        if (ok && owner[block] != 0 && OwnerRow(owner[block]) != n) {
          *status =
              StatusFromFault(MakeFault(field, CheckProblem::kWriteOfRead, index, col, block, 0), n,
                              OwnerRow(owner[block]));
          ok = false;
        }
      });
    }
    for (int n = 0; n < num_rows; ++n) {
      writes(n, [&](int32_t block, CheckedField, int32_t, int32_t) { owner[block] = 0; });
    }
    return ok;
  }

  // One row a block, where it matters: the lowest row using a block
  // (block_of(n); null blocks skipped) owns it, and the first other row
  // using a block for which guarded(block) holds is the fault fault(block,
  // n), reported against the owner. (FAST: every block, rows must not share
  // a ring; DEFERRED Verify: blocks with tokens pending.) `owner` is all
  // zero on entry and on return.
  template <typename BlockOf, typename Guarded, typename Fault>
  static bool OneUserABlock(int num_rows, int32_t* owner, DeviceStatus* status, BlockOf block_of,
                            Guarded guarded, Fault fault) {
    for (int n = 0; n < num_rows; ++n) {
      const int32_t b = block_of(n);
      if (IsBlock(b)) owner[b] = std::max(owner[b], OwnerTag(n));
    }
    bool ok = true;
    for (int n = 0; n < num_rows && ok; ++n) {
      const int32_t b = block_of(n);
      if (!IsBlock(b) || !guarded(b) || OwnerRow(owner[b]) == n) continue;
      *status = StatusFromFault(fault(b, n), n, OwnerRow(owner[b]));
      ok = false;
    }
    for (int n = 0; n < num_rows; ++n) {
      const int32_t b = block_of(n);
      if (IsBlock(b)) owner[b] = 0;
    }
    return ok;
  }
};

// The status mirror's contract (kda_args.h): written only when a check failed.
inline void PublishStatus(const DeviceStatus& status, DeviceStatus* mirror) {
  if (mirror != nullptr && status.failed != 0) *mirror = status;
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_CPU_CHECKER_H_
