// LoadParams' check: element i of the staged parameters, a_log [H] then
// dt_bias [H * K], finite.
#ifndef SPECSTATE_KERNELS_CHECKS_PARAMS_H_
#define SPECSTATE_KERNELS_CHECKS_PARAMS_H_

#include <math.h>

#include "kernels/checks/rows.h"

namespace specstate {
namespace kernels {
namespace internal {

SPECSTATE_HD RowFault CheckParamValue(float x, int i, int num_heads) {
  if (isfinite(x)) return NoFault();
  const bool a_log = i < num_heads;
  return MakeFault(a_log ? CheckedField::kALog : CheckedField::kDtBias, CheckProblem::kNotFinite,
                   a_log ? i : i - num_heads, -1, 0, 0);
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_PARAMS_H_
