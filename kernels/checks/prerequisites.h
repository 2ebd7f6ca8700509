// The checks of a call's prerequisites (kda_args.h, Prerequisites): the
// step's cancellation, the earlier calls it depends on, and (CPU backend) a
// fault while reading a client's shared memory.
#ifndef SPECSTATE_KERNELS_CHECKS_PREREQUISITES_H_
#define SPECSTATE_KERNELS_CHECKS_PREREQUISITES_H_

#include <cstdint>

#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

// Whether reading the call's inputs faulted (Prerequisites::input_fault).
SPECSTATE_HD RowFault CheckInputFault(const uint32_t* input_fault) {
  if (input_fault != nullptr && *static_cast<const volatile uint32_t*>(input_fault) != 0) {
    return MakeFault(CheckedField::kInputs, CheckProblem::kInputFault, -1, -1, 0, 0);
  }
  return NoFault();
}

// Whether the step was cancelled. A volatile read: on CUDA another stream
// wrote the word, just before the write that released this call.
SPECSTATE_HD RowFault CheckCancelled(const Prerequisites& p) {
  if (p.cancelled != nullptr && p.generation != 0 &&
      *static_cast<const volatile uint32_t*>(p.cancelled) == p.generation) {
    return MakeFault(CheckedField::kPrerequisites, CheckProblem::kCancelled, -1, -1, p.generation,
                     0);
  }
  return NoFault();
}

// The step's cancellation, else the first failed prerequisite, if any.
SPECSTATE_HD RowFault CheckPrerequisites(const Prerequisites& p) {
  const RowFault cancelled = CheckCancelled(p);
  if (cancelled.problem != 0) return cancelled;
  for (int i = 0; i < p.count; ++i) {
    if (p.statuses[i].failed != 0) {
      return MakeFault(CheckedField::kPrerequisites, CheckProblem::kPrerequisiteFailed, i, -1, 0,
                       0);
    }
  }
  return NoFault();
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_PREREQUISITES_H_
